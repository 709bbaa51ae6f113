"""The serving benchmark's output: rich tables and checks, and the TTFT plot."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["DEFAULT_SOURCES", "SOURCES", "median", "plot", "render"]

#: every source, in report order; ``cold`` is always measured
SOURCES = ("cold", "cpu", "file_warm", "file_cold", "s3", "slow", "slow_off")
#: what runs unless ``--sources`` says otherwise (the throttled tier is opt-in: it is slow by design)
DEFAULT_SOURCES = ("cold", "cpu", "file_warm", "file_cold", "s3")


def median(xs: Sequence[float | None]) -> float | None:
    """The median of the values that are not None (None when there are none)."""
    vals = [float(x) for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def render(result: dict[str, Any], console: Any) -> None:
    """The tables (TTFT per length and source, raw reads) and the checks."""
    from rich.table import Table

    m = result["model"]
    t = Table(title=f"TTFT, {m['name']} ({m['parameters'] / 1e6:.0f}M params, "
                    f"{m['kv_bytes_per_token'] // 1024} KiB KV/token), median of {result['repeats']}")
    cols = ("tokens", "source", "TTFT s", "x cold", "queued s", "samples s", "cached tokens", "same token")
    for col in cols:
        t.add_column(col, justify="right" if col not in ("source",) else "left")
    for n, per in result["results"].items():
        for source, e in per.items():
            same = e.get("same_token_as_cold")
            t.add_row(n, source, _fmt(e["ttft_s"]), _fmt(e["ratio_to_cold"]), _fmt(median(e["queue_s"])),
                      " ".join(_fmt(x) for x in e["samples"]),
                      " ".join(str(x) for x in e["num_cached_tokens"]),
                      "" if same is None else ("yes" if all(x is True for x in same) else "NO"))
    console.print(t)
    if result["raw_read"]:
        rt = Table(title=f"raw read of the file tier's records (one thread; cold: {result['cold_method']})")
        for col in ("tokens", "files", "MiB", "cold s", "cold MiB/s", "warm s"):
            rt.add_column(col, justify="right")
        for n, r in result["raw_read"].items():
            mib = (r["bytes"] or 0) / 2**20
            rt.add_row(n, str(r["files"]), f"{mib:.1f}", _fmt(r["cold_s"]),
                       f"{mib / r['cold_s']:.0f}" if r["cold_s"] else "-", _fmt(r["warm_s"]))
        console.print(rt)
    for name, per in result["checks"].items():
        cells = ", ".join(f"{n}: {'pass' if v else 'FAIL'}" for n, v in per.items())
        console.print(f"check {name}: {cells}", highlight=False)
    for w in result["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {w}", highlight=False)
    mach = result["machine"]
    console.print(f"{mach['cpus']} CPUs, load {mach['load_start'][0]} at start, {mach['load_end'][0]} at "
                  f"end; {mach['seconds']:.0f} s", highlight=False)
    if not result["ok"]:
        console.print("[red]FAILED: a restored request was not restored or gave another token "
                      "than cold[/red]")


def plot(result: dict[str, Any], path: str) -> None:
    """TTFT (median) against prompt length, one line per source."""
    import matplotlib  # type: ignore[import-not-found,unused-ignore]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]

    fig, ax = plt.subplots(figsize=(7, 4.5))
    lengths = [int(n) for n in result["results"]]
    for source in SOURCES:
        pts = [(n, result["results"][str(n)][source]["ttft_s"]) for n in lengths
               if source in result["results"][str(n)]]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=source)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lengths)
    ax.set_xticklabels([str(n) for n in lengths])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("time to first token (s, median)")
    ax.set_title(f"tierkv + vLLM, {result['model']['name']}, {result['repeats']} repeat(s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

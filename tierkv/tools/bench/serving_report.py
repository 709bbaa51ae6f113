"""The serving benchmark's output: rich tables and checks, and the TTFT plot."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["DEFAULT_SOURCES", "SOURCES", "TARGET_MIN_LENGTH", "condense", "median", "plot", "render",
           "summarize"]

#: every source, in report order; ``cold`` is always measured
SOURCES = ("cold", "cpu", "file_warm", "file_cold", "s3", "slow", "slow_off")
#: what runs unless ``--sources`` says otherwise (the throttled tier is opt-in: it is slow by design)
DEFAULT_SOURCES = ("cold", "cpu", "file_warm", "file_cold", "s3")
#: lengths at which the ratio-to-cold targets apply
TARGET_MIN_LENGTH = 4096


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


def condense(stats: dict[str, Any] | None) -> dict[str, Any] | None:
    """The parts of ``TieredStore.stats()`` that say where a restore came from."""
    if stats is None:
        return None
    keys = ("kind", "describe", "hits", "misses", "bytes_read", "bytes_written", "stores", "stores_shed",
            "stores_failed", "stores_skipped", "promotions", "promotions_failed", "probes", "backend")
    return {"tiers": [{k: t.get(k) for k in keys} for t in stats.get("tiers", [])],
            "lookups": stats.get("lookups"), "promotions_pending": stats.get("promotions_pending"),
            "pending_deadline_miss": stats.get("pending_deadline_miss"), "cost": stats.get("cost")}


def summarize(run_samples: dict[int, dict[str, list[dict[str, Any]]]],
              raw: dict[int, dict[str, list[Any]]]) -> dict[str, Any]:
    """Medians, ratios to cold, identical-output checks and the targets, from the samples."""
    results: dict[str, Any] = {}
    ok = True
    for n in sorted(run_samples):
        per = run_samples[n]
        cold_by_repeat = {s["repeat"]: s for s in per.get("cold", [])}
        cold_med = median([s["ttft_s"] for s in per.get("cold", [])])
        out: dict[str, Any] = {}
        for source in SOURCES:
            ss = per.get(source)
            if not ss:
                continue
            med = median([s["ttft_s"] for s in ss])
            same = [None if s["repeat"] not in cold_by_repeat
                    else s["token"] == cold_by_repeat[s["repeat"]]["token"] for s in ss]
            dlp = [abs(s["logprob"] - cold_by_repeat[s["repeat"]]["logprob"]) for s in ss
                   if s["repeat"] in cold_by_repeat and s.get("logprob") is not None
                   and cold_by_repeat[s["repeat"]].get("logprob") is not None]
            entry: dict[str, Any] = {
                "ttft_s": med, "samples": [s["ttft_s"] for s in ss], "wall_s": [s["wall_s"] for s in ss],
                "queue_s": [s.get("queue_s") for s in ss], "prefill_s": [s.get("prefill_s") for s in ss],
                "num_cached_tokens": [s["num_cached_tokens"] for s in ss], "tokens": [s["token"] for s in ss],
                "ratio_to_cold": (med / cold_med) if med is not None and cold_med else None,
                "load1": [s.get("load1") for s in ss], "trace": [s.get("trace") for s in ss]}
            if source != "cold":
                entry["same_token_as_cold"] = same
                entry["max_abs_logprob_diff"] = max(dlp) if dlp else None
                entry["restored"] = [bool(s["num_cached_tokens"]) for s in ss]
                must_restore = source != "slow"  # the cost model may (should) recompute it
                if (must_restore and not all(entry["restored"])) or not all(x is True for x in same):
                    ok = False
            if any("resident" in s for s in ss):
                entry["page_cache_resident"] = [s.get("resident") for s in ss]
            out[source] = entry
        results[str(n)] = out
    raw_out: dict[str, dict[str, Any]] = {str(n): {"bytes": r["bytes"][-1] if r["bytes"] else None,
                        "files": r["files"][-1] if r["files"] else None,
                        "cold_s": median(r["cold_s"]), "cold_samples": r["cold_s"],
                        "warm_s": median(r["warm_s"]), "warm_samples": r["warm_s"],
                        "resident_before_cold": r["resident_before_cold"]}
               for n, r in sorted(raw.items())}

    def median_of(n: int, source: str) -> float | None:
        v = results.get(str(n), {}).get(source, {}).get("ttft_s")
        return None if v is None else float(v)

    checks: dict[str, dict[str, bool]] = {}

    def put(name: str, n: int, value: bool | None) -> None:
        if value is not None:
            checks.setdefault(name, {})[str(n)] = value

    for n in sorted(run_samples):
        cpu, fw, fc = median_of(n, "cpu"), median_of(n, "file_warm"), median_of(n, "file_cold")
        cold = median_of(n, "cold")
        rc = raw_out.get(str(n), {}).get("cold_s")
        raw_cold = None if rc is None else float(rc)
        put("file_warm <= 2x cpu", n, None if cpu is None or fw is None else fw <= 2 * cpu)
        put("file_cold <= 2x cpu + 2x raw read cold", n,
            None if cpu is None or fc is None or raw_cold is None else fc <= 2 * cpu + 2 * raw_cold)
        slow = median_of(n, "slow")
        put("slow <= 1.1x cold", n, None if slow is None or not cold else slow <= 1.1 * cold)
        if n >= TARGET_MIN_LENGTH and cold:
            put("cpu <= 0.3x cold", n, None if cpu is None else cpu <= 0.3 * cold)
            put("file_warm <= 0.3x cold", n, None if fw is None else fw <= 0.3 * cold)
            put("file_cold <= 0.5x cold", n, None if fc is None else fc <= 0.5 * cold)
    all_checks = [v for d in checks.values() for v in d.values()]
    return {"results": results, "raw_read": raw_out, "checks": checks,
            "checks_pass": all(all_checks) if all_checks else None, "ok": ok}

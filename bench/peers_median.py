"""Several full bench/peers.py runs as one table: the median over runs of each figure, and the targets.

    python bench/peers_median.py RUN1.json RUN2.json RUN3.json [--markdown FILE.md]

Reads reports written with ``--json`` / ``--json-file``. Per system, block size and phase it takes
each run's figure (MB/s: the run's median of its rounds; ``x``, ``xa``, ``of device``: the run's
median of per-round ratios) and prints the median over the runs, then tierkv's targets, each met
or not: ``x >= 1.0`` against vLLM's fs tier and LMCache's disk backend on stores, warm and cold
loads; cold loads ``>= 0.9`` of the device (fio), stores ``>= 0.8``. A run flagged busy (other
processes on the CPUs during its timed phases) is named. Exit status 0 (2 on bad input).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from peers_compare import load
from peers_report import size_label

PHASES = ("store", "warm", "cold")
PEERS = ("vllm-fs", "lmcache-disk")
DEVICE_TARGETS = {"store": 0.8, "cold": 0.9}


def figures(report: dict[str, Any]) -> dict[tuple[str, int, str, str], float]:
    """(system, block bytes, phase, figure) -> value, for every figure of one run."""
    out: dict[tuple[str, int, str, str], float] = {}
    for row in report["results"]:
        phase = row["direction"] if row["cache"] is None else row["cache"]
        for label, key in (("mb_s", "mb_s"), ("x", "ratio_vs_tierkv"), ("xa", "ratio_vs_tierkv_api"),
                           ("dev", "fraction_of_device")):
            v = row.get(key)
            if isinstance(v, (int, float)) and v > 0:
                out[(row["system"], int(row["block_bytes"]), phase, label)] = float(v)
    return out


def medians(runs: list[dict[tuple[str, int, str, str], float]]) -> dict[tuple[str, int, str, str], float]:
    keys = {k for r in runs for k in r}
    return {k: statistics.median([r[k] for r in runs if k in r]) for k in keys}


def _f(x: float | None, mbs: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if mbs else f"{x:.2f}"


def table(med: dict[tuple[str, int, str, str], float], systems: list[str], sizes: list[int]) -> list[str]:
    head = ("| system | block | store MB/s | warm MB/s | cold MB/s | of device: store | cold "
            "| x store | x warm | x cold | xa store | xa warm | xa cold |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for size in sizes:
        for s in systems:
            def g(phase: str, label: str, s: str = s, size: int = size) -> float | None:
                return med.get((s, size, phase, label))
            if all(g(p, "mb_s") is None for p in PHASES):
                continue
            cells = [s, size_label(size)] + [_f(g(p, "mb_s"), True) for p in PHASES]
            cells += [_f(g("store", "dev")), _f(g("cold", "dev"))]
            cells += [_f(g(p, "x")) for p in PHASES] + [_f(g(p, "xa")) for p in PHASES]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def targets(med: dict[tuple[str, int, str, str], float], sizes: list[int]) -> list[str]:
    """One line per target: which sizes meet it, with the figure."""
    out = []
    for peer in PEERS:
        for phase in PHASES:
            cells = [(size, med.get((peer, size, phase, "x"))) for size in sizes]
            if all(v is None for _, v in cells):
                continue
            out.append(f"- tierkv / {peer}, {phase} >= 1.0: " + ", ".join(
                f"{size_label(size)} {_f(v)} {'met' if v is not None and v >= 1.0 else 'NOT met'}"
                for size, v in cells))
    for phase, want in DEVICE_TARGETS.items():
        cells = [(size, med.get(("tierkv", size, phase, "dev"))) for size in sizes]
        out.append(f"- tierkv {phase} >= {want} of the device: " + ", ".join(
            f"{size_label(size)} {_f(v)} {'met' if v is not None and v >= want else 'NOT met'}"
            for size, v in cells))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("runs", nargs="+", metavar="RUN.json")
    ap.add_argument("--markdown", metavar="FILE.md", help="also write the table and targets as markdown")
    args = ap.parse_args()
    reports = [load(p) for p in args.runs]
    runs = [figures(r) for r in reports]
    med = medians(runs)
    systems = list(dict.fromkeys(s for r in reports for s in (x["system"] for x in r["results"])))
    sizes = sorted({k[1] for k in med})
    lines = [f"Medians over {len(reports)} run(s) of bench/peers.py:"]
    for path, r in zip(args.runs, reports, strict=True):
        busy = r.get("machine", {}).get("busy")
        lines.append(f"- {Path(path).name}: {r.get('date', '?')}, commit {r.get('commit', '?')}"
                     + (" (BUSY: other processes on the CPUs)" if busy else ""))
    lines += ["", *table(med, systems, sizes), "", "Targets:", *targets(med, sizes)]
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        try:
            Path(args.markdown).write_text(text + "\n")
        except OSError as exc:
            print(f"peers_median.py: {args.markdown}: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

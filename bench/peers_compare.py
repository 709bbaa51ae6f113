"""Every ratio of two bench/peers.py runs side by side: is the bench stable enough to decide on?

    python bench/peers_compare.py RUN1.json RUN2.json [--tolerance 0.15]

Reads two reports written with ``--json`` / ``--json-file`` and prints, for every (system, block
size, phase) and every ratio the report carries (``x``: tierkv / system, ``xa``: tierkv-api /
system, ``dev``: system / device, ``dev+sync``: the same counting the store's ``sync``), both runs'
values and how far apart they are (``|a - b| / min(a, b)``). Exit status 1 when any pair differs
by more than ``--tolerance`` (default 0.15), 0 otherwise, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NoReturn

from peers_report import size_label

RATIOS = (("x", "ratio_vs_tierkv"), ("xa", "ratio_vs_tierkv_api"), ("dev", "fraction_of_device"),
          ("dev+sync", "fraction_of_device_with_sync"))


def ratios(report: dict[str, Any]) -> dict[tuple[str, int, str, str], float]:
    out: dict[tuple[str, int, str, str], float] = {}
    for row in report["results"]:
        phase = row["direction"] if row["cache"] is None else row["cache"]
        for label, key in RATIOS:
            v = row.get(key)
            if isinstance(v, (int, float)) and v > 0:
                out[(row["system"], int(row["block_bytes"]), phase, label)] = float(v)
    return out


def load(path: str) -> dict[str, Any]:
    try:
        report: dict[str, Any] = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        _bad_input(f"{path}: {exc}")
    if not isinstance(report, dict) or report.get("bench") != "peers" or "results" not in report:
        _bad_input(f"{path} is not a bench/peers.py report")
    return report


def _bad_input(message: str) -> NoReturn:
    print(f"{Path(sys.argv[0]).name}: {message}", file=sys.stderr)
    raise SystemExit(2)


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("first")
    ap.add_argument("second")
    ap.add_argument("--tolerance", type=float, default=0.15)
    args = ap.parse_args()
    a, b = load(args.first), load(args.second)
    ra, rb = ratios(a), ratios(b)
    keys = [k for k in ra if k in rb]
    if not keys:
        print("peers_compare.py: the two runs have no ratio in common", file=sys.stderr)
        return 2
    print(f"run 1: {a.get('date', '?')} {a.get('commit', '?')} {a.get('command', '')}")
    print(f"run 2: {b.get('date', '?')} {b.get('commit', '?')} {b.get('command', '')}")
    print(f"{'system':<17}{'block':>6}  {'phase':<6}{'ratio':<9}{'run 1':>8}{'run 2':>8}{'apart':>8}")
    worst = 0.0
    over = 0
    for k in sorted(keys, key=lambda k: (k[1], k[0], k[2], k[3])):
        x, y = ra[k], rb[k]
        apart = abs(x - y) / min(x, y)
        worst = max(worst, apart)
        flag = "  <-- over" if apart > args.tolerance else ""
        over += apart > args.tolerance
        name, size, phase, label = k
        print(f"{name:<17}{size_label(size):>6}  {phase:<6}{label:<9}{x:8.2f}{y:8.2f}{apart:8.1%}{flag}")
    print(f"{len(keys)} ratios; {over} apart by more than {args.tolerance:.0%}; the widest {worst:.1%}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())

"""Token hit rate against primary capacity on real traces: LRU, the default policy, the bound.

    python bench/traffic.py conversation_trace.jsonl synthetic_trace.jsonl \\
        [--capacities 500,1000,2000,4000,6000,10000,20000,50000] [--policies lru,slru] \\
        [--json-file traffic.json] [--from-json traffic.json] [--markdown] [--plot docs/traffic.png]

Each trace is replayed with ``tierkv.tools.replay`` (a real TieredStore, one CPU pool of that many
blocks, nothing below it) once per policy and capacity, plus once unbounded; the Belady bound is
computed offline for each capacity. ``--markdown`` prints the tables docs/traffic.md shows,
``--plot`` draws them (matplotlib: the ``plot`` extra); ``--from-json`` redraws saved results
without replaying.
"""

from __future__ import annotations

import benchmain  # first: Ctrl-C while the imports below load ends quietly

# isort: split

import argparse
import json
import os
import sys
from typing import Any

import anyio

from tierkv.tools.replay import ReplayOptions, replay
from tierkv.tools.traces import belady_hit_rate, read_trace

CAPACITIES = [500, 1000, 2000, 4000, 6000, 10000, 20000, 50000]


def measure(path: str, capacities: list[int], policies: list[str]) -> dict[str, Any]:
    """Hit rates of one trace: ``trace``, ``requests``, ``unbounded`` and ``rows``, one per capacity
    (``capacity``, each policy's rate, ``belady``)."""
    reqs = read_trace(path)
    unbounded = anyio.run(replay, reqs, ReplayOptions(policy="lru"))
    rows = []
    for cap in capacities:
        row: dict[str, Any] = {"capacity": cap, "belady": belady_hit_rate(reqs, cap, 512)}
        for name in policies:
            res = anyio.run(replay, reqs, ReplayOptions(cpu_blocks=cap, policy=name))
            row[name] = res.token_hit_rate
            row[f"{name}_s"] = res.seconds
        print(f"{os.path.basename(path)} {cap:>6} " + " ".join(f"{n} {row[n]:.4f}" for n in policies)
              + f" belady {row['belady']:.4f}", file=sys.stderr, flush=True)
        rows.append(row)
    return {"trace": os.path.basename(path), "requests": len(reqs), "unbounded": unbounded.token_hit_rate,
            "rows": rows}


def markdown(results: list[dict[str, Any]], policies: list[str]) -> str:
    """One table per trace: capacity, each policy's rate (and its ratio to LRU), the bound."""
    out = []
    for r in results:
        out.append(f"{r['trace']} ({r['requests']} requests; unbounded: {r['unbounded']:.3f})\n")
        head = ["capacity (blocks)", *policies, *(f"{p} / lru" for p in policies if p != "lru"), "belady"]
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---:|" * len(head))
        for row in r["rows"]:
            cells = [f"{row['capacity']:,}", *(f"{row[p]:.3f}" for p in policies),
                     *(f"{row[p] / row['lru']:.2f}x" for p in policies if p != "lru"), f"{row['belady']:.3f}"]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def plot(path: str, results: list[dict[str, Any]], policies: list[str]) -> None:
    """Hit rate against capacity, one panel per trace."""
    benchmain.require("matplotlib", "matplotlib", "pip install -e '.[plot]'")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.2), squeeze=False)
    style = {"lru": ("LRU", "tab:gray", "o"), "slru": ("slru (default)", "tab:blue", "s"),
             "arc": ("ARC", "tab:green", "^"), "belady": ("Belady (clairvoyant bound)", "black", "")}
    for ax, r in zip(axes[0], results, strict=True):
        caps = [row["capacity"] for row in r["rows"]]
        for name in [*policies, "belady"]:
            label, color, marker = style.get(name, (name, None, "x"))
            ax.plot(caps, [row[name] for row in r["rows"]], label=label, color=color, marker=marker,
                    linestyle="--" if name == "belady" else "-")
        ax.axhline(r["unbounded"], color="tab:red", linewidth=0.8, linestyle=":", label="unbounded")
        ax.set_xscale("log")
        ax.set_xlabel("primary capacity (blocks of 512 tokens)")
        ax.set_ylabel("token hit rate")
        ax.set_title(f"{r['trace']} ({r['requests']} requests)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Mooncake FAST'25 traces through tierkv's store (tierkv replay)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="*", help="Mooncake-format traces")
    ap.add_argument("--capacities", type=benchmain.positive_list, default=CAPACITIES)
    ap.add_argument("--policies", default="lru,slru", help="comma-separated policy names")
    ap.add_argument("--json-file", help="save the results here")
    ap.add_argument("--from-json", help="use saved results instead of replaying")
    ap.add_argument("--markdown", action="store_true", help="print the tables as markdown")
    ap.add_argument("--plot", metavar="FILE.png", help="draw the results (needs matplotlib)")
    args = ap.parse_args()
    policies = args.policies.split(",")
    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)
    else:
        if not args.traces:
            ap.error("give traces, or --from-json")
        results = [measure(p, args.capacities, policies) for p in args.traces]
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump(results, f, indent=1)
    if args.markdown or not args.plot:
        print(markdown(results, policies))
    if args.plot:
        plot(args.plot, results, policies)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    benchmain.run(main)

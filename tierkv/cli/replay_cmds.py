"""``tierkv replay``: a request trace (Mooncake's format) through a real store; hit rates per tier."""

from __future__ import annotations

import argparse
import json
from typing import Any

from tierkv.cli.common import (
    Formatter,
    console,
    positive_float,
    positive_int,
    print_table,
    progress,
    run_async,
)

__all__ = ["add_replay"]


def add_replay(sub: Any) -> None:
    """The ``replay`` command."""
    from tierkv.blocks.policy import DEFAULT_POLICY, POLICIES

    r = sub.add_parser(
        "replay", formatter_class=Formatter,
        help="replay a request trace through a real store: token hit rate per tier",
        description="Replay a request trace (JSON Lines, Mooncake's FAST'25 format: timestamp, input_length, "
                    "output_length, hash_ids) through a real TieredStore with tiny blocks: per request a "
                    "lookup of its prefix, a get of what was found, then a put of the rest. Prints the "
                    "tokens each tier served, the token hit rate, and the clairvoyant (Belady) bound for "
                    "the same capacity. docs/traffic.md describes the format and the accounting.\n\n"
                    "Exit codes: 0 done, 2 error (a missing file, a malformed line: named with its "
                    "line number), 130 interrupted.")
    r.add_argument("trace", metavar="TRACE", help="the trace file (.jsonl)")
    r.add_argument("--block-tokens", type=positive_int, default=512, metavar="N",
                   help="tokens per block of the trace's hash_ids")
    r.add_argument("--cpu-blocks", type=positive_int, default=None, metavar="N",
                   help="slots of the primary (CPU) pool (default: unbounded, every block of the trace)")
    r.add_argument("--disk-blocks", type=positive_int, default=None, metavar="N",
                   help="add a file tier in a temporary directory holding N blocks (capacity_bytes: N "
                        "records of the replay's block size)")
    r.add_argument("--url", default=None, metavar="URL",
                   help="add a lower tier: an fsspec URL, or 'memory' (unbounded)")
    r.add_argument("--policy", choices=POLICIES, default=DEFAULT_POLICY, help="the primary's eviction policy")
    r.add_argument("--requests", type=positive_int, default=None, metavar="N",
                   help="replay only the first N requests")
    r.add_argument("--recompute-tokens-per-s", type=positive_float, default=None, metavar="R",
                   help="the engine's prefill rate: also print the prefill time each tier's hits saved, "
                        "at that tier's measured read rate")
    r.add_argument("--block-bytes", type=positive_int, default=64, metavar="B",
                   help="bytes per block (tiny by default; give the model's for read rates that mean "
                        "something)")
    r.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    r.set_defaults(func=_replay)


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.1f} MB/s"


def _replay(args: argparse.Namespace) -> int:
    from tierkv.tools.replay import ReplayOptions, replay
    from tierkv.tools.traces import read_trace

    requests = read_trace(args.trace, args.requests)
    opts = ReplayOptions(block_tokens=args.block_tokens, cpu_blocks=args.cpu_blocks,
                         disk_blocks=args.disk_blocks, url=args.url, policy=args.policy,
                         block_bytes=args.block_bytes, recompute_tokens_per_s=args.recompute_tokens_per_s)
    with progress() as bar:
        task = bar.add_task("replaying requests", total=len(requests))
        res = run_async(lambda: replay(requests, opts, progress=lambda n: bar.advance(task, n)))
    if args.json:
        print(json.dumps(res.to_json()))
        return 0
    out = console()
    cols = ["tier", "capacity (blocks)", "hit blocks", "hit tokens", "token hit rate", "read rate"]
    if args.recompute_tokens_per_s:
        cols.append("prefill saved")
    rows = []
    for t in res.tiers:
        row: list[object] = [t.kind, "unbounded" if t.capacity_blocks is None else t.capacity_blocks,
                             t.hit_blocks, t.hit_tokens, f"{t.token_hit_rate:.4f}", _rate(t.read_bytes_per_s)]
        if args.recompute_tokens_per_s:
            row.append("-" if t.saved_s is None else f"{t.saved_s:.1f} s")
        rows.append(row)
    title = f"{args.trace}: {res.requests} requests, {res.input_tokens} input tokens, policy {res.policy}"
    print_table(title, cols, rows, out)
    cap = "unbounded" if res.bound_capacity_blocks is None else f"{res.bound_capacity_blocks} blocks"
    out.print(f"token hit rate {res.token_hit_rate:.4f} ({res.hit_tokens} tokens); "
              f"belady bound ({cap}) {res.bound:.4f}; replayed in {res.seconds:.1f} s")
    return 0

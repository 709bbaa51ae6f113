"""``tierkv bench tier URL`` (your storage, through the public API) and ``tierkv bench serving``."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass

from tierkv.cli.common import (
    Formatter,
    console,
    error,
    interrupts_raise,
    kv_pairs,
    positive_float,
    positive_int,
    print_table,
    progress,
    run_async,
    warn,
)
from tierkv.tools.bench.tier import TierBench, measure

__all__ = ["add_bench"]


def add_bench(sub: Any) -> None:
    """The ``bench`` command and its two subcommands."""
    b = sub.add_parser("bench", formatter_class=Formatter, help="measure a tier, or TTFT of a real engine",
                       description="Measure your storage as tierkv uses it (bench tier), or time-to-first-"
                                   "token of a real vLLM engine restoring prefixes from tierkv (bench "
                                   "serving).")
    bsub = b.add_subparsers(dest="what", required=True, metavar="WHAT")
    t = bsub.add_parser("tier", formatter_class=Formatter, help="write and read rates of a tier URL",
                        description="Write blocks to URL through a TieredStore, then restore them with a new "
                                    "store (warm page cache, and cold where this process may drop it), and "
                                    "print the rates and the prompt length past which restoring beats "
                                    "recomputing at --recompute-tokens-per-s. Writes a namespace of its own "
                                    "and deletes it afterwards.\n\nExit codes: 0 measured, 2 error.")
    t.add_argument("url", help="where to measure: a path or any fsspec URL (file://, s3://, ...)")
    t.add_argument("-o", "--storage-option", action="append", metavar="KEY=VALUE", default=[],
                   help="fsspec storage option (repeatable), e.g. -o endpoint_url=http://host:9000")
    t.add_argument("--block-kib", type=positive_int, default=1024, help="block size in KiB")
    t.add_argument("--blocks", type=positive_int, default=256, help="blocks written and read")
    t.add_argument("--batch", type=positive_int, default=16, help="blocks per put")
    t.add_argument("--concurrency", type=positive_int, default=None,
                   help="the tier's io_threads (local) or requests in flight (remote); default: the tier's")
    t.add_argument("--tokens-per-block", type=positive_int, default=16, help="tokens one block spans")
    t.add_argument("--recompute-tokens-per-s", type=positive_float, default=10000.0,
                   help="the engine's prefill throughput, for the break-even prompt length")
    t.add_argument("--codec", choices=["none", "zstd", "zstd-shuffle"], default="none", help="record codec")
    t.add_argument("--no-drop-caches", "--no-cold", dest="no_cold", action="store_true",
                   help="never drop the page cache (as root the cold read drops the whole machine's, "
                        "and says so): no cold read")
    t.add_argument("--rounds", type=positive_int, default=3,
                   help="timed reads of every block, warm and cold (the median is used)")
    t.add_argument("--samples", type=positive_int, default=21,
                   help="first-block reads timed for the latency (the median is used; spread shown)")
    t.add_argument("--json", action="store_true", help="print a JSON report on stdout")
    t.set_defaults(func=_bench_tier)
    s = bsub.add_parser("serving", formatter_class=Formatter, add_help=False,
                        help="TTFT of a real vLLM engine restoring from tierkv, or a Mooncake trace "
                             "replayed through it (--trace FILE; needs vLLM)",
                        description="Run `tierkv bench serving --help` (or `--trace FILE --help`) for its "
                                    "options.")
    s.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    s.set_defaults(func=_bench_serving)


def _bench_tier(args: argparse.Namespace) -> int:
    with progress() as bar:
        task = bar.add_task("writing and reading blocks", total=3 * args.blocks)
        res = run_async(lambda: measure(_settings(args), lambda k: bar.advance(task, k), warn))
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    cold = res["read_cold_mb_s"]
    title = f"{res['url']}: {res['blocks']} blocks x {res['block_bytes'] >> 10} KiB, codec {res['codec']}"
    lat = res["latency_samples_s"]
    print_table(title,
                ("write MB/s", "read MB/s (warm)", "read MB/s (cold)", "first block (ms)"),
                [(f"{res['write_mb_s']:,.0f}", f"{res['read_warm_mb_s']:,.0f}",
                  "-" if cold is None else f"{cold:,.0f}",
                  f"{res['latency_s'] * 1e3:.2f} (median of {len(lat)}: {min(lat) * 1e3:.2f}-"
                  f"{max(lat) * 1e3:.2f})")])
    if res.get("cold_note"):
        warn(res["cold_note"])
    out = console()
    be = res["break_even_tokens"]
    rate = res["recompute_tokens_per_s"]
    if be is None:
        out.print(f"at {rate:,.0f} tokens/s of recompute, restoring from this tier never beats recomputing "
                  "(it reads slower than the engine computes)")
    else:
        iqr = res["break_even_tokens_iqr"]
        spread = f" (first-block quartiles: {iqr[0]:,.0f}-{iqr[1]:,.0f})" if iqr else ""
        out.print(f"at {rate:,.0f} tokens/s of recompute, restoring beats recomputing for prompts "
                  f"longer than {be:,.0f} tokens{spread}")
    return 0


def _settings(args: argparse.Namespace) -> TierBench:
    return TierBench(url=args.url, storage_options=kv_pairs(args.storage_option), block_kib=args.block_kib,
                     blocks=args.blocks, batch=args.batch, concurrency=args.concurrency,
                     tokens_per_block=args.tokens_per_block,
                     recompute_tokens_per_s=args.recompute_tokens_per_s, codec=args.codec,
                     no_cold=args.no_cold, rounds=args.rounds, samples=args.samples)


def _bench_serving(args: argparse.Namespace) -> int:
    try:
        from tierkv.tools.bench import serving
    except ImportError as exc:
        error(f"the serving benchmark cannot load: {exc}")
        return 2
    rest = [a for a in args.rest if a != "--"]
    interrupts_raise()  # the benchmark stops its engine processes on KeyboardInterrupt
    rc: int = serving.main(rest)
    return rc

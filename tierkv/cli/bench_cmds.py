"""``tierkv bench tier URL`` (your storage, through the public API) and ``tierkv bench serving``."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import statistics
import time
from typing import TYPE_CHECKING, Any

import anyio

if TYPE_CHECKING:
    from tierkv.layout import Layout

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
from tierkv.errors import BenchError

__all__ = ["add_bench", "break_even_tokens"]


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
                        help="TTFT of a real vLLM engine restoring from tierkv (needs vLLM)",
                        description="Run `tierkv bench serving --help` for its options.")
    s.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    s.set_defaults(func=_bench_serving)


def break_even_tokens(read_bytes_per_s: float, latency_s: float, bytes_per_token: float,
                      recompute_tokens_per_s: float) -> float | None:
    """The prompt length (tokens) past which loading beats recomputing, or None when it never does.

    Loading ``n`` tokens takes ``latency_s + n * bytes_per_token / read_bytes_per_s``; recomputing
    them ``n / recompute_tokens_per_s``.
    """
    gain = 1.0 / recompute_tokens_per_s - bytes_per_token / read_bytes_per_s
    if gain <= 0:
        return None
    return latency_s / gain


def _drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


async def _measure(args: argparse.Namespace, advance: Any) -> dict[str, Any]:
    import torch

    from tierkv import GroupSpec, Layout, Lookup, TieredStore
    from tierkv.backends.fsopen import is_local_url
    from tierkv.backends.fsspec import FsspecTierConfig

    block = args.block_kib << 10
    n = args.blocks
    layout = Layout(tokens_per_block=args.tokens_per_block,
                    groups=[GroupSpec(kind="full", block_bytes=block)])
    namespace = f"tierkv-bench-{secrets.token_hex(6)}"
    tier: dict[str, Any] = {"kind": "fsspec", "url": args.url, "codec": args.codec,
                            "storage_options": kv_pairs(args.storage_option),
                            "max_inflight_bytes": max(256 << 20, 2 * args.batch * block),
                            "scan_on_open": False}
    if args.concurrency:
        tier.update(io_threads=args.concurrency, read_concurrency=args.concurrency,
                    max_inflight_ops=args.concurrency)
    cfg = {"layout": layout, "namespace": namespace, "tiers": [{"kind": "cpu", "slots": {0: n}}, tier]}
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(n, block // 2, generator=g) * 0.3).to(torch.bfloat16)
    data = data.view(torch.uint8).reshape(n, block)
    hashes = [secrets.token_bytes(16) for _ in range(n)]
    out = torch.zeros_like(data)
    res: dict[str, Any] = {"url": FsspecTierConfig(url=args.url).model_dump()["url"], "block_bytes": block,
                           "blocks": n, "codec": args.codec}
    opened = False  # nothing to clean up when the tier never opened
    try:
        t0 = time.perf_counter()
        async with TieredStore(cfg) as store:
            opened = True
            for i in range(0, n, args.batch):
                await store.put(0, hashes[i:i + args.batch], data[i:i + args.batch])
                advance(len(hashes[i:i + args.batch]))
            await store.flush()
            st = store.stats().tiers[1]
            if st.stores != n:
                raise BenchError(f"{args.url}: {st.stores} of {n} blocks were stored ({st.stores_failed} "
                                 f"failed, {st.stores_shed} shed; the warnings above say why): is the file "
                                 "system full or read-only, or does the tier not keep up?")
        res["write_mb_s"] = n * block / (time.perf_counter() - t0) / 1e6

        async def restore(hs: list[bytes], rows: Any) -> float:
            async with TieredStore(cfg) as reader:
                t = time.perf_counter()
                while reader.lookup_prefix(hs, request_id="bench").state is Lookup.PENDING:
                    await anyio.sleep(0.001)
                await reader.get(0, hs, rows, request_id="bench")
                return time.perf_counter() - t

        samples = await _first_block_latencies(cfg, hashes, out, min(args.samples, n))
        res["latency_samples_s"] = samples
        res["latency_s"] = statistics.median(samples)
        await restore(hashes, out)  # direct writes left nothing in the page cache: this fills it
        warm = [n * block / await restore(hashes, out) / 1e6 for _ in range(args.rounds)]
        res["read_warm_mb_s"] = statistics.median(warm)
        res["read_warm_samples_mb_s"] = warm
        advance(n)
        if not torch.equal(out, data):
            raise BenchError("the blocks read back differ from those written")
        res["read_cold_mb_s"] = None
        if not args.no_cold and is_local_url(args.url):
            if _may_drop_caches():
                warn("dropping the whole machine's page cache for the cold read (sync; echo 3 > "
                     "/proc/sys/vm/drop_caches); --no-drop-caches skips it")
            cold: list[float] = []
            for _ in range(args.rounds):
                if not _drop_caches():
                    break
                cold.append(n * block / await restore(hashes, out) / 1e6)
            if cold:
                res["read_cold_mb_s"] = statistics.median(cold)
                res["read_cold_samples_mb_s"] = cold
            else:
                res["cold_note"] = "the page cache could not be dropped (needs root): cold read skipped"
        advance(n)
    finally:
        with anyio.CancelScope(shield=True):
            if opened:
                await _remove_records(tier, layout, namespace, hashes)
    bpt = block / args.tokens_per_block
    read = res["read_cold_mb_s"] or res["read_warm_mb_s"]
    res["recompute_tokens_per_s"] = args.recompute_tokens_per_s
    res["break_even_tokens"] = break_even_tokens(read * 1e6, res["latency_s"], bpt,
                                                 args.recompute_tokens_per_s)
    q1, _, q3 = statistics.quantiles(res["latency_samples_s"], n=4) if len(samples) > 1 else [samples[0]] * 3
    spread = [break_even_tokens(read * 1e6, lat, bpt, args.recompute_tokens_per_s) for lat in (q1, q3)]
    res["break_even_tokens_iqr"] = spread if None not in spread else None
    return res


async def _first_block_latencies(cfg: dict[str, Any], hashes: list[bytes], out: Any, k: int) -> list[float]:
    """Seconds from the first lookup to a block in hand, for ``k`` blocks not yet in the primary,
    after one untimed read (the store's threads and file handles start on the first)."""
    from tierkv import Lookup, TieredStore

    async with TieredStore(cfg) as reader:
        times = []
        for i in range(k + 1):
            hs = hashes[i % len(hashes):i % len(hashes) + 1]
            t = time.perf_counter()
            while reader.lookup_prefix(hs, request_id=f"lat{i}").state is Lookup.PENDING:
                await anyio.sleep(0.0002)
            await reader.get(0, hs, out[:1], request_id=f"lat{i}")
            if i:
                times.append(time.perf_counter() - t)
            reader.release(f"lat{i}")
        return times


def _may_drop_caches() -> bool:
    return os.access("/proc/sys/vm/drop_caches", os.W_OK)


def _bench_tier(args: argparse.Namespace) -> int:
    with progress() as bar:
        task = bar.add_task("writing and reading blocks", total=3 * args.blocks)
        res = run_async(lambda: _measure(args, lambda k: bar.advance(task, k)))
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


def _bench_serving(args: argparse.Namespace) -> int:
    try:
        from tierkv.benchmarks import serving
    except ImportError as exc:
        error(f"the serving benchmark cannot load: {exc}")
        return 2
    rest = [a for a in args.rest if a != "--"]
    interrupts_raise()  # the benchmark stops its engine processes on KeyboardInterrupt
    rc: int = serving.main(rest)
    return rc


async def _remove_records(tier: dict[str, Any], layout: Layout, namespace: str, hashes: list[bytes]) -> None:
    """Delete what ``bench tier`` wrote (its records and its namespace's layout file); a warning,
    not an error, when that fails."""
    from tierkv.backends.base import TierContext
    from tierkv.backends.fsopen import is_local_url
    from tierkv.backends.fsspec import FsspecTier, FsspecTierConfig

    ctx = TierContext(layout=layout, namespace=namespace, fingerprint=layout.fingerprint(namespace))
    cleanup = FsspecTier(FsspecTierConfig(**{k: v for k, v in tier.items() if k != "kind"}), ctx)
    try:
        await cleanup.open()
        await cleanup.delete(0, [h + b"\0\0\0\0" for h in hashes])
        await cleanup.driver.delete_many([f"{cleanup.ns_root}/layout.json"])
        await cleanup.close()
        if is_local_url(str(tier["url"])):  # and the directory fan-out the records left, now empty
            for dirpath, _, _ in os.walk(cleanup.ns_root, topdown=False):
                with contextlib.suppress(OSError):
                    os.rmdir(dirpath)
    except Exception as exc:
        warn(f"could not remove the benchmark's records ({str(exc)[:200]})")

"""``tierkv bench tier``: a tier's write and read rates and first-block latency, measured through
the public API as a user's store sees them, and the prompt length past which restoring from it beats
recomputing. The command line (:mod:`tierkv.cli.bench_cmds`) parses and prints; this measures."""

from __future__ import annotations

import contextlib
import os
import secrets
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from tierkv.errors import BenchError

if TYPE_CHECKING:
    from tierkv.layout import Layout

__all__ = ["TierBench", "break_even_tokens", "drop_caches", "first_block_latencies", "may_drop_caches",
           "measure", "remove_records"]

@dataclass(frozen=True)
class TierBench:
    """What ``tierkv bench tier`` measures (its options)."""

    url: str
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    block_kib: int = 1024
    blocks: int = 256
    batch: int = 16
    concurrency: int | None = None
    tokens_per_block: int = 16
    recompute_tokens_per_s: float = 10000.0
    codec: str = "none"
    no_cold: bool = False
    rounds: int = 3
    samples: int = 21


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


def drop_caches() -> bool:
    """Drop the whole machine's page cache (root only); whether it could."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def may_drop_caches() -> bool:
    """Whether this process may drop the page cache."""
    return os.access("/proc/sys/vm/drop_caches", os.W_OK)




async def measure(args: TierBench, advance: Callable[[int], None],
                  say: Callable[[str], None]) -> dict[str, Any]:
    """Write ``args.blocks`` blocks to ``args.url`` through a store, restore them with new stores
    (first-block latencies, warm reads, cold reads where the page cache may be dropped), delete
    them, and return the figures (``advance(n)``: progress; ``say``: notices for the user)."""
    import torch

    from tierkv import GroupSpec, Layout, Lookup, TieredStore
    from tierkv.backends.fsspec import FsspecTierConfig, is_local_url

    block = args.block_kib << 10
    n = args.blocks
    layout = Layout(tokens_per_block=args.tokens_per_block,
                    groups=[GroupSpec(kind="full", block_bytes=block)])
    namespace = f"tierkv-bench-{secrets.token_hex(6)}"
    tier: dict[str, Any] = {"kind": "fsspec", "url": args.url, "codec": args.codec,
                            "storage_options": dict(args.storage_options),
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

        samples = await first_block_latencies(cfg, hashes, out, min(args.samples, n))
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
            if may_drop_caches():
                say("dropping the whole machine's page cache for the cold read (sync; echo 3 > "
                     "/proc/sys/vm/drop_caches); --no-drop-caches skips it")
            cold: list[float] = []
            for _ in range(args.rounds):
                if not drop_caches():
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
                await remove_records(tier, layout, namespace, hashes, say)
    bpt = block / args.tokens_per_block
    read = res["read_cold_mb_s"] or res["read_warm_mb_s"]
    res["recompute_tokens_per_s"] = args.recompute_tokens_per_s
    res["break_even_tokens"] = break_even_tokens(read * 1e6, res["latency_s"], bpt,
                                                 args.recompute_tokens_per_s)
    q1, _, q3 = statistics.quantiles(res["latency_samples_s"], n=4) if len(samples) > 1 else [samples[0]] * 3
    spread = [break_even_tokens(read * 1e6, lat, bpt, args.recompute_tokens_per_s) for lat in (q1, q3)]
    res["break_even_tokens_iqr"] = spread if None not in spread else None
    return res


async def first_block_latencies(cfg: dict[str, Any], hashes: list[bytes], out: Any, k: int) -> list[float]:
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


async def remove_records(tier: dict[str, Any], layout: Layout, namespace: str, hashes: list[bytes],
                         say: Callable[[str], None]) -> None:
    """Delete what ``bench tier`` wrote (its records and its namespace's layout file); a warning,
    not an error, when that fails."""
    from tierkv.backends.base import TierContext
    from tierkv.backends.fsspec import FsspecTier, FsspecTierConfig, is_local_url
    from tierkv.backends.namespace import manifest_path

    ctx = TierContext(layout=layout, namespace=namespace, fingerprint=layout.fingerprint(namespace))
    cleanup = FsspecTier(FsspecTierConfig(**{k: v for k, v in tier.items() if k != "kind"}), ctx)
    try:
        await cleanup.open()
        try:
            await cleanup.delete(0, [h + b"\0\0\0\0" for h in hashes])
            await cleanup.driver.delete_many([manifest_path(cleanup.root, cleanup.context.fingerprint)])
        finally:
            await cleanup.close()  # an obstore tier's threads must be out of Python before exit
        if is_local_url(str(tier["url"])):  # and the directory fan-out the records left, now empty
            for dirpath, _, _ in os.walk(cleanup.ns_root, topdown=False):
                with contextlib.suppress(OSError):
                    os.rmdir(dirpath)
    except Exception as exc:
        say(f"could not remove the benchmark's records ({str(exc)[:200]})")

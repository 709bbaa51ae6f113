"""``tierkv demo``: a hybrid model serving requests with shared prefixes through a TieredStore.

Blocks are made from their own hash (a seeded generator), so every restored block can be checked
against what was stored without keeping a copy.
"""

from __future__ import annotations

import hashlib
import random
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from tierkv.layout import GroupSpec, Layout
from tierkv.store import Lookup, TieredStore

__all__ = ["DemoResult", "block_for", "chain_hashes", "demo_layout", "run_demo"]


def demo_layout() -> Layout:
    """Full attention + scratch + sliding window + recurrent (Mamba-like) groups."""
    return Layout(tokens_per_block=16, groups=[
        GroupSpec(kind="full", block_bytes=64 << 10),
        GroupSpec(kind="scratch", block_bytes=512),
        GroupSpec(kind="sliding_window", block_bytes=64 << 10, window_blocks=4),
        GroupSpec(kind="recurrent", block_bytes=256 << 10, states_per_request=1),
    ])


def chain_hashes(doc: int, n: int) -> list[bytes]:
    """Chained block hashes of document ``doc``: hash i covers blocks 0..i."""
    out, prev = [], doc.to_bytes(8, "big")
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "big")).digest()
        out.append(prev)
    return out


def block_for(block_hash: bytes, group: int, nbytes: int) -> torch.Tensor:
    """The deterministic contents of one block (bf16-like values, as bytes)."""
    seed = int.from_bytes(hashlib.blake2b(block_hash + group.to_bytes(4, "big"), digest_size=8).digest(),
                          "big") & ((1 << 63) - 1)
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(nbytes // 2, generator=g) * 0.5).to(torch.bfloat16).view(torch.uint8)


@dataclass
class DemoResult:
    """What the demo saw."""

    requests: int = 0
    restored_blocks: int = 0
    computed_blocks: int = 0
    mismatches: int = 0
    steps_waited: int = 0
    bytes_restored: int = 0
    seconds: float = 0.0
    stats: Any = None
    plan: Any = None
    per_tier_hits: dict[int, int] = field(default_factory=dict)


async def run_demo(*, requests: int = 48, documents: int = 12, seed: int = 0,
                   lower_url: str | None = None, primary_bytes: int = 24 << 20,
                   progress: Any = None) -> DemoResult:
    """Serve ``requests`` requests over ``documents`` shared prefixes; verify every restore."""
    layout = demo_layout()
    rng = random.Random(seed)
    tmp = None
    if lower_url is None:
        tmp = tempfile.TemporaryDirectory(prefix="tierkv-demo-")
        lower_url = f"file://{tmp.name}"
    lower: dict[str, Any] = ({"kind": "memory"} if lower_url == "memory" else
                             {"kind": "fsspec", "url": lower_url, "codec": "zstd-shuffle"})
    cfg = {"layout": layout, "namespace": "demo-hybrid-bf16", "max_concurrent_requests": 4,
           "tiers": [{"kind": "cpu", "capacity_bytes": primary_bytes}, lower]}
    docs = [chain_hashes(d, rng.randint(8, 40)) for d in range(documents)]
    res = DemoResult()
    groups = layout.cacheable_groups
    t0 = time.perf_counter()
    try:
        async with TieredStore(cfg) as store:
            res.plan = store.stats().plan
            for r in range(requests):
                doc = docs[rng.randrange(documents)]
                n = rng.randint(len(doc) // 2, len(doc))
                hashes = doc[:n]
                rid = f"req-{r}"
                while True:
                    pl = store.lookup_prefix(hashes, request_id=rid)
                    if pl.state is not Lookup.PENDING:
                        break
                    res.steps_waited += 1
                    await store.idle()
                    await anyio.sleep(0)
                k = pl.blocks if pl.state is Lookup.HIT else 0
                for g in groups:
                    spec = layout.groups[g]
                    need = list(spec.blocks_needed(k))
                    if need:
                        out = torch.empty((len(need), spec.block_bytes), dtype=torch.uint8)
                        await store.get(g, [hashes[i] for i in need], out, request_id=rid)
                        for j, i in enumerate(need):
                            if not torch.equal(out[j], block_for(hashes[i], g, spec.block_bytes)):
                                res.mismatches += 1
                        res.bytes_restored += out.numel()
                    fresh = [i for i in range(n) if i >= k]
                    if fresh:
                        data = torch.stack([block_for(hashes[i], g, spec.block_bytes) for i in fresh])
                        await store.put(g, [hashes[i] for i in fresh], data)
                res.restored_blocks += k
                res.computed_blocks += n - k
                store.release(rid)
                res.requests += 1
                if progress is not None:
                    progress(1)
                if r % 8 == 7:
                    # the engine's own GPU cache is gone (eviction, restart): drop the CPU pool so
                    # the next restores come from the lower tier
                    await store.flush()
                    store.engine.clear()
            await store.flush()
            res.stats = store.stats()
    finally:
        if tmp is not None:
            tmp.cleanup()
    res.seconds = time.perf_counter() - t0
    return res

"""``tierkv replay``: a request trace through a real :class:`~tierkv.TieredStore`.

The blocks are tiny (``block_bytes``, 64 by default), so a trace of ten thousand requests takes
seconds, but everything else is what serves an engine: the pool, its eviction policy, admission,
the cascade to lower tiers and the promotions back. Per request, as an engine does it:
``lookup_prefix`` over the request's block hashes (waiting while it is PENDING), ``get`` of the
prefix found, ``release``; then ``put`` of the rest of the blocks, in runs, in order: a run the
primary holds is only touched, a run it does not is stored (and cascades down).

Accounting (:mod:`tierkv.tools.traces`): the request hits ``min(n * block_tokens, input_length)``
tokens, ``n`` the prefix found. Each of those blocks is credited to the tier that served it: the
primary when it was ready there at the lookup, else the first lower tier that held it.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from tierkv.backends.pooltier import PoolTier
from tierkv.keys import make_key
from tierkv.layout import GroupSpec, Layout
from tierkv.records import encode_record
from tierkv.store import Lookup, TieredStore
from tierkv.tools.traces import TraceRequest, belady_hit_rate, hit_tokens

__all__ = ["ReplayOptions", "ReplayResult", "TierResult", "block_key", "record_bytes", "replay"]

NAMESPACE = "tierkv-replay"


@dataclass
class ReplayOptions:
    """What to replay the trace through. ``cpu_blocks`` None: a primary that holds every block of
    the trace; ``disk_blocks``: a ``file://`` tier of that many blocks in a temporary directory
    (0: unbounded); ``url``: one more lower tier (fsspec URL, or ``memory``), unbounded."""

    block_tokens: int = 512
    cpu_blocks: int | None = None
    disk_blocks: int | None = None
    url: str | None = None
    policy: str | None = None
    block_bytes: int = 64
    recompute_tokens_per_s: float | None = None


@dataclass
class TierResult:
    """Hits one tier served. ``capacity_blocks`` None: unbounded. ``read_bytes_per_s``: the rate
    measured while it served them; ``saved_s``: prefill time its hits saved (recompute time of the
    tokens less the time to read their blocks), with a recompute rate."""

    kind: str
    capacity_blocks: int | None
    hit_blocks: int = 0
    hit_tokens: int = 0
    token_hit_rate: float = 0.0
    read_bytes_per_s: float | None = None
    saved_s: float | None = None


@dataclass
class ReplayResult:
    """The replay's totals, per tier, and the clairvoyant bound for the same capacity."""

    requests: int
    input_tokens: int
    hit_tokens: int
    token_hit_rate: float
    policy: str
    tiers: list[TierResult]
    bound: float
    bound_capacity_blocks: int | None
    seconds: float
    stats: Any = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` object (docs/traffic.md): per tier ``prefill_saved_s`` only with a
        recompute rate."""
        tiers = []
        for t in self.tiers:
            d: dict[str, Any] = {"kind": t.kind, "capacity_blocks": t.capacity_blocks,
                                 "hit_tokens": t.hit_tokens, "token_hit_rate": t.token_hit_rate}
            if t.saved_s is not None:
                d["prefill_saved_s"] = t.saved_s
            tiers.append(d)
        return {"requests": self.requests, "input_tokens": self.input_tokens,
                "hit_tokens": self.hit_tokens, "token_hit_rate": self.token_hit_rate,
                "policy": self.policy, "tiers": tiers,
                "bound": {"policy": "belady", "token_hit_rate": self.bound}}


def block_key(hash_id: int) -> bytes:
    """The block hash a trace id becomes: 8 bytes, so every record has the same size."""
    return hash_id.to_bytes(8, "big", signed=True)


def record_bytes(block_bytes: int, fingerprint: str, codec: str = "none") -> int:
    """The size of one record on a file tier (docs/format.md), which its ``capacity_bytes`` counts."""
    payload = torch.zeros(block_bytes, dtype=torch.uint8).numpy()
    return len(encode_record(key=make_key(block_key(0), 0), fingerprint=fingerprint, payload=payload,
                             codec=codec))


def _layout(opts: ReplayOptions) -> Layout:
    return Layout(tokens_per_block=opts.block_tokens,
                  groups=[GroupSpec(kind="full", block_bytes=opts.block_bytes)])


def _config(opts: ReplayOptions, distinct: int, directory: str | None) -> dict[str, Any]:
    layout = _layout(opts)
    slots = opts.cpu_blocks if opts.cpu_blocks is not None else max(1, distinct)
    cfg: dict[str, Any] = {"layout": layout, "namespace": NAMESPACE, "max_concurrent_requests": 1,
                           "cost_model": False, "tiers": [{"kind": "cpu", "slots": {0: slots}}]}
    if opts.policy is not None:
        cfg["policy"] = opts.policy
    if directory is not None:
        disk: dict[str, Any] = {"kind": "fsspec", "url": f"file://{directory}", "codec": "none",
                                "scan_on_open": False, "rescan_s": 0, "required": True}
        if opts.disk_blocks:
            fp = layout.fingerprint(NAMESPACE)
            disk["capacity_bytes"] = opts.disk_blocks * record_bytes(opts.block_bytes, fp)
        cfg["tiers"].append(disk)
    if opts.url is not None:
        cfg["tiers"].append({"kind": "memory"} if opts.url == "memory" else
                            {"kind": "fsspec", "url": opts.url, "codec": "none", "required": True})
    return cfg


class _Replayer:
    """One store, one trace: the per-request steps and the per-tier accounting."""

    def __init__(self, store: TieredStore, opts: ReplayOptions) -> None:
        self.store = store
        self.opts = opts
        primary = store.tiers[0]
        assert isinstance(primary, PoolTier)
        self.primary = primary
        self.lower = store.tiers[1:]
        self.blocks = [0] * len(store.tiers)
        self.tokens = [0] * len(store.tiers)
        self.primary_read_s = 0.0
        self.primary_read_blocks = 0
        self.rows = torch.zeros((1, opts.block_bytes), dtype=torch.uint8)

    def _rows(self, n: int) -> torch.Tensor:
        if self.rows.shape[0] < n:
            rows = max(n, 2 * self.rows.shape[0])
            self.rows = torch.zeros((rows, self.opts.block_bytes), dtype=torch.uint8)
        return self.rows[:n]

    def _ready(self, full: Sequence[bytes]) -> list[bool]:
        """Per pool key (``make_key(hash, 0)``), whether the primary holds it ready."""
        return self.primary.contains_nowait(0, full)

    async def _source(self, key: bytes) -> int:
        """The lower tier a block not in the primary came from: the first that holds it."""
        full = [make_key(key, 0)]
        for i, tier in enumerate(self.lower, start=1):
            if (await tier.contains(0, full))[0]:
                return i
        return 1

    async def request(self, index: int, req: TraceRequest) -> int:
        """Replay one request; the tokens it hit."""
        store, bt = self.store, self.opts.block_tokens
        keys = [block_key(h) for h in req.hash_ids]
        full = [make_key(k, 0) for k in keys]
        rid = f"r{index}"
        ready = self._ready(full)
        found = store.lookup_prefix(keys, request_id=rid)
        while found.state is Lookup.PENDING:
            await store.idle()
            await anyio.sleep(0)
            found = store.lookup_prefix(keys, request_id=rid)
        n = found.blocks if found.state is Lookup.HIT else 0
        if n:
            t0 = time.perf_counter()
            await store.get(0, keys[:n], self._rows(n), request_id=rid)
            if all(ready[:n]):
                self.primary_read_s += time.perf_counter() - t0
                self.primary_read_blocks += n
        store.release(rid)
        for i in range(n):
            tier = 0 if ready[i] else await self._source(keys[i])
            self.blocks[tier] += 1
            self.tokens[tier] += max(0, min(bt, req.input_length - i * bt))
        i = n
        while i < len(keys):  # runs the primary holds (touched) or not (stored), in order
            now = self._ready(full[i:])  # again after each run: storing one may evict later ones
            j = 1
            while j < len(now) and now[j] == now[0]:
                j += 1
            await store.put(0, keys[i:i + j], self._rows(j))
            i += j
        if self.lower:
            await store.flush()
        return hit_tokens(n, req.input_length, bt)


def _tiers(opts: ReplayOptions) -> list[TierResult]:
    out = [TierResult("cpu", opts.cpu_blocks)]
    if opts.disk_blocks is not None:
        out.append(TierResult("disk", opts.disk_blocks or None))
    if opts.url is not None:
        out.append(TierResult("memory" if opts.url == "memory" else "url", None))
    return out


async def replay(requests: Sequence[TraceRequest], opts: ReplayOptions,
                 progress: Callable[[int], None] | None = None) -> ReplayResult:
    """Replay ``requests`` through a store built from ``opts``; the hits per tier and in all."""
    distinct = len({h for r in requests for h in r.hash_ids})
    tiers = _tiers(opts)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tierkv-replay-") as tmp:
        cfg = _config(opts, distinct, tmp if opts.disk_blocks is not None else None)
        hit = 0
        async with TieredStore(cfg) as store:
            rp = _Replayer(store, opts)
            for i, req in enumerate(requests):
                hit += await rp.request(i, req)
                if progress is not None:
                    progress(1)
            stats = store.stats()
            policy = store.config.policy
    seconds = time.perf_counter() - t0
    total = sum(r.input_length for r in requests)
    for i, t in enumerate(tiers):
        t.hit_blocks, t.hit_tokens = rp.blocks[i], rp.tokens[i]
        t.token_hit_rate = t.hit_tokens / total if total else 0.0
        if i == 0:
            t.read_bytes_per_s = (rp.primary_read_blocks * opts.block_bytes / rp.primary_read_s
                                  if rp.primary_read_s > 0 else None)
        else:
            t.read_bytes_per_s = stats.tiers[i].read_bytes_per_s if stats.tiers[i].bytes_read else None
        if opts.recompute_tokens_per_s and t.hit_tokens:
            read_s = t.hit_blocks * opts.block_bytes / t.read_bytes_per_s if t.read_bytes_per_s else 0.0
            t.saved_s = t.hit_tokens / opts.recompute_tokens_per_s - read_s
    caps = [t.capacity_blocks for t in tiers]
    bound_cap = None if any(c is None for c in caps) else max(c for c in caps if c is not None)
    return ReplayResult(requests=len(requests), input_tokens=total, hit_tokens=hit,
                        token_hit_rate=hit / total if total else 0.0, policy=policy, tiers=tiers,
                        bound=belady_hit_rate(requests, bound_cap, opts.block_tokens),
                        bound_capacity_blocks=bound_cap, seconds=seconds, stats=stats)

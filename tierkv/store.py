"""TieredStore: the facade over the primary pool, its lower tiers and the work between them.

Data paths (docs/design.md has the module map):

- put ↓: :meth:`TieredStore.put` writes rows into primary slots (:mod:`tierkv.pool`); the
  :class:`~tierkv.cascade.Cascader` writes them on through each lower tier's
  :class:`~tierkv.gateway.TierGateway` to its backend.
- restore ↑: :meth:`TieredStore.lookup_prefix` asks the :class:`~tierkv.lookup.Resolver`,
  which admits promotions (:class:`~tierkv.admission.Admission`); each is a gateway ``load``
  straight into the reserved pool rows, batch by batch; :meth:`TieredStore.get` copies the
  rows out in one batched copy per run of ready blocks.

Engines that copy blocks themselves use :attr:`TieredStore.engine`
(:class:`~tierkv.engine.EngineSlots`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import anyio
import torch

from tierkv.admission import Admission, Promotion
from tierkv.backends.base import Tier, TierContext
from tierkv.backends.pooltier import PoolTier
from tierkv.backends.registry import get_backend
from tierkv.bridge import LoopBridge, locked
from tierkv.cascade import Cascader
from tierkv.config import StoreConfig
from tierkv.engine import EngineSlots, Reservation
from tierkv.errors import BlockMissing, ConfigError, InvalidArgument, StoreClosed
from tierkv.gateway import TierGateway
from tierkv.keys import GROUP_BYTES, check_hashes
from tierkv.layout import Layout
from tierkv.lookup import KeyState, Lookup, PrefixLookup, Resolver, Work
from tierkv.metrics import GroupStats, StoreStats, TierStats
from tierkv.pool import SlotPool, SlotState, contiguous_run, plan_pools
from tierkv.tensors import byte_rows

__all__ = ["KeyState", "Lookup", "PrefixLookup", "Reservation", "TieredStore"]

log = logging.getLogger("tierkv")


class TieredStore:
    """A tiered block store. Use as ``async with TieredStore(config) as store:``.

    ``lookup`` and ``lookup_prefix`` never await: they read in-memory state and start background
    work (presence probes, promotions). ``put`` returns once the blocks are in the primary; the
    cascade to lower tiers runs in the background (``flush`` waits for it). The synchronous
    methods may be called from any thread while the store runs on its asyncio loop.
    """

    def __init__(self, config: StoreConfig | Mapping[str, Any]) -> None:
        self.config = config if isinstance(config, StoreConfig) else StoreConfig.from_dict(config)
        self.layout: Layout = self.config.layout
        self.fingerprint = self.config.fingerprint
        ctx = TierContext(layout=self.layout, namespace=self.config.namespace,
                          fingerprint=self.fingerprint,
                          max_concurrent_requests=self.config.max_concurrent_requests,
                          policy=self.config.policy)
        self._tiers: list[Tier] = [get_backend(tc.kind)(tc, ctx) for tc in self.config.tiers]
        primary = self._tiers[0]
        if not isinstance(primary, PoolTier):
            raise ConfigError(f"tiers.0: the primary must be a slot-pool tier (cpu or device), "
                              f"not {primary.kind!r}")
        self._primary: PoolTier = primary
        self._bridge = LoopBridge("tierkv store")
        self._lock = self._bridge.lock
        self._open = False
        self._pools: dict[int, SlotPool] = {}
        self._gateways: list[TierGateway] = []
        self._promoting: dict[bytes, anyio.Event] = {}
        self._probe_batches: dict[tuple[int, int], list[bytes]] = {}
        self._admission = Admission({}, self.config.admission)
        self._cascader: Cascader | None = None
        self._resolver: Resolver | None = None
        self._engine: EngineSlots | None = None
        self._primary_stats = TierStats(index=0, kind=primary.kind, describe=primary.describe())
        self._lookups = {s.value: 0 for s in Lookup}
        self._counts = {"puts": 0, "put_blocks_direct": 0, "put_blocks_dropped": 0,
                        "evictions_unbacked": 0, "leases_expired": 0}

    # ---- lifecycle ------------------------------------------------------------------------------
    async def __aenter__(self) -> TieredStore:
        await self.open()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def open(self) -> None:
        """Open every tier and start background work. Prefer ``async with``."""
        if self._open:
            return
        opened: list[Tier] = []
        try:
            for t in self._tiers:
                await t.open()
                opened.append(t)
        except BaseException:
            with anyio.CancelScope(shield=True):
                for t in reversed(opened):
                    await _close_quietly(t)
            raise
        self._pools = self._primary.pools
        lock = self._lock
        self._gateways = [TierGateway(i, t, lock) for i, t in enumerate(self._tiers[1:], start=1)]
        self._admission = Admission(self._pools, self.config.admission)
        self._cascader = Cascader(self._bridge, self._pools, self._gateways, self._changed)
        self._resolver = Resolver(self.layout, self._pools, self._gateways, self._admission,
                                  self._cascader.staged, self._promoting)
        self._engine = EngineSlots(lock=lock, layout=self.layout, pools=self._pools,
                                   admission=self._admission, resolver=self._resolver,
                                   check_open=self._check_open, start=self._start,
                                   committed=self._committed, changed=self._changed,
                                   set_event=self._bridge.set_event)
        for g, pool in self._pools.items():
            pool.on_evict = functools.partial(self._evicted, g)
        await self._bridge.start()
        self._open = True
        self._bridge.spawn(self._lease_sweeper)
        for t in self._tiers:
            self._bridge.spawn(_guarded, t.background)

    async def close(self) -> None:
        """Wait for admitted cascades, stop background work, close every tier.

        May be called from any task or inside a timeout: when cancelled while it waits for
        cascades, it still stops the background work and closes the tiers before it returns.
        """
        if not self._open:
            return
        try:
            await self.flush()
        finally:
            with self._lock:
                self._open = False
            with anyio.CancelScope(shield=True):
                await self._bridge.stop()
                for t in reversed(self._tiers):
                    await _close_quietly(t)

    def _check_open(self) -> None:
        if not self._open:
            raise StoreClosed("the store is not open: use 'async with TieredStore(config) as store'")

    @property
    def tiers(self) -> list[Tier]:
        """The tier objects, primary first."""
        return list(self._tiers)

    @property
    def engine(self) -> EngineSlots:
        """The slot API for engine adapters (see :mod:`tierkv.engine`)."""
        self._check_open()
        assert self._engine is not None
        return self._engine

    # ---- validation -----------------------------------------------------------------------------
    def _keys(self, group: int, hashes: Sequence[bytes]) -> tuple[SlotPool, list[bytes]]:
        pool = self._pools.get(group) if type(group) is int else None
        if pool is None:
            self.layout.group(group)  # raises the clear error
            raise InvalidArgument(f"group {group} has no pool")
        tail = group.to_bytes(GROUP_BYTES, "big")
        return pool, [h + tail for h in check_hashes(hashes)]

    # ---- put ------------------------------------------------------------------------------------
    async def put(self, group: int, hashes: Sequence[bytes], blocks: torch.Tensor) -> None:
        """Store ``blocks[i]`` as block ``hashes[i]`` of ``group``.

        Returns once the blocks are in the primary (readable at once); cascades to lower tiers run
        in the background. Blocks already held are not written again. Blocks that find no free or
        evictable slot go straight to the lower tiers from a private copy; when no tier takes them
        either they are dropped and counted (``put_blocks_dropped``).
        """
        with self._lock:
            self._put(group, hashes, blocks)

    def _put(self, group: int, hashes: Sequence[bytes], blocks: torch.Tensor) -> None:
        self._check_open()
        pool, keys = self._keys(group, hashes)
        src = byte_rows(blocks, len(keys), pool.block_bytes, "blocks", pool.device)
        self._counts["puts"] += 1
        new = []
        for i, k in enumerate(keys):
            if pool.slot_of(k) is None:
                new.append(i)
            else:
                pool.touch(k)
        if not new:
            return
        n = min(len(new), pool.available())
        placed = new[:n]
        if placed:
            got = pool.allocate([keys[i] for i in placed])
            assert got is not None
            slots = got[0]
            pool.write(slots, _rows(src, placed))
            pool.mark_ready(slots)
            self._committed(group, [keys[i] for i in placed], slots)
        direct = new[n:]
        if direct:
            assert self._cascader is not None
            copy = _rows(src, direct).to("cpu", copy=True)
            if self._cascader.start(group, [keys[i] for i in direct], None, copy):
                self._counts["put_blocks_direct"] += len(direct)
            else:
                self._counts["put_blocks_dropped"] += len(direct)

    def _committed(self, group: int, keys: list[bytes], slots: list[int]) -> None:
        """Blocks just became READY in the primary: count them and cascade them down."""
        nbytes = len(slots) * self._pools[group].block_bytes
        self._primary_stats.stores += len(slots)
        self._primary_stats.bytes_written += nbytes
        assert self._cascader is not None
        self._cascader.start(group, keys, slots, None)

    def _evicted(self, group: int, keys: list[bytes]) -> None:
        """Keys left the primary to make room: count those no lower tier holds; tell listeners."""
        now = time.monotonic()
        unbacked = sum(1 for k in keys if not any(gw.presence(group, k, now) for gw in self._gateways))
        self._counts["evictions_unbacked"] += unbacked
        if self._engine is not None:
            self._engine.notify_evicted(group, keys)

    async def flush(self) -> None:
        """Wait until every admitted cascade has finished (or failed, counted in ``stats()``)."""
        if self._cascader is not None:
            await self._cascader.flush()

    async def idle(self) -> None:
        """Wait until no cascade, promotion or probe is in flight (for tests and simulations)."""
        while (self._cascader is not None and self._cascader.running) or self._bridge.busy:
            await self.flush()
            await self._bridge.wait_idle()

    # ---- lookups --------------------------------------------------------------------------------
    @locked
    def lookup(self, group: int, hashes: Sequence[bytes],
               request_id: str | None = None) -> list[Lookup]:
        """Per block: HIT (ready in the primary), PENDING (on its way) or MISS. Never awaits.

        A block held only by a lower tier gets a primary slot reserved now and is promoted in the
        background; with ``request_id`` every HIT or PENDING block is pinned for that request until
        it loads the block (``get(..., request_id=)``) or is released.
        """
        return [st.lookup for st in self.lookup_states(group, hashes, request_id)]

    @locked
    def lookup_states(self, group: int, hashes: Sequence[bytes],
                      request_id: str | None = None) -> list[KeyState]:
        """:meth:`lookup` with the reason behind each answer (see :class:`KeyState`)."""
        self._check_open()
        _, keys = self._keys(group, hashes)
        assert self._resolver is not None
        req = self._admission.request(request_id)
        anon = req is None
        if req is None:
            req = self._admission.anonymous()
        try:
            states, work = self._resolver.states(group, keys, req)
        finally:
            if anon:
                self._admission.end_call(req)
        self._start(work)
        for st in states:
            self._lookups[st.lookup.value] += 1
        return states

    @locked
    def lookup_prefix(self, hashes: Sequence[bytes], request_id: str | None = None) -> PrefixLookup:
        """The longest usable prefix over every prefix-cacheable group (docs/design.md).

        ``blocks`` is the longest prefix whose needed blocks are all known to exist somewhere;
        ``state`` is HIT when they are all ready in the primary and no probe can lengthen it,
        PENDING when waiting gives a ready or longer prefix, MISS when there is nothing at all.
        A prefix needing more blocks of a group than its pool has falls back to the longest that fits.
        """
        self._check_open()
        assert self._resolver is not None
        req = self._admission.request(request_id)
        anon = req is None
        if req is None:
            req = self._admission.anonymous()
        try:
            result, work = self._resolver.prefix(hashes, req)
        finally:
            if anon:
                self._admission.end_call(req)
        self._start(work)
        self._lookups[result.state.value] += 1
        return result

    @locked
    def release(self, request_id: str) -> None:
        """Drop every pin ``request_id`` holds and its place in the admission queue."""
        self._check_open()
        if type(request_id) is not str:
            raise InvalidArgument(f"request_id must be a str, got {type(request_id).__name__}")
        self._admission.release(request_id)
        self._changed()

    # ---- background work ------------------------------------------------------------------------
    def _changed(self) -> None:
        """Slots may have become available: admit waiting requests (call under the lock)."""
        if self._open and self._admission.queue:
            assert self._resolver is not None
            self._start(Work(promotions=self._admission.service(self._resolver.held_by)))

    def _start(self, work: Work) -> None:
        for p in work.promotions:
            for k in p.keys:
                self._promoting[k] = anyio.Event()
            self._bridge.begin()
            self._bridge.spawn(self._promote, p)
        for (pos, group), keys in work.probes.items():
            gw = self._gateways[pos]
            keys = [k for k in dict.fromkeys(keys) if k not in gw.probing]
            if not keys:
                continue
            gw.probing.update(keys)
            batch = self._probe_batches.get((pos, group))
            if batch is not None:  # a probe task is scheduled and has not started: it takes these
                batch.extend(keys)
                continue
            self._probe_batches[(pos, group)] = list(keys)
            self._bridge.begin()
            self._bridge.spawn(self._probe, gw, pos, group)

    async def _promote(self, p: Promotion) -> None:
        gw = self._gateways[p.tier]
        pool = self._pools[p.group]

        def landed(positions: list[int], ok: list[bool]) -> None:
            p.landed(ok)
            good = [p.slots[i] for i, f in zip(positions, ok, strict=True) if f]
            pool.mark_ready(good)
            gw.stats.promotions += len(good)
            for i, f in zip(positions, ok, strict=True):
                key = p.keys[i]
                if not f:
                    gw.stats.promotions_failed += 1
                    self._admission.drop(p.group, key)
                ev = self._promoting.pop(key, None)
                if ev is not None:
                    self._bridge.set_event(ev)

        try:
            await gw.load(p.group, p.keys, pool.tensor, p.slots, on_batch=landed)
        finally:
            with self._lock:
                left = [i for i, k in enumerate(p.keys) if k in self._promoting]
                if left:  # cancelled (the store is closing): what did not land is dropped
                    landed(left, [False] * len(left))
                self._bridge.end()
                self._changed()

    async def _probe(self, gw: TierGateway, pos: int, group: int) -> None:
        try:
            with self._lock:
                keys = self._probe_batches.pop((pos, group))
            await gw.probe(group, keys)
        finally:
            with self._lock:
                self._bridge.end()
                self._changed()

    async def _lease_sweeper(self) -> None:
        lease = self.config.pin_lease_s
        while True:
            await anyio.sleep(min(1.0, lease / 4))
            with self._lock:
                for rid in self._admission.expired(lease):
                    self._counts["leases_expired"] += 1
                    log.info("request %s made no call for %.1fs: its pins expired", rid, lease)
                    self._admission.release(rid)
                self._changed()

    # ---- get ------------------------------------------------------------------------------------
    async def get(self, group: int, hashes: Sequence[bytes], out: torch.Tensor,
                  request_id: str | None = None) -> None:
        """Copy blocks into the rows of ``out``, waiting for PENDING ones.

        Blocks not in the primary are read from the first lower tier that holds them, straight
        into ``out`` (and kept in the primary when a slot is free or evictable). Raises
        :class:`BlockMissing` when a block is held by no tier (``out`` rows are then unspecified).
        With ``request_id``, that request's pins on these blocks are dropped once they are copied.
        """
        with self._lock:
            self._check_open()
            pool, keys = self._keys(group, hashes)
            out8 = byte_rows(out, len(keys), pool.block_bytes, "out", pool.device, writable=True)
            req = self._admission.request(request_id)
        todo = list(range(len(keys)))
        missing: list[int] = []
        while todo:
            with self._lock:
                absent, waits = self._copy_resident(pool, keys, todo, out8)
            if absent:
                missing += await self._read_lower(group, keys, absent, out8)
            if waits:
                await next(iter(waits.values())).wait()
            todo = list(waits)
        if req is not None:
            with self._lock:
                for k in keys:
                    self._admission.unpin(req, k)
                self._changed()
        if missing:
            raise BlockMissing(f"{len(missing)} of {len(keys)} blocks of group {group} are held"
                               f" by no tier", missing=sorted(missing))

    def _copy_resident(self, pool: SlotPool, keys: list[bytes], todo: list[int],
                       out8: torch.Tensor) -> tuple[list[int], dict[int, anyio.Event]]:
        """Copy READY (and staged) rows out; the rows held by no slot, and events to wait for."""
        assert self._cascader is not None and self._engine is not None
        ready: list[int] = []
        absent: list[int] = []
        waits: dict[int, anyio.Event] = {}
        index, state = pool.index, pool.state
        for i in todo:
            s = index.get(keys[i])
            if s is None:
                staged = self._cascader.staged_row(keys[i])
                if staged is not None:
                    out8[i].copy_(staged)
                else:
                    absent.append(i)
            elif state[s] is SlotState.READY:
                ready.append(i)
            else:
                ev = self._promoting.get(keys[i]) or self._engine.storing(keys[i])
                assert ev is not None, "every WRITING slot has an event"
                waits[i] = ev
        if ready:
            slots = [index[keys[i]] for i in ready]
            r = contiguous_run(ready)
            if r is not None:
                pool.read(slots, out8[r[0]:r[1]])
            else:
                tmp = torch.empty((len(ready), pool.block_bytes), dtype=torch.uint8, device=out8.device)
                pool.read(slots, tmp)
                out8.index_copy_(0, torch.tensor(ready, dtype=torch.int64, device=out8.device), tmp)
            for i in ready:
                pool.touch(keys[i])
            self._primary_stats.hits += len(ready)
            self._primary_stats.bytes_read += len(ready) * pool.block_bytes
        return absent, waits

    async def _read_lower(self, group: int, keys: list[bytes], rows: list[int],
                          out8: torch.Tensor) -> list[int]:
        """Read blocks held by no primary slot straight into ``out8``; the rows still missing."""
        left = rows
        now = time.monotonic()
        for gw in self._gateways:
            if not left:
                break
            with self._lock:
                sub = [i for i in left if gw.presence(group, keys[i], now) is not False]
            if not sub:
                continue
            sub_keys = [keys[i] for i in sub]
            ok = await gw.load(group, sub_keys, out8, sub)
            got = [j for j, f in enumerate(ok) if f]
            if got:
                with self._lock:
                    self._keep(group, [sub_keys[j] for j in got], out8, [sub[j] for j in got])
            done = {sub[j] for j in got}
            left = [i for i in left if i not in done]
        return left

    def _keep(self, group: int, keys: list[bytes], src: torch.Tensor, rows: list[int]) -> None:
        """Keep blocks read from a lower tier in the primary when slots can be had now."""
        pool = self._pools[group]
        take = [j for j, k in enumerate(keys) if pool.slot_of(k) is None]
        if not take or pool.available() < len(take) or self._admission.queue:
            return
        got = pool.allocate([keys[j] for j in take])
        if got is None:
            return
        pool.write(got[0], _rows(src, [rows[j] for j in take]))
        pool.mark_ready(got[0])

    @contextlib.asynccontextmanager
    async def borrow(self, group: int, hashes: Sequence[bytes],
                     request_id: str | None = None) -> AsyncIterator[torch.Tensor]:
        """Lend the primary's rows of resident blocks, without copying them out.

        ``async with store.borrow(g, hashes) as rows:`` gives ``rows``, a ``[len(hashes),
        block_bytes]`` uint8 tensor: a view of the pool itself when the blocks sit in consecutive
        slots (after a promotion they usually do), else one gathered copy. The blocks stay pinned
        (neither evicted nor rewritten) until the block exits; PENDING blocks are waited for.
        Raises :class:`BlockMissing` when a block is not in the primary (``lookup_prefix`` brings
        blocks from lower tiers; ``get`` reads them directly). With ``request_id``, that request's
        pins on these blocks are dropped on exit too.
        """
        with self._lock:
            self._check_open()
            pool, keys = self._keys(group, hashes)
            req = self._admission.request(request_id)
            lender = self._admission.anonymous()
        try:
            while True:
                with self._lock:
                    missing, waits = [], []
                    slots: list[int] = []
                    for i, k in enumerate(keys):
                        s = pool.index.get(k)
                        if s is None:
                            missing.append(i)
                        elif pool.state[s] is not SlotState.READY:
                            waits.append(self._promoting.get(k) or self.engine.storing(k))
                        else:
                            slots.append(s)
                    if not missing and not waits:
                        for k, s in zip(keys, slots, strict=True):
                            self._admission.pin(lender, group, k, s)
                        break
                if missing:
                    raise BlockMissing(f"{len(missing)} of {len(keys)} blocks of group {group} are not "
                                       f"in the primary", missing=missing)
                ev = next((e for e in waits if e is not None), None)
                if ev is None:
                    await anyio.sleep(0)
                else:
                    await ev.wait()
            run = contiguous_run(slots)
            if run is not None:
                rows = pool.tensor[run[0]:run[1]]
            else:
                rows = pool.tensor.index_select(0, torch.tensor(slots, dtype=torch.int64, device=pool.device))
            with self._lock:
                for k in keys:
                    pool.touch(k)
                self._primary_stats.hits += len(keys)
                self._primary_stats.bytes_read += len(keys) * pool.block_bytes
            yield rows
        finally:
            with self._lock:
                self._admission.end_call(lender)
                if req is not None:
                    for k in keys:
                        self._admission.unpin(req, k)
                self._changed()

    # ---- state ----------------------------------------------------------------------------------
    @locked
    def has_pending_work(self) -> bool:
        """True while cascades, promotions, probes or queued requests are in flight."""
        running = self._cascader.running if self._cascader is not None else 0
        return bool(running or self._bridge.busy or self._admission.queue)

    @locked
    def check(self) -> list[str]:
        """Consistency problems in the store's accounting (empty when sound): slots leaked or
        owned twice, counts that disagree, pins no request or cascade accounts for.

        For tests and debugging; it walks every slot, so it is not meant for a hot path.
        """
        problems = []
        cascading = self._cascader is not None and self._cascader.running
        for g, pool in self._pools.items():
            problems += pool.problems()
            if cascading:
                continue  # cascades pin slots too
            expected = [0] * pool.num_slots
            for req in self._admission.requests.values():
                for key, grp in req.pins.items():
                    if grp != g:
                        continue
                    s = pool.slot_of(key)
                    if s is None:
                        problems.append(f"group {g}: request {req.rid!r} pins {key.hex()}, not resident")
                    else:
                        expected[s] += 1
            if expected != pool.pins:
                problems.append(f"group {g}: pins do not match the requests holding them")
        return problems

    @locked
    def stats(self) -> StoreStats:
        """Counters per tier and per group, the pool plan, lookups and admission state."""
        groups = []
        for g, pool in self._pools.items():
            c = pool.counts()
            groups.append(GroupStats(group=g, kind=self.layout.groups[g].kind, slots=pool.num_slots,
                                     block_bytes=pool.block_bytes, free=c["free"],
                                     writing=c["writing"], ready=c["ready"], pinned=c["pinned"],
                                     evictable=c["evictable"], evictions=pool.evictions))
        prim = self._primary_stats.model_copy()
        prim.used_bytes = self._primary.used_bytes()
        prim.backend = dict(self._primary.counters)
        plan = self._primary.plan
        if plan is None:
            cfg = self.config.tiers[0]
            plan = plan_pools(cfg.capacity_bytes, self.layout, self.config.max_concurrent_requests,
                              getattr(cfg, "slots", None))
        return StoreStats(
            plan=plan, tiers=[prim] + [gw.snapshot() for gw in self._gateways], groups=groups,
            lookups=dict(self._lookups), requests_active=len(self._admission.requests),
            admission_queue=len(self._admission.queue), promotions_pending=len(self._promoting),
            **self._counts)


def _rows(t: torch.Tensor, idx: list[int]) -> torch.Tensor:
    if len(idx) == t.shape[0] and all(i == j for j, i in enumerate(idx)):
        return t
    r = contiguous_run(idx)
    if r is not None:
        return t[r[0]:r[1]]
    return t.index_select(0, torch.tensor(idx, dtype=torch.int64, device=t.device))


async def _guarded(fn: Callable[[], Awaitable[None]]) -> None:
    try:
        await fn()
    except Exception:
        log.exception("background work of a tier failed")


async def _close_quietly(t: Tier) -> None:
    try:
        await t.close()
    except Exception:
        log.exception("closing tier %s failed", t.describe())

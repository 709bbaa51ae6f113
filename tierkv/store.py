"""TieredStore: lookup, promotion, cascade and backpressure over a primary pool and lower tiers."""

from __future__ import annotations

import asyncio
import collections
import enum
import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar, cast

import anyio
import anyio.abc
import torch

from tierkv.backends.base import TierContext
from tierkv.backends.pooltier import PoolTier
from tierkv.backends.registry import get_backend
from tierkv.config import StoreConfig
from tierkv.errors import BlockMissing, ConfigError, InvalidArgument, StoreClosed
from tierkv.keys import GROUP_BYTES, check_hashes, make_key
from tierkv.layout import Layout
from tierkv.lower import LowerTier
from tierkv.metrics import GroupStats, StoreStats, TierStats
from tierkv.pool import SlotPool, SlotState
from tierkv.pool import contiguous_run as _run
from tierkv.prefix import longest_prefix, needed_blocks

__all__ = ["KeyState", "Lookup", "PrefixLookup", "Reservation", "TieredStore"]

log = logging.getLogger("tierkv")


class Lookup(str, enum.Enum):
    """The answer for one block: ready now, on its way, or nowhere."""

    HIT = "hit"
    PENDING = "pending"
    MISS = "miss"


class KeyState(str, enum.Enum):
    """Why a block is HIT, PENDING or MISS: what engine adapters need to answer their own API."""

    READY = "ready"  #: in a READY primary slot (HIT)
    STORING = "storing"  #: reserved by a store that has not completed yet (PENDING)
    PROMOTING = "promoting"  #: a promotion into a reserved slot is in flight (PENDING)
    PROBING = "probing"  #: presence on a slow tier is being probed, or a cascade holds it (PENDING)
    QUEUED = "queued"  #: held by a lower tier, waiting in FIFO order for a primary slot (PENDING)
    MISS = "miss"  #: nowhere, or can never fit this request's pool share (MISS)

    @property
    def lookup(self) -> Lookup:
        """The public answer for this state."""
        if self is KeyState.READY:
            return Lookup.HIT
        return Lookup.MISS if self is KeyState.MISS else Lookup.PENDING


_ANSWER = {s: s.lookup.value for s in KeyState}


@dataclass(frozen=True)
class Reservation:
    """Slots reserved by :meth:`TieredStore.reserve`: ``slots[i]`` is None for a block already held."""

    slots: list[int | None]
    evicted: list[bytes]


@dataclass(frozen=True)
class PrefixLookup:
    """``blocks``: the longest usable prefix known now; ``state`` as in :class:`Lookup`."""

    blocks: int
    state: Lookup


@dataclass
class _Request:
    rid: str
    last_seen: float
    pins: dict[bytes, int] = field(default_factory=dict)  # key -> group
    #: what the request waits for while it sits in the admission queue: group -> keys
    wants: dict[int, list[bytes]] = field(default_factory=dict)


_Promo = tuple[bytes, LowerTier]
_F = TypeVar("_F", bound=Any)


def _locked(fn: _F) -> _F:
    """Run a synchronous method under the store's lock (callers may be on any thread)."""

    @functools.wraps(fn)
    def wrapper(self: TieredStore, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return fn(self, *args, **kwargs)

    return cast(_F, wrapper)


class TieredStore:
    """A tiered block store. Use as ``async with TieredStore(config) as store:``.

    ``lookup`` and ``lookup_prefix`` never await: they read in-memory state and start background
    work (presence probes, promotions). ``put`` returns once the blocks are in the primary; the
    cascade to lower tiers runs in the background (``flush`` waits for it).
    """

    def __init__(self, config: StoreConfig | Mapping[str, Any]) -> None:
        self.config = config if isinstance(config, StoreConfig) else StoreConfig.from_dict(config)
        self.layout: Layout = self.config.layout
        self.fingerprint = self.config.fingerprint
        ctx = TierContext(layout=self.layout, namespace=self.config.namespace,
                          fingerprint=self.fingerprint,
                          max_concurrent_requests=self.config.max_concurrent_requests,
                          policy=self.config.policy)
        self._tiers = [get_backend(tc.kind)(tc, ctx) for tc in self.config.tiers]
        primary = self._tiers[0]
        if not isinstance(primary, PoolTier):
            raise ConfigError(f"tiers.0: the primary must be a slot-pool tier (cpu or device), "
                              f"not {primary.kind!r}")
        self._primary: PoolTier = primary
        self._pools: dict[int, SlotPool] = {}
        self._lower: list[LowerTier] = []
        self._tg: anyio.abc.TaskGroup | None = None
        self._open = False
        #: the synchronous API may be called from threads other than the event loop's (e.g. a
        #: serving engine's scheduler); every state change happens under this lock
        self._lock = threading.RLock()
        self._loop_thread = 0
        self._aio_loop: asyncio.AbstractEventLoop | None = None
        self._spawn_queue: collections.deque[tuple[Any, tuple[Any, ...]]] = collections.deque()
        self._spawn_wakeup: asyncio.Event | None = None
        #: keys waiting for a scheduled probe task: (tier index, group) -> keys
        self._probe_batches: dict[tuple[int, int], list[bytes]] = {}
        self._wakeup_pending = False
        self._events: dict[bytes, anyio.Event] = {}
        #: keys reserved by ``reserve`` until ``commit``; set when they complete
        self._storing: dict[bytes, anyio.Event | None] = {}
        self._requests: dict[str, _Request] = {}
        self._pinners: dict[bytes, set[str]] = {}
        self._queue: OrderedDict[str, None] = OrderedDict()
        self._cascades = 0
        self._background = 0
        self._idle = anyio.Event()
        self._cascades_idle = anyio.Event()
        self._primary_stats = TierStats(index=0, kind=primary.kind, describe=primary.describe())
        self._lookups = {s.value: 0 for s in Lookup}
        self._puts = 0
        self._put_direct = 0
        self._put_dropped = 0
        #: blocks that found no primary slot, held until their cascades end: key -> (row, refs)
        self._staged: dict[bytes, list[Any]] = {}
        self._leases_expired = 0

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
        opened = []
        try:
            for t in self._tiers:
                await t.open()
                opened.append(t)
        except BaseException:
            for t in reversed(opened):
                with anyio.CancelScope(shield=True):
                    await t.close()
            raise
        self._pools = self._primary.pools
        self._lower = [LowerTier(i, t) for i, t in enumerate(self._tiers[1:], start=1)]
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._loop_thread = threading.get_ident()
        try:
            self._aio_loop = asyncio.get_running_loop()
            self._spawn_wakeup = asyncio.Event()
        except RuntimeError:
            self._aio_loop = None
        self._open = True
        if self._spawn_wakeup is not None:
            self._tg.start_soon(self._spawner)
        self._tg.start_soon(self._lease_sweeper)
        for t in self._tiers:
            self._tg.start_soon(self._guarded, t.background)

    async def close(self) -> None:
        """Wait for accepted cascades, stop background work, close every tier."""
        if not self._open:
            return
        try:
            with anyio.CancelScope(shield=True):
                await self.flush()
        finally:
            self._open = False
            assert self._tg is not None
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
            self._tg = None
            with anyio.CancelScope(shield=True):
                for t in reversed(self._tiers):
                    try:
                        await t.close()
                    except Exception:
                        log.exception("closing tier %s failed", t.describe())

    def _check_open(self) -> anyio.abc.TaskGroup:
        if not self._open or self._tg is None:
            raise StoreClosed("the store is not open: use 'async with TieredStore(config) as store'")
        return self._tg

    def _spawn(self, fn: Any, *args: Any) -> None:
        """Start background work from the loop's thread or, thread-safely, from any other."""
        tg = self._check_open()
        if threading.get_ident() == self._loop_thread:
            tg.start_soon(fn, *args)
        elif self._aio_loop is not None and self._spawn_wakeup is not None:
            self._spawn_queue.append((fn, args))
            if not self._wakeup_pending:
                self._wakeup_pending = True
                self._aio_loop.call_soon_threadsafe(self._spawn_wakeup.set)
        else:
            raise StoreClosed("calls from other threads need the store to run on asyncio")

    def _set_event(self, ev: anyio.Event) -> None:
        """Set an event that tasks on the loop may wait on, from whichever thread we are on."""
        if threading.get_ident() == self._loop_thread or self._aio_loop is None:
            ev.set()
        else:
            self._aio_loop.call_soon_threadsafe(ev.set)

    async def _spawner(self) -> None:
        """Start, inside the loop, the background work other threads asked for."""
        assert self._spawn_wakeup is not None and self._tg is not None
        while True:
            await self._spawn_wakeup.wait()
            self._spawn_wakeup.clear()
            self._wakeup_pending = False  # before draining: a later append wakes the loop again
            while self._spawn_queue:
                fn, args = self._spawn_queue.popleft()
                self._tg.start_soon(fn, *args)

    @property
    def tiers(self) -> list[Any]:
        """The tier objects, primary first."""
        return list(self._tiers)

    @property
    def pools(self) -> dict[int, SlotPool]:
        """The primary's pools by group index."""
        return self._pools

    # ---- validation -----------------------------------------------------------------------------
    def _keys(self, group: int, hashes: Sequence[bytes]) -> tuple[SlotPool, list[bytes]]:
        pool = self._pools.get(group) if type(group) is int else None
        if pool is None:
            self.layout.group(group)  # raises the clear error
            pool = self._pools[group]
        check_hashes(hashes)
        tail = group.to_bytes(GROUP_BYTES, "big")
        return pool, [bytes(h) + tail for h in hashes]

    def _check_rows(self, t: object, n: int, pool: SlotPool, what: str) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise InvalidArgument(f"{what} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2 or t.shape[0] != n or t.shape[1] * t.element_size() != pool.block_bytes:
            raise InvalidArgument(
                f"{what}: expected {n} rows of {pool.block_bytes} bytes (group {pool.group}), got"
                f" shape {tuple(t.shape)} of {t.dtype} ({t.element_size()} bytes per element)")
        if t.device.type not in ("cpu", pool.device.type):
            raise InvalidArgument(f"{what} is on {t.device}; the pool is on {pool.device}")
        if not t.is_contiguous():
            raise InvalidArgument(f"{what} must be contiguous")
        return t

    # ---- put / cascade --------------------------------------------------------------------------
    async def put(self, group: int, hashes: Sequence[bytes], blocks: torch.Tensor) -> None:
        """Store ``blocks[i]`` as block ``hashes[i]`` of ``group``.

        Returns once the blocks are in the primary (readable at once); cascades to lower tiers run
        in the background. Blocks already held are not written again. Blocks that find no free or
        evictable slot go straight to the lower tiers from a private copy.
        """
        with self._lock:
            self._put(group, hashes, blocks)

    def _put(self, group: int, hashes: Sequence[bytes], blocks: torch.Tensor) -> None:
        self._check_open()
        pool, keys = self._keys(group, hashes)
        self._check_rows(blocks, len(keys), pool, "blocks")
        self._puts += 1
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
        slots: list[int] = []
        if placed:
            got = pool.allocate([keys[i] for i in placed])
            assert got is not None
            slots = got[0]
            pool.write(slots, _rows(blocks, placed))
            pool.mark_ready(slots)
            self._primary_stats.bytes_written += len(slots) * pool.block_bytes
            self._primary_stats.stores += len(slots)
            self._cascade(group, [keys[i] for i in placed], slots, None)
        direct = new[n:]
        if direct:
            if not self._lower:
                self._put_dropped += len(direct)
                return
            self._put_direct += len(direct)
            copy = _rows(blocks, direct).to("cpu", copy=True).view(torch.uint8)
            self._cascade(group, [keys[i] for i in direct], None, copy.reshape(len(direct), -1))

    def _cascade(self, group: int, keys: list[bytes], slots: list[int] | None,
                 copy: torch.Tensor | None) -> None:
        pool = self._pools[group]
        now = time.monotonic()
        for lt in self._lower:
            idx = [i for i, k in enumerate(keys) if lt.presence(group, k, now) is not True]
            if not idx:
                continue
            nbytes = len(idx) * pool.block_bytes
            if not lt.admit_store(nbytes):
                lt.stats.stores_shed += len(idx)
                continue
            sub_keys = [keys[i] for i in idx]
            sub_slots = [slots[i] for i in idx] if slots is not None else None
            if sub_slots is not None:
                for s in sub_slots:
                    pool.pin(s)
            sub_copy = copy if copy is None or len(idx) == len(keys) else copy[idx]
            if sub_copy is not None:
                for j, k in enumerate(sub_keys):
                    entry = self._staged.setdefault(k, [sub_copy[j], 0])
                    entry[1] += 1
            self._cascades += 1
            self._cascades_idle = anyio.Event() if self._cascades == 1 else self._cascades_idle
            self._spawn(self._run_cascade, lt, group, sub_keys, sub_slots, sub_copy, nbytes)

    async def _run_cascade(self, lt: LowerTier, group: int, keys: list[bytes],
                           slots: list[int] | None, copy: torch.Tensor | None, nbytes: int) -> None:
        pool = self._pools[group]
        elapsed: float | None = None
        try:
            async with lt.write_limiter:
                t0 = time.monotonic()
                data = copy if copy is not None else _gather(pool, slots or [])
                ok = await lt.tier.put(group, keys, data)
                elapsed = time.monotonic() - t0
            with self._lock:
                now = time.monotonic()
                for k, good in zip(keys, ok, strict=True):
                    lt.note(k, good, now)
                n_ok = sum(ok)
                lt.stats.stores += n_ok
                lt.stats.stores_failed += len(keys) - n_ok
                lt.stats.bytes_written += n_ok * pool.block_bytes
        except Exception as exc:  # a failing lower tier must never reach the caller
            with self._lock:
                lt.stats.stores_failed += len(keys)
                for k in keys:
                    lt.forget(k)
            log.warning("cascade of %d blocks to tier %d (%s) failed: %s", len(keys), lt.index,
                        lt.tier.describe(), exc)
        finally:
            with self._lock:
                self._cascade_done(lt, pool, keys, slots, copy, nbytes, elapsed)

    def _cascade_done(self, lt: LowerTier, pool: SlotPool, keys: list[bytes], slots: list[int] | None,
                      copy: torch.Tensor | None, nbytes: int, elapsed: float | None) -> None:
        lt.store_done(nbytes, elapsed)
        if slots is not None:
            for s in slots:
                pool.unpin(s)
        if copy is not None:
            for k in keys:
                entry = self._staged.get(k)
                if entry is not None:
                    entry[1] -= 1
                    if entry[1] <= 0:
                        del self._staged[k]
        self._cascades -= 1
        if self._cascades == 0:
            self._cascades_idle.set()
        self._service_queue()

    async def flush(self) -> None:
        """Wait until every accepted cascade has finished (or failed, counted in ``stats()``)."""
        while self._cascades:
            await self._cascades_idle.wait()

    async def idle(self) -> None:
        """Wait until no cascade, promotion or probe is in flight (for tests and simulations)."""
        while self._cascades or self._background:
            if self._cascades:
                await self._cascades_idle.wait()
            if self._background:
                await self._idle.wait()

    # ---- requests and pins ----------------------------------------------------------------------
    def _request(self, request_id: str | None) -> _Request | None:
        if request_id is None:
            return None
        if not isinstance(request_id, str):
            raise InvalidArgument(f"request_id must be a str, got {type(request_id).__name__}")
        now = time.monotonic()
        req = self._requests.get(request_id)
        if req is None:
            req = self._requests[request_id] = _Request(request_id, now)
        req.last_seen = now
        return req

    def _pin(self, req: _Request | None, group: int, key: bytes, slot: int) -> None:
        if req is None or key in req.pins:
            return
        self._pools[group].pin(slot)
        req.pins[key] = group
        self._pinners.setdefault(key, set()).add(req.rid)

    def _unpin(self, req: _Request, key: bytes) -> None:
        group = req.pins.pop(key, None)
        if group is None:
            return
        pool = self._pools[group]
        s = pool.slot_of(key)
        if s is not None:
            pool.unpin(s)
        holders = self._pinners.get(key)
        if holders is not None:
            holders.discard(req.rid)
            if not holders:
                del self._pinners[key]

    def _drop(self, group: int, key: bytes) -> None:
        """Free a key's slot (a failed promotion) and forget every pin on it."""
        for rid in self._pinners.pop(key, ()):
            req = self._requests.get(rid)
            if req is not None:
                req.pins.pop(key, None)
        pool = self._pools[group]
        s = pool.slot_of(key)
        if s is not None:
            pool.free([s])

    @_locked
    def release(self, request_id: str) -> None:
        """Drop every pin ``request_id`` holds and its place in the admission queue."""
        self._check_open()
        req = self._requests.pop(request_id, None)
        self._queue.pop(request_id, None)
        if req is not None:
            for key in list(req.pins):
                self._unpin(req, key)
        self._service_queue()

    @staticmethod
    async def _guarded(fn: Any) -> None:
        try:
            await fn()
        except Exception:
            log.exception("background work of a tier failed")

    async def _lease_sweeper(self) -> None:
        period = min(1.0, self.config.pin_lease_s / 4)
        while True:
            await anyio.sleep(period)
            cutoff = time.monotonic() - self.config.pin_lease_s
            for rid in [r.rid for r in self._requests.values() if r.last_seen < cutoff]:
                self._leases_expired += 1
                log.info("request %s made no call for %.1fs: its pins expired", rid,
                         self.config.pin_lease_s)
                self.release(rid)

    # ---- lookup ---------------------------------------------------------------------------------
    def _locate(self, group: int, key: bytes, now: float,
                probes: dict[int, list[bytes]]) -> LowerTier | bool:
        """The first lower tier known to hold ``key``; True when a probe or a cascade may bring it."""
        unknown = key in self._staged
        for lt in self._lower:
            p = lt.presence(group, key, now)
            if p is True:
                return lt
            if p is None:
                unknown = True
                if key not in lt.probing:
                    probes.setdefault(lt.index, []).append(key)
        return unknown

    @_locked
    def lookup(self, group: int, hashes: Sequence[bytes],
               request_id: str | None = None) -> list[Lookup]:
        """Per block: HIT (ready in the primary), PENDING (on its way) or MISS. Never awaits.

        A block held only by a lower tier gets a primary slot reserved now and is promoted in the
        background; with ``request_id`` every HIT or PENDING block is pinned for that request until
        it loads the block (``get(..., request_id=)``) or is released.
        """
        return [st.lookup for st in self.lookup_states(group, hashes, request_id)]

    @_locked
    def lookup_states(self, group: int, hashes: Sequence[bytes],
                      request_id: str | None = None) -> list[KeyState]:
        """:meth:`lookup` with the reason behind each answer (see :class:`KeyState`)."""
        self._check_open()
        pool, keys = self._keys(group, hashes)
        req = self._request(request_id)
        if req is None:
            # an anonymous call pins for its own duration, so its promotions never evict its HITs
            req = _Request("", time.monotonic())
            try:
                return self._lookup(group, pool, keys, req)
            finally:
                # no queue service here: it could evict at once what this call answered HIT
                for key in list(req.pins):
                    self._unpin(req, key)
        return self._lookup(group, pool, keys, req)

    def _lookup(self, group: int, pool: SlotPool, keys: list[bytes], req: _Request) -> list[KeyState]:
        now = 0.0
        out: list[KeyState] = []
        probes: dict[int, list[bytes]] = {}
        promos: list[_Promo] = []
        promo_pos: list[int] = []
        for i, k in enumerate(keys):
            s = pool.slot_of(k)
            if s is not None:
                if pool.state[s] is SlotState.READY:
                    out.append(KeyState.READY)
                else:
                    out.append(KeyState.PROMOTING if k in self._events else KeyState.STORING)
                self._pin(req, group, k, s)
                pool.touch(k)
                continue
            if not now:
                now = time.monotonic()
            where = self._locate(group, k, now, probes)
            if isinstance(where, LowerTier):
                out.append(KeyState.PROMOTING)
                promos.append((k, where))
                promo_pos.append(i)
            else:
                out.append(KeyState.PROBING if where else KeyState.MISS)
        if promos:
            held = sum(1 for g in req.pins.values() if g == group)
            room = max(0, pool.num_slots - held)
            for i in promo_pos[room:]:
                out[i] = KeyState.MISS
            if room and not self._admit(req, {group: promos[:room]}):
                late = KeyState.MISS if self.config.admission == "naive" else KeyState.QUEUED
                for i in promo_pos[:room]:
                    out[i] = late
        if probes:
            self._start_probes(group, probes)
        counts = self._lookups
        for r in out:
            counts[_ANSWER[r]] += 1
        return out

    @_locked
    def lookup_prefix(self, hashes: Sequence[bytes], request_id: str | None = None) -> PrefixLookup:
        """The longest usable prefix over every prefix-cacheable group (see DESIGN.md rules).

        ``blocks`` is the longest prefix whose needed blocks are all known to exist somewhere;
        ``state`` is HIT when they are all ready in the primary and no probe can lengthen it,
        PENDING when waiting gives a ready or longer prefix, MISS when there is nothing at all.
        A prefix needing more blocks of a group than its pool has falls back to the longest that fits.
        """
        self._check_open()
        check_hashes(hashes)
        req = self._request(request_id)
        if req is None:
            req = _Request("", time.monotonic())
            try:
                return self._lookup_prefix(hashes, req)
            finally:
                for key in list(req.pins):
                    self._unpin(req, key)
        return self._lookup_prefix(hashes, req)

    def _lookup_prefix(self, hashes: Sequence[bytes], req: _Request) -> PrefixLookup:
        now = time.monotonic()
        n = len(hashes)
        cache: dict[tuple[int, int], Any] = {}
        probes: dict[int, dict[int, list[bytes]]] = {}

        def status(g: int, i: int) -> Any:
            st = cache.get((g, i))
            if st is None:
                key = make_key(bytes(hashes[i]), g)
                pool = self._pools[g]
                s = pool.slot_of(key)
                if s is not None:
                    st = pool.state[s]
                else:
                    st = self._locate(g, key, now, probes.setdefault(g, {}))
                cache[(g, i)] = st
            return st

        capacity = {g: p.num_slots for g, p in self._pools.items()}
        known = longest_prefix(self.layout, n, lambda g, i: status(g, i) is not False
                               and status(g, i) is not True, capacity)
        maybe = longest_prefix(self.layout, n, lambda g, i: status(g, i) is not False, capacity)
        for g, per_tier in probes.items():
            self._start_probes(g, per_tier)
        if known == 0:
            result = PrefixLookup(0, Lookup.PENDING if maybe else Lookup.MISS)
            self._lookups[result.state.value] += 1
            return result
        all_ready = True
        wants: dict[int, list[_Promo]] = {}
        for g, rng in needed_blocks(self.layout, known).items():
            pool = self._pools[g]
            for i in rng:
                st = status(g, i)
                key = make_key(bytes(hashes[i]), g)
                if isinstance(st, LowerTier):
                    wants.setdefault(g, []).append((key, st))
                    all_ready = False
                    continue
                if st is not SlotState.READY:
                    all_ready = False
                s = pool.slot_of(key)
                if s is not None:
                    self._pin(req, g, key, s)
                    pool.touch(key)
        if wants and not self._admit(req, wants) and self.config.admission == "naive":
            self._lookups[Lookup.MISS.value] += 1
            return PrefixLookup(0, Lookup.MISS)
        state = Lookup.HIT if all_ready and maybe == known else Lookup.PENDING
        self._lookups[state.value] += 1
        return PrefixLookup(known, state)

    # ---- admission and promotion ----------------------------------------------------------------
    def _admit(self, req: _Request, wants: dict[int, list[_Promo]]) -> bool:
        """Reserve slots for every wanted block at once and start promotions, or queue (FIFO).

        A request either gets every slot it asks for or holds none while it waits: it gives up the
        pins it holds when it joins the queue, so no two requests can wait on each other.
        """
        named = req.rid != ""
        if self.config.admission == "naive":
            if all(self._pools[g].available() >= len(items) for g, items in wants.items()):
                for g, items in wants.items():
                    self._start_promotions(req, g, items)
                return True
            return False
        if self._queue and (not named or next(iter(self._queue)) != req.rid):
            if named:
                self._enqueue(req, wants)
            return False
        for g, items in wants.items():
            if self._pools[g].available() < len(items):
                if named:
                    self._enqueue(req, wants)
                return False
        if named:
            self._queue.pop(req.rid, None)
            req.wants = {}
        for g, items in wants.items():
            self._start_promotions(req, g, items)
        return True

    def _enqueue(self, req: _Request, wants: dict[int, list[_Promo]]) -> None:
        """Queue ``req``; it gives back its pins and keeps the blocks they held among its wants."""
        merged = {g: [k for k, _ in items] for g, items in wants.items()}
        for key, g in req.pins.items():
            merged.setdefault(g, []).append(key)
        req.wants = {g: list(dict.fromkeys(keys)) for g, keys in merged.items()}
        if req.rid not in self._queue:
            self._queue[req.rid] = None
        for key in list(req.pins):
            self._unpin(req, key)

    def _service_queue(self) -> None:
        """Admit waiting requests in FIFO order while their wants fit."""
        if not self._open:
            return
        now = time.monotonic()
        while self._queue:
            rid = next(iter(self._queue))
            req = self._requests.get(rid)
            if req is None:
                self._queue.pop(rid)
                continue
            wants: dict[int, list[_Promo]] = {}
            pinned_now: list[tuple[int, bytes, int]] = []
            for g, keys in req.wants.items():
                pool = self._pools[g]
                for k in keys:
                    s = pool.slot_of(k)
                    if s is not None:
                        pinned_now.append((g, k, s))
                        continue
                    where = self._locate(g, k, now, {})
                    if isinstance(where, LowerTier):
                        wants.setdefault(g, []).append((k, where))
            # the blocks it will pin are no longer evictable: count them out of what is available
            held: dict[int, int] = {}
            for g, k, _ in pinned_now:
                if self._pools[g].evictable(k):
                    held[g] = held.get(g, 0) + 1
            if any(self._pools[g].available() - held.get(g, 0) < len(items) for g, items in wants.items()):
                return
            self._queue.pop(rid)
            req.wants = {}
            for g, k, s in pinned_now:
                self._pin(req, g, k, s)
            for g, items in wants.items():
                self._start_promotions(req, g, items)

    def _start_promotions(self, req: _Request | None, group: int, items: list[_Promo]) -> None:
        pool = self._pools[group]
        got = pool.allocate([k for k, _ in items])
        assert got is not None, "admission checked availability"
        slots = got[0]
        by_tier: dict[int, tuple[LowerTier, list[bytes], list[int]]] = {}
        for (key, lt), s in zip(items, slots, strict=True):
            self._events[key] = anyio.Event()
            self._pin(req, group, key, s)
            entry = by_tier.setdefault(lt.index, (lt, [], []))
            entry[1].append(key)
            entry[2].append(s)
        for lt, keys, sl in by_tier.values():
            self._begin_background()
            self._spawn(self._promote, lt, group, keys, sl)

    async def _promote(self, lt: LowerTier, group: int, keys: list[bytes], slots: list[int]) -> None:
        ok = [False] * len(keys)
        try:
            ok = await self._read_into_slots(lt, group, keys, slots)
        finally:
            with self._lock:
                self._promotion_done(lt, group, keys, slots, ok)

    def _promotion_done(self, lt: LowerTier, group: int, keys: list[bytes], slots: list[int],
                        ok: list[bool]) -> None:
        pool = self._pools[group]
        good = [s for s, f in zip(slots, ok, strict=True) if f]
        pool.mark_ready(good)
        lt.stats.promotions += len(good)
        lt.stats.hits += len(good)
        lt.stats.bytes_read += len(good) * pool.block_bytes
        now = time.monotonic()
        for k, f in zip(keys, ok, strict=True):
            if not f:
                lt.stats.promotions_failed += 1
                lt.stats.misses += 1
                lt.note(k, False, now)
                self._drop(group, k)
        for k in keys:
            ev = self._events.pop(k, None)
            if ev is not None:
                ev.set()
        self._end_background()
        self._service_queue()

    async def _read_into_slots(self, lt: LowerTier, group: int, keys: list[bytes],
                               slots: list[int]) -> list[bool]:
        pool = self._pools[group]
        run = _run(slots)
        direct = pool.device.type == "cpu" and run is not None
        buf = (pool.tensor[run[0]:run[1]] if direct and run is not None
               else torch.empty((len(keys), pool.block_bytes), dtype=torch.uint8))
        try:
            async with lt.read_limiter:
                ok = list(await lt.tier.get(group, keys, buf))
        except Exception as exc:
            log.warning("reading %d blocks from tier %d (%s) failed: %s", len(keys), lt.index,
                        lt.tier.describe(), exc)
            lt.tier.count("read_errors")
            return [False] * len(keys)
        if not direct:
            rows = [i for i, f in enumerate(ok) if f]
            if rows:
                with self._lock:
                    pool.write([slots[i] for i in rows], _rows(buf, rows))
        return ok

    def _start_probes(self, group: int, probes: dict[int, list[bytes]]) -> None:
        if not probes:
            return
        for idx, keys in probes.items():
            lt = self._lower[idx - 1]
            keys = [k for k in dict.fromkeys(keys) if k not in lt.probing]
            if keys:
                lt.probing.update(keys)
                batch = self._probe_batches.get((idx, group))
                if batch is not None:  # a probe task is scheduled and has not started: it takes these
                    batch.extend(keys)
                    continue
                self._probe_batches[(idx, group)] = list(keys)
                self._begin_background()
                self._spawn(self._probe_batch, lt, group)

    async def _probe_batch(self, lt: LowerTier, group: int) -> None:
        with self._lock:
            keys = self._probe_batches.pop((lt.index, group))
        await self._probe(lt, group, keys)

    async def _probe(self, lt: LowerTier, group: int, keys: list[bytes]) -> None:
        try:
            async with lt.read_limiter:
                found = await lt.tier.contains(group, keys)
            with self._lock:
                now = time.monotonic()
                for k, f in zip(keys, found, strict=True):
                    lt.note(k, f, now)
                lt.stats.probes += len(keys)
        except Exception as exc:
            log.warning("probing tier %d (%s) failed: %s", lt.index, lt.tier.describe(), exc)
            with self._lock:
                lt.tier.count("probe_errors")
                now = time.monotonic()
                for k in keys:
                    lt.note(k, False, now)
        finally:
            with self._lock:
                lt.probing.difference_update(keys)
                self._end_background()
                self._service_queue()

    def _begin_background(self) -> None:
        if self._background == 0:
            self._idle = anyio.Event()
        self._background += 1

    def _end_background(self) -> None:
        self._background -= 1
        if self._background == 0:
            self._idle.set()

    # ---- get ------------------------------------------------------------------------------------
    async def get(self, group: int, hashes: Sequence[bytes], out: torch.Tensor,
                  request_id: str | None = None) -> None:
        """Copy blocks into the rows of ``out``, waiting for PENDING ones.

        Blocks not in the primary are read from the first lower tier that holds them (and kept in
        the primary when a slot is free or evictable). Raises :class:`BlockMissing` when a block is
        held by no tier (``out`` rows are then unspecified). With ``request_id``, that request's
        pins on these blocks are dropped once they are copied out.
        """
        with self._lock:
            self._check_open()
            pool, keys = self._keys(group, hashes)
            self._check_rows(out, len(keys), pool, "out")
            req = self._request(request_id)
        out8 = out.view(torch.uint8).reshape(len(keys), pool.block_bytes)
        todo = list(range(len(keys)))
        missing: list[int] = []
        while todo:
            with self._lock:
                absent, waits = self._copy_resident(pool, keys, todo, out8)
            if absent:
                missing += await self._get_from_lower(group, keys, absent, out8)
            for ev in waits.values():
                await ev.wait()
            todo = list(waits)
        if req is not None:
            with self._lock:
                for k in keys:
                    self._unpin(req, k)
                self._service_queue()
        if missing:
            raise BlockMissing(f"{len(missing)} of {len(keys)} blocks of group {group} are held"
                               f" by no tier", missing=sorted(missing))

    def _copy_resident(self, pool: SlotPool, keys: list[bytes], todo: list[int],
                       out8: torch.Tensor) -> tuple[list[int], dict[int, anyio.Event]]:
        """Copy READY (and staged) rows out; the rows held by no slot, and events to wait for."""
        ready: list[int] = []
        absent: list[int] = []
        waits: dict[int, anyio.Event] = {}
        for i in todo:
            s = pool.slot_of(keys[i])
            if s is None:
                staged = self._staged.get(keys[i])
                if staged is not None:
                    out8[i].copy_(staged[0])
                else:
                    absent.append(i)
            elif pool.state[s] is SlotState.READY:
                ready.append(i)
            else:
                ev = self._events.get(keys[i])
                if ev is None:
                    assert keys[i] in self._storing, "every WRITING slot has an event"
                    ev = self._storing[keys[i]]
                    if ev is None:
                        ev = self._storing[keys[i]] = anyio.Event()
                waits[i] = ev
        if ready:
            slots = [pool.index[keys[i]] for i in ready]
            if len(ready) == len(keys):
                pool.read(slots, out8)
            else:
                r = _run(ready)
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

    async def _get_from_lower(self, group: int, keys: list[bytes], rows: list[int],
                              out8: torch.Tensor) -> list[int]:
        pool = self._pools[group]
        left = rows
        now = time.monotonic()
        for lt in self._lower:
            if not left:
                break
            sub = [i for i in left if lt.presence(group, keys[i], now) is not False]
            if not sub:
                continue
            run = _run(sub)
            direct = run is not None and out8.device.type == "cpu"
            buf = (out8[run[0]:run[1]] if direct and run is not None
                   else torch.empty((len(sub), pool.block_bytes), dtype=torch.uint8))
            sub_keys = [keys[i] for i in sub]
            try:
                async with lt.read_limiter:
                    ok = await lt.tier.get(group, sub_keys, buf)
            except Exception as exc:
                log.warning("reading from tier %d (%s) failed: %s", lt.index, lt.tier.describe(), exc)
                lt.tier.count("read_errors")
                ok = [False] * len(sub)
            got = [j for j, f in enumerate(ok) if f]
            if got and not direct:
                dst = torch.tensor([sub[j] for j in got], dtype=torch.int64, device=out8.device)
                out8.index_copy_(0, dst, _rows(buf, got).to(out8.device))
            with self._lock:
                for j, f in enumerate(ok):
                    lt.note(sub_keys[j], f, now)
                lt.stats.hits += len(got)
                lt.stats.misses += len(sub) - len(got)
                lt.stats.bytes_read += len(got) * pool.block_bytes
                if got:
                    self._keep(group, [sub_keys[j] for j in got], _rows(buf, got))
            done = {sub[j] for j in got}
            left = [i for i in left if i not in done]
        return left

    def _keep(self, group: int, keys: list[bytes], data: torch.Tensor) -> None:
        """Keep blocks read from a lower tier in the primary when slots can be had now."""
        pool = self._pools[group]
        take = [i for i, k in enumerate(keys) if pool.slot_of(k) is None]
        if not take or pool.available() < len(take) or self._queue:
            return
        got = pool.allocate([keys[i] for i in take])
        if got is None:
            return
        pool.write(got[0], _rows(data, take))
        pool.mark_ready(got[0])

    # ---- stats ----------------------------------------------------------------------------------
    # ---- slot-level API for engine adapters -----------------------------------------------------
    def _pool_for_keys(self, group: int) -> SlotPool:
        self._check_open()
        pool = self._pools.get(group) if type(group) is int else None
        if pool is None:
            self.layout.group(group)
            raise InvalidArgument(f"group {group} has no pool")
        return pool

    @_locked
    def key_state(self, group: int, key: bytes, request_id: str) -> KeyState:
        """:meth:`lookup_states` of one full key (``hash + group tail``, e.g. a vLLM offload key).

        The caller guarantees the key's tail is ``group``; a READY key is answered without lists.
        """
        pool = self._pool_for_keys(group)
        req = self._request(request_id)
        assert req is not None
        s = pool.index.get(key)
        if s is not None and pool.state[s] is SlotState.READY:
            if key not in req.pins:
                pool.pin(s)
                req.pins[key] = group
                self._pinners.setdefault(key, set()).add(req.rid)
            pool.policy.touch(key)
            self._lookups["hit"] += 1
            return KeyState.READY
        return self._lookup(group, pool, [key], req)[0]

    @_locked
    def reserve_keys(self, group: int, keys: list[bytes]) -> Reservation | None:
        """:meth:`reserve` of full keys (``hash + group tail``) the caller has checked."""
        pool = self._pool_for_keys(group)
        index = pool.index
        new = [k for k in keys if k not in index]
        if not new:
            return Reservation(slots=[None] * len(keys), evicted=[])
        got = pool.allocate(new)
        if got is None:
            return None
        storing = self._storing
        for k in new:
            storing[k] = None
        if len(new) == len(keys):
            return Reservation(slots=list(got[0]), evicted=list(got[1]))
        by_key = dict(zip(new, got[0], strict=True))
        return Reservation(slots=[by_key.get(k) for k in keys], evicted=list(got[1]))

    @_locked
    def commit_keys(self, group: int, keys: list[bytes], success: bool = True) -> None:
        """:meth:`commit` of full keys."""
        self._commit(group, self._pool_for_keys(group), keys, success)

    @_locked
    def ready_slots_keys(self, group: int, keys: list[bytes]) -> list[int | None]:
        """:meth:`ready_slots` of full keys."""
        pool = self._pool_for_keys(group)
        index, state, ready = pool.index, pool.state, SlotState.READY
        return [s if (s := index.get(k)) is not None and state[s] is ready else None for k in keys]

    @_locked
    def unpin_keys(self, group: int, keys: list[bytes], request_id: str) -> None:
        """:meth:`unpin` of full keys."""
        self._pool_for_keys(group)
        req = self._requests.get(request_id)
        if req is not None:
            req.last_seen = time.monotonic()
            for k in keys:
                self._unpin(req, k)
        if self._queue:
            self._service_queue()

    @_locked
    def reserve(self, group: int, hashes: Sequence[bytes]) -> Reservation | None:
        """Reserve primary slots for blocks an engine is about to write into the pool itself.

        Blocks already held (ready or in flight) are skipped (``slots[i] is None``); the others get
        WRITING slots, evicting what they must, all or none: None when not enough slots can be had.
        Reserved blocks are invisible to lookups as HITs until :meth:`commit`.
        """
        self._check_open()
        _, keys = self._keys(group, hashes)
        return self.reserve_keys(group, keys)

    @_locked
    def commit(self, group: int, hashes: Sequence[bytes], success: bool = True) -> None:
        """Complete reserved blocks: READY and cascaded to lower tiers, or freed and forgotten."""
        self._check_open()
        pool, keys = self._keys(group, hashes)
        self._commit(group, pool, keys, success)

    def _commit(self, group: int, pool: SlotPool, keys: list[bytes], success: bool) -> None:
        done_keys, done_slots = [], []
        for k in keys:
            if k not in self._storing:
                continue
            ev = self._storing.pop(k)
            if ev is not None:
                self._set_event(ev)
            s = pool.slot_of(k)
            if s is None:
                continue
            if success:
                done_keys.append(k)
                done_slots.append(s)
            else:
                self._drop(group, k)
        if done_slots:
            pool.mark_ready(done_slots)
            self._primary_stats.stores += len(done_slots)
            self._primary_stats.bytes_written += len(done_slots) * pool.block_bytes
            self._cascade(group, done_keys, done_slots, None)
        self._service_queue()

    @_locked
    def ready_slots(self, group: int, hashes: Sequence[bytes]) -> list[int | None]:
        """The primary slot of each READY block (None for the others)."""
        self._check_open()
        _, keys = self._keys(group, hashes)
        return self.ready_slots_keys(group, keys)

    @_locked
    def unpin(self, group: int, hashes: Sequence[bytes], request_id: str) -> None:
        """Drop ``request_id``'s pins on these blocks (it has loaded them)."""
        self._check_open()
        _, keys = self._keys(group, hashes)
        self.unpin_keys(group, keys, request_id)

    @_locked
    def has_pending_work(self) -> bool:
        """True while cascades, promotions, probes or queued requests are in flight."""
        return bool(self._cascades or self._background or self._queue)

    @_locked
    def clear_primary(self) -> int:
        """Free every READY, unpinned primary slot (lower tiers keep their blocks); how many."""
        n = 0
        for pool in self._pools.values():
            slots = [s for s in range(pool.num_slots)
                     if pool.state[s] is SlotState.READY and pool.pins[s] == 0]
            pool.free(slots)
            n += len(slots)
        self._service_queue()
        return n

    @_locked
    def stats(self) -> StoreStats:
        """Counters per tier and per group, the pool plan, lookups and admission state."""
        assert self._primary.plan is not None or not self._open
        groups = []
        for g, pool in self._pools.items():
            c = pool.counts()
            groups.append(GroupStats(group=g, kind=self.layout.groups[g].kind, slots=pool.num_slots,
                                     block_bytes=pool.block_bytes, free=c["free"],
                                     writing=c["writing"], ready=c["ready"], pinned=c["pinned"],
                                     evictions=pool.evictions))
        prim = self._primary_stats.model_copy()
        prim.used_bytes = self._primary.used_bytes()
        prim.backend = dict(self._primary.counters)
        plan = self._primary.plan
        if plan is None:
            from tierkv.pool import plan_pools

            cfg = self.config.tiers[0]
            plan = plan_pools(cfg.capacity_bytes, self.layout, self.config.max_concurrent_requests,
                              getattr(cfg, "slots", None))
        return StoreStats(
            plan=plan, tiers=[prim] + [lt.snapshot() for lt in self._lower], groups=groups,
            lookups=dict(self._lookups), requests_active=len(self._requests),
            admission_queue=len(self._queue), promotions_pending=len(self._events),
            puts=self._puts, put_blocks_direct=self._put_direct, put_blocks_dropped=self._put_dropped,
            leases_expired=self._leases_expired)


def _rows(t: torch.Tensor, idx: list[int]) -> torch.Tensor:
    if len(idx) == t.shape[0] and all(i == j for j, i in enumerate(idx)):
        return t
    r = _run(idx)
    if r is not None:
        return t[r[0]:r[1]]
    return t.index_select(0, torch.tensor(idx, dtype=torch.int64, device=t.device))




def _gather(pool: SlotPool, slots: list[int]) -> torch.Tensor:
    """The bytes of ``slots`` as one CPU tensor (a view when they are adjacent on the CPU)."""
    r = _run(slots)
    if r is not None:
        t = pool.tensor[r[0]:r[1]]
    else:
        t = pool.tensor.index_select(0, torch.tensor(slots, dtype=torch.int64, device=pool.device))
    return t.cpu()


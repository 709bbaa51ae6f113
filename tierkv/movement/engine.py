"""The engine-facing slot API: what an engine adapter needs to copy blocks in and out of the pool.

An engine that moves KV blocks between its own memory and tierkv's primary pool by itself (the
vLLM adapter's worker does, through a shared-memory pool) works on *full keys* (``block_hash +
4-byte big-endian group index``, the bytes vLLM's offload keys use) and on slot numbers:

- :meth:`EngineSlots.key_state`: what a lookup of one key says, with the reason
  (:class:`~tierkv.movement.lookup.KeyState`); HIT and PENDING blocks are pinned for the request.
- :meth:`EngineSlots.ready_slots` / :meth:`EngineSlots.unpin`: where READY blocks are; the
  request is done with them.
- :meth:`EngineSlots.reserve` / :meth:`EngineSlots.commit`: slots for blocks the engine writes
  itself; committed blocks become READY and cascade to the lower tiers, failed ones vanish.
- :meth:`EngineSlots.subscribe_evictions`: be told which keys leave the primary (KV events).

Every method may be called from any thread; none waits on I/O.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from tierkv.blocks.admission import Admission
from tierkv.blocks.ledger import BlockLedger
from tierkv.blocks.pool import SlotPool, SlotState
from tierkv.blocks.slottable import SlotTable
from tierkv.bridge import locked
from tierkv.errors import InvalidArgument
from tierkv.layout import Layout
from tierkv.movement.keystates import KeyLookups
from tierkv.movement.lookup import KeyState, Lookup, Resolver
from tierkv.observing.metrics import TierStats

__all__ = ["EngineSlots", "EvictionListener", "Reservation", "pool_for"]

#: called under the store's lock with a group and the keys that just left its primary pool
EvictionListener = Callable[[int, list[bytes]], None]


@dataclass(frozen=True)
class Reservation:
    """Slots reserved by :meth:`EngineSlots.reserve`: ``slots[i]`` is None for a block already held."""

    slots: list[int | None]
    evicted: list[bytes]
    #: the pool the slots are rows of ('' for the store's own; a daemon store names its daemon's)
    pool: str = ""


def pool_for(pools: Mapping[int, SlotPool], layout: Layout, group: int) -> SlotPool:
    """The pool of ``group``; :class:`InvalidArgument` (or the layout's error) when it has none."""
    pool = pools.get(group) if type(group) is int else None
    if pool is None:
        layout.group(group)  # raises the clear error for an unknown group
        raise InvalidArgument(f"group {group} has no pool")
    return pool


class EngineSlots:
    """The slot API of one store (``store.engine``); see the module docstring."""

    def __init__(self, *, lock: threading.RLock, layout: Layout, ledger: BlockLedger,
                 admission: Admission, resolver: Resolver, keys: KeyLookups,
                 check_open: Callable[[], None],
                 committed: Callable[[int, list[bytes], list[int]], None], stats: TierStats) -> None:
        self._lock = lock
        self._layout = layout
        self._ledger = ledger
        self._pools = ledger.pools
        self._admission = admission
        self._resolver = resolver
        self._keys = keys
        self._check_open = check_open
        self._committed = committed
        self._stats = stats  # the primary's: pin_ready counts what a get through it reads
        self._listeners: list[EvictionListener] = []

    def _pool(self, group: int) -> SlotPool:
        self._check_open()
        return pool_for(self._pools, self._layout, group)

    # ---- eviction events ------------------------------------------------------------------------
    def subscribe_evictions(self, listener: EvictionListener) -> Callable[[], None]:
        """Call ``listener(group, keys)`` whenever keys leave the primary; returns an unsubscribe."""
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe

    def notify_evicted(self, group: int, keys: list[bytes]) -> None:
        """Tell the listeners (the store calls this from the pools' eviction hook)."""
        for listener in list(self._listeners):
            listener(group, keys)

    # ---- lookups and loads ----------------------------------------------------------------------
    @locked
    def key_state(self, group: int, key: bytes, request_id: str,
                  ahead: Callable[[], list[bytes]] | None = None) -> KeyState:
        """What a lookup of one full key says, pinning HIT and PENDING blocks for the request.

        The caller guarantees the key's tail is ``group``; a READY key is answered without lists.
        ``ahead`` (the keys the engine asks about next) matters to a daemon store's slots only,
        where a lookup is a message: here it costs microseconds and is not used.
        """
        pool = self._pool(group)
        req = self._admission.request(request_id)
        assert req is not None
        s = pool.index.get(key)
        if s is not None and pool.state[s] is SlotState.READY:
            self._admission.pin(req, group, key, s)
            if req.runs:
                self._keys.restored(req, group, key)
            return KeyState.READY
        if req.pending.gave_up:
            return KeyState.MISS
        if s is not None and key in req.pins:
            # in flight and already pinned for this request: an engine asks again every step
            # while the restore runs, and this answer must cost next to nothing (it holds the GIL)
            state = KeyState.PROMOTING if key in self._ledger.promoting else KeyState.STORING
        else:
            state = self._keys.states(group, [key], req)[0]
        if state.lookup is Lookup.PENDING:
            now = self._admission.clock()
            if req.pending.since is None:
                req.pending.since = now
            elif self._resolver.overdue(req, now, self._resolver.cost.deadline_s(req.waiting)):
                return KeyState.MISS  # the request recomputes from here (its promotions go on)
        return state

    @locked
    def pin_ready(self, group: int, keys: list[bytes], request_id: str) -> list[int] | None:
        """When every key is READY now: pin them all for the request and return their slots (a
        batch: no lookups, no promotions), counted as reads of the primary (a daemon's client copies
        them out); None, nothing pinned, when one is not."""
        pool = self._pool(group)
        index, state, ready = pool.index, pool.state, SlotState.READY
        slots = [index.get(k) for k in keys]
        if any(s is None or state[s] is not ready for s in slots):
            return None
        req = self._admission.request(request_id)
        assert req is not None
        self._ledger.pin(req, group, keys, slots)  # type: ignore[arg-type]
        self._stats.hits += len(keys)
        self._stats.bytes_read += len(keys) * pool.block_bytes
        return slots  # type: ignore[return-value]

    @locked
    def ready_slots(self, group: int, keys: list[bytes], request_id: str | None = None) -> list[int | None]:
        """The primary slot of each READY key (None for the others). ``request_id``, whose lookups
        pinned them, matters to a daemon store's slots only: here a READY key has one slot."""
        pool = self._pool(group)
        index, state, ready = pool.index, pool.state, SlotState.READY
        return [s if (s := index.get(k)) is not None and state[s] is ready else None for k in keys]

    @locked
    def unpin(self, group: int, keys: list[bytes], request_id: str) -> None:
        """``request_id`` has loaded these keys: drop its pins on them."""
        self._pool(group)
        req = self._admission.requests.get(request_id)
        if req is not None:
            req.last_seen = self._admission.clock()
            self._ledger.unpin(req, group, keys)

    # ---- stores ---------------------------------------------------------------------------------
    @locked
    def reserve(self, group: int, keys: list[bytes]) -> Reservation | None:
        """WRITING slots for keys the engine is about to write into the pool itself.

        Keys already held (ready or in flight) are skipped (``slots[i] is None``); the others get
        slots, evicting what they must, all or none: None when not enough slots can be had.
        Reserved keys are PENDING to lookups until :meth:`commit`.
        """
        pool = self._pool(group)
        index = pool.index
        new = [k for k in keys if k not in index]
        if not new:
            return Reservation(slots=[None] * len(keys), evicted=[])
        got = self._ledger.reserve(group, new)
        if got is None:
            return None
        if len(new) == len(keys):
            return Reservation(slots=list(got[0]), evicted=list(got[1]))
        by_key = dict(zip(new, got[0], strict=True))
        return Reservation(slots=[by_key.get(k) for k in keys], evicted=list(got[1]))

    @locked
    def commit(self, group: int, keys: list[bytes], success: bool = True) -> None:
        """Complete reserved keys: READY and cascaded to the lower tiers, or freed and forgotten."""
        self._pool(group)
        self._ledger.commit(group, keys, success, self._committed)

    @locked
    def adopt(self, group: int, pairs: list[tuple[bytes, bytes]], success: bool = True) -> list[bytes]:
        """Commit slots reserved under stand-in keys as the blocks their engine wrote into them:
        for each ``(stand_in, key)``, the slot becomes READY under ``key``, as :meth:`commit` makes
        it; a stand-in whose key is held already (ready or in flight), or all of them without
        ``success``, is freed unwritten. Returns the keys adopted."""
        self._pool(group)
        ledger = self._ledger
        adopted = [key for old, key in pairs if success and ledger.rekey(group, old, key)]
        taken = set(adopted)
        dropped = [old for old, key in pairs if key not in taken]
        if dropped:
            ledger.commit(group, dropped, False, self._committed)
        if adopted:
            ledger.commit(group, adopted, True, self._committed)
        return adopted

    def pool_of(self, request_id: str) -> str:
        """The pool whose rows :meth:`ready_slots` numbers for the request: '' (the store's own)."""
        return ""

    def pool_rows(self) -> dict[int, torch.Tensor]:
        """Each keyed group's primary pool as its ``[slots, block_bytes]`` uint8 tensor: the rows
        that :meth:`reserve` and :meth:`ready_slots` number, for engines that copy into and out of
        them themselves (a device pool's tensor is on its device)."""
        self._check_open()
        return {g: pool.tensor for g, pool in self._pools.items()}

    @locked
    def publish(self, tables: Mapping[int, SlotTable]) -> None:
        """Keep each group's slot table (``tables[group]``, one row per slot of its primary pool)
        up to date from now on, starting from the slots as they are: other processes then copy
        READY blocks out without asking (:mod:`tierkv.blocks.slottable`)."""
        for group, table in tables.items():
            pool = self._pool(group)
            for s in range(pool.num_slots):
                table.reset(s, pool.slot_key[s], pool.state[s] is SlotState.READY)
            pool.table = table

    @locked
    def touched(self, group: int, keys: list[bytes]) -> int:
        """Blocks another process copied out of the pool by itself: each is counted as a read of
        the primary, as a ``get`` counts it, and each still READY is made recent for eviction (how
        many were)."""
        pool = self._pool(group)
        index, state, ready = pool.index, pool.state, SlotState.READY
        held = [k for k in keys if (s := index.get(k)) is not None and state[s] is ready]
        if held:
            self._ledger.touch(group, held)
        self._stats.hits += len(keys)  # each was copied whole, checked against the table after
        self._stats.bytes_read += len(keys) * pool.block_bytes
        return len(held)

    # ---- whole pool -----------------------------------------------------------------------------
    @locked
    def clear(self) -> int:
        """Free every READY, unpinned primary slot (lower tiers keep their blocks); how many."""
        self._check_open()
        return self._ledger.clear()

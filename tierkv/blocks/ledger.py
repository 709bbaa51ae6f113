"""The block ledger: what is happening to each block of the primary, in one place.

A block of the primary is in a slot of its group's :class:`~tierkv.blocks.pool.SlotPool` (FREE, WRITING
or READY; how many pins hold it). The ledger keeps the rest of its life, which the parts that
move blocks used to keep each for itself and ask of each other:

- **in flight**: a WRITING block is on its way from a lower tier (a promotion: its
  :class:`Landing`) or from the engine (a reservation not committed yet); :meth:`BlockLedger.waiter`
  gives the event to wait on, whoever writes it;
- **staged**: a block that found no primary slot is cascaded from a private copy, which lookups and
  ``get`` see until the cascade ends (:meth:`BlockLedger.staged_row`);
- **pins by owner**: requests and calls pin through :class:`~tierkv.blocks.admission.Admission`,
  cascades through :meth:`BlockLedger.pin_cascade`; :meth:`BlockLedger.problems` checks that
  every pin on every slot has its owner.

It is the one writer of a primary block's life: promotions begin and end here
(:meth:`BlockLedger.begin_promotion`, :meth:`BlockLedger.end_promotion`), engine reservations are
made and committed here (:meth:`BlockLedger.reserve`, :meth:`BlockLedger.commit`), blocks written at
once are placed here (:meth:`BlockLedger.place`); the promoter, the engine slots and the reader
execute and never change a slot's state or the ledger's fields. Every change that may free a slot
is announced to the subscribers (:meth:`BlockLedger.subscribe`; the store admits the requests
waiting in the queue); nothing here imports what starts the work.

State changes happen under the store's lock; nothing here awaits.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import anyio
import torch

from tierkv.blocks.admission import Admission, Promotion, Request
from tierkv.blocks.pool import SlotPool, SlotState
from tierkv.blocks.rowsink import RowSink
from tierkv.tensors import take_rows

__all__ = ["BlockLedger", "Landing", "Storing"]


class Landing:
    """What waiters of one promotion's blocks wait on: an event set as each batch lands.

    One event per batch, not per block (a 1,024-block restore made 1,024 events): a waiter wakes
    when any batch of its promotion lands, finds its block READY or not, and waits on the next.
    ``sinks``: the waiting ``get`` calls' rows, which each block is copied into as soon as its
    read is verified, by the thread that read it. ``slots``: key -> (slot, allocation token) of
    the blocks still on their way, what :meth:`BlockLedger.problems` checks against the pool.
    """

    __slots__ = ("event", "group", "sinks", "slots")

    def __init__(self, group: int) -> None:
        self.event = anyio.Event()
        self.group = group
        self.sinks: tuple[RowSink, ...] = ()
        self.slots: dict[bytes, tuple[int, int]] = {}


class Storing:
    """A block an engine reserved and has not committed: its slot, the allocation's token, and
    the event ``get`` waits on (made on demand)."""

    __slots__ = ("event", "group", "slot", "token")

    def __init__(self, group: int, slot: int, token: int) -> None:
        self.group = group
        self.slot = slot
        self.token = token
        self.event: anyio.Event | None = None


class _Staged:
    """A staged block: its private copy, how many cascades still hold it, whether a tier took it."""

    __slots__ = ("cascades", "row", "stored")

    def __init__(self, row: torch.Tensor) -> None:
        self.row = row
        self.cascades = 0
        self.stored = False


class BlockLedger:
    """The in-flight, staged and pinned state of one store's primary blocks (see module docs)."""

    def __init__(self, pools: Mapping[int, SlotPool], admission: Admission,
                 set_event: Callable[[anyio.Event], None]) -> None:
        self.pools = pools
        self.admission = admission
        admission.slots = self
        self._set_event = set_event
        #: whether changes are announced (the store is open)
        self.open = False
        self._subscribers: list[Callable[[], None]] = []
        #: keys being promoted -> their promotion's landing
        self.promoting: dict[bytes, Landing] = {}
        #: when a promotion last began or landed a batch (``time.monotonic()``)
        self.promoted_at = 0.0
        #: keys an engine reserved and has not committed
        self.storing: dict[bytes, Storing] = {}
        #: keys cascading from a private copy
        self.staged: dict[bytes, _Staged] = {}
        #: pins cascades hold: group -> slot -> count
        self._cascade_pins: dict[int, Counter[int]] = {g: Counter() for g in pools}

    # ---- in flight ------------------------------------------------------------------------------
    def restoring(self, within: float) -> bool:
        """Whether the store is restoring blocks: promotions in flight, a ``get`` open, or a
        promotion begun or landed within the last ``within`` seconds."""
        return (bool(self.promoting or self.admission.calls)
                or time.monotonic() - self.promoted_at < within)

    def waiter(self, key: bytes) -> anyio.Event | None:
        """The event set when the block in flight under ``key`` lands or is stored; None when it
        is not in flight."""
        landing = self.promoting.get(key)
        if landing is not None:
            return landing.event
        entry = self.storing.get(key)
        if entry is None:
            return None
        if entry.event is None:
            entry.event = anyio.Event()
        return entry.event

    # ---- promotions -----------------------------------------------------------------------------
    def begin_promotion(self, p: Promotion, landing: Landing | None = None) -> Landing:
        """``p``'s keys are on their way into its reserved slots, landing on ``landing`` (a new one
        when None: ``p`` rides along with a promotion not started yet otherwise)."""
        if landing is None:
            landing = Landing(p.group)
        self.promoted_at = time.monotonic()
        self.promoting.update(dict.fromkeys(p.keys, landing))
        landing.slots.update(zip(p.keys, zip(p.slots, p.tokens, strict=True), strict=True))
        return landing

    def end_promotion(self, p: Promotion, landing: Landing, positions: Sequence[int],
                      ok: Sequence[bool], last: bool) -> int:
        """Blocks ``positions`` of ``p`` landed (``ok``) or failed: READY, or freed with every pin
        on them; only slots still the promotion's own (its tokens) change. Wakes the landing's
        waiters (``last``: nothing more of it is on its way). Returns how many became READY."""
        pool = self.pools[p.group]
        self.promoted_at = time.monotonic()
        slots, tokens, keys, promoting = p.slots, p.tokens, p.keys, self.promoting
        good = [i for i, f in zip(positions, ok, strict=True) if f]
        if good:
            # a slot no longer its own is refused (pool.refused): nothing of it is served
            kept = pool.land([slots[i] for i in good], [tokens[i] for i in good])
            good = [i for i, f in zip(good, kept, strict=True) if f]
        done = set(good)
        for i, f in zip(positions, ok, strict=True):
            if not f:
                self.admission.abandon(p.group, keys[i], slots[i], tokens[i])
        p.landed([i in done for i in positions])
        for i in positions:
            if promoting.get(keys[i]) is landing:
                del promoting[keys[i]]
            landing.slots.pop(keys[i], None)
        ev = landing.event
        if not last:
            landing.event = anyio.Event()  # for the blocks still on their way
        self._set_event(ev)
        if len(done) < len(positions):
            self.changed()
        return len(done)

    def listen(self, keys: Sequence[bytes], sink: RowSink, listened: list[Landing]) -> None:
        """Have the promotions of ``keys`` fill ``sink`` as their reads are verified; the landings
        it now listens on are added to ``listened``."""
        for k in keys:
            landing = self.promoting.get(k)
            if landing is not None and landing not in listened:
                listened.append(landing)
                landing.sinks = (*landing.sinks, sink)

    @staticmethod
    def unlisten(listened: Sequence[Landing], sink: RowSink) -> None:
        """``sink`` is closed: the landings it listened on forget it."""
        for landing in listened:
            landing.sinks = tuple(s for s in landing.sinks if s is not sink)

    # ---- engine reservations --------------------------------------------------------------------
    def reserve(self, group: int, keys: Sequence[bytes]) -> tuple[list[int], list[bytes]] | None:
        """WRITING slots for ``keys`` (none resident) that the engine fills itself, all or none:
        ``(slots, evicted keys)``, or None when not enough can be had."""
        pool = self.pools[group]
        got = pool.allocate(keys)
        if got is None:
            return None
        storing = self.storing
        for k, s, t in zip(keys, got[0], pool.tokens(got[0]), strict=True):
            storing[k] = Storing(group, s, t)
        return got

    def rekey(self, group: int, old: bytes, new: bytes) -> bool:
        """A reservation made under ``old`` is for ``new`` (resident nowhere in the pool) from now
        on, its slot unchanged; False, nothing changed, when ``old`` is not reserved or ``new``
        is in the pool already."""
        entry = self.storing.get(old)
        if entry is None or entry.group != group or new in self.storing:
            return False
        if not self.pools[group].rekey(entry.slot, entry.token, old, new):
            return False
        del self.storing[old]
        self.storing[new] = entry
        return True

    def commit(self, group: int, keys: Sequence[bytes], success: bool,
               committed: Callable[[int, list[bytes], list[int]], None]) -> None:
        """The engine filled (``success``) or gave up reserved ``keys``: READY, or freed and
        forgotten; wakes what waits for them. ``committed(group, keys, slots)`` is told of the
        blocks that became READY (keys not reserved are skipped) before anything else can evict
        them: it pins what it must keep (the cascade) before slots are announced free."""
        pool = self.pools[group]
        done_keys, done_slots, done_tokens = [], [], []
        for k in keys:
            entry = self.storing.pop(k, None)
            if entry is None:
                continue
            if entry.event is not None:
                self._set_event(entry.event)
            if success:
                done_keys.append(k)
                done_slots.append(entry.slot)
                done_tokens.append(entry.token)
            else:
                self.admission.abandon(group, k, entry.slot, entry.token)
        if done_slots:
            kept = pool.land(done_slots, done_tokens)
            if not all(kept):
                done_keys = [k for k, f in zip(done_keys, kept, strict=True) if f]
                done_slots = [s for s, f in zip(done_slots, kept, strict=True) if f]
            if done_slots:
                committed(group, done_keys, done_slots)
        self.changed()

    # ---- blocks written at once -----------------------------------------------------------------
    def place(self, group: int, keys: Sequence[bytes], src: torch.Tensor,
              rows: Sequence[int] | None = None) -> list[int] | None:
        """Write ``keys`` (none resident) into free or evicted slots and make them READY at once,
        all or none: ``keys[i]``'s bytes are row ``rows[i]`` of ``src`` (row ``i`` without
        ``rows``). Returns the slots in key order, or None when they do not fit now."""
        pool = self.pools[group]
        got = pool.allocate(keys)
        if got is None:
            return None
        pool.write(got[0], src if rows is None else take_rows(src, list(rows)))
        pool.mark_ready(got[0])
        return got[0]

    def clear(self) -> int:
        """Free every READY, unpinned primary slot (lower tiers keep their blocks); how many."""
        n = 0
        for pool in self.pools.values():
            slots = [s for s in range(pool.num_slots)
                     if pool.state[s] is SlotState.READY and pool.pins[s] == 0]
            pool.free(slots)
            n += len(slots)
        self.changed()
        return n

    # ---- staged copies --------------------------------------------------------------------------
    def stage(self, key: bytes, row: torch.Tensor) -> None:
        """One more cascade writes ``key`` from the private copy ``row``."""
        entry = self.staged.get(key)
        if entry is None:
            entry = self.staged[key] = _Staged(row)
        entry.cascades += 1

    def unstage(self, key: bytes, stored: bool) -> bool:
        """A cascade of a staged block ended (``stored``: a tier took it). True when that was the
        last and no tier took it: the block is held by nothing now."""
        entry = self.staged.get(key)
        if entry is None:
            return False
        entry.cascades -= 1
        entry.stored = entry.stored or stored
        if entry.cascades > 0:
            return False
        del self.staged[key]
        return not entry.stored

    def staged_row(self, key: bytes) -> torch.Tensor | None:
        """The staged copy of ``key``, if a cascade from a copy holds it."""
        entry = self.staged.get(key)
        return None if entry is None else entry.row

    # ---- pins and slots coming free --------------------------------------------------------------
    def subscribe(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` (under the lock) whenever slots may have become available while open."""
        self._subscribers.append(fn)

    def changed(self) -> None:
        """Slots may have become available (pins dropped, slots freed): tell the subscribers (call
        under the lock)."""
        if self.open:
            for fn in self._subscribers:
                fn()

    def unpin(self, req: Request, group: int, keys: Sequence[bytes]) -> None:
        """``req`` is done with ``keys`` of ``group``."""
        self.admission.unpin_many(req, group, keys)
        self.changed()

    def release(self, request_id: str) -> None:
        """Drop every pin ``request_id`` holds and its place in the queue."""
        self.admission.release(request_id)
        self.changed()

    def pin(self, req: Request, group: int, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """``req`` holds ``keys`` of ``group`` (resident in ``slots``) until it unpins them."""
        self.admission.pin_many(req, group, list(keys), list(slots))

    def touch(self, group: int, keys: Sequence[bytes]) -> None:
        """``keys`` of ``group`` were used: their recency for the pool's eviction policy."""
        self.pools[group].touch_many(keys)

    # ---- pins -----------------------------------------------------------------------------------
    def allocate_pinned(self, group: int, keys: list[bytes]) -> tuple[list[int], list[int]]:
        """Slots (WRITING, pinned) for ``keys``, new to the pool, and their allocation tokens (the
        caller checked they are available)."""
        pool = self.pools[group]
        got = pool.allocate(keys)
        assert got is not None, "admission checked availability"
        slots = got[0]
        pool.pin_many(slots)
        return slots, pool.tokens(slots)

    def pin_slots(self, group: int, slots: list[int]) -> None:
        """A request or call pins ``slots``: neither evicted nor rewritten until unpinned."""
        pool = self.pools[group]
        if len(slots) == 1:
            pool.pin(slots[0])
        else:
            pool.pin_many(slots)

    def unpin_key(self, group: int, key: bytes) -> None:
        """A request is done with ``key``: its pin goes, and the use counts for its recency."""
        pool = self.pools[group]
        s = pool.slot_of(key)
        if s is not None:
            pool.unpin(s)
            pool.touch(key)

    def unpin_keys(self, group: int, keys: list[bytes]) -> None:
        """:meth:`unpin_key` of many keys of one group, at once."""
        self.pools[group].unpin_keys(keys)

    def abandon_slot(self, group: int, slot: int, token: int) -> bool:
        """A write into ``slot`` (allocation ``token``) failed: free it, unless a later allocation
        holds it now (False, nothing changed)."""
        return self.pools[group].abandon([slot], [token])[0]

    def pin_cascade(self, group: int, slots: Sequence[int]) -> None:
        """A cascade reads ``slots``: they stay until it ends."""
        pool, pins = self.pools[group], self._cascade_pins[group]
        for s in slots:
            pool.pin(s)
            pins[s] += 1

    def unpin_cascade(self, group: int, slots: Sequence[int]) -> None:
        """The cascade that read ``slots`` ended."""
        pool, pins = self.pools[group], self._cascade_pins[group]
        for s in slots:
            pool.unpin(s)
            pins[s] -= 1
            if not pins[s]:
                del pins[s]

    def problems(self) -> list[str]:
        """Inconsistencies (empty when sound): the pools' slot accounting (writes refused because
        their slot was no longer theirs among them), pins whose owner (a request, a call, a
        cascade) does not account for them, and blocks in flight whose writer does not hold the
        slot they are written into."""
        problems = [p for pool in self.pools.values() for p in pool.problems()]
        problems += self._writer_problems()
        for g, pool in self.pools.items():
            expected = [0] * pool.num_slots
            problems += self.admission.count_pins(g, pool, expected)
            for s, n in self._cascade_pins[g].items():
                expected[s] += n
            if expected != pool.pins:
                wrong = [s for s in range(pool.num_slots) if expected[s] != pool.pins[s]]
                problems.append(f"group {g}: pins of slots {wrong[:8]} do not match their owners "
                                f"(requests, calls, cascades)")
        return problems

    def _writer_problems(self) -> list[str]:
        """Every WRITING slot is written by one promotion or reservation that holds its token."""
        out: list[str] = []
        writers: dict[tuple[int, int], str] = {}
        for key, landing in self.promoting.items():
            slot, token = landing.slots.get(key, (-1, -1))
            writers[(landing.group, slot)] = key.hex()
            if slot < 0 or not self.pools[landing.group].owns(slot, token):
                out.append(f"group {landing.group}: the promotion of {key.hex()} does not hold its slot")
        for key, entry in self.storing.items():
            writers[(entry.group, entry.slot)] = key.hex()
            if not self.pools[entry.group].owns(entry.slot, entry.token):
                out.append(f"group {entry.group}: the reservation of {key.hex()} does not hold its slot")
        for g, pool in self.pools.items():
            for s in range(pool.num_slots):
                if pool.state[s] is SlotState.WRITING and (g, s) not in writers:
                    out.append(f"group {g}: slot {s} is being written by nobody")
        return out


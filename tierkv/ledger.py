"""The block ledger: what is happening to each block of the primary, in one place.

A block of the primary is in a slot of its group's :class:`~tierkv.pool.SlotPool` (FREE, WRITING
or READY; how many pins hold it). The ledger keeps the rest of its life, which the parts that
move blocks used to keep each for itself and ask of each other:

- **in flight**: a WRITING block is on its way from a lower tier (a promotion: its
  :class:`Landing`) or from the engine (a reservation not committed yet); :meth:`BlockLedger.waiter`
  gives the event to wait on, whoever writes it;
- **staged**: a block that found no primary slot is cascaded from a private copy, which lookups and
  ``get`` see until the cascade ends (:meth:`BlockLedger.staged_row`);
- **pins by owner**: requests and calls pin through :class:`~tierkv.admission.Admission`,
  cascades through :meth:`BlockLedger.pin_cascade`; :meth:`BlockLedger.problems` checks that
  every pin on every slot has its owner.

It also says when slots may have come free (:meth:`BlockLedger.changed`, called by whatever
unpinned or freed them) and admits the requests waiting for them at once.

State changes happen under the store's lock; nothing here awaits.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import anyio
import torch

from tierkv.admission import Admission
from tierkv.pool import SlotPool, SlotState

if TYPE_CHECKING:
    from tierkv.promotion import Promoter
    from tierkv.rowsink import RowSink

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
        self._set_event = set_event
        #: whether queued requests may be admitted (the store is open)
        self.open = False
        self._promoter: Promoter | None = None
        self._locate: Callable[[int, bytes], int | None] = lambda g, k: None
        #: keys being promoted -> their promotion's landing
        self.promoting: dict[bytes, Landing] = {}
        #: keys an engine reserved and has not committed
        self.storing: dict[bytes, Storing] = {}
        #: keys cascading from a private copy
        self.staged: dict[bytes, _Staged] = {}
        #: pins cascades hold: group -> slot -> count
        self._cascade_pins: dict[int, Counter[int]] = {g: Counter() for g in pools}

    # ---- in flight ------------------------------------------------------------------------------
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

    def stored(self, key: bytes) -> Storing | None:
        """The engine completed its reservation of ``key``: wake what waits for it and return the
        reservation (its slot and token); None when ``key`` was not reserved."""
        entry = self.storing.pop(key, None)
        if entry is not None and entry.event is not None:
            self._set_event(entry.event)
        return entry

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

    # ---- slots coming free ----------------------------------------------------------------------
    def bind(self, promoter: Promoter, locate: Callable[[int, bytes], int | None]) -> None:
        """Who starts the promotions of admitted requests, and where a lower tier holds a key."""
        self._promoter = promoter
        self._locate = locate

    def changed(self) -> None:
        """Slots may have become available (pins dropped, slots freed): admit the requests waiting
        in the queue, first come first served (call under the lock)."""
        if self.open and self.admission.queue and self._promoter is not None:
            self._promoter.start(self.admission.service(self._locate))

    # ---- pins -----------------------------------------------------------------------------------
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


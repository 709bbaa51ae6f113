"""Slots of the daemon's pool leased to a client, so that a ``put`` copies at once.

A ``put`` through the daemon must know where to copy before it copies. Without a lease it asks
(``reserve``) and waits for the answer. With one, it copies into slots the daemon reserved for it
earlier under stand-in keys, then names the blocks (``adopt``: the slots become READY under the
blocks' keys, or are freed where the pool holds a block already), and asks for as many slots
again in the same message. That answer is read later, while the next ``put`` copies. A client
keeps about two puts' worth leased; the daemon lends all that is asked or nothing, within what
one connection, and all of them, may hold (``LEASE_SHARE_CONN``, ``LEASE_SHARE_ALL`` in
:mod:`tierkv.daemon.ops`: an eighth of the pool, a quarter), so only a pool much larger than the
puts lends. A client the daemon refused does not ask again on that connection. Leased slots are
WRITING: no lookup sees them, eviction does not take them, and the daemon frees them when the
client closes or its connection drops. A client that has not put for :data:`IDLE_S` seconds gives
its leased slots back (:class:`~tierkv.daemon.puts.DaemonPuts` watches the clock on a thread of
its own), so an idle engine does not keep a share of the shared pool from the others; only the
client can, since only it knows which slots it is copying into. Its next put asks again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["IDLE_S", "Leases"]

#: seconds without a put after which a client gives its leased slots back
IDLE_S = 5.0


@dataclass
class _Lease:
    generation: int
    slots: list[int] = field(default_factory=list)
    asked: int = 0  # slots asked for whose answer is not in yet
    refused: bool = False  # the daemon lent none when asked: not asked again on this connection


class Leases:
    """One store's leased slots, per group, on its daemon connection now (see the module docstring)."""

    def __init__(self) -> None:
        self._by_group: dict[int, _Lease] = {}
        #: a slot is handed out once, whichever threads put at the same time
        self._lock = threading.Lock()

    def _of(self, group: int, generation: int) -> _Lease:
        lease = self._by_group.get(group)
        if lease is None or lease.generation != generation:  # a new connection: the old lease went
            lease = self._by_group[group] = _Lease(generation)
        return lease

    def take(self, group: int, n: int, generation: int) -> list[int] | None:
        """``n`` leased slots of connection ``generation`` (handed out once), or None when it has fewer."""
        with self._lock:
            lease = self._of(group, generation)
            if len(lease.slots) < n:
                return None
            got = lease.slots[:n]
            del lease.slots[:n]
            return got

    def want(self, group: int, n: int, generation: int) -> int:
        """How many slots to ask for so that about ``2 * n`` are leased or on their way (counted as
        asked for now)."""
        with self._lock:
            lease = self._of(group, generation)
            more = 0 if lease.refused else max(0, 2 * n - len(lease.slots) - lease.asked)
            lease.asked += more
            return more

    def on_answer(self, group: int, generation: int, asked: int) -> Callable[[dict[str, Any] | None], None]:
        """What to do with the answer to a message that asked for ``asked`` slots."""
        def landed(answer: dict[str, Any] | None) -> None:
            with self._lock:
                lease = self._by_group.get(group)
                if lease is None or lease.generation != generation:
                    return
                lease.asked = max(0, lease.asked - asked)
                got = answer.get("slots") if answer is not None else None
                if isinstance(got, list):
                    lease.slots += [s for s in got if type(s) is int]
                    lease.refused |= asked > 0 and not got
        return landed

    def busy(self) -> bool:
        """Whether slots are leased, or asked for and not answered yet."""
        with self._lock:
            return any(lease.slots or lease.asked for lease in self._by_group.values())

    def take_all(self, forget: bool = False) -> dict[int, tuple[int, list[int]]]:
        """Every group's leased slots and their connection's generation, handed out (the answers
        still owed add to the lease as they come; with ``forget``, they are dropped too)."""
        with self._lock:
            out = {g: (lease.generation, lease.slots) for g, lease in self._by_group.items() if lease.slots}
            for lease in self._by_group.values():
                lease.slots = []
            if forget:
                self._by_group.clear()
            return out

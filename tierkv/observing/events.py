"""Tier events delivered off the event loop: a listener that blocks never stalls the store.

:class:`ListenerThread` hands each event to the listener on a thread of its own, through a bounded
queue; when the listener falls :data:`QUEUE_EVENTS` events behind, new events are dropped and
counted (``dropped``), never waited for. :meth:`ListenerThread.close` delivers what is queued,
waiting at most ``timeout_s``.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierkv.backends.base import Tier

__all__ = ["QUEUE_EVENTS", "ListenerThread", "subscribe"]

log = logging.getLogger("tierkv")

#: events a listener may fall behind before new ones are dropped
QUEUE_EVENTS = 65536
_STOP = object()


class ListenerThread:
    """Calls ``listener(*event)`` for each event :meth:`put`, in order, on a daemon thread."""

    def __init__(self, listener: Callable[..., None], name: str = "tierkv-events") -> None:
        self._listener = listener
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=QUEUE_EVENTS)
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, *event: Any) -> None:
        """Queue one event; never blocks (a full queue drops it, counted)."""
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        while True:
            event = self._queue.get()
            if event is _STOP:
                return
            try:
                self._listener(*event)
            except Exception:
                log.exception("a tier event listener failed")

    def close(self, timeout_s: float = 2.0) -> None:
        """Deliver what is queued (at most ``timeout_s``), then stop the thread."""
        try:
            self._queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            return
        self._thread.join(timeout_s)


def subscribe(tiers: Sequence[Tier], listener: Callable[[int, str, list[bytes]], None]) -> ListenerThread:
    """Relay the ``stored`` / ``removed`` events of ``tiers`` (tier index 1 first) to ``listener``
    on a :class:`ListenerThread` of its own, which is returned (close it with the store)."""
    thread = ListenerThread(listener)

    def relay(tier: int, event: str, keys: list[bytes]) -> None:
        if event != "listed":  # what a listing saw is for the gateways' presence, not news
            thread.put(tier, event, keys)

    for i, t in enumerate(tiers, start=1):
        t.add_listener(functools.partial(relay, i))
    return thread

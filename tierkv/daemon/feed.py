"""Events the daemon pushes to the connections that subscribe to them.

A connection that sends ``{"op": "subscribe", "what": "evictions" | "tier"}`` after its hello is
answered ``{"local": [...], "slots": {...}}`` (whether each lower tier keeps its data on this
machine; each group's pool slots) and from then on only receives frames, one per event:

- ``{"e": "evicted", "g": group, "k": [key, ...]}``: keys that left the store's pool;
- ``{"e": "stored" | "removed", "t": tier, "k": [key, ...]}``: keys that a lower tier (1 the
  first below the pool) gained or lost.

Keys are hex, at most :data:`FRAME_KEYS` to a frame. Events are the store's, so every client of the
namespace and layout sees every event, whichever client caused it. A subscriber never holds the
daemon up: each has a queue of :data:`QUEUE_FRAMES` frames, and one that falls that far behind
loses the newest frames (counted in the store's ``events_dropped``). A subscribed connection
that sends anything is disconnected.
"""

from __future__ import annotations

import contextlib
import queue
import select
import socket
import threading
from typing import Any

from tierkv.backends.fsspec._open import tier_is_local
from tierkv.daemon.protocol import encode
from tierkv.errors import InvalidArgument
from tierkv.store import TieredStore

__all__ = ["FRAME_KEYS", "QUEUE_FRAMES", "Feed"]

#: keys in one event frame at most (a frame stays far below the message size limit)
FRAME_KEYS = 4096
#: frames one subscriber may fall behind before the newest are dropped
QUEUE_FRAMES = 4096
#: how often a subscriber's thread checks whether its client hung up, when no event comes
_POLL_S = 0.5
#: a client that does not read its frames for this long is disconnected
_SEND_TIMEOUT_S = 30.0
_WHAT = ("evictions", "tier")


class Feed:
    """One store's events, fanned out to its subscribers' queues (see the module docstring)."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._subs: dict[str, list[queue.Queue[bytes]]] = {w: [] for w in _WHAT}
        self._listening: set[str] = set()
        #: frames dropped because a subscriber fell behind
        self.dropped = 0

    def _send(self, what: str, frames: list[bytes]) -> None:
        with self._lock:
            subs = list(self._subs[what])
        for q in subs:
            for frame in frames:
                try:
                    q.put_nowait(frame)
                except queue.Full:
                    self.dropped += 1

    def _evicted(self, group: int, keys: list[bytes]) -> None:
        self._send("evictions", _frames({"e": "evicted", "g": group}, keys))

    def _tier_event(self, tier: int, event: str, keys: list[bytes]) -> None:
        self._send("tier", _frames({"e": event, "t": tier}, keys))

    def serve(self, sock: socket.socket, msg: dict[str, Any]) -> None:
        """Answer a subscribe message, then push its events to ``sock`` until the client hangs up."""
        what = msg.get("what")
        if what not in _WHAT:
            raise InvalidArgument(f"what must be one of {', '.join(_WHAT)}")
        q: queue.Queue[bytes] = queue.Queue(maxsize=QUEUE_FRAMES)
        with self._lock:
            if what not in self._listening:  # the store's listeners, registered on first use
                self._listening.add(what)
                if what == "evictions":
                    self.store.engine.subscribe_evictions(self._evicted)
                else:
                    self.store.subscribe_tier_events(self._tier_event)
            self._subs[what].append(q)
        try:
            tiers = [t.model_dump(mode="json") for t in self.store.config.tiers[1:]]
            slots = {str(g): t.shape[0] for g, t in self.store.engine.pool_rows().items()}
            sock.settimeout(_SEND_TIMEOUT_S)
            sock.sendall(encode({"local": [tier_is_local(t) for t in tiers], "slots": slots}))
            _push(sock, q)
        finally:
            with self._lock:
                self._subs[what].remove(q)


def _frames(head: dict[str, Any], keys: list[bytes]) -> list[bytes]:
    return [encode({**head, "k": [k.hex() for k in keys[i:i + FRAME_KEYS]]})
            for i in range(0, len(keys), FRAME_KEYS)]


def _push(sock: socket.socket, q: queue.Queue[bytes]) -> None:
    while True:
        try:
            frame = q.get(timeout=_POLL_S)
        except queue.Empty:
            frame = b""
        if frame:
            sock.sendall(frame)
            continue
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            continue
        sent = b""
        with contextlib.suppress(OSError):
            sent = sock.recv(1)
        if sent:
            raise InvalidArgument("a subscribed connection only receives")
        return  # the client hung up (or the daemon is stopping)

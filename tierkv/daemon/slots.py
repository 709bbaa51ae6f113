"""``DaemonSlots``: the engine slot API (``store.engine``) of a daemon store, for engine adapters.

An adapter that copies between its engine's buffers and the pool itself (vLLM's) calls
``key_state``, ``ready_slots``, ``unpin``, ``reserve`` and ``commit`` as on an in-process store; here
each is a message to the daemon, and the rows are those of the daemon's pool, which this process
maps. What a daemon restart must not break:

- Slots are named together with their pool (:meth:`pool_of`, :attr:`Reservation.pool`): the
  worker copies into and out of that pool's rows, never another's. A restarted daemon makes a new
  pool file, so rows of the old one that a load still reads stay as they were.
- A READY answer carries its slot, remembered per request: ``ready_slots`` never asks the daemon,
  so a load prepared from lookups made before a restart reads what those lookups pinned.
- One request's pins are all in one pool: a key looked up in another pool than the request's
  earlier HITs is a MISS (the request recomputes from there).

While the daemon cannot be reached, ``key_state`` is MISS, ``reserve`` None (the store is skipped)
and ``unpin``, ``commit`` and ``clear`` do nothing.

Eviction events (:meth:`DaemonSlots.subscribe_evictions`) are the daemon pool's: every key that
leaves it, whichever client stored it. A daemon that restarts starts with an empty pool; the keys
this client committed that had not been reported evicted are then reported evicted, once the
subscription reaches the new daemon.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from tierkv.daemon.link import Link
from tierkv.daemon.protocol import MAX_REQUEST_ID
from tierkv.daemon.subscription import Subscription
from tierkv.errors import InvalidArgument, TierUnavailable
from tierkv.keys import GROUP_BYTES
from tierkv.movement.engine import Reservation
from tierkv.movement.lookup import KeyState

__all__ = ["AHEAD_KEYS", "DaemonSlots", "user_request"]

log = logging.getLogger("tierkv.daemon")
EvictionListener = Callable[[int, list[bytes]], None]
#: keys asked in one message at most when the engine says which come next
AHEAD_KEYS = 64


def user_request(request_id: object) -> str:
    """The daemon's name for a caller's request id (checked: a str of bounded length)."""
    if type(request_id) is not str:
        raise InvalidArgument(f"request_id must be a str, got {type(request_id).__name__}")
    if not 0 < len(request_id) <= MAX_REQUEST_ID - 2:
        raise InvalidArgument(f"request_id must be 1..{MAX_REQUEST_ID - 2} characters through the daemon")
    return f"u:{request_id}"


class DaemonSlots:
    """The slot API over the daemon's pool (see the module docstring)."""

    def __init__(self, link: Link) -> None:
        self._link = link
        self._lock = threading.Lock()
        #: request id -> (pool id, {(group, key): slot}) of its READY answers not unpinned yet
        self._held: dict[str, tuple[str, dict[tuple[int, bytes], int]]] = {}
        #: request id -> answers given early (asked with an earlier key): state, slot, connection
        self._early: dict[str, dict[tuple[int, bytes], tuple[KeyState, int | None, int]]] = {}
        self._listeners: list[EvictionListener] = []
        self._feed: Subscription | None = None
        #: while someone listens: each group's keys this client committed and not seen evicted
        #: (insertion order; never more than the group's pool slots), and the daemon they are in
        self._mine: dict[int, dict[bytes, None]] = {}
        self._slots: dict[int, int] = {}
        self._instance: str | None = None

    def subscribe_evictions(self, listener: EvictionListener) -> Callable[[], None]:
        """Call ``listener(group, keys)`` whenever keys leave the daemon's pool (see the module
        docstring); returns an unsubscribe. The listener runs on the subscription's thread; while the
        daemon is reachable, the subscription is in place when this returns."""
        with self._lock:
            self._listeners.append(listener)
            feed = self._feed
            if feed is None:
                feed = self._feed = Subscription(self._link.path, self._link.hello, "evictions",
                                                 self._link.timeout_s, self._attached, self._frame)
        if self._link.connected:  # events from the return on are heard (a daemon away: none to hear)
            feed.attached.wait(self._link.timeout_s)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)
        return unsubscribe

    def _attached(self, instance: str, answer: dict[str, Any]) -> None:
        slots = answer.get("slots")
        with self._lock:
            self._slots = {int(g): int(n) for g, n in slots.items()} if isinstance(slots, dict) else {}
            gone = self._mine if self._instance is not None and instance != self._instance else {}
            if gone:
                self._mine = {}
            self._instance = instance
        for group, keys in gone.items():  # the daemon restarted: its pool, and these keys, are gone
            if keys:
                self._tell(group, list(keys))

    def _frame(self, msg: dict[str, Any]) -> None:
        if msg.get("e") != "evicted" or type(msg.get("g")) is not int:
            return
        group, keys = msg["g"], [bytes.fromhex(k) for k in msg.get("k", [])]
        with self._lock:
            mine = self._mine.get(group)
            if mine:
                for k in keys:
                    mine.pop(k, None)
        self._tell(group, keys)

    def _tell(self, group: int, keys: list[bytes]) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(group, keys)
            except Exception:
                log.exception("an eviction listener failed")

    def committed(self, group: int, keys: list[bytes]) -> None:
        """Keys this client made READY in the daemon's pool (remembered while someone listens, so a
        daemon restart reports them evicted)."""
        overflow: list[bytes] = []
        with self._lock:
            if self._feed is None:
                return
            mine = self._mine.setdefault(group, {})
            mine.update(dict.fromkeys(keys))
            room = self._slots.get(group)
            while room is not None and len(mine) > room:  # a pool holds no more: the oldest left it
                old = next(iter(mine))
                del mine[old]
                overflow.append(old)
        if overflow:
            self._tell(group, overflow)

    def close(self) -> None:
        """Stop the eviction subscription."""
        with self._lock:
            feed, self._feed = self._feed, None
        if feed is not None:
            feed.close()

    def key_state(self, group: int, key: bytes, request_id: str,
                  ahead: Callable[[], list[bytes]] | None = None) -> KeyState:
        """The key's state, pinning it for the request (see the module docstring).

        ``ahead`` gives the keys the engine will ask about next, in order (the rest of a prefix):
        they are asked in the same message, up to the first MISS and :data:`AHEAD_KEYS` in all,
        and their answers (their pins taken) are given when the engine asks for them, once each.
        """
        rid = user_request(request_id)
        with self._lock:
            early = self._early.get(request_id)
            got = early.pop((group, key), None) if early else None
        if got is not None:
            state, slot, gen = got
            return self._answer(group, key, request_id, state, slot, gen)
        keys = list(dict.fromkeys([key, *(ahead() if ahead is not None else ())]))[:AHEAD_KEYS]
        try:
            answer, gen = self._link.call({"op": "state", "g": group, "h": [_hash(k, group) for k in keys],
                                           "r": rid, "stop": True})
        except TierUnavailable:
            return KeyState.MISS
        states, slots = answer["k"], answer["slots"]
        if len(states) > 1:
            with self._lock:
                early = self._early.setdefault(request_id, {})
                for k, st, sl in zip(keys[1:], states[1:], slots[1:], strict=False):
                    early[(group, k)] = (KeyState(st), sl, gen)
        return self._answer(group, key, request_id, KeyState(states[0]), slots[0], gen)

    def _answer(self, group: int, key: bytes, request_id: str, state: KeyState, slot: int | None,
                gen: int) -> KeyState:
        """A key's state as the daemon answered it on connection ``gen``; a READY one's slot is
        remembered for the request (in that connection's pool)."""
        if state is not KeyState.READY:
            return state
        at = self._link.attached(gen)
        if at is None:  # pinned on a connection gone since: its pins go with it
            return KeyState.MISS
        pool = at.pool_id
        with self._lock:
            held = self._held.get(request_id)
            if held is None or not held[1]:
                held = self._held[request_id] = (pool, {})
            elif held[0] != pool:
                return KeyState.MISS  # its other pins are in the pool of a daemon now gone
            held[1][(group, key)] = int(slot)  # type: ignore[arg-type]
        return state

    def ready_slots(self, group: int, keys: list[bytes], request_id: str | None = None) -> list[int | None]:
        """The slots ``request_id``'s lookups found these keys in (None: not looked up as READY)."""
        with self._lock:
            held = self._held.get(request_id) if request_id is not None else None
            at = held[1] if held is not None else {}
            return [at.get((group, k)) for k in keys]

    def pool_of(self, request_id: str) -> str:
        """The pool id of the slots ``ready_slots`` gives for the request."""
        with self._lock:
            held = self._held.get(request_id)
            return held[0] if held is not None else self._link.pool_id

    def unpin(self, group: int, keys: list[bytes], request_id: str) -> None:
        """The request has loaded these keys: drop its pins on them."""
        rid = user_request(request_id)
        with self._lock:
            held = self._held.get(request_id)
            if held is not None:
                for k in keys:
                    held[1].pop((group, k), None)
        with contextlib.suppress(TierUnavailable):
            self._link.call({"op": "unpin", "g": group, "h": [_hash(k, group) for k in keys], "r": rid,
                             "nr": True}, reply=False, retry=False)

    def forget(self, request_id: str) -> None:
        """The request ended: nothing of it is loaded any more."""
        with self._lock:
            self._held.pop(request_id, None)
            self._early.pop(request_id, None)

    def reserve(self, group: int, keys: list[bytes]) -> Reservation | None:
        """WRITING slots in the daemon's pool for these keys (see :meth:`EngineSlots.reserve`), in
        the pool :attr:`Reservation.pool` names; None when it has no room or cannot be reached."""
        try:
            answer, gen = self._link.call({"op": "reserve", "g": group, "h": [_hash(k, group) for k in keys],
                                           "ev": True})
        except TierUnavailable:
            return None
        slots = answer.get("slots")
        at = self._link.attached(gen)
        if slots is None or at is None:  # no room; or reserved on a connection gone since
            return None
        return Reservation(slots=slots, evicted=[bytes.fromhex(k) for k in answer.get("ev", [])],
                           pool=at.pool_id)

    def commit(self, group: int, keys: list[bytes], success: bool = True) -> None:
        """Complete reserved keys (on the connection that reserved them; otherwise the daemon has
        let them go already and nothing happens)."""
        try:
            self._link.call({"op": "commit", "g": group, "h": [_hash(k, group) for k in keys], "ok": success,
                             "nr": True}, reply=False, retry=False)
        except TierUnavailable:
            return
        if success:
            self.committed(group, keys)

    def clear(self) -> int:
        """Free every READY, unpinned slot of the daemon's store (every client's); how many."""
        try:
            answer, _ = self._link.call({"op": "clear"})
        except TierUnavailable:
            return 0
        return int(answer["n"])


def _hash(key: bytes, group: int) -> str:
    """The hash part of a full key (the daemon adds the group's tail back)."""
    if len(key) <= GROUP_BYTES or key[-GROUP_BYTES:] != group.to_bytes(GROUP_BYTES, "big"):
        raise InvalidArgument(f"a key of group {group} must end in the group's {GROUP_BYTES}-byte tail")
    return key[:-GROUP_BYTES].hex()

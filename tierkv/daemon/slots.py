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
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

from tierkv.daemon.link import Link
from tierkv.daemon.protocol import MAX_REQUEST_ID
from tierkv.errors import InvalidArgument, TierUnavailable
from tierkv.keys import GROUP_BYTES
from tierkv.movement.engine import Reservation
from tierkv.movement.lookup import KeyState

__all__ = ["DaemonSlots", "user_request"]


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

    def subscribe_evictions(self, listener: Callable[[int, list[bytes]], None]) -> Callable[[], None]:
        """Not available through the daemon."""
        raise InvalidArgument("eviction events are not available through the tierkv daemon")

    def key_state(self, group: int, key: bytes, request_id: str) -> KeyState:
        """The key's state, pinning it for the request (see the module docstring)."""
        rid = user_request(request_id)
        try:
            answer, gen = self._link.call({"op": "state", "g": group, "h": [_hash(key, group)], "r": rid})
        except TierUnavailable:
            return KeyState.MISS
        state = KeyState(answer["k"][0])
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
            held[1][(group, key)] = int(answer["slots"][0])
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
        with contextlib.suppress(TierUnavailable):
            self._link.call({"op": "commit", "g": group, "h": [_hash(k, group) for k in keys], "ok": success,
                             "nr": True}, reply=False, retry=False)

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

"""The daemon's operations: what a connection holds, and one handler per message kind.

A handler parses its message first (a field of the wrong type raises :class:`InvalidArgument`, and
the daemon closes the connection), then returns the call that serves it on the connection's thread;
``on_loop`` runs a coroutine function on the daemon's event loop.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tierkv.daemon.feed import Feed
from tierkv.daemon.protocol import MAX_REQUEST_ID
from tierkv.daemon.staging import Staging
from tierkv.errors import InvalidArgument, TierKVError
from tierkv.keys import GROUP_BYTES, MAX_HASH_BYTES
from tierkv.movement.lookup import KeyState
from tierkv.store import TieredStore
from tierkv.units import RecordUnits

__all__ = ["HANDLERS", "Call", "Conn", "OnLoop", "Served", "let_go"]

_LOOKUP_CHAR = {"hit": "h", "pending": "p", "miss": "m"}
#: runs a coroutine function with its arguments on the daemon's event loop, returning its result
OnLoop = Callable[..., Any]


@dataclass
class Served:
    """One open store and what a client needs to map its pools."""

    store: TieredStore
    shm_path: str
    pools: list[list[int]]  # [group, offset, slots, block_bytes]
    staging: Staging | None = None
    feed: Feed | None = None  # its events, for the connections that subscribe
    counts: dict[str, int] = field(default_factory=lambda: {"puts": 0, "put_blocks_dropped": 0})
    #: where each group's slot table lies in the ``.slots`` file: ``[group, byte offset, slots]``
    slot_tables: list[list[int]] = field(default_factory=list)
    #: slots leased to connections now, per group (see ``_lease``)
    leased: dict[int, int] = field(default_factory=dict)
    #: the store's blocks as its records (the pool and the slot API name records)
    units: RecordUnits = field(init=False)

    def __post_init__(self) -> None:
        self.units = RecordUnits(self.store.layout)


@dataclass
class Conn:
    """What one connection holds: its store, its request ids, its reserved keys per group."""

    id: int
    served: Served | None = None
    #: request id -> when it was last named, oldest first (ids idle past the pin lease are
    #: forgotten: the store has dropped their pins already)
    requests: dict[str, float] = field(default_factory=dict)
    reserved: dict[int, set[bytes]] = field(default_factory=dict)
    #: staging ranges handed to it: offset -> bytes
    staged: dict[int, int] = field(default_factory=dict)
    #: slots leased to it, per group: slot -> the stand-in key it is reserved under
    leases: dict[int, dict[int, bytes]] = field(default_factory=dict)


def let_go(conn: Conn) -> None:
    """Release a gone connection's requests' pins, abandon its reservations."""
    if conn.served is None:
        return
    store = conn.served.store
    try:
        for rid in conn.requests:
            store.release(rid)
        for group, keys in conn.reserved.items():
            if keys:
                store.engine.commit(group, list(keys), success=False)
    except TierKVError:  # the store closed under it (the daemon is stopping)
        pass
    if conn.served.staging is not None:
        for off, nbytes in conn.staged.items():
            conn.served.staging.give(off, nbytes)
    for group, held in conn.leases.items():
        conn.served.leased[group] = conn.served.leased.get(group, 0) - len(held)
    conn.requests.clear()
    conn.reserved.clear()
    conn.staged.clear()
    conn.leases.clear()


# ---- message fields: a wrong one raises InvalidArgument (the connection is closed) ------------
def _group(msg: dict[str, Any]) -> int:
    g = msg.get("g")
    if type(g) is not int:
        raise InvalidArgument("g (the group) must be an int")
    return g


def _hashes(msg: dict[str, Any]) -> list[bytes]:
    h = msg.get("h")
    if not isinstance(h, list):
        raise InvalidArgument("h (the hashes) must be a list of hex strings")
    try:
        out = [bytes.fromhex(x) for x in h]
    except (TypeError, ValueError):
        raise InvalidArgument("h (the hashes) must be a list of hex strings") from None
    if any(not 0 < len(x) <= MAX_HASH_BYTES for x in out):
        raise InvalidArgument(f"a hash must be 1..{MAX_HASH_BYTES} bytes long")
    if len(set(out)) != len(out):
        raise InvalidArgument("a hash repeats within the message")
    return out


def _request(conn: Conn, msg: dict[str, Any], required: bool = False) -> str | None:
    r = msg.get("r")
    if r is None and not required:
        return None
    if not isinstance(r, str) or not 0 < len(r) <= MAX_REQUEST_ID:
        raise InvalidArgument(f"r (the request id) must be a string of 1..{MAX_REQUEST_ID} characters")
    rid = f"{conn.id}/{r}"
    requests, now = conn.requests, time.monotonic()
    requests.pop(rid, None)
    requests[rid] = now
    if len(requests) > 4096:
        lease = conn.served.store.config.pin_lease_s if conn.served is not None else 0.0
        while requests and now - next(iter(requests.values())) > lease:
            del requests[next(iter(requests))]
    return rid


def _keys(group: int, hashes: list[bytes]) -> list[bytes]:
    tail = group.to_bytes(GROUP_BYTES, "big") if 0 <= group < 1 << 31 else b""
    return [h + tail for h in hashes]


Call = Callable[[], dict[str, Any] | None]


def _lookup(on_loop: OnLoop, conn: Conn, served: Served, msg: dict[str, Any]) -> Call:
    g, h, rid = _group(msg), _hashes(msg), _request(conn, msg)
    return lambda: {"s": "".join(_LOOKUP_CHAR[x.value] for x in served.store.lookup(g, h, rid))}


def _prefix(on_loop: OnLoop, conn: Conn, served: Served, msg: dict[str, Any]) -> Call:
    h, rid = _hashes(msg), _request(conn, msg)

    def call() -> dict[str, Any]:
        res = served.store.lookup_prefix(h, rid)
        return {"n": res.blocks, "s": res.state.value}
    return call


def _state(on_loop: OnLoop, conn: Conn, served: Served, msg: dict[str, Any]) -> Call:
    """The engine slot API's per-key lookup: each key's state, pinning it for the request, and
    the slot of each READY one; with ``stop``, none after the first MISS."""
    g, h, rid = _group(msg), _hashes(msg), _request(conn, msg, required=True)
    assert rid is not None

    stop = msg.get("stop") is True  # at the first MISS: the engine asks no further

    def call() -> dict[str, Any]:
        engine = served.store.engine
        keys = _keys(g, h)
        states = []
        for k in keys:
            states.append(engine.key_state(g, k, rid))
            if stop and states[-1] is KeyState.MISS:
                break
        keys = keys[:len(states)]
        ready = [k for k, s in zip(keys, states, strict=True) if s is KeyState.READY]
        at = dict(zip(ready, engine.ready_slots(g, ready), strict=True)) if ready else {}
        return {"k": [s.value for s in states], "slots": [at.get(k) for k in keys]}
    return call


def _states(on_loop: OnLoop, conn: Conn, served: Served, msg: dict[str, Any]) -> Call:
    g, h, rid = _group(msg), _hashes(msg), _request(conn, msg)
    return lambda: {"k": [s.value for s in served.store.lookup_states(g, h, rid)]}


def _touch(on_loop: OnLoop, conn: Conn, served: Served, msg: dict[str, Any]) -> Call:
    """Records the client copied out of the pool by itself, checked against the slot table."""
    g, h = _group(msg), _hashes(msg)
    return lambda: {"n": served.store.engine.touched(g, _keys(g, h))}


def _clear(on_loop: OnLoop, conn: Conn, served: Served, msg: dict[str, Any]) -> Call:
    return lambda: {"n": served.store.engine.clear()}


def _pin(on_loop: OnLoop, conn: Conn, served: Served, msg: dict[str, Any]) -> Call:
    g, h, rid = _group(msg), _hashes(msg), _request(conn, msg, required=True)

    def call() -> dict[str, Any]:  # a state per block, a slot per record
        store, keys = served.store, served.units.keys(g, h)[0]
        if len(keys) * served.units.per == len(h):
            pinned = store.engine.pin_ready(g, keys, str(rid))  # all there (the usual case): one batch
            if pinned is not None:
                return {"s": "h" * len(h), "slots": pinned}
        states = store.lookup(g, h, rid)  # pins what is there, promotes what is below
        slots = store.engine.ready_slots(g, keys)
        return {"s": "".join(_LOOKUP_CHAR[x.value] for x in states), "slots": slots}
    return call


def _unpin(on_loop: OnLoop, conn: Conn, served: Served, msg: dict[str, Any]) -> Call:
    g, h, rid = _group(msg), _hashes(msg), _request(conn, msg, required=True)
    assert rid is not None

    def call() -> dict[str, Any]:
        served.store.engine.unpin(g, _keys(g, h), rid)  # records: get's unpin names them too
        return {}
    return call


def _release(on_loop: OnLoop, conn: Conn, served: Served, msg: dict[str, Any]) -> Call:
    rid = _request(conn, msg, required=True)
    assert rid is not None

    def call() -> dict[str, Any]:
        conn.requests.pop(rid, None)
        served.store.release(rid)
        return {}
    return call


def _reserve(on_loop: OnLoop, conn: Conn, served: Served, msg: dict[str, Any]) -> Call:
    g, h = _group(msg), _hashes(msg)

    def call() -> dict[str, Any]:
        keys = _keys(g, h)
        served.counts["puts"] += 1
        got = served.store.engine.reserve(g, keys)
        if got is None:
            staging = served.staging
            nbytes = len(keys) * served.units.records.group(g).block_bytes
            off = staging.take(nbytes) if staging is not None and msg.get("stage") is True else None
            if off is None:
                served.counts["put_blocks_dropped"] += len(keys)
                return {"slots": None}
            conn.staged[off] = nbytes
            served.counts["puts"] -= 1  # the store counts the put it makes from staging
            return {"slots": None, "stage": off}
        mine = conn.reserved.setdefault(g, set())
        mine.update(k for k, s in zip(keys, got.slots, strict=True) if s is not None)
        if msg.get("ev") is True:  # the evicted keys, for engines that report them
            return {"slots": got.slots, "ev": [k.hex() for k in got.evicted]}
        return {"slots": got.slots}
    return call


def _commit(on_loop: OnLoop, conn: Conn, served: Served, msg: dict[str, Any]) -> Call:
    g, h, ok = _group(msg), _hashes(msg), msg.get("ok")
    if type(ok) is not bool:
        raise InvalidArgument("ok must be true or false")

    def call() -> dict[str, Any]:
        mine = conn.reserved.get(g, set())
        keys = [k for k in _keys(g, h) if k in mine]  # only what this connection reserved
        mine.difference_update(keys)
        if keys:
            served.store.engine.commit(g, keys, success=ok)
        return {}
    return call


#: a connection holds at most this share of a pool's slots in leases, all connections this one
LEASE_SHARE_CONN = 8
LEASE_SHARE_ALL = 4


def _count(msg: dict[str, Any], name: str) -> int:
    n = msg.get(name, 0)
    if type(n) is not int or not 0 <= n <= 1 << 20:
        raise InvalidArgument(f"{name} must be a count")
    return n


def _take_lease(conn: Conn, served: Served, g: int, n: int) -> list[int]:
    """``n`` WRITING slots of group ``g`` for the connection to fill before it names their keys
    (:func:`_adopt`), reserved under stand-in keys; none when the lease limits or the pool's room
    would not give all of them (a pool much larger than the puts lends; a small one does not)."""
    size = next((p[2] for p in served.pools if p[0] == g), 0)
    held = conn.leases.setdefault(g, {})
    room = min(size // LEASE_SHARE_CONN - len(held), size // LEASE_SHARE_ALL - served.leased.get(g, 0))
    if not 0 < n <= room:
        return []
    tail = g.to_bytes(GROUP_BYTES, "big")
    keys = [b"\xfftierkv-lease:" + os.urandom(16) + tail for _ in range(n)]  # no block's hash
    got = served.store.engine.reserve(g, keys)
    if got is None:
        return []
    slots = [s for s in got.slots if s is not None]
    conn.reserved.setdefault(g, set()).update(keys)
    held.update(zip(slots, keys, strict=True))
    served.leased[g] = served.leased.get(g, 0) + len(slots)
    return slots


def _lease(on_loop: OnLoop, conn: Conn, served: Served, msg: dict[str, Any]) -> Call:
    """Slots leased to the connection: a put into them needs no round trip before its copy."""
    g, n = _group(msg), _count(msg, "n")
    served.store.layout.group(g)
    return lambda: {"slots": _take_lease(conn, served, g, n)}


def _adopt(on_loop: OnLoop, conn: Conn, served: Served, msg: dict[str, Any]) -> Call:
    """A put into leased slots: ``s[i]`` holds the record ``h[i]`` (READY from now on, unless the
    pool holds that record already: the slot is freed then); the slots of ``free`` are given back
    unwritten; with ``lease``, that many slots more are leased."""
    g, h, ok, want = _group(msg), _hashes(msg), msg.get("ok"), _count(msg, "lease")
    slots, free = msg.get("s"), msg.get("free", [])
    if type(ok) is not bool:
        raise InvalidArgument("ok must be true or false")
    if not isinstance(slots, list) or len(slots) != len(h) or any(type(s) is not int for s in slots):
        raise InvalidArgument("s (the slots) must be a list of ints, one per hash")
    if not isinstance(free, list) or any(type(s) is not int for s in free):
        raise InvalidArgument("free (slots given back) must be a list of ints")

    def call() -> dict[str, Any]:
        held = conn.leases.get(g, {})
        pairs = [(held.pop(s), k) for s, k in zip(slots, _keys(g, h), strict=True) if s in held]
        back = [held.pop(s) for s in free if s in held]
        conn.reserved.get(g, set()).difference_update([old for old, _ in pairs] + back)
        served.leased[g] = served.leased.get(g, 0) - len(pairs) - len(back)
        if back:
            served.store.engine.commit(g, back, success=False)
        if h:
            served.counts["puts"] += 1
            served.counts["put_blocks_dropped"] += len(h) - len(pairs)  # slots it did not hold
        adopted = served.store.engine.adopt(g, pairs, success=ok) if pairs else []
        answer: dict[str, Any] = {"n": len(adopted)}
        if want:
            answer["slots"] = _take_lease(conn, served, g, want)
        return answer
    return call


def _write(on_loop: OnLoop, conn: Conn, served: Served, msg: dict[str, Any]) -> Call:
    """Store blocks a client copied into its staging range (a put that found no room), then free it."""
    g, h, off = _group(msg), _hashes(msg), msg.get("off")
    if type(off) is not int:
        raise InvalidArgument("off (a staging offset) must be an int")

    def call() -> dict[str, Any]:
        staging, nbytes = served.staging, conn.staged.get(off)
        block_bytes = served.store.layout.group(g).block_bytes
        if staging is None or nbytes is None or len(h) * block_bytes != nbytes:
            raise InvalidArgument("off must name a staging range this connection holds, filled by the blocks")
        del conn.staged[off]
        try:
            on_loop(served.store.put, g, h, staging.rows(off, len(h), block_bytes))
        finally:
            staging.give(off, nbytes)
        return {}
    return call


def _stats(on_loop: OnLoop, conn: Conn, served: Served, msg: dict[str, Any]) -> Call:
    def call() -> dict[str, Any]:
        st = served.store.stats()
        counts = served.counts
        dropped = st.put_blocks_dropped + counts["put_blocks_dropped"]
        events_dropped = st.events_dropped + (served.feed.dropped if served.feed is not None else 0)
        st = st.model_copy(update={"puts": st.puts + counts["puts"], "put_blocks_dropped": dropped,
                                   "events_dropped": events_dropped})
        return {"stats": st.model_dump(mode="json")}
    return call


def _flush(on_loop: OnLoop, conn: Conn, served: Served, msg: dict[str, Any]) -> Call:
    def call() -> dict[str, Any]:
        on_loop(served.store.flush)
        return {}
    return call


#: each operation: parses its message (a bad field raises, fatal) and returns the call serving it
HANDLERS: dict[str, Callable[[OnLoop, Conn, Served, dict[str, Any]], Call]] = {
    "lookup": _lookup, "prefix": _prefix, "pin": _pin, "unpin": _unpin, "release": _release,
    "reserve": _reserve, "commit": _commit, "stats": _stats, "flush": _flush,
    "state": _state, "states": _states, "clear": _clear, "touch": _touch, "write": _write,
    "lease": _lease, "adopt": _adopt,
    "ping": lambda *_: lambda: {},
}

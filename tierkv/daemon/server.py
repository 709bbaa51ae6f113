"""The daemon: one process per node serving stores to engines over a Unix socket.

Each connection says hello with its namespace and layout and is bound to the store serving that pair
(opened on first use; every client of the pair shares its blocks, other pairs never see them). The
store's CPU pool lives in a shared file the client maps; messages carry keys and slot numbers, and
the client copies rows itself:

- a put reserves WRITING slots (invisible to lookups), the client fills them, then commits;
- a get pins READY slots for a request of the connection, the client copies them, then unpins.

What a connection holds is its own: request ids are scoped to it, and when it drops (closed,
killed) its pins are released and its reservations abandoned (freed, never READY). A message that
is not valid (not a frame, over the size limit, not JSON, an unknown operation, a field of the wrong
type, a namespace the daemon does not serve) gets an error and the connection is closed; errors a
store raises for a valid message are answered and the connection stays.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import os
import secrets
import socket
import stat
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import anyio
import anyio.abc

from tierkv.daemon.config import DaemonConfig
from tierkv.daemon.protocol import MAX_REQUEST_ID, VERSION, recv_message, send_message
from tierkv.daemon.staging import Staging
from tierkv.errors import ConfigError, InvalidArgument, TierKVError, TierUnavailable
from tierkv.keys import GROUP_BYTES, MAX_HASH_BYTES
from tierkv.layout import Layout
from tierkv.movement.lookup import KeyState
from tierkv.store import TieredStore

__all__ = ["Daemon", "prepare_socket"]

log = logging.getLogger("tierkv.daemon")
T = TypeVar("T")

_LOOKUP_CHAR = {"hit": "h", "pending": "p", "miss": "m"}


@dataclass
class _Served:
    """One open store and what a client needs to map its pools."""

    store: TieredStore
    shm_path: str
    pools: list[list[int]]  # [group, offset, slots, block_bytes]
    staging: Staging | None = None
    counts: dict[str, int] = field(default_factory=lambda: {"puts": 0, "put_blocks_dropped": 0})


@dataclass
class _Conn:
    """What one connection holds: its store, its request ids, its reserved keys per group."""

    id: int
    served: _Served | None = None
    #: request id -> when it was last named, oldest first (ids idle past the pin lease are
    #: forgotten: the store has dropped their pins already)
    requests: dict[str, float] = field(default_factory=dict)
    reserved: dict[int, set[bytes]] = field(default_factory=dict)
    #: staging ranges handed to it: offset -> bytes
    staged: dict[int, int] = field(default_factory=dict)


def prepare_socket(path: str, mode: int) -> socket.socket:
    """A listening Unix socket at ``path`` with permission bits ``mode`` from its creation on.

    A stale socket file (nothing answers it) is replaced; a live one, or a file that is not a
    socket, is a :class:`ConfigError`.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise ConfigError(f"--socket {path}: a file that is not a socket is in the way")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # stale: its daemon is gone
        else:
            raise ConfigError(f"--socket {path}: another daemon is serving it")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o777 & ~mode)  # never wider than asked, not even between bind and chmod
    try:
        sock.bind(path)
        os.chmod(path, mode)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"--socket {path}: cannot listen there: {exc.strerror or exc}") from None
    finally:
        os.umask(old)
    sock.listen(128)
    return sock


class Daemon:
    """Serves stores on a listening socket until cancelled; then closes them (see module docs)."""

    def __init__(self, config: DaemonConfig, socket_path: str) -> None:
        self.config = config
        self.socket_path = socket_path
        self._tag = hashlib.sha256(os.path.abspath(socket_path).encode()).hexdigest()[:12]
        self._stores: dict[str, _Served] = {}
        self._opening = anyio.Lock()
        self._ids = itertools.count(1)
        self._live: set[socket.socket] = set()
        self._opened = 0
        #: names this run of the daemon: a pool slot means something only within one instance
        self.instance = secrets.token_hex(8)
        #: connections gone, with when their pins and reservations are let go
        self._graced: list[tuple[float, _Conn]] = []
        self._graced_lock = threading.Lock()

    async def serve(self, sock: socket.socket, ready: Callable[[], None] | None = None) -> None:
        """Accept connections on ``sock`` until cancelled; every store is closed on the way out.

        Each connection is served on a thread of its own with blocking I/O: a lookup's round trip
        is then two thread wake-ups, not a trip through the event loop (the store's synchronous
        methods may be called from any thread); what must run on the loop (opening a store,
        ``flush``) is handed to it.
        """
        listener = await anyio.abc.SocketListener.from_socket(sock)
        limiter = anyio.CapacityLimiter(self.config.max_clients + 1)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._reaper)
                if ready is not None:
                    ready()
                while True:
                    stream = await listener.accept()
                    conn = stream.extra(anyio.abc.SocketAttribute.raw_socket).dup()
                    await stream.aclose()
                    conn.setblocking(True)
                    self._live.add(conn)
                    tg.start_soon(partial(anyio.to_thread.run_sync, self._connection, conn,
                                          abandon_on_cancel=True, limiter=limiter))
        finally:
            with anyio.CancelScope(shield=True):
                await listener.aclose()
                for conn in list(self._live):  # wakes the threads blocked reading them
                    with contextlib.suppress(OSError):
                        conn.shutdown(socket.SHUT_RDWR)
                for served in list(self._stores.values()):
                    await served.store.close()
                    if served.staging is not None:
                        served.staging.close()
                self._stores.clear()

    # ---- one connection, on its own thread ------------------------------------------------------
    def _connection(self, sock: socket.socket) -> None:
        conn = _Conn(next(self._ids))
        try:
            if len(self._live) > self.config.max_clients:
                raise InvalidArgument(f"the daemon serves at most {self.config.max_clients} connections")
            while True:
                try:
                    msg = recv_message(sock)
                except TierUnavailable:  # the client hung up
                    return
                reply = self._handle(conn, msg)
                if reply is not None:
                    send_message(sock, reply)
        except TierKVError as exc:  # a message not to be served: say why, then hang up
            log.warning("connection %d refused: %s", conn.id, exc)
            with contextlib.suppress(Exception):
                send_message(sock, {"error": str(exc), "fatal": True})
        except OSError:
            pass
        except Exception:  # a bug: this connection ends, the daemon serves on
            log.exception("connection %d failed", conn.id)
        finally:
            self._live.discard(sock)
            self._drop(conn)
            sock.close()

    def _drop(self, conn: _Conn) -> None:
        """The connection is gone: its pins and reservations go after ``drop_grace_s``.

        Not at once: a client whose connection broke while the daemon lives (a call that timed
        out) may still be copying rows it was given, and a row must not be handed to anyone else
        until that copy is over."""
        if conn.served is None:
            return
        with self._graced_lock:
            self._graced.append((time.monotonic() + self.config.drop_grace_s, conn))

    async def _reaper(self) -> None:
        """Lets go of what dropped connections held once their grace is over."""
        while True:
            await anyio.sleep(min(1.0, self.config.drop_grace_s / 4))
            now = time.monotonic()
            with self._graced_lock:
                due = [c for t, c in self._graced if t <= now]
                self._graced = [(t, c) for t, c in self._graced if t > now]
            for conn in due:
                self._let_go(conn)

    @staticmethod
    def _let_go(conn: _Conn) -> None:
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
        conn.requests.clear()
        conn.reserved.clear()
        conn.staged.clear()

    def _handle(self, conn: _Conn, msg: dict[str, Any]) -> dict[str, Any] | None:
        op = msg.get("op")
        if op == "hello":
            return self._on_loop(self._hello, conn, msg)
        served = conn.served
        if served is None:
            raise InvalidArgument("say hello first")
        handler = _HANDLERS.get(op) if isinstance(op, str) else None
        if handler is None:
            raise InvalidArgument(f"unknown operation {str(op)[:40]!r}")
        if op == "flush":
            self._on_loop(served.store.flush)
            return {}
        call = handler(self, conn, served, msg)  # parses first: a bad field is fatal
        quiet = msg.get("nr") is True  # the client reads no answer to this one
        try:
            answer = call()
        except TierKVError as exc:  # the store refused a well-formed message: answer, stay
            if quiet:
                log.warning("connection %d: %s failed: %s", conn.id, op, exc)
                return None
            return {"error": str(exc), "fatal": False}
        return None if quiet else answer

    def _on_loop(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
        """Run ``fn`` on the daemon's event loop; :class:`TierUnavailable` once it has stopped."""
        try:
            return anyio.from_thread.run(fn, *args)
        except RuntimeError as exc:  # the loop is gone: the daemon is stopping
            raise TierUnavailable(f"the daemon is stopping: {exc}") from None

    async def _hello(self, conn: _Conn, msg: dict[str, Any]) -> dict[str, Any]:
        if conn.served is not None:
            raise InvalidArgument("hello twice on one connection")
        if msg.get("version") != VERSION:
            raise InvalidArgument(f"protocol version {msg.get('version')!r} is not {VERSION}")
        namespace = msg.get("namespace")
        if not isinstance(namespace, str) or len(namespace) > 4096:
            raise InvalidArgument("namespace must be a string")
        if self.config.namespaces and namespace not in self.config.namespaces:
            raise InvalidArgument(f"namespace {namespace[:200]!r} is not served here")
        try:
            layout = Layout.model_validate(msg.get("layout"))
            fingerprint = layout.fingerprint(namespace)
        except (TierKVError, ValueError) as exc:
            raise InvalidArgument(f"layout: {str(exc).splitlines()[0][:300]}") from None
        served = await self._open(layout, namespace, fingerprint)
        conn.served = served
        staging = served.staging
        return {"pools": served.pools, "shm": served.shm_path, "fingerprint": fingerprint,
                "instance": self.instance, "staging": [staging.path, staging.size] if staging else None,
                "metrics": served.store.metrics_url}

    async def _open(self, layout: Layout, namespace: str, fingerprint: str) -> _Served:
        async with self._opening:
            served = self._stores.get(fingerprint)
            if served is not None:
                return served
            if len(self._stores) >= self.config.max_stores:
                raise InvalidArgument(f"the daemon serves at most {self.config.max_stores} namespace and "
                                      "layout pairs (max_stores)")
            shm_path = os.path.join(self.config.shm_dir, f"tierkv-daemon-{self._tag}-{fingerprint[:16]}")
            # a pool file left by a killed daemon: unlinked, not reused, so a client still
            # holding that daemon's mapping can never write into this one's rows
            with contextlib.suppress(FileNotFoundError):
                os.unlink(shm_path)
            try:
                store = TieredStore(self.config.store_config(layout, namespace, shm_path, self._opened))
                await store.open()
            except TierKVError as exc:
                raise InvalidArgument(f"cannot open a store for this layout: {exc}") from None
            rows = store.engine.pool_rows()
            base = min(t.data_ptr() for t in rows.values())
            pools = [[g, t.data_ptr() - base, t.shape[0], t.shape[1]] for g, t in sorted(rows.items())]
            staging = None
            if self.config.staging_bytes:
                staging = Staging(f"{shm_path}.staging", self.config.staging_bytes)
            served = _Served(store, shm_path, pools, staging)
            self._stores[fingerprint] = served
            self._opened += 1
            log.info("serving namespace %r, layout %s, pool %s%s", namespace, fingerprint, shm_path,
                     f", metrics at {store.metrics_url}" if store.metrics_url else "")
            return served


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


def _request(conn: _Conn, msg: dict[str, Any], required: bool = False) -> str | None:
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


def _lookup(d: Daemon, conn: _Conn, served: _Served, msg: dict[str, Any]) -> Call:
    g, h, rid = _group(msg), _hashes(msg), _request(conn, msg)
    return lambda: {"s": "".join(_LOOKUP_CHAR[x.value] for x in served.store.lookup(g, h, rid))}


def _prefix(d: Daemon, conn: _Conn, served: _Served, msg: dict[str, Any]) -> Call:
    h, rid = _hashes(msg), _request(conn, msg)

    def call() -> dict[str, Any]:
        res = served.store.lookup_prefix(h, rid)
        return {"n": res.blocks, "s": res.state.value}
    return call


def _state(d: Daemon, conn: _Conn, served: _Served, msg: dict[str, Any]) -> Call:
    """The engine slot API's per-key lookup: each key's state, pinning it for the request, and
    the slot of each READY one."""
    g, h, rid = _group(msg), _hashes(msg), _request(conn, msg, required=True)
    assert rid is not None

    def call() -> dict[str, Any]:
        engine = served.store.engine
        keys = _keys(g, h)
        states = [engine.key_state(g, k, rid) for k in keys]
        ready = [k for k, s in zip(keys, states, strict=True) if s is KeyState.READY]
        at = dict(zip(ready, engine.ready_slots(g, ready), strict=True)) if ready else {}
        return {"k": [s.value for s in states], "slots": [at.get(k) for k in keys]}
    return call


def _states(d: Daemon, conn: _Conn, served: _Served, msg: dict[str, Any]) -> Call:
    g, h, rid = _group(msg), _hashes(msg), _request(conn, msg)
    return lambda: {"k": [s.value for s in served.store.lookup_states(g, h, rid)]}


def _clear(d: Daemon, conn: _Conn, served: _Served, msg: dict[str, Any]) -> Call:
    return lambda: {"n": served.store.engine.clear()}


def _pin(d: Daemon, conn: _Conn, served: _Served, msg: dict[str, Any]) -> Call:
    g, h, rid = _group(msg), _hashes(msg), _request(conn, msg, required=True)

    def call() -> dict[str, Any]:
        states = served.store.lookup(g, h, rid)
        slots = served.store.engine.ready_slots(g, _keys(g, h))
        return {"s": "".join(_LOOKUP_CHAR[x.value] for x in states), "slots": slots}
    return call


def _unpin(d: Daemon, conn: _Conn, served: _Served, msg: dict[str, Any]) -> Call:
    g, h, rid = _group(msg), _hashes(msg), _request(conn, msg, required=True)
    assert rid is not None

    def call() -> dict[str, Any]:
        served.store.engine.unpin(g, _keys(g, h), rid)
        return {}
    return call


def _release(d: Daemon, conn: _Conn, served: _Served, msg: dict[str, Any]) -> Call:
    rid = _request(conn, msg, required=True)
    assert rid is not None

    def call() -> dict[str, Any]:
        conn.requests.pop(rid, None)
        served.store.release(rid)
        return {}
    return call


def _reserve(d: Daemon, conn: _Conn, served: _Served, msg: dict[str, Any]) -> Call:
    g, h = _group(msg), _hashes(msg)

    def call() -> dict[str, Any]:
        keys = _keys(g, h)
        served.counts["puts"] += 1
        got = served.store.engine.reserve(g, keys)
        if got is None:
            staging = served.staging
            nbytes = len(keys) * served.store.layout.group(g).block_bytes
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


def _commit(d: Daemon, conn: _Conn, served: _Served, msg: dict[str, Any]) -> Call:
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


def _write(d: Daemon, conn: _Conn, served: _Served, msg: dict[str, Any]) -> Call:
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
            d._on_loop(served.store.put, g, h, staging.rows(off, len(h), block_bytes))
        finally:
            staging.give(off, nbytes)
        return {}
    return call


def _stats(d: Daemon, conn: _Conn, served: _Served, msg: dict[str, Any]) -> Call:
    def call() -> dict[str, Any]:
        st = served.store.stats()
        counts = served.counts
        dropped = st.put_blocks_dropped + counts["put_blocks_dropped"]
        st = st.model_copy(update={"puts": st.puts + counts["puts"], "put_blocks_dropped": dropped})
        return {"stats": st.model_dump(mode="json")}
    return call


_HANDLERS: dict[str, Callable[[Daemon, _Conn, _Served, dict[str, Any]], Call]] = {
    "lookup": _lookup, "prefix": _prefix, "pin": _pin, "unpin": _unpin, "release": _release,
    "reserve": _reserve, "commit": _commit, "stats": _stats, "flush": lambda *_: lambda: {},
    "state": _state, "states": _states, "clear": _clear, "write": _write, "ping": lambda *_: lambda: {},
}

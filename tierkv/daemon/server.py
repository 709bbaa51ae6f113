"""The daemon: one process per node serving stores to engines over a Unix socket.

Each connection says hello with its namespace and layout and is bound to the store serving that pair
(opened on first use; every client of the pair shares its blocks, other pairs never see them). The
store's CPU pool lives in a shared file the client maps; messages carry keys and slot numbers, and
the client copies rows itself:

- a put reserves WRITING slots (invisible to lookups), the client fills them, then commits;
- a get pins READY slots for a request of the connection, the client copies them, then unpins.

What a connection holds is its own: request ids are scoped to it, and ``drop_grace_s`` after it
drops (closed, killed) its pins are released and its reservations abandoned (freed, never READY).
The operations themselves are :mod:`tierkv.daemon.ops`; a connection that subscribes to events
gets them from :mod:`tierkv.daemon.feed` and sends nothing more. A message that
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
from functools import partial
from typing import Any, TypeVar

import anyio
import anyio.abc

from tierkv.blocks.slottable import create_tables
from tierkv.daemon.config import DaemonConfig
from tierkv.daemon.feed import Feed
from tierkv.daemon.ops import HANDLERS, Conn, Served, let_go
from tierkv.daemon.protocol import VERSION, recv_message, send_message
from tierkv.daemon.staging import Staging
from tierkv.errors import ConfigError, InvalidArgument, TierKVError, TierUnavailable
from tierkv.layout import Layout
from tierkv.store import TieredStore

__all__ = ["Daemon", "prepare_socket"]

log = logging.getLogger("tierkv.daemon")
T = TypeVar("T")


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
        self._stores: dict[str, Served] = {}
        self._opening = anyio.Lock()
        self._ids = itertools.count(1)
        self._live: set[socket.socket] = set()
        self._opened = 0
        #: names this run of the daemon: a pool slot means something only within one instance
        self.instance = secrets.token_hex(8)
        #: connections gone, with when their pins and reservations are let go
        self._graced: list[tuple[float, Conn]] = []
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
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(f"{served.shm_path}.slots")
                self._stores.clear()

    # ---- one connection, on its own thread ------------------------------------------------------
    def _connection(self, sock: socket.socket) -> None:
        conn = Conn(next(self._ids))
        try:
            if len(self._live) > self.config.max_clients:
                raise InvalidArgument(f"the daemon serves at most {self.config.max_clients} connections")
            while True:
                try:
                    msg = recv_message(sock)
                except TierUnavailable:  # the client hung up
                    return
                if msg.get("op") == "subscribe" and conn.served is not None and conn.served.feed is not None:
                    conn.served.feed.serve(sock, msg)  # from now on, the connection only receives events
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

    def _drop(self, conn: Conn) -> None:
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
                let_go(conn)

    def _handle(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any] | None:
        op = msg.get("op")
        if op == "hello":
            return self._on_loop(self._hello, conn, msg)
        served = conn.served
        if served is None:
            raise InvalidArgument("say hello first")
        handler = HANDLERS.get(op) if isinstance(op, str) else None
        if handler is None:
            raise InvalidArgument(f"unknown operation {str(op)[:40]!r}")
        call = handler(self._on_loop, conn, served, msg)  # parses first: a bad field is fatal
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

    async def _hello(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
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
                "slots": [f"{served.shm_path}.slots", served.slot_tables],
                "instance": self.instance, "staging": [staging.path, staging.size] if staging else None,
                "metrics": served.store.metrics_url}

    async def _open(self, layout: Layout, namespace: str, fingerprint: str) -> Served:
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
            tables, where = create_tables(f"{shm_path}.slots", {g: t.shape[0] for g, t in rows.items()})
            store.engine.publish(tables)
            served = Served(store, shm_path, pools, staging, Feed(store), slot_tables=where)
            self._stores[fingerprint] = served
            self._opened += 1
            log.info("serving namespace %r, layout %s, pool %s%s", namespace, fingerprint, shm_path,
                     f", metrics at {store.metrics_url}" if store.metrics_url else "")
            return served

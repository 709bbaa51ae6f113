"""A client's subscription to the daemon's events: a connection of its own, read on a thread.

:class:`Subscription` says hello as the store's :class:`~tierkv.daemon.link.Link` does, subscribes
(:mod:`tierkv.daemon.feed`) and hands every frame to ``on_frame`` on its thread. When the daemon goes
away it connects again every :data:`RECONNECT_S` until it is back or the subscription is closed;
``on_attach`` is told each time it attaches, with the daemon's instance (a new one after a
restart: a new, empty pool) and its answer to the subscription.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

from tierkv.daemon.protocol import dial, recv_message, send_message
from tierkv.errors import InvalidArgument, TierUnavailable

__all__ = ["RECONNECT_S", "Subscription"]

log = logging.getLogger("tierkv.daemon")

#: how often a subscription whose daemon is gone tries to connect again
RECONNECT_S = 0.25


class Subscription:
    """Receives the events ``what`` names from the daemon at ``path`` (see the module docstring)."""

    def __init__(self, path: str, hello: dict[str, Any], what: str, timeout_s: float,
                 on_attach: Callable[[str, dict[str, Any]], None],
                 on_frame: Callable[[dict[str, Any]], None]) -> None:
        self._path, self._hello, self._what, self._timeout = path, hello, what, timeout_s
        self._on_attach, self._on_frame = on_attach, on_frame
        self._closed = threading.Event()
        self._sock: socket.socket | None = None
        self._sock_lock = threading.Lock()
        self._warned = False
        #: set once it has attached to a daemon (again after every reattachment)
        self.attached = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tierkv-daemon-{what}", daemon=True)
        self._thread.start()

    def _connect(self) -> tuple[socket.socket, str, dict[str, Any]]:
        sock, hello = dial(self._path, self._hello, self._timeout)
        try:
            if "error" not in hello:
                send_message(sock, {"op": "subscribe", "what": self._what})
                answer = recv_message(sock)
            else:
                answer = hello
            if "error" in answer:
                why = answer["error"]
                raise InvalidArgument(f"tierkv daemon at {self._path} refused the subscription: {why}")
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        return sock, str(hello.get("instance", "")), answer

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                sock, instance, answer = self._connect()
            except (OSError, TierUnavailable, InvalidArgument) as exc:
                if isinstance(exc, InvalidArgument) and not self._warned:
                    self._warned = True
                    log.warning("%s", exc)
                self._closed.wait(RECONNECT_S)
                continue
            with self._sock_lock:
                if self._closed.is_set():
                    sock.close()
                    return
                self._sock = sock
            try:
                self._on_attach(instance, answer)
                self.attached.set()
                while True:
                    self._on_frame(recv_message(sock))
            except (OSError, TierUnavailable, InvalidArgument):
                pass  # the daemon went away (or sent nonsense): connect again
            except Exception:
                log.exception("a daemon event listener failed; events are read again from a new connection")
            finally:
                self.attached.clear()
                with self._sock_lock:
                    self._sock = None
                sock.close()
            self._closed.wait(RECONNECT_S)

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop receiving; waits at most ``timeout_s`` for the thread."""
        self._closed.set()
        with self._sock_lock:
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

"""A client's connection to the daemon: hello, calls, the mapped pool, and reattaching.

Every failure to reach the daemon (no socket, refused, closed, a timeout) closes the connection
and raises :class:`TierUnavailable`; the next call (no sooner than :data:`RETRY_S` later) connects
again and says hello again, mapping the pool file the daemon names then.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tierkv.blocks.slottable import ORDERED_MEMORY, SlotTable, map_tables
from tierkv.daemon.protocol import VERSION, dial, recv_message, send_message
from tierkv.errors import InvalidArgument, TierUnavailable
from tierkv.layout import Layout

__all__ = ["RETRY_S", "Attachment", "Link", "mapped_pools"]

log = logging.getLogger("tierkv.daemon")

#: after a failure, no new connection is tried for this long (a dead daemon costs nothing per call)
RETRY_S = 0.05
#: the pools this process has mapped, by pool id: an old daemon's rows are still read after it is
#: gone (a load prepared before its restart), and its file was replaced, never reused, so nobody
#: else writes them. A pool no link of this process is attached to any more is forgotten (its
#: pages freed) RETIRE_S after the link left it.
_MAPPED: dict[str, dict[int, torch.Tensor]] = {}
_ATTACHED: dict[str, int] = {}  # links attached to each pool now
_RETIRED: dict[str, float] = {}  # since when none is
_MAPPED_LOCK = threading.Lock()
RETIRE_S = 60.0


def mapped_pools(pool_id: str) -> dict[int, torch.Tensor] | None:
    """Each group's rows of the pool named ``pool_id`` (:attr:`Link.pool_id`), as mapped by a link
    of this process (None when none did, or its link left it more than :data:`RETIRE_S` ago)."""
    with _MAPPED_LOCK:
        _expire()
        return _MAPPED.get(pool_id)


def _expire() -> None:
    now = time.monotonic()
    for pool_id, since in list(_RETIRED.items()):
        if now - since > RETIRE_S:
            del _RETIRED[pool_id]
            _MAPPED.pop(pool_id, None)


@dataclass(frozen=True)
class Attachment:
    """What one connection mapped: each group's pool rows, the pool's id, the staging file, and
    each group's slot table (empty when the daemon publishes none, or this machine cannot read it)."""

    pools: dict[int, torch.Tensor]
    pool_id: str
    staging: torch.Tensor | None
    tables: dict[int, SlotTable] = field(default_factory=dict)
    #: the connection's generation (see :attr:`Link.generation`)
    generation: int = 0


class Link:
    """One connection at a time to the daemon at ``path``, serving ``namespace`` and ``layout``."""

    def __init__(self, path: str, namespace: str, layout: Layout, timeout_s: float) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.hello = {"op": "hello", "version": VERSION, "namespace": namespace,
                       "layout": layout.model_dump(mode="json")}
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._next_try = 0.0
        #: each group's pool rows in the mapped pool file (empty while not connected)
        self.pools: dict[int, torch.Tensor] = {}
        #: bumped on every new connection: slots named under one generation mean nothing in another
        self.generation = 0
        #: where the daemon serves the store's metrics (None: it does not, or not connected)
        self.metrics_url: str | None = None
        #: the daemon's staging file, mapped (None while not connected, or when it has none)
        self.staging: torch.Tensor | None = None
        #: each group's slot table, mapped (empty while not connected, or when not readable here)
        self.tables: dict[int, SlotTable] = {}
        #: what to do with the answers of messages sent by :meth:`send_owing`, oldest first
        self._owed: list[Callable[[dict[str, Any] | None], None]] = []
        #: names the pool of the current connection: the daemon's instance and its pool file ('' while
        #: not connected); slots mean something only within one pool id
        self.pool_id = ""
        self.closed = False
        #: a hello the daemon refuses raises InvalidArgument (while the store opens), else it is
        #: logged and the daemon treated as unreachable (a serving engine keeps serving)
        self.refusal_raises = True

    @property
    def connected(self) -> bool:
        """Whether a connection is up now."""
        return self._sock is not None

    def call(self, msg: dict[str, Any], *, reply: bool = True, retry: bool = True,
             timeout_s: float | None = None) -> tuple[dict[str, Any], int]:
        """Send ``msg`` and read the answer: ``(answer, generation)``.

        With ``retry``, a connection found broken is replaced and the message sent once more (for
        messages that hold nothing on the old connection). Raises :class:`TierUnavailable` when the
        daemon cannot be reached, :class:`InvalidArgument` when it refuses the message.
        """
        with self._lock:
            fresh = self._sock is None
            sock = self._connect()
            try:
                return self._exchange(sock, msg, reply, timeout_s), self.generation
            except (OSError, TierUnavailable) as exc:
                self._disconnect()
                if fresh or not retry:
                    raise TierUnavailable(f"tierkv daemon at {self.path}: {exc}") from None
            sock = self._connect()  # the daemon restarted since the last call: reattach once
            try:
                return self._exchange(sock, msg, reply, timeout_s), self.generation
            except (OSError, TierUnavailable) as exc:
                self._disconnect()
                raise TierUnavailable(f"tierkv daemon at {self.path}: {exc}") from None

    def attached(self, generation: int) -> Attachment | None:
        """What connection ``generation`` mapped (its pools, pool id and staging file), read
        together; None when that connection is no longer the current one. Slots a call answered
        on one connection must only ever be used with that connection's rows."""
        with self._lock:
            if self.generation != generation or self._sock is None:
                return None
            return Attachment(self.pools, self.pool_id, self.staging, self.tables, generation)

    def current(self) -> Attachment | None:
        """What the connection now up mapped, without a message (answers owed that have arrived
        are handed over first); None when none is up or the daemon hung up on it (found without
        waiting: the next call reconnects)."""
        with self._lock:
            sock = self._sock
            if sock is None:
                return None
            try:
                self._settle(sock, wait=False)
            except (OSError, TierUnavailable):
                self._disconnect()
                return None
            if not self._owed and _hung_up(sock):
                return None
            return Attachment(self.pools, self.pool_id, self.staging, self.tables, self.generation)

    def send_owing(self, msg: dict[str, Any], on_answer: Callable[[dict[str, Any] | None], None]) -> int:
        """Send ``msg`` on the connection now up and go on: its answer is read later, before the
        next message's on this connection (or by :meth:`current` once it is there), and handed to
        ``on_answer`` (None when the connection went before it came; called under the link's
        lock: it must not call the link). Returns the connection's generation;
        :class:`TierUnavailable` when none is up or the send fails."""
        with self._lock:
            sock = self._sock
            if sock is None:
                raise TierUnavailable(f"tierkv daemon at {self.path} is not connected")
            try:
                sock.settimeout(self.timeout_s)
                send_message(sock, msg)
            except OSError as exc:
                self._disconnect()
                raise TierUnavailable(f"tierkv daemon at {self.path}: {exc}") from None
            self._owed.append(on_answer)
            return self.generation

    def settle(self) -> None:
        """Read every answer owed on the connection now up (waiting for them) and hand each over."""
        with self._lock:
            if self._sock is not None:
                try:
                    self._settle(self._sock, wait=True)
                except (OSError, TierUnavailable):
                    self._disconnect()

    def _settle(self, sock: socket.socket, wait: bool) -> None:
        """Read the answers owed on ``sock`` (all of them, or with ``wait`` False those that have
        arrived) and hand each over. A frame that is not an answer means the connection is broken."""
        while self._owed and (wait or _hung_up(sock)):
            sock.settimeout(self.timeout_s)
            try:
                answer = recv_message(sock)
            except InvalidArgument as exc:
                raise TierUnavailable(str(exc)) from None
            self._owed.pop(0)(answer)

    def rows_of(self, pool_id: str) -> dict[int, torch.Tensor] | None:
        """The rows of the pool ``pool_id`` names: mapped by this process already, or the daemon's
        pool now (asked, reattaching if the daemon restarted); None when neither."""
        got = mapped_pools(pool_id)
        if got is not None:
            return got
        with contextlib.suppress(TierUnavailable, InvalidArgument):
            self.call({"op": "ping"})
        with self._lock:
            return self.pools if self.pool_id == pool_id else None

    def _exchange(self, sock: socket.socket, msg: dict[str, Any], reply: bool,
                  timeout_s: float | None) -> dict[str, Any]:
        self._settle(sock, wait=True)
        sock.settimeout(self.timeout_s if timeout_s is None else timeout_s)
        send_message(sock, msg)
        if not reply:
            return {}
        answer = recv_message(sock)
        if "error" in answer:
            if answer.get("fatal"):
                self._disconnect()
            raise InvalidArgument(f"tierkv daemon: {answer['error']}")
        return answer

    def _connect(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        if self.closed:
            raise TierUnavailable("the store is closed")
        now = time.monotonic()
        if now < self._next_try:
            raise TierUnavailable(f"tierkv daemon at {self.path} is not reachable (retrying)")
        self._next_try = now + RETRY_S
        try:
            sock, answer = dial(self.path, self.hello, self.timeout_s)
        except (OSError, TierUnavailable) as exc:
            raise TierUnavailable(f"tierkv daemon at {self.path} is not reachable: {exc}") from None
        if "error" in answer:
            sock.close()
            why = f"tierkv daemon at {self.path} refused this store: {answer['error']}"
            if self.refusal_raises:
                raise InvalidArgument(why)
            log.warning("%s", why)
            raise TierUnavailable(why)
        pool_id = f"{answer.get('instance', '')}:{answer.get('shm', '')}"
        try:
            self.pools = mapped_pools(pool_id) or _map_pools(str(answer["shm"]), answer["pools"])
        except (OSError, KeyError, TypeError, ValueError) as exc:
            sock.close()
            raise TierUnavailable(f"cannot map the daemon's pool: {exc}") from None
        self.pool_id = pool_id
        metrics = answer.get("metrics")
        self.metrics_url = metrics if isinstance(metrics, str) else None
        staging = answer.get("staging")
        try:
            self.staging = _map_file(str(staging[0]), int(staging[1])) if staging else None
        except (OSError, TypeError, ValueError, IndexError) as exc:
            log.warning("cannot map the daemon's staging file: %s", exc)
            self.staging = None
        self.tables = {}
        slots = answer.get("slots")
        if ORDERED_MEMORY and slots:
            try:
                self.tables = map_tables(str(slots[0]), slots[1])
            except (OSError, TypeError, ValueError, IndexError) as exc:
                log.warning("cannot map the daemon's slot tables: %s", exc)
        with _MAPPED_LOCK:
            _MAPPED[pool_id] = self.pools
            _ATTACHED[pool_id] = _ATTACHED.get(pool_id, 0) + 1
            _RETIRED.pop(pool_id, None)
        self._sock = sock
        self.generation += 1
        return sock

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self.pool_id:
            with _MAPPED_LOCK:
                left = _ATTACHED.pop(self.pool_id, 1) - 1
                if left > 0:
                    _ATTACHED[self.pool_id] = left
                else:
                    _RETIRED[self.pool_id] = time.monotonic()
        self.pools = {}
        self.pool_id = ""
        self.staging = None
        self.tables = {}
        owed, self._owed = self._owed, []
        for on_answer in owed:
            on_answer(None)

    def close(self) -> None:
        """Hang up; no call connects again."""
        with self._lock:
            self.closed = True
            self._disconnect()


def _hung_up(sock: socket.socket) -> bool:
    """Whether a connection with no answer due has something to read: the daemon closed it (or
    sent what nobody asked for); either way it is not to be used."""
    try:
        return bool(select.select([sock], [], [], 0)[0])
    except (OSError, ValueError):
        return True


def _map_file(path: str, size: int) -> torch.Tensor:
    """The file at ``path`` (``size`` bytes) mapped shared, as a flat uint8 tensor (pages are
    allocated as they are written)."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size < size:
            raise ValueError(f"{path} is smaller than {size} bytes")
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    return torch.frombuffer(mapped, dtype=torch.uint8)


def _map_pools(path: str, pools: list[list[int]]) -> dict[int, torch.Tensor]:
    """Each group's ``[slots, block_bytes]`` rows in the pool file at ``path``, mapped shared."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        # populated now, as the daemon's own mapping is: a first copy into unmapped pages faults
        # every 4 KiB
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
    flat = torch.frombuffer(mapped, dtype=torch.uint8)  # the tensor keeps the mapping alive
    out = {}
    for group, offset, slots, block_bytes in pools:
        if offset < 0 or offset + slots * block_bytes > size:
            raise ValueError(f"group {group}'s pool lies outside the {size}-byte file")
        out[int(group)] = flat[offset:offset + slots * block_bytes].view(slots, block_bytes)
    return out

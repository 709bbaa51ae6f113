"""A daemon store's puts: into slots leased ahead (:mod:`tierkv.daemon.leases`), else into slots
reserved for the call, else through the daemon's staging file; each dropped one counted."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import torch

from tierkv.daemon import leases as _leases
from tierkv.daemon.direct import DirectReads
from tierkv.daemon.leases import Leases
from tierkv.daemon.link import Link
from tierkv.daemon.slots import DaemonSlots
from tierkv.errors import TierUnavailable
from tierkv.keys import GROUP_BYTES
from tierkv.tensors import scatter_rows
from tierkv.units import RecordUnits

__all__ = ["DaemonPuts"]


class DaemonPuts:
    """The puts of one :class:`~tierkv.daemon.client.DaemonStore` (its link, records, slot API,
    known slots and local counters)."""

    def __init__(self, link: Link, units: RecordUnits, slots: DaemonSlots, direct: DirectReads,
                 local: dict[str, int]) -> None:
        self._link = link
        self._units = units
        self._slots = slots
        self._direct = direct
        self._local = local
        self._leases = Leases()
        self._last_put = time.monotonic()
        self._watch_lock = threading.Lock()
        self._watcher: threading.Thread | None = None
        self._stop = threading.Event()

    def put(self, group: int, hashes: list[bytes], keys: list[bytes], src: torch.Tensor) -> None:
        """Store ``src`` (a row per record of ``keys``; ``hashes`` are the blocks, checked) in the
        daemon's pool: into leased slots, else reserved ones, else through the staging file."""
        self._last_put = time.monotonic()
        if self._put_leased(group, keys, src):
            self._watch_idle()
            return
        # the pool and the slot API name records; a staged write names the blocks (the store's put)
        msg = {"g": group, "h": [k[:-GROUP_BYTES].hex() for k in keys]}
        try:
            answer, gen = self._link.call({"op": "reserve", **msg, "stage": True})
        except TierUnavailable:
            self._local["put_blocks_dropped"] += len(keys)
            return
        slots = answer.get("slots")
        if slots is None:
            if "stage" in answer:
                blocks_of = hashes[:len(keys) * self._units.per]
                whole = {"g": group, "h": [h.hex() for h in blocks_of]}
                block_bytes = self._units.layout.group(group).block_bytes
                rows_of = self._units.block_rows(src, group)
                self._write_staged(whole, int(answer["stage"]), rows_of, block_bytes, gen)
            return  # otherwise no room anywhere: the daemon counted them
        rows = [i for i, s in enumerate(slots) if s is not None]
        if not rows:
            return
        ok = False
        try:
            at = self._link.attached(gen)
            pool = at.pools.get(group) if at is not None else None
            if pool is not None:
                data = src if len(rows) == len(keys) else src.index_select(0, torch.tensor(rows))
                scatter_rows(pool, [slots[i] for i in rows], data)
                ok = True
                assert at is not None
                self._direct.learn(at.pool_id, keys, slots)
        finally:
            ok = self._send_quietly({"op": "commit", **msg, "ok": ok, "nr": True}, gen) and ok
            if not ok:
                self._local["put_blocks_dropped"] += len(rows)
        if ok:
            self._slots.committed(group, [keys[i] for i in rows])
            self._lease(group, len(keys))
            self._watch_idle()

    def _put_leased(self, group: int, keys: list[bytes], src: torch.Tensor) -> bool:
        """A put into slots leased to this store (:mod:`tierkv.daemon.leases`): copied at once,
        then named; False, nothing done, when fewer slots are leased."""
        at = self._link.current()
        pool = at.pools.get(group) if at is not None else None
        if at is None or pool is None:
            return False
        slots = self._leases.take(group, len(keys), at.generation)
        if slots is None:
            return False
        ok = sent = False
        try:
            scatter_rows(pool, slots, src)
            ok = True
        finally:
            more = self._leases.want(group, len(keys), at.generation) if ok else 0
            msg = {"op": "adopt", "g": group, "h": [k[:-GROUP_BYTES].hex() for k in keys], "s": slots,
                   "ok": ok, "lease": more}
            with contextlib.suppress(TierUnavailable):
                self._link.send_owing(msg, self._leases.on_answer(group, at.generation, more))
                sent = True
        if not (ok and sent):
            self._local["put_blocks_dropped"] += len(keys)
            return True
        self._direct.learn(at.pool_id, keys, slots)
        self._slots.committed(group, keys)
        return True

    def _lease(self, group: int, n: int) -> None:
        """Ask for slots enough for the next puts of ``n`` records to copy at once (the answer is
        read later, not waited for)."""
        at = self._link.current()
        if at is None:
            return
        more = self._leases.want(group, n, at.generation)
        if more:
            with contextlib.suppress(TierUnavailable):
                self._link.send_owing({"op": "lease", "g": group, "n": more},
                                      self._leases.on_answer(group, at.generation, more))

    def _watch_idle(self) -> None:
        """Have a thread give the leased slots back once no put came for ``leases.IDLE_S`` s."""
        with self._watch_lock:
            if self._watcher is None and not self._stop.is_set() and self._leases.busy():
                self._watcher = threading.Thread(target=self._watch, name="tierkv-lease-idle", daemon=True)
                self._watcher.start()

    def _watch(self) -> None:
        idle = _leases.IDLE_S
        while not self._stop.wait(idle / 4):
            if time.monotonic() - self._last_put < idle:
                continue
            self._link.current()  # answers that have come lend their slots first (no waiting)
            self._free(self._leases.take_all())
            with self._watch_lock:
                if not self._leases.busy():  # a put on another thread may have asked meanwhile
                    self._watcher = None
                    return

    def give_back(self) -> None:
        """Return the slots leased to this store (the daemon would free them when the connection
        dropped, but only ``drop_grace_s`` later); no more are asked for after."""
        self._stop.set()
        watcher = self._watcher
        if watcher is not None:
            watcher.join()
        self._link.settle()  # slots lent by answers not read yet are given back too
        self._free(self._leases.take_all(forget=True))
        self._watcher = None
        self._stop.clear()  # a store opened again leases again

    def _free(self, held: dict[int, tuple[int, list[int]]]) -> None:
        """Tell the daemon to free ``held`` slots (those of a connection no longer up went with it)."""
        now = self._link.generation
        for group, (generation, slots) in held.items():
            if generation == now and self._link.connected:
                with contextlib.suppress(TierUnavailable):
                    self._link.call({"op": "adopt", "g": group, "h": [], "s": [], "ok": False,
                                     "free": slots, "nr": True}, reply=False, retry=False)

    def _write_staged(self, msg: dict[str, Any], off: int, src: torch.Tensor, block_bytes: int,
                      gen: int) -> None:
        """A put that found no room in the pool: copy it into the staging range the daemon gave,
        for the daemon to store from there (to the lower tiers, as an in-process put would)."""
        at = self._link.attached(gen)
        staging = at.staging if at is not None else None
        n = len(msg["h"])
        if staging is None:
            self._local["put_blocks_dropped"] += n
            return
        staging[off:off + n * block_bytes].view(n, block_bytes).copy_(src)
        if not self._send_quietly({"op": "write", **msg, "off": off, "nr": True}, gen):
            self._local["put_blocks_dropped"] += n

    def _send_quietly(self, msg: dict[str, Any], gen: int) -> bool:
        """Send a message whose answer is not read; whether it went on connection ``gen`` (no
        answer to wait for: this connection's next message is served after it)."""
        try:
            _, now = self._link.call(msg, reply=False, retry=False)
        except TierUnavailable:
            return False
        return now == gen  # a new connection: what was given went with the old one

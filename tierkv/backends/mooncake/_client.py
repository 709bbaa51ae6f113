"""The blocking side of the ``mooncake`` tier: one Mooncake Store client, its status codes, the
memory it may copy into and out of, and one record batch per call (run on worker threads).

Records are tierkv's ``none`` records (:mod:`tierkv.records.format`): header, the block, trailer. A batch
moves them with the registered-buffer calls, scattered: the header and trailer of each record in a
small frame buffer, the block straight in (or out of) its row, so a block is copied once, by
Mooncake, into the engine's memory. Each record read is checked (header compared, xxh3 checksum);
one whose size or bytes do not match is fetched whole and decoded, which says why it is damaged.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from mooncake.store import MooncakeDistributedStore, ReplicateConfig

from tierkv.backends.mooncake._config import MooncakeTierConfig, split_endpoint
from tierkv.errors import BackendError, CorruptRecord, TierUnavailable
from tierkv.records import TRAILER_LEN, decode_record, encode_record_parts, none_parts_match

__all__ = ["ABSENT", "DOWN_CODES", "INCOMPLETE", "NOT_MOUNTED", "MooncakeClient", "Verdicts", "Writes",
           "probe_master"]

#: Mooncake's status codes that matter here (mooncake-store/include/types.h)
NO_AVAILABLE_HANDLE = -200
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
REPLICA_IS_NOT_READY = -703
#: codes that say the master (or the cluster) does not answer now: RPC failures and timeouts,
#: "unavailable in the current status" (a master starting or failing over)
DOWN_CODES = frozenset({-900, -901, -902, -1010, -1011})
#: codes that say the object is not (or no longer, or not yet) there
ABSENT = frozenset({OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY, -710, -712})
RPC_FAIL = -900
ELEM_SIZE = 2
#: tierkv's own codes in :attr:`Writes.codes`. NOT_MOUNTED: Mooncake's "no room" (-200) while the
#: master has not taken a write since it went away: a restarted master holds no segment until the
#: nodes mount theirs again, so the pool is not full, it is not there yet
NOT_MOUNTED = -1_000_200
#: written, yet the master does not hold the object complete afterwards, even written over: a put
#: of another process that died (or is still running) holds the name unfinished
INCOMPLETE = -1_000_703
#: the names of the objects a health check writes (and removes) to see that the pool takes writes
PROBE_PREFIX = "tierkv-health-probe"


def probe_master(endpoint: str, timeout_s: float) -> None:
    """Raise :class:`TierUnavailable` (endpoint and cause) unless the master accepts a connection:
    Mooncake's own setup retries for a minute and a half before it gives up."""
    host, port = split_endpoint(endpoint)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        raise TierUnavailable(f"mooncake master {endpoint} does not answer: {exc}") from exc


@dataclass
class Verdicts:
    """What one batch read found: per key ``True`` (verified, in its row), ``None`` (absent) or a
    corruption reason; and how many keys failed because the cluster did not answer."""

    found: list[bool | str | None]
    down: int = 0
    transfer_errors: int = 0
    removed: int = 0


@dataclass
class Writes:
    """What one batch write did: per key 0 (the master holds the object complete, asked after the
    write) or a status code (Mooncake's, :data:`NOT_MOUNTED` or :data:`INCOMPLETE`); and how many
    objects another writer had left unfinished were written over."""

    codes: list[int]
    replaced: int = 0


_tls = threading.local()


def _all_down(codes: list[int]) -> bool:
    """Every call of a batch failed at once (RPC_FAIL: a broken connection, not a timeout)."""
    return bool(codes) and all(c == RPC_FAIL for c in codes)


def _frames(nbytes: int) -> np.ndarray:
    """This thread's frame buffer (headers and trailers of one batch), at least ``nbytes``."""
    buf: np.ndarray | None = getattr(_tls, "frames", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _tls.frames = np.empty(max(nbytes, 1 << 16), dtype=np.uint8)
    return buf


class MooncakeClient:
    """One ``MooncakeDistributedStore`` set up against a master; every method blocks."""

    def __init__(self, cfg: MooncakeTierConfig) -> None:
        self.cfg = cfg
        self.store = MooncakeDistributedStore()
        self._lock = threading.Lock()
        self._registered: dict[int, list[int]] = {}  # ptr -> [size, users]
        self.closed = False
        #: the master did not answer a call since a write last went through: a master that
        #: restarted holds no segment until the nodes mount theirs again (their next heartbeat),
        #: so "no room" (-200) then says the pool is not there yet, not that it is full
        self.master_lost = False

    def setup(self) -> None:
        """Connect to the master and mount this process's segment; raises with the master's
        endpoint and the cause. Mooncake's calls to the master then time out after
        ``request_timeout_s`` (its ``MC_RPC_TIMEOUT_MS``, read when a client is set up, one value
        per process: the environment's, else the first tier's), not after 30 s."""
        cfg = self.cfg
        os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(max(1, round(cfg.request_timeout_s * 1000))))
        rc = self.store.setup(cfg.hostname, cfg.metadata_server, cfg.segment_bytes, cfg.buffer_bytes,
                              cfg.protocol, cfg.rdma_devices, cfg.master)
        if rc != 0:
            raise TierUnavailable(f"mooncake setup against master {cfg.master} failed (status {rc}); "
                                  "see the log lines of Mooncake's client above")

    # ---- registered memory ------------------------------------------------------------------------
    def _register(self, spans: Sequence[tuple[int, int]]) -> list[int]:
        """Register each (ptr, size) span for the calls of one batch (counted per user)."""
        held = []
        with self._lock:
            for ptr, size in spans:
                entry = self._registered.get(ptr)
                if entry is not None and entry[0] >= size:
                    entry[1] += 1
                    held.append(ptr)
                elif entry is None and self.store.register_buffer(ptr, size) == 0:
                    self._registered[ptr] = [size, 1]
                    held.append(ptr)
        return held

    def _release(self, held: list[int]) -> None:
        with self._lock:
            for ptr in held:
                entry = self._registered[ptr]
                entry[1] -= 1
                if entry[1] == 0:
                    del self._registered[ptr]
                    self.store.unregister_buffer(ptr)

    # ---- batches ----------------------------------------------------------------------------------
    def _batch(self, call: Callable[[], Sequence[int]]) -> list[int]:
        """One batch call, tried once more when every key failed with RPC_FAIL (a connection to a
        master that restarted fails once, then reconnects). A key that failed because the master
        did not answer marks it lost (:attr:`master_lost`)."""
        codes = list(call())
        if _all_down(codes):
            self.master_lost = True
            codes = list(call())
        if any(c in DOWN_CODES for c in codes):
            self.master_lost = True
        return codes

    def exist(self, names: list[str]) -> list[int]:
        """Per name: 1 held (complete), 0 not (or not complete), negative: a status code."""
        return self._batch(lambda: self.store.batch_is_exist(names))

    def remove(self, names: list[str]) -> list[int]:
        """Remove objects, leases or not (a damaged record, a delete); per name a status code."""
        return self._batch(lambda: self.store.batch_remove(names, True))

    def check(self) -> str | None:
        """Why the tier cannot be used now, or None: the master does not answer a presence query;
        or, once it was lost, it does not take a write (a probe object, removed again): a master
        that restarted does once a segment is mounted on it again. (Returned, not raised: a check
        that ends after its caller gave up on it leaves no error behind.)"""
        (code,) = self.exist([PROBE_PREFIX])
        if code < 0:
            return f"mooncake master {self.cfg.master} does not answer (status {code})"
        if not self.master_lost:
            return None
        name = f"{PROBE_PREFIX}/{uuid.uuid4().hex}"
        code = self.store.put(name, b"tierkv health probe")
        if code == 0:
            (code,) = self._confirm([name], [0])
            self.store.remove(name, True)
        if code != 0:
            why = "no segment is mounted on it yet" if code in (1, NO_AVAILABLE_HANDLE) else f"status {code}"
            return f"mooncake master {self.cfg.master} answers again but takes no write: {why}"
        self.master_lost = False
        return None

    def _confirm(self, names: list[str], codes: list[int]) -> list[int]:
        """``codes`` with each 0 checked: Mooncake answers 0 to a write of a name that exists
        already, complete or not, so the master is asked which it holds complete. 0 stays 0 for
        those, becomes 1 for those it does not (or a status code)."""
        asked = [i for i, c in enumerate(codes) if c == 0]
        if not asked:
            return codes
        found = self.exist([names[i] for i in asked])
        out = list(codes)
        for i, f in zip(asked, found, strict=True):
            out[i] = 0 if f == 1 else 1 if f == 0 else f
        return out

    def put(self, names: list[str], keys: Sequence[bytes], rows: np.ndarray, fingerprint: str) -> Writes:
        """Write one ``none`` record per row (header and trailer from a frame buffer, the block
        from its row), then ask the master which it holds complete. A name another writer holds
        unfinished (a put of a process that died, or one still running) is written over once
        (Mooncake's upsert, which takes over an unfinished put); not complete even then:
        :data:`INCOMPLETE`. "No room" while the master is lost: :data:`NOT_MOUNTED`."""
        n, block = rows.shape
        heads = []
        trailers = []
        for i in range(n):
            head, _payload, trailer = encode_record_parts(key=keys[i], fingerprint=fingerprint,
                                                          payload=rows[i], elem_size=ELEM_SIZE)
            heads.append(head)
            trailers.append(trailer)
        frame_bytes = sum(len(h) for h in heads) + n * TRAILER_LEN
        frames = _frames(frame_bytes)
        base = frames.ctypes.data
        row_ptr, stride = rows.ctypes.data, rows.strides[0]
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        offs = []
        off = 0
        for i in range(n):
            h = heads[i]
            frames[off:off + len(h)] = np.frombuffer(h, dtype=np.uint8)
            frames[off + len(h):off + len(h) + TRAILER_LEN] = np.frombuffer(trailers[i], dtype=np.uint8)
            ptrs.append([base + off, row_ptr + i * stride, base + off + len(h)])
            sizes.append([len(h), block, TRAILER_LEN])
            offs.append(off)
            off += len(h) + TRAILER_LEN
        config = ReplicateConfig()
        config.replica_num = self.cfg.replicas
        held = self._register([(base, frame_bytes), (row_ptr, n * stride)])
        try:
            codes = self._batch(lambda: self.store.batch_put_from_multi_buffers(names, ptrs, sizes, config))
        finally:
            self._release(held)
        codes = self._confirm(names, [0 if c == OBJECT_ALREADY_EXISTS else c for c in codes])
        out = Writes(codes)
        redo = [i for i, c in enumerate(codes) if c == 1]
        if redo:
            again = []
            for i in redo:
                o, hl = offs[i], len(heads[i])
                again.append(self.store.upsert_parts(names[i], frames[o:o + hl].data, rows[i].data,
                                                     frames[o + hl:o + hl + TRAILER_LEN].data, config=config))
            for i, c in zip(redo, self._confirm([names[i] for i in redo], again), strict=True):
                codes[i] = INCOMPLETE if c == 1 else c
            out.replaced = sum(1 for i in redo if codes[i] == 0)
        if 0 in codes:
            self.master_lost = False  # a segment is mounted: "no room" says the pool is full again
        elif NO_AVAILABLE_HANDLE in codes and (self.master_lost or self.store.health_check() != 0):
            self.master_lost = True
            out.codes = [NOT_MOUNTED if c == NO_AVAILABLE_HANDLE else c for c in codes]
        return out

    def get(self, names: list[str], keys: Sequence[bytes], rows: np.ndarray, heads: Sequence[bytes],
            fingerprint: str) -> Verdicts:
        """Read and verify one record per row, straight into the row. ``heads[i]`` is the header
        key ``i``'s record must have (:func:`~tierkv.records.none_header`)."""
        n, block = rows.shape
        frame_bytes = sum(len(h) for h in heads) + n * TRAILER_LEN
        frames = _frames(frame_bytes)
        base = frames.ctypes.data
        row_ptr, stride = rows.ctypes.data, rows.strides[0]
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        offs = []
        off = 0
        for i in range(n):
            hl = len(heads[i])
            ptrs.append([base + off, row_ptr + i * stride, base + off + hl])
            sizes.append([hl, block, TRAILER_LEN])
            offs.append(off)
            off += hl + TRAILER_LEN
        held = self._register([(base, frame_bytes), (row_ptr, n * stride)])
        try:
            codes = self._batch(lambda: self.store.batch_get_into_multi_buffers(names, ptrs, sizes, False))
        finally:
            self._release(held)
        out = Verdicts(found=[None] * n)
        damaged = []
        for i, code in enumerate(codes):
            hl = len(heads[i])
            if code == hl + block + TRAILER_LEN:
                o = offs[i]
                head = frames[o:o + hl].tobytes()
                tail = frames[o + hl:o + hl + TRAILER_LEN].tobytes()
                if none_parts_match(heads[i], head, rows[i], tail, code):
                    out.found[i] = True
                    continue
            elif code in ABSENT:
                continue
            elif code in DOWN_CODES:
                out.down += 1
                continue
            out.found[i] = self._read_whole(names[i], keys[i], rows[i], fingerprint, code,
                                            hl + block + TRAILER_LEN, out)
            if isinstance(out.found[i], str):
                damaged.append(names[i])
        if damaged:
            out.removed = sum(1 for c in self.remove(damaged) if c == 0)
        return out

    def _read_whole(self, name: str, key: bytes, row: np.ndarray, fingerprint: str, code: int,
                    expected: int, out: Verdicts) -> bool | str | None:
        """An object whose scattered read failed or did not verify: fetch it whole and decode it;
        True (it was good after all), a corruption reason, or None (gone, or unreachable)."""
        size = self.store.get_size(name)
        if size <= 0 or (code < 0 and size == expected):
            if code not in ABSENT and size not in ABSENT:
                out.transfer_errors += 1  # the right size, not transferred: its node has gone
            return None
        if size > row.nbytes + (1 << 16):
            return "size"
        data = self.store.get(name)
        if not data:
            out.transfer_errors += 1
            return None
        try:
            decode_record(data, key=key, fingerprint=fingerprint, max_raw_bytes=row.nbytes, out=row)
        except CorruptRecord as exc:
            return None if exc.reason == "newer" else exc.reason  # a newer release's record: left alone
        return True

    def close(self) -> None:
        """Unmount this process's segment and disconnect."""
        if self.closed:
            return
        self.closed = True
        with self._lock:
            for ptr in list(self._registered):
                self.store.unregister_buffer(ptr)
            self._registered.clear()
        rc = self.store.close()
        if rc != 0:
            raise BackendError(f"closing the mooncake client of master {self.cfg.master}: status {rc}")

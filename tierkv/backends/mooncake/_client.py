"""The blocking side of the ``mooncake`` tier: one Mooncake Store client, its status codes, the
memory it may copy into and out of, and one record batch per call (run on worker threads).

Records are tierkv's ``none`` records (:mod:`tierkv.record`): header, the block, trailer. A batch
moves them with the registered-buffer calls, scattered: the header and trailer of each record in a
small frame buffer, the block straight in (or out of) its row, so a block is copied once, by
Mooncake, into the engine's memory. Each record read is checked (header compared, xxh3 checksum);
one whose size or bytes do not match is fetched whole and decoded, which says why it is damaged.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from mooncake.store import MooncakeDistributedStore, ReplicateConfig

from tierkv.backends.mooncake._config import MooncakeTierConfig, split_endpoint
from tierkv.errors import BackendError, CorruptRecord, TierUnavailable
from tierkv.record import TRAILER_LEN, decode_record, encode_record_parts, none_parts_match

__all__ = ["ABSENT", "DOWN_CODES", "MooncakeClient", "Verdicts", "probe_master"]

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
    def exist(self, names: list[str]) -> list[int]:
        """Per name: 1 held, 0 not, negative: a Mooncake status code."""
        codes = list(self.store.batch_is_exist(names))
        if _all_down(codes):  # a connection to a master that restarted fails once, then reconnects
            codes = list(self.store.batch_is_exist(names))
        return codes

    def remove(self, names: list[str]) -> list[int]:
        """Remove objects, leases or not (a damaged record, a delete); per name a status code."""
        return list(self.store.batch_remove(names, True))

    def check(self) -> None:
        """Raise unless the master answers a presence query."""
        (code,) = self.exist(["tierkv-health-check"])
        if code < 0:
            raise TierUnavailable(f"mooncake master {self.cfg.master} does not answer (status {code})")

    def put(self, names: list[str], keys: Sequence[bytes], rows: np.ndarray, fingerprint: str) -> list[int]:
        """Write one ``none`` record per row: header and trailer from a frame buffer, the block
        from its row. Per key a status code (0: stored)."""
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
        off = 0
        for i in range(n):
            h = heads[i]
            frames[off:off + len(h)] = np.frombuffer(h, dtype=np.uint8)
            frames[off + len(h):off + len(h) + TRAILER_LEN] = np.frombuffer(trailers[i], dtype=np.uint8)
            ptrs.append([base + off, row_ptr + i * stride, base + off + len(h)])
            sizes.append([len(h), block, TRAILER_LEN])
            off += len(h) + TRAILER_LEN
        held = self._register([(base, frame_bytes), (row_ptr, n * stride)])
        try:
            config = ReplicateConfig()
            config.replica_num = self.cfg.replicas
            codes = list(self.store.batch_put_from_multi_buffers(names, ptrs, sizes, config))
            if _all_down(codes):
                codes = list(self.store.batch_put_from_multi_buffers(names, ptrs, sizes, config))
            return codes
        finally:
            self._release(held)

    def get(self, names: list[str], keys: Sequence[bytes], rows: np.ndarray, heads: Sequence[bytes],
            fingerprint: str) -> Verdicts:
        """Read and verify one record per row, straight into the row. ``heads[i]`` is the header
        key ``i``'s record must have (:func:`~tierkv.record.none_header`)."""
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
            codes = list(self.store.batch_get_into_multi_buffers(names, ptrs, sizes, False))
            if _all_down(codes):
                codes = list(self.store.batch_get_into_multi_buffers(names, ptrs, sizes, False))
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
            return exc.reason
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

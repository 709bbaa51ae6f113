"""Reading one record into its row and verifying it: what a tier's ``get`` does per key.

``none`` records are read in place: one scatter read fills the header, the row itself and the
trailer, and :func:`~tierkv.records.none_parts_match` checks them against the header the key's
record must have. Anything else (another codec, a damaged or foreign record) is read whole and
decoded by :func:`~tierkv.records.decode_record`, whose verdict counts. A tier with a
:class:`~tierkv.records.encryption.KeyRing` reads a sealed ``none`` record's ciphertext into a per-thread
buffer and decrypts it into the row (:func:`~tierkv.records.format.sealed_none_open`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from tierkv.errors import CorruptRecord
from tierkv.records.decode import decode_record, none_parts_match, sealed_none_open
from tierkv.records.encryption import KeyRing
from tierkv.records.format import FIXED_HEADER_LEN, TAG_LEN, TRAILER_LEN, none_header
from tierkv.records.outcomes import ABSENT, Damaged, Found, RecordRead, Refused
from tierkv.records.verdicts import NOT_OURS

__all__ = ["RECORD_OVERHEAD", "Heads", "RecordSource", "SpecialFile", "none_heads", "read_into",
           "read_record"]

#: a record is at most this much larger than its block (header, key, plane table, trailer)
RECORD_OVERHEAD = 64 << 10
#: per key length: a ``none`` record's header before and after the key
Heads = dict[int, tuple[bytes, bytes]]

_tls = threading.local()

class SpecialFile(OSError):
    """A record's path holds something that is not a regular file (FIFO, device, symlink, ...)."""


class RecordSource(Protocol):
    """One record's bytes, wherever they are: a file to read, or bytes already fetched."""

    def readinto(self, bufs: list[Any]) -> int | None:
        """Fill ``bufs`` in order from the start of the record; bytes read, None when absent."""

    def read_all(self, buf: memoryview) -> memoryview | None:
        """The record's bytes (at most ``len(buf)``; ``buf`` may receive them); None when absent."""



def _read_buffer(size: int, name: str = "buf") -> memoryview:
    """``size`` bytes of this thread's reusable read buffer ``name`` (no allocation per record)."""
    buf: bytearray | None = getattr(_tls, name, None)
    if buf is None or len(buf) < size:
        buf = bytearray(size)
        setattr(_tls, name, buf)
    return memoryview(buf)[:size]


def none_heads(keys: Sequence[bytes], fingerprint: str, block_bytes: int, elem_size: int,
               key_id: bytes | None = None) -> Heads:
    """Per key length, the header every ``none`` record of these blocks has, around the key
    (sealed by ``key_id``'s key when given, nonce zero)."""
    heads: Heads = {}
    for k in keys:
        if len(k) not in heads:
            h = none_header(key=k, fingerprint=fingerprint, raw_len=block_bytes, elem_size=elem_size,
                            key_id=key_id)
            heads[len(k)] = (h[:FIXED_HEADER_LEN], h[FIXED_HEADER_LEN + len(k):])
    return heads


def read_record(keys: Sequence[bytes], rows: Sequence[np.ndarray], heads: Heads, fingerprint: str,
                ring: KeyRing | None, landed: Callable[[int], None] | None, i: int,
                src: RecordSource) -> RecordRead:
    """Read record ``i`` (``keys[i]``) from ``src`` into ``rows[i]`` and verify it (in a worker
    thread for local files), then tell ``landed(i)`` when it was: the job a tier hands its driver
    per record, its first six arguments bound (:func:`functools.partial`).

    ``heads`` (:func:`none_heads`, empty when the tier's codec is not ``none``; with the ring's
    current key id when ``ring`` is given) enables the in-place read; the spare byte after the
    trailer catches longer files. Returns :class:`Found`, :data:`ABSENT`, :class:`Damaged` or
    :class:`Refused` (a sound record this reader may not serve)."""
    key, row = keys[i], rows[i]
    try:
        if heads:
            fixed, pad = heads[len(key)]
            expected = fixed + key + pad
            head, tail = bytearray(len(expected)), bytearray(TRAILER_LEN + 1)
            if ring is None:
                got = src.readinto([head, row, tail])
                if got is None:
                    return ABSENT
                if none_parts_match(expected, head, row, tail, got):
                    if landed is not None:
                        landed(i)
                    return Found(got)
            else:
                sealed = _read_buffer(row.size + TAG_LEN, "sealed")
                got = src.readinto([head, sealed, tail])
                if got is None:
                    return ABSENT
                if sealed_none_open(expected, head, sealed, tail, got, ring, row):
                    if landed is not None:
                        landed(i)
                    return Found(got)
        data = src.read_all(_read_buffer(row.size + RECORD_OVERHEAD + 1))
    except SpecialFile:
        return Damaged("special")
    if data is None:
        return ABSENT
    try:
        decode_record(data, key=key, fingerprint=fingerprint, max_raw_bytes=row.size, out=row, keys=ring)
    except CorruptRecord as exc:
        return Refused(exc.reason) if exc.reason in NOT_OURS else Damaged(exc.reason)
    if landed is not None:
        landed(i)
    return Found(data.nbytes)


def read_into(key: bytes, row: np.ndarray, heads: Heads, src: RecordSource, fingerprint: str,
              ring: KeyRing | None = None) -> RecordRead:
    """Read ``key``'s record from ``src`` into ``row`` and verify it (:func:`read_record` of one)."""
    return read_record([key], [row], heads, fingerprint, ring, None, 0, src)

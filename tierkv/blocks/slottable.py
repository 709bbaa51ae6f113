"""Each pool slot's key and version in a shared file, so that another process can copy a READY
block out of a shared pool without asking the pool's owner, and know afterwards whether what it
copied was that block.

One row of :data:`ROW_WORDS` little-endian int64 words per slot: the slot's *version*, the length
of its key, then the key's bytes (up to :data:`KEY_BYTES`, zero-padded). The owner (the pool, under
its lock) keeps one rule: **the version is even exactly while the slot is READY**, and it changes
whenever the slot stops being READY. It starts odd (free); a slot made READY goes up by one (even);
a READY slot freed or evicted goes up by one (odd) before anyone can be handed it to write. The key
is written while the version is odd (a slot is allocated while free). A key longer than
:data:`KEY_BYTES` is written with length -1 and never matches.

A reader (:meth:`SlotTable.snapshot`, then :meth:`SlotTable.unchanged`) reads the versions, checks
they are even and the keys are the ones it wants, copies the rows, and reads the versions again.
Equal versions mean no slot stopped being READY meanwhile, so its copy holds the blocks it named;
anything else means the copy is thrown away. This is a sequence lock: each version is one aligned
8-byte word (read and written whole), and it relies on loads and stores not being reordered
across each other, which x86-64 guarantees (:data:`ORDERED_MEMORY`); elsewhere readers must ask
the owner instead.
"""

from __future__ import annotations

import mmap
import os
import platform
from collections.abc import Sequence

import numpy as np

__all__ = ["KEY_BYTES", "ORDERED_MEMORY", "ROW_WORDS", "SlotTable", "create_tables", "map_tables"]

#: int64 words per slot: version, key length, key
ROW_WORDS = 16
#: the longest key a row holds (a longer one is never published)
KEY_BYTES = (ROW_WORDS - 2) * 8
#: whether this machine orders loads and stores as the readers need (x86-64: TSO)
ORDERED_MEMORY = platform.machine().lower() in ("x86_64", "amd64")


class SlotTable:
    """The rows of one pool's slots: ``rows`` is an int64 array ``[slots, ROW_WORDS]``."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows
        self._version = rows[:, 0]

    # ---- the owner: call under the pool's lock ---------------------------------------------------
    def reset(self, s: int, key: bytes | None, ready: bool) -> None:
        """Slot ``s`` as it is now (holding ``key``, READY or not), for a table attached to a pool
        that already holds blocks."""
        if key is not None:
            self.allocated(s, key)
        self._version[s] = (self._version[s] | 1) + (1 if ready else 0)

    def allocated(self, s: int, key: bytes) -> None:
        """Slot ``s`` (free, its version odd) now holds ``key``, not yet READY."""
        row = self.rows[s]
        if len(key) > KEY_BYTES:
            row[1] = -1
            return
        row[2:] = np.frombuffer(key.ljust(KEY_BYTES, b"\0"), dtype="<i8")
        row[1] = len(key)

    def ready(self, s: int) -> None:
        """Slot ``s`` became READY (its bytes complete)."""
        if self._version[s] & 1:
            self._version[s] += 1

    def freed(self, s: int) -> None:
        """Slot ``s`` is no longer READY (freed, evicted, or its write abandoned)."""
        if not self._version[s] & 1:
            self._version[s] += 1

    # ---- a reader ---------------------------------------------------------------------------------
    def snapshot(self, slots: Sequence[int], keys: Sequence[bytes]) -> np.ndarray | None:
        """The versions of ``slots`` when each is READY and holds ``keys[i]`` now; None when one
        does not (or a key is too long to be published)."""
        lengths = {len(k) for k in keys}
        if len(lengths) != 1:
            return None  # keys of one layout have one length; others are left to the owner
        n = lengths.pop()
        if not 0 < n <= KEY_BYTES:
            return None
        idx = np.array(slots, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.rows.shape[0]):
            return None
        before = self._version[idx]  # first: what follows is checked against these versions
        if (before & 1).any():
            return None
        rows = self.rows[idx]
        want = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), n)
        if not ((rows[:, 1] == n).all() and np.array_equal(rows[:, 2:].view(np.uint8)[:, :n], want)):
            return None
        return before

    def unchanged(self, slots: Sequence[int], before: np.ndarray) -> bool:
        """Whether no slot of ``slots`` stopped being READY since :meth:`snapshot` gave ``before``
        (read after the copy: then the copy holds the blocks the snapshot named)."""
        return bool(np.array_equal(self._version[np.array(slots, dtype=np.int64)], before))


def _file(path: str, size: int, create: bool) -> np.ndarray:
    if create:
        try:  # a killed owner's file: a reader may still map it, so never reuse its pages
            os.unlink(path)
        except FileNotFoundError:
            pass
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL if create else os.O_RDWR, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        elif os.fstat(fd).st_size < size:
            raise ValueError(f"{path} is smaller than {size} bytes")
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    return np.frombuffer(mapped, dtype="<i8")


def _tables(flat: np.ndarray, groups: Sequence[Sequence[int]]) -> dict[int, SlotTable]:
    out = {}
    for group, offset, slots in groups:
        if offset < 0 or offset % (ROW_WORDS * 8) or offset // 8 + slots * ROW_WORDS > flat.size:
            raise ValueError(f"group {group}'s slot table lies outside the file")
        start = offset // 8
        out[int(group)] = SlotTable(flat[start:start + slots * ROW_WORDS].reshape(slots, ROW_WORDS))
    return out


def create_tables(path: str, slots: dict[int, int]) -> tuple[dict[int, SlotTable], list[list[int]]]:
    """A new file at ``path`` with a table per group (``slots``: group -> its pool's slots), every
    slot free; the tables and where each lies (``[group, byte offset, slots]``, for readers)."""
    where, offset = [], 0
    for group, n in sorted(slots.items()):
        where.append([group, offset, n])
        offset += n * ROW_WORDS * 8
    flat = _file(path, max(offset, 8), create=True)
    flat[:offset // 8].reshape(-1, ROW_WORDS)[:, 0] = 1  # every slot free: odd
    return _tables(flat, where), where


def map_tables(path: str, groups: Sequence[Sequence[int]]) -> dict[int, SlotTable]:
    """The tables :func:`create_tables` made at ``path`` (``groups`` as it returned them), mapped
    shared for reading."""
    size = max((int(o) + int(n) * ROW_WORDS * 8 for _, o, n in groups), default=8)
    return _tables(_file(path, size, create=False), groups)

"""A ``get`` call's rows, filled by the threads that read its blocks, as each read is verified.

Without it a promoted block reached the caller in two steps: the tier's thread read and verified
it into its pool slot, and once the whole batch had landed the event loop copied every row out.
By then the rows had left the CPU's caches, so the copy out read them all again from memory: a
warm 38 MiB load spent a third of its time there. A :class:`RowSink` lets the reading thread copy
each verified block into the caller's row while it is still in cache; ``get`` then copies only
the rows no thread filled (blocks read by reader processes, by tiers that do not report rows, or
whose promotion was started before the call was listening).

Only verified bytes of the block under that key are ever copied, so a row filled here is right
whatever becomes of its promotion. :meth:`RowSink.close` (``get`` returning, raising or
cancelled) waits for the copies under way, which take microseconds, and stops any later one:
after it, nothing writes into the caller's rows.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from tierkv.tensors import copy_row

__all__ = ["RowSink"]


class RowSink:
    """The rows of ``out`` (``[n, block_bytes]`` bytes) that ``keys[i]`` goes to."""

    def __init__(self, out: torch.Tensor, keys: Sequence[bytes]) -> None:
        self._out = out
        self._rows: dict[bytes, list[int]] = {}
        for i, k in enumerate(keys):
            self._rows.setdefault(k, []).append(i)
        self._filled = bytearray(len(keys))
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._copying = 0
        self._open = True

    def fill(self, key: bytes, row: torch.Tensor) -> None:
        """Copy ``row``, the verified block of ``key``, into the rows that want it (from any
        thread; never raises: a row not filled is copied by ``get`` as before)."""
        with self._lock:
            if not self._open:
                return
            rows = [i for i in self._rows.get(key, ()) if not self._filled[i]]
            if not rows:
                return
            self._copying += 1
        done: list[int] = []
        try:
            for i in rows:
                copy_row(self._out[i], row)
                done.append(i)
        except Exception:  # get copies the rows not marked filled
            pass
        finally:
            with self._lock:
                for i in done:
                    self._filled[i] = 1
                self._copying -= 1
                if not self._copying:
                    self._idle.notify_all()

    def filled(self, i: int) -> bool:
        """Whether row ``i`` holds its block already."""
        return bool(self._filled[i])

    def close(self) -> None:
        """No copy after this returns (the ones under way are waited for)."""
        with self._lock:
            self._open = False
            while self._copying:
                self._idle.wait()

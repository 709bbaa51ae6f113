"""A ``get`` call's rows: the one road by which bytes reach them. The threads that read its blocks
fill rows as each read is verified (:meth:`RowSink.fill`); ``get`` copies blocks resident in the
pool (:meth:`RowSink.copy_slots`) and blocks read aside or staged (:meth:`RowSink.copy_rows`)
through the same object, so every row is written once, by one of these, and never after
:meth:`RowSink.close`.

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

from tierkv.blocks.pool import SlotPool
from tierkv.tensors import contiguous_run, copy_row, scatter_rows

__all__ = ["RowSink"]


class RowSink:
    """The rows of ``out`` (``[n, block_bytes]`` bytes) that ``keys[i]`` goes to."""

    def __init__(self, out: torch.Tensor, keys: Sequence[bytes]) -> None:
        self._out = out
        self._keys = keys
        #: key -> its rows, built on the first fill (a get of resident blocks never needs it)
        self._rows: dict[bytes, list[int]] | None = None
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
            if self._rows is None:
                self._rows = {}
                for i, k in enumerate(self._keys):
                    self._rows.setdefault(k, []).append(i)
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

    def copy_slots(self, rows: list[int], pool: SlotPool, slots: list[int]) -> None:
        """Copy the READY ``slots`` of ``pool`` into ``rows`` (the caller holds the store's lock):
        one copy for a run of consecutive rows, else one gathered copy and one scatter."""
        out = self._out
        r = contiguous_run(rows)
        if r is not None:
            pool.read(slots, out[r[0]:r[1]])
        else:
            tmp = torch.empty((len(rows), pool.block_bytes), dtype=torch.uint8, device=out.device)
            pool.read(slots, tmp)
            out.index_copy_(0, torch.tensor(rows, dtype=torch.int64, device=out.device), tmp)
        self._mark(rows)

    def copy_rows(self, rows: list[int], src: torch.Tensor) -> None:
        """Copy ``src[j]`` (verified bytes: a block read aside, a staged copy) into row ``rows[j]``."""
        scatter_rows(self._out, rows, src.to(self._out.device))
        self._mark(rows)

    def _mark(self, rows: list[int]) -> None:
        with self._lock:
            for i in rows:
                self._filled[i] = 1

    def close(self) -> None:
        """No copy after this returns (the ones under way are waited for)."""
        with self._lock:
            self._open = False
            while self._copying:
                self._idle.wait()

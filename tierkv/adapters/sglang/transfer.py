"""Pages between SGLang's host pools and the store, through reusable staging rows.

Each calling thread (SGLang's backup and prefetch I/O threads) has its own staging buffer per page
size, reused from call to call (fresh allocations cost a page fault per 4 KiB). A call is cut into
chunks of at most ``chunk_bytes`` and of distinct keys (the store takes each key once per call).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator, Sequence

import torch

from tierkv.adapters.sglang.groups import PoolGroup
from tierkv.adapters.sglang.pages import Rows
from tierkv.adapters.sglang.runner import StoreRunner

__all__ = ["CHUNK_BYTES", "Transfers"]

CHUNK_BYTES = 32 << 20


class Transfers:
    """Writes and reads of whole pages of one store, for any thread."""

    def __init__(self, runner: StoreRunner, chunk_bytes: int = CHUNK_BYTES) -> None:
        self._runner = runner
        self._chunk_bytes = chunk_bytes
        self._local = threading.local()

    def _rows(self, block_bytes: int, n: int) -> torch.Tensor:
        bufs: dict[int, torch.Tensor] = self._local.__dict__.setdefault("bufs", {})
        buf = bufs.get(block_bytes)
        if buf is None or buf.shape[0] < n:
            buf = bufs[block_bytes] = torch.empty((n, block_bytes), dtype=torch.uint8)
        return buf[:n]

    def _chunks(self, hashes: Sequence[bytes], block_bytes: int) -> Iterator[list[int]]:
        most = max(1, self._chunk_bytes // block_bytes)
        chunk: list[int] = []
        seen: set[bytes] = set()
        for i, h in enumerate(hashes):
            if len(chunk) == most or h in seen:
                yield chunk
                chunk, seen = [], set()
            chunk.append(i)
            seen.add(h)
        if chunk:
            yield chunk

    def write(self, pool: PoolGroup, hashes: Sequence[bytes], starts: Sequence[int]) -> None:
        """Store the pages starting at host slots ``starts`` as blocks ``hashes``."""
        codec = pool.codec
        for pos in self._chunks(hashes, codec.block_bytes):
            at = [starts[i] for i in pos]

            def fill(idx: list[int], rows: Rows, at: list[int] = at) -> None:
                codec.gather([at[j] for j in idx], rows)

            self._runner.write(pool.group, [hashes[i] for i in pos], fill,
                               functools.partial(self._rows, codec.block_bytes, len(pos)))

    def read(self, pool: PoolGroup, hashes: Sequence[bytes], starts: Sequence[int]) -> list[bool]:
        """Load blocks ``hashes`` into the pages starting at ``starts``; per page, whether it loaded.

        A page that is missing, unreadable or fails verification is False and its host slots are
        left untouched.
        """
        codec = pool.codec
        ok = [False] * len(hashes)
        for pos in self._chunks(hashes, codec.block_bytes):
            at = [starts[i] for i in pos]

            def use(rows: Rows, got: list[bool], at: list[int] = at) -> None:
                codec.scatter(at, rows, [j for j, f in enumerate(got) if f])

            got = self._runner.read(pool.group, [hashes[i] for i in pos], use,
                                    functools.partial(self._rows, codec.block_bytes, len(pos)))
            for j, f in zip(pos, got, strict=True):
                ok[j] = f
        return ok

    def write_flat(self, pool: PoolGroup, hashes: Sequence[bytes], pages: Sequence[torch.Tensor]) -> None:
        """Store flat pages (SGLang's ``get_data_page(flat=True)`` form) as blocks ``hashes``."""
        codec = pool.codec
        for pos in self._chunks(hashes, codec.block_bytes):
            src = [pages[i] for i in pos]

            def fill(idx: list[int], rows: Rows, src: list[torch.Tensor] = src) -> None:
                for j, i in enumerate(idx):
                    codec.from_flat(src[i], rows[j])

            self._runner.write(pool.group, [hashes[i] for i in pos], fill,
                               functools.partial(self._rows, codec.block_bytes, len(pos)))

    def read_flat(self, pool: PoolGroup, hashes: Sequence[bytes],
                  targets: Sequence[torch.Tensor]) -> list[bool]:
        """Load blocks into flat pages shaped like ``get_dummy_flat_data_page()``; per page, whether
        it loaded (a target that did not is left untouched)."""
        codec = pool.codec
        ok = [False] * len(hashes)
        for pos in self._chunks(hashes, codec.block_bytes):
            dst = [targets[i] for i in pos]

            def use(rows: Rows, got: list[bool], dst: list[torch.Tensor] = dst) -> None:
                for j, f in enumerate(got):
                    if f:
                        codec.to_flat(rows[j], dst[j])

            got = self._runner.read(pool.group, [hashes[i] for i in pos], use,
                                    functools.partial(self._rows, codec.block_bytes, len(pos)))
            for j, f in zip(pos, got, strict=True):
                ok[j] = f
        return ok

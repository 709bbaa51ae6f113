"""How the pages of one SGLang host pool become rows of tierkv blocks, and back.

KV pages of SGLang's MHA and MLA host pools are stored in one canonical element order whatever
the host layout (``layer_first``, ``page_first``, ``page_first_direct``, and ``page_head`` for MHA):
MHA ``[k/v, token, layer, head, dim]``, MLA ``[token, layer, 1, dim]``, the order of SGLang's
default ``page_first`` layout, where a page is then two plain copies (K and V). A deployment that
changes its layout keeps its cache, and a pool can never load another layout's bytes scrambled. Any other
pool (Mamba states, pools added by later SGLang versions) is stored as the pool's own flat page
(``get_data_page``), and its class and layout are part of the namespace instead.

Nothing here imports SGLang: pools are recognised by their class's qualified name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["CanonicalCodec", "FlatCodec", "PageCodec", "Row", "Rows", "codec_for"]

_MHA = "sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost"
_MLA = "sglang.srt.mem_cache.pool_host.mla.MLATokenToKVPoolHost"

View = Callable[[int], torch.Tensor]
#: rows of block bytes: a ``[n, block_bytes]`` uint8 tensor or a list of 1-D uint8 row views
#: (tensors, or numpy arrays: views of the CPU pool made without a torch call)
Row = torch.Tensor | np.ndarray
Rows = torch.Tensor | Sequence[Row]


class PageCodec(ABC):
    """Moves pages of one host pool into and out of ``[n, block_bytes]`` uint8 rows."""

    #: host slots per page (tokens for KV pools, 1 for Mamba state pools)
    page_size: int
    #: bytes of one stored page
    block_bytes: int
    #: what the stored bytes mean (dtype, geometry, order); part of the namespace
    describe: str

    @abstractmethod
    def gather(self, starts: Sequence[int], rows: Rows) -> None:
        """Copy the page starting at host slot ``starts[i]`` into ``rows[i]``."""

    @abstractmethod
    def scatter(self, starts: Sequence[int], rows: Rows, positions: Sequence[int]) -> None:
        """Copy ``rows[i]`` into the page starting at host slot ``starts[i]``, for ``i`` in ``positions``."""

    @abstractmethod
    def from_flat(self, page: torch.Tensor, row: Row) -> None:
        """Copy a flat page as SGLang's ``get_data_page(flat=True)`` makes it into ``row``."""

    @abstractmethod
    def to_flat(self, row: Row, target: torch.Tensor) -> None:
        """Copy ``row`` into a flat page shaped like SGLang's ``get_dummy_flat_data_page()``."""


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class _StridedPages:
    """Numpy views of a host buffer's pages in canonical order, with no torch call per page.

    Torch releases the GIL in every ``view``/``permute``/``copy_`` (five per page), and on a busy
    machine each hand-over of the GIL costs more than the copy of a small page; numpy copies a
    strided page in one call. A page at host slot ``s`` is the page at slot 0 shifted by
    ``s // page_size`` page strides (SGLang's pages start at multiples of the page size).
    """

    def __init__(self, buffer: torch.Tensor, view: View, perm: tuple[int, ...], page_size: int,
                 pages: int) -> None:
        es = buffer.element_size()
        if buffer.device.type != "cpu" or not buffer.is_contiguous() or es not in _UINT:
            raise ValueError("not a plain CPU buffer")
        self._flat = buffer.detach().reshape(-1).view(torch.uint8).numpy().view(_UINT[es])
        self._dtype = _UINT[es]
        first = view(0).permute(perm)
        self.shape = tuple(first.shape)
        self._strides = tuple(st * es for st in first.stride())
        self._base = first.storage_offset() - buffer.storage_offset()
        self._step = view(page_size).storage_offset() - view(0).storage_offset() if pages > 1 else 0
        self._extent = 1 + sum((n - 1) * st for n, st in zip(first.shape, first.stride(), strict=True))
        self._page_size = page_size
        self._pages = pages

    def page(self, start: int) -> np.ndarray | None:
        """The page at host slot ``start`` as a strided numpy view, or None (not a page start)."""
        index, rest = divmod(start, self._page_size)
        if rest or not 0 <= index < self._pages:
            return None
        off = self._base + index * self._step
        if off < 0 or off + self._extent > self._flat.size:
            return None
        return np.lib.stride_tricks.as_strided(self._flat[off:], shape=self.shape, strides=self._strides)

    def row(self, row: Any) -> np.ndarray:
        """``row`` (a uint8 tensor or array of a page's bytes) in the page's canonical shape."""
        arr = row if isinstance(row, np.ndarray) else row.numpy()
        return arr.view(self._dtype).reshape(self.shape)


class CanonicalCodec(PageCodec):
    """KV pages stored in one element order: a strided view of each page, permuted to it."""

    def __init__(self, view: View, perm: tuple[int, ...], page_size: int, describe: str,
                 buffer: torch.Tensor | None = None, pages: int = 1) -> None:
        self._view = view
        self._perm = perm
        sample = view(0)
        self._view_shape = tuple(sample.shape)
        self._canon_shape = tuple(sample.permute(perm).shape)
        self._dtype = sample.dtype
        self.page_size = page_size
        self.block_bytes = sample.numel() * sample.element_size()
        self.describe = describe
        self._fast: _StridedPages | None = None
        if buffer is not None:
            try:
                self._fast = _StridedPages(buffer, view, perm, page_size, pages)
            except (ValueError, RuntimeError, TypeError):
                self._fast = None

    def _canon(self, row: Row) -> torch.Tensor:
        return _tensor(row).view(self._dtype).view(self._canon_shape)

    def gather(self, starts: Sequence[int], rows: Rows) -> None:
        """See :meth:`PageCodec.gather`."""
        fast = self._fast
        for i, s in enumerate(starts):
            page = fast.page(s) if fast is not None else None
            if page is not None:
                np.copyto(fast.row(rows[i]), page)  # type: ignore[union-attr]
            else:
                self._canon(rows[i]).copy_(self._view(s).permute(self._perm))

    def scatter(self, starts: Sequence[int], rows: Rows, positions: Sequence[int]) -> None:
        """See :meth:`PageCodec.scatter`."""
        fast = self._fast
        arr = rows.numpy() if fast is not None and isinstance(rows, torch.Tensor) else rows
        for i in positions:
            page = fast.page(starts[i]) if fast is not None else None
            if page is not None:
                np.copyto(page, fast.row(arr[i]))  # type: ignore[union-attr]
            else:
                self._view(starts[i]).permute(self._perm).copy_(self._canon(rows[i]))

    def from_flat(self, page: torch.Tensor, row: Row) -> None:
        """See :meth:`PageCodec.from_flat`."""
        self._canon(row).copy_(page.reshape(self._view_shape).permute(self._perm))

    def to_flat(self, row: Row, target: torch.Tensor) -> None:
        """See :meth:`PageCodec.to_flat`."""
        target.view(self._view_shape).permute(self._perm).copy_(self._canon(row))


class FlatCodec(PageCodec):
    """Any host pool, through SGLang's page API: the pool's own flat page, byte for byte."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        dummy = pool.get_dummy_flat_data_page()
        self._dtype: torch.dtype = dummy.dtype
        self.page_size = int(getattr(pool, "page_size", 1) or 1)
        self.block_bytes = int(dummy.numel() * dummy.element_size())
        cls = type(pool)
        self.describe = (f"{cls.__module__}.{cls.__qualname__}:layout={getattr(pool, 'layout', None)}"
                         f":{self._dtype}:page={self.page_size}:bytes={self.block_bytes}")

    def gather(self, starts: Sequence[int], rows: Rows) -> None:
        """See :meth:`PageCodec.gather`."""
        for i, s in enumerate(starts):
            _tensor(rows[i]).copy_(_bytes(self._pool.get_data_page(s, flat=True)))

    def scatter(self, starts: Sequence[int], rows: Rows, positions: Sequence[int]) -> None:
        """See :meth:`PageCodec.scatter`."""
        for i in positions:
            self._pool.set_from_flat_data_page(starts[i], _tensor(rows[i]).view(self._dtype))

    def from_flat(self, page: torch.Tensor, row: Row) -> None:
        """See :meth:`PageCodec.from_flat`."""
        _tensor(row).copy_(_bytes(page))

    def to_flat(self, row: Row, target: torch.Tensor) -> None:
        """See :meth:`PageCodec.to_flat`."""
        target.view(torch.uint8).view(-1).copy_(_tensor(row))


def _tensor(row: Row) -> torch.Tensor:
    return torch.from_numpy(row) if isinstance(row, np.ndarray) else row


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).view(-1)


def _qualname(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _mha(pool: Any) -> CanonicalCodec | None:
    kv, ps, layout = pool.kv_buffer, int(pool.page_size), pool.layout
    views: dict[str, tuple[View, tuple[int, ...]]] = {
        "layer_first": (lambda s: kv[:, :, s:s + ps], (0, 2, 1, 3, 4)),
        "page_first": (lambda s: kv[:, s:s + ps], (0, 1, 2, 3, 4)),
        "page_first_direct": (lambda s: kv[:, s // ps], (0, 2, 1, 3, 4)),
        "page_head": (lambda s: kv[:, s // ps], (0, 2, 3, 1, 4)),
    }
    if layout not in views or not isinstance(kv, torch.Tensor):
        return None
    view, perm = views[layout]
    want = (2, ps, int(pool.layer_num), int(pool.head_num), int(pool.head_dim))
    if tuple(view(0).permute(perm).shape) != want:
        return None
    return CanonicalCodec(view, perm, ps, f"mha:{kv.dtype}:kv,token,layer,head,dim={want}", kv,
                          _pages(pool, ps))


def _mla(pool: Any) -> CanonicalCodec | None:
    kv, ps, layout = pool.kv_buffer, int(pool.page_size), pool.layout
    if int(getattr(pool, "dcp_size", 1)) != 1 or not isinstance(kv, torch.Tensor):
        return None
    views: dict[str, tuple[View, tuple[int, ...]]] = {
        "layer_first": (lambda s: kv[:, s:s + ps], (1, 0, 2, 3)),
        "page_first": (lambda s: kv[s:s + ps], (0, 1, 2, 3)),
        "page_first_direct": (lambda s: kv[s // ps], (1, 0, 2, 3)),
    }
    if layout not in views:
        return None
    view, perm = views[layout]
    shape = tuple(view(0).permute(perm).shape)
    if len(shape) != 4 or shape[0] != ps or shape[1] != int(pool.layer_num) or shape[2] != 1:
        return None
    return CanonicalCodec(view, perm, ps, f"mla:{kv.dtype}:token,layer,1,dim={shape}", kv, _pages(pool, ps))


def _pages(pool: Any, page_size: int) -> int:
    """Whole pages of a host pool (its ``size`` in slots)."""
    try:
        return int(pool.size) // page_size
    except (AttributeError, TypeError, ValueError):
        return 1


def codec_for(pool: Any) -> PageCodec:
    """The codec of a host pool: canonical for SGLang's MHA and MLA KV pools, flat otherwise."""
    name = _qualname(pool)
    codec = _mha(pool) if name == _MHA else _mla(pool) if name == _MLA else None
    return codec if codec is not None else FlatCodec(pool)

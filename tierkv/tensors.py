"""Rows of block bytes: checks that a caller's tensor can be used as such rows (before any state
changes), and the batched row copies every part uses (runs of adjacent rows copied as one)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from tierkv.errors import InvalidArgument

__all__ = ["as_bytes", "byte_rows", "contiguous_run", "copy_row", "row_span", "scatter_rows", "take_rows",
           "wide_view"]


def as_bytes(t: torch.Tensor, n: int, block_bytes: int) -> torch.Tensor:
    """``t`` (checked rows) as a ``[n, block_bytes]`` uint8 tensor: ``t`` itself when it already is.

    Torch releases the GIL in ``view`` and ``reshape``; on a busy 2-core machine taking it back
    costs more than the call, so hot paths skip them when they would change nothing.
    """
    if t.dtype is torch.uint8 and t.dim() == 2 and t.shape[0] == n and not t.requires_grad:
        return t
    return t.detach().view(torch.uint8).reshape(n, block_bytes)


def row_span(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of ``t`` as a view (``narrow``: unlike indexing, it keeps the GIL)."""
    return t if start == 0 and stop == t.shape[0] else t.narrow(0, start, stop - start)


def byte_rows(t: object, n: int, block_bytes: int, what: str, device: torch.device,
              writable: bool = False) -> torch.Tensor:
    """``t`` as a ``[n, block_bytes]`` uint8 view, or :class:`InvalidArgument` saying why not.

    Any dtype whose rows are ``block_bytes`` long is accepted; refused are tensors that cannot be
    viewed as plain bytes (sparse, quantized, conjugate or negative views, meta tensors), tensors
    that are not contiguous, on another device than ``device`` or the CPU, and, for ``writable``
    (an output), tensors that require grad.
    """
    if not isinstance(t, torch.Tensor):
        raise InvalidArgument(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout is not torch.strided:
        raise InvalidArgument(f"{what} must be a dense tensor, not {t.layout}")
    if t.is_quantized:
        raise InvalidArgument(f"{what} is a quantized tensor: pass its raw bytes (int_repr()) instead")
    if t.is_conj() or t.is_neg():
        raise InvalidArgument(f"{what} is a lazy conjugate or negative view: call resolve_conj() /"
                              " resolve_neg() first")
    if t.device.type not in ("cpu", device.type):
        raise InvalidArgument(f"{what} is on {t.device}; the pool is on {device}")
    if t.dim() != 2 or t.shape[0] != n or t.shape[1] * t.element_size() != block_bytes:
        raise InvalidArgument(
            f"{what}: expected {n} rows of {block_bytes} bytes, got shape {tuple(t.shape)} of"
            f" {t.dtype} ({t.element_size()} bytes per element)")
    if not t.is_contiguous():
        raise InvalidArgument(f"{what} must be contiguous")
    if writable and t.requires_grad:
        raise InvalidArgument(f"{what} must not require grad")
    try:
        return as_bytes(t, n, block_bytes)
    except RuntimeError as exc:
        raise InvalidArgument(f"{what} cannot be viewed as bytes: {str(exc).splitlines()[0]}") from None


def copy_row(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src`` for one row, from any thread.

    Between contiguous CPU tensors of the same dtype and size this is one ``memmove`` with the GIL
    released. Torch's ``copy_`` splits even a 256 KiB row over its intra-op threads, and called
    from a worker thread (a tier's reader) that costs more than the copy: 4 GB/s against 21 for
    ``memmove`` here (docs/performance-history.md, "Loads and stores: scattered rows, and row copies from
    threads").
    """
    n = dst.nbytes
    if (dst.device.type == "cpu" and src.device.type == "cpu" and dst.dtype == src.dtype
            and src.nbytes == n and dst.is_contiguous() and src.is_contiguous()):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
    else:
        dst.copy_(src)


def take_rows(t: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """Rows ``idx`` of ``t``: ``t`` itself or a view when they are all or one run, else a copy."""
    if len(idx) == t.shape[0] and all(i == j for j, i in enumerate(idx)):
        return t
    if idx and idx[-1] - idx[0] + 1 == len(idx) and all(s == idx[0] + j for j, s in enumerate(idx)):
        return row_span(t, idx[0], idx[-1] + 1)
    return t.index_select(0, torch.tensor(idx, dtype=torch.int64, device=t.device))


def wide_view(t: torch.Tensor) -> torch.Tensor:
    """View rows as int64 (or the widest type dividing the row) for fast batched index copies."""
    row = t.shape[-1]
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if row % size == 0 and t.data_ptr() % size == 0:
            return t.view(dtype)
    return t


def contiguous_run(idx: Sequence[int]) -> tuple[int, int] | None:
    """``(start, stop)`` when ``idx`` is ``start, start+1, ..., stop-1``; None otherwise."""
    if not idx:
        return None
    first = idx[0]
    if idx[-1] - first + 1 != len(idx) or any(s != first + j for j, s in enumerate(idx)):
        return None
    return first, first + len(idx)


def scatter_rows(dest: torch.Tensor, rows: Sequence[int], src: torch.Tensor) -> None:
    """``dest[rows[i]] = src[i]`` for byte rows, batched (an int64 view where the rows allow)."""
    block = dest.shape[1] * dest.element_size()
    d8 = dest.view(torch.uint8).reshape(dest.shape[0], block)
    s8 = src.view(torch.uint8).reshape(len(rows), block)
    if s8.device != d8.device:
        s8 = s8.to(d8.device)
    r = contiguous_run(rows)
    if r is not None:
        d8[r[0]:r[1]].copy_(s8)
        return
    wide = wide_view(d8)
    idx = torch.tensor(list(rows), dtype=torch.int64, device=d8.device)
    wide.index_copy_(0, idx, s8.contiguous().view(wide.dtype))

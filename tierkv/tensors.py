"""Checks that a caller's tensor can be used as rows of block bytes, before any state changes."""

from __future__ import annotations

import torch

from tierkv.errors import InvalidArgument

__all__ = ["as_bytes", "byte_rows", "row_span", "take_rows"]


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


def take_rows(t: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """Rows ``idx`` of ``t``: ``t`` itself or a view when they are all or one run, else a copy."""
    if len(idx) == t.shape[0] and all(i == j for j, i in enumerate(idx)):
        return t
    if idx and idx[-1] - idx[0] + 1 == len(idx) and all(s == idx[0] + j for j, s in enumerate(idx)):
        return row_span(t, idx[0], idx[-1] + 1)
    return t.index_select(0, torch.tensor(idx, dtype=torch.int64, device=t.device))

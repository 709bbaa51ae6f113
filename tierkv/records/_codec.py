"""The codecs' machinery: per-thread zstd contexts and scratch buffers, byte planes split and
merged, zstd frames decoded into their destination."""

from __future__ import annotations

import threading
from typing import Final

import numpy as np
import zstandard

from tierkv.errors import CorruptRecord
from tierkv.records.format import U8Array

#: A compressed plane is kept only if it is at most this fraction of the raw plane.
_PAYS: Final = 0.9


#: Planes shorter than this are stored raw without trying.
_MIN_COMPRESS: Final = 64


#: Thread-local scratch buffers up to this size are kept for reuse.
_SCRATCH_KEEP: Final = 8 << 20




class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.compressors: dict[tuple[bool, int], zstandard.ZstdCompressor] = {}
        self.decompressor: zstandard.ZstdDecompressor | None = None
        self.scratch: dict[str, U8Array] = {}


_tls = _ThreadState()


def _compressor(level: int, *, planes: bool) -> zstandard.ZstdCompressor:
    """This thread's compressor for ``level``; ``planes`` selects the byte-plane tuning.

    Byte planes of floating-point data hold few long repeats: short matches cost more than they
    save and finding them is what makes zstd slow there. Plane compressors therefore take the
    level's parameters with the longest minimum match (7) and a small hash table, which on bf16 KV
    data compresses the high plane both better (2.71x against 2.51x) and about 1.6 times as fast
    as the plain level 1.
    """
    cctx = _tls.compressors.get((planes, level))
    if cctx is None:
        if planes:
            base = zstandard.ZstdCompressionParameters.from_level(level)
            params = zstandard.ZstdCompressionParameters.from_level(
                level,
                min_match=7,
                hash_log=min(base.hash_log, 8 + max(level, 1)),
                write_content_size=1,
                write_checksum=0,
                write_dict_id=0,
            )
            cctx = zstandard.ZstdCompressor(compression_params=params)
        else:
            cctx = zstandard.ZstdCompressor(
                level=level, write_content_size=True, write_checksum=False, write_dict_id=False
            )
        _tls.compressors[(planes, level)] = cctx
    return cctx


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx = _tls.decompressor
    if dctx is None:
        dctx = _tls.decompressor = zstandard.ZstdDecompressor()
    return dctx


def _scratch(name: str, nbytes: int) -> U8Array:
    buf = _tls.scratch.get(name)
    if buf is None or buf.size < nbytes:
        buf = np.empty(nbytes, dtype=np.uint8)
        if nbytes <= _SCRATCH_KEEP:
            _tls.scratch[name] = buf
    return buf[:nbytes]




def _split_planes(body: U8Array, elem_size: int, n: int) -> U8Array:
    """Planes of ``body`` (``n`` elements) as an ``[elem_size, n]`` array; plane i = byte i."""
    planes = _scratch("planes", elem_size * n).reshape(elem_size, n)
    if elem_size in (2, 4, 8):
        wide = body.view(f"<u{elem_size}")
        tmp = _scratch("wide", elem_size * n).view(f"<u{elem_size}")
        np.copyto(planes[0], wide, casting="unsafe")
        for i in range(1, elem_size):
            np.right_shift(wide, 8 * i, out=tmp)
            np.copyto(planes[i], tmp, casting="unsafe")
    else:
        np.copyto(planes, body.reshape(n, elem_size).T)
    return planes


def _merge_planes(planes: list[U8Array], dst: U8Array, elem_size: int) -> None:
    """Interleave ``planes`` back into ``dst`` (``elem_size * n`` bytes), the inverse of the split."""
    if elem_size in (2, 4, 8):
        wide = dst.view(f"<u{elem_size}")
        np.copyto(wide, planes[-1])
        for plane in reversed(planes[:-1]):
            np.left_shift(wide, 8, out=wide)
            np.bitwise_or(wide, plane, out=wide)
    else:
        grid = dst.reshape(-1, elem_size)
        for i, plane in enumerate(planes):
            grid[:, i] = plane


def _compress_if_pays(plane: U8Array, cctx: zstandard.ZstdCompressor) -> bytes | None:
    """A zstd frame of ``plane`` when it saves enough, else None (store the plane raw)."""
    n = plane.size
    if n < _MIN_COMPRESS:
        return None
    frame = cctx.compress(plane.data)
    return frame if len(frame) <= _PAYS * n else None


def _zstd_into(frame: memoryview, dst: U8Array) -> None:
    """Decompress one zstd frame into ``dst``, which it must fill exactly."""
    n = dst.size
    try:
        declared = zstandard.frame_content_size(frame)
        if declared != n:
            raise CorruptRecord("decompress", f"zstd frame declares {declared} bytes, expected {n}")
        filled = 0
        with _decompressor().stream_reader(frame, read_size=max(len(frame), 1)) as reader:
            target = dst.data
            while filled < n:
                got = reader.readinto(target[filled:])
                if got == 0:
                    break
                filled += got
            extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise CorruptRecord("decompress", str(exc)) from exc
    if filled != n or extra:
        raise CorruptRecord(
            "decompress", f"zstd frame decodes to {'more' if extra else filled} bytes, not {n}"
        )

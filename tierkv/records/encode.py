"""Encoding a record: a block's bytes, compressed as the codec says and sealed where the tier has a
key, into header, payload and trailer (:mod:`tierkv.records.format`)."""

from __future__ import annotations

import os

import numpy as np
import numpy.typing as npt
import xxhash
import zstandard

from tierkv.errors import InvalidArgument
from tierkv.records._codec import _compress_if_pays, _compressor, _scratch, _split_planes
from tierkv.records.encryption import NONCE_LEN, KeyRing
from tierkv.records.format import (
    _CHECKSUM_XXH3_64,
    _CIPHER_AES256_GCM,
    _CODEC_NONE,
    _CODEC_ZSTD,
    _FIXED,
    _MODE_RAW,
    _MODE_ZSTD,
    _PLANE,
    _RESERVED_PLANE,
    _SEAL,
    _TRAILER,
    CODECS,
    FIXED_HEADER_LEN,
    FLAG_ENCRYPTED,
    FORMAT_VERSION,
    MAGIC,
    MAX_RAW_LEN,
    TAG_LEN,
    U8Array,
    _fingerprint_bytes,
    _key_bytes,
    header_align,
    header_len_for,
)

__all__ = ["encode_record", "encode_record_parts"]


def _payload_array(payload: memoryview | bytes | npt.NDArray[np.generic]) -> U8Array:
    if isinstance(payload, np.ndarray):
        if not payload.flags.c_contiguous or payload.dtype.hasobject:
            raise InvalidArgument("payload array must be C-contiguous and hold plain values")
        return payload.reshape(-1).view(np.uint8)
    try:
        view = memoryview(payload)
    except TypeError:
        raise InvalidArgument(
            f"payload must be bytes, a memoryview or a numpy array, not {type(payload).__name__}"
        ) from None
    if not view.c_contiguous:
        raise InvalidArgument("payload memoryview must be C-contiguous")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return np.frombuffer(view, dtype=np.uint8)


def encode_record(
    *,
    key: bytes,
    fingerprint: str,
    payload: memoryview | bytes | npt.NDArray[np.generic],
    codec: str = "none",
    elem_size: int = 2,
    level: int = 1,
    keys: KeyRing | None = None,
) -> bytes:
    """Encode one block as a record: :func:`encode_record_parts` joined into one ``bytes``."""
    return b"".join(encode_record_parts(key=key, fingerprint=fingerprint, payload=payload, codec=codec,
                                        elem_size=elem_size, level=level, keys=keys))


def encode_record_parts(
    *,
    key: bytes,
    fingerprint: str,
    payload: memoryview | bytes | npt.NDArray[np.generic],
    codec: str = "none",
    elem_size: int = 2,
    level: int = 1,
    keys: KeyRing | None = None,
) -> list[bytes | memoryview]:
    """Encode one block as a record, in pieces whose concatenation is the record.

    With ``keys`` the record is sealed with the ring's current key (AES-256-GCM, a fresh random
    nonce, the header as associated data); the sealed payload is in this thread's scratch.

    Nothing is copied: for ``none`` the payload piece is a view of ``payload`` itself, so a writer
    hands the pieces to ``os.writev`` (or joins them once). The views are valid as long as
    ``payload`` (and, for ``zstd-shuffle``, this thread's scratch buffers: use them before the
    thread encodes again) are not changed.

    ``payload`` holds the raw block bytes: bytes, a C-contiguous memoryview or a C-contiguous numpy
    array (its bytes are taken as they lie in memory). ``fingerprint`` is the layout fingerprint,
    32 lowercase hex characters. ``elem_size`` is the size of one value in bytes (2 for bf16/fp16);
    ``zstd-shuffle`` splits the block into that many byte planes. ``level`` is the zstd level.

    Raises :class:`~tierkv.errors.InvalidArgument` for an unknown codec or a bad argument.
    """
    if codec not in CODECS:
        raise InvalidArgument(f"unknown codec {codec!r}; known: {', '.join(CODECS)}")
    codec_id = CODECS.index(codec)
    fp = _fingerprint_bytes(fingerprint)
    key = _key_bytes(key)
    if isinstance(elem_size, bool) or not isinstance(elem_size, int) or not 1 <= elem_size <= 255:
        raise InvalidArgument(f"elem_size must be an int in 1..255, got {elem_size!r}")
    if (
        isinstance(level, bool)
        or not isinstance(level, int)
        or not -(1 << 17) <= level <= zstandard.MAX_COMPRESSION_LEVEL
    ):
        raise InvalidArgument(f"level must be a zstd level (int up to {zstandard.MAX_COMPRESSION_LEVEL})")
    src = _payload_array(payload)
    raw_len = src.size
    if raw_len > MAX_RAW_LEN:
        raise InvalidArgument(f"payload of {raw_len} bytes is larger than {MAX_RAW_LEN}")

    pieces: list[bytes | memoryview] = []
    table = b""
    plane_count = 0
    if codec_id == _CODEC_NONE:
        pieces.append(src.data)
    elif codec_id == _CODEC_ZSTD:
        pieces.append(_compressor(level, planes=False).compress(src.data))
    else:
        plane_count = elem_size
        n = raw_len // elem_size
        body = src[: n * elem_size]
        planes = body.reshape(1, n) if elem_size == 1 else _split_planes(body, elem_size, n)
        cctx = _compressor(level, planes=True)
        entries = []
        for plane in planes:
            frame = _compress_if_pays(plane, cctx)
            if frame is None:
                entries.append(_PLANE.pack(n, _MODE_RAW, _RESERVED_PLANE))
                pieces.append(plane.data)
            else:
                entries.append(_PLANE.pack(len(frame), _MODE_ZSTD, _RESERVED_PLANE))
                pieces.append(frame)
        table = b"".join(entries)
        pieces.append(src[n * elem_size :].data)

    stored_len = sum(len(p) for p in pieces)
    header_len = header_len_for(len(key), plane_count, keys is not None, header_align(codec, raw_len))
    fixed = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        codec_id,
        _CHECKSUM_XXH3_64,
        elem_size,
        plane_count,
        len(key),
        header_len,
        0 if keys is None else FLAG_ENCRYPTED,
        fp,
        raw_len,
        stored_len,
    )
    seal = b""
    if keys is not None:
        nonce = os.urandom(NONCE_LEN)
        seal = _SEAL.pack(_CIPHER_AES256_GCM, bytes(3), keys.current_id, nonce)
    pad = header_len - FIXED_HEADER_LEN - len(key) - len(table) - len(seal)
    head = fixed + key + table + seal + bytes(pad)
    if keys is not None:
        plain = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        sealed = _scratch("sealed", stored_len + TAG_LEN)
        keys.seal_into(nonce, plain, head, sealed)
        pieces = [sealed.data]
    digest = xxhash.xxh3_64()
    digest.update(head)
    for part in pieces:
        digest.update(part)
    return [head, *pieces, _TRAILER.pack(digest.intdigest())]

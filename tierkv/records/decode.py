"""Decoding and checking a record: structure, sizes and checksum before a byte is used, then the
payload opened and decompressed into the caller's buffer; the fast checks of a ``none`` record read
in pieces."""

from __future__ import annotations

from typing import Any

import numpy as np
import xxhash

from tierkv.errors import CorruptRecord, InvalidArgument
from tierkv.records._codec import _merge_planes, _scratch, _zstd_into
from tierkv.records.encryption import KEY_ID_LEN, NONCE_LEN, KeyRing
from tierkv.records.format import (
    FIXED_HEADER_LEN,
    TRAILER_LEN,
    RecordHeader,
    U8Array,
    _check_record,
    _fingerprint_bytes,
    _key_bytes,
    _record_view,
)

__all__ = ["decode_record", "none_parts_match", "sealed_none_open", "verify_record"]


def sealed_none_open(expected_header: bytes, head: bytes | bytearray, sealed: Any, tail: bytes | bytearray,
                     nread: int, keys: KeyRing, out: Any) -> bool:
    """Whether a sealed ``none`` record read in pieces (header, ciphertext and tag, trailer) is
    exactly the one expected and authenticates; its block is then in ``out``.

    ``expected_header`` is :func:`none_header` with the ring's key id; ``sealed`` received the
    ciphertext and tag, ``tail`` the trailer and a spare byte. Every header byte but the nonce
    must match, then GCM's tag (over the header as read). The checksum is not computed here: the
    tag covers every byte it does (header, ciphertext, and the tag itself by comparison), and a
    reader with the key spends its time on the decryption. False means: read the record whole and
    decode it (:func:`decode_record` checks the checksum too and tells why it fails, or opens a
    record of an older key); ``out`` may then hold bytes that must not be used.
    """
    if nread != len(head) + memoryview(sealed).nbytes + TRAILER_LEN:
        return False
    at = FIXED_HEADER_LEN + int.from_bytes(expected_header[14:16], "little") + 12
    if head[:at] != expected_header[:at] or head[at + NONCE_LEN:] != expected_header[at + NONCE_LEN:]:
        return False
    kid = expected_header[at - KEY_ID_LEN:at]
    try:
        keys.open_into(kid, bytes(head[at:at + NONCE_LEN]), sealed, head, out)
    except CorruptRecord:
        return False
    return True


def none_parts_match(expected_header: bytes, head: bytes | bytearray, payload: Any,
                     tail: bytes | bytearray, nread: int) -> bool:
    """Whether a ``none`` record read in pieces (header, payload, trailer) is exactly the one expected.

    ``expected_header`` is :func:`none_header` of the key, fingerprint and size the reader wants;
    ``payload`` (any buffer: bytes, a memoryview, a numpy row) received the block;
    ``head`` and ``tail`` received the record's first and last bytes (``tail`` one spare byte
    longer than the trailer, to catch longer files) and ``nread`` is how many bytes the read
    returned. One comparison checks every header field; then the xxh3 checksum of header and
    payload must match the trailer. False means: read the record whole and decode it
    (:func:`decode_record` tells why it fails, or decodes a record of another codec).
    """
    if nread != len(head) + memoryview(payload).nbytes + TRAILER_LEN or head != expected_header:
        return False
    digest = xxhash.xxh3_64(head)
    digest.update(payload)
    return digest.intdigest() == int.from_bytes(tail[:TRAILER_LEN], "little")


def _decode_payload(payload: memoryview, header: RecordHeader, dst: U8Array) -> None:
    """Decode the (plain) payload into ``dst``."""
    if header.codec == "none":
        np.copyto(dst, np.frombuffer(payload, dtype=np.uint8))
    elif header.codec == "zstd":
        _zstd_into(payload, dst)
    else:
        elem_size = header.elem_size
        n = header.raw_len // elem_size
        body = dst[: n * elem_size]
        direct = elem_size == 1
        scratch = None if direct else _scratch("planes", elem_size * n).reshape(elem_size, n)
        planes: list[U8Array] = []
        offset = 0
        for i, plane in enumerate(header.planes):
            chunk = payload[offset : offset + plane.stored_len]
            offset += plane.stored_len
            target = body if scratch is None else scratch[i]
            if plane.compressed:
                _zstd_into(chunk, target)
                planes.append(target)
            elif direct:
                np.copyto(body, np.frombuffer(chunk, dtype=np.uint8))
            else:
                planes.append(np.frombuffer(chunk, dtype=np.uint8))
        if not direct:
            _merge_planes(planes, body, elem_size)
        np.copyto(dst[n * elem_size :], np.frombuffer(payload[offset:], dtype=np.uint8))


def decode_record(
    data: bytes | bytearray | memoryview,
    *,
    key: bytes,
    fingerprint: str,
    max_raw_bytes: int,
    out: U8Array | None = None,
    keys: KeyRing | None = None,
) -> U8Array:
    """Check a record completely and return its block.

    In order: header structure, ``raw_len <= max_raw_bytes``, total length, checksum over header
    and payload, key, fingerprint, and only then decoding, which is bounded by ``raw_len`` (zstd
    frames must declare and produce exactly their plane's length). Nothing larger than
    ``max_raw_bytes`` is allocated whatever the header claims.

    ``out``, when given, is a writable C-contiguous uint8 array of exactly ``raw_len`` bytes (any
    shape); the block is decoded into it and ``out`` is returned. Otherwise a new uint8 array is
    returned. A sealed record needs ``keys`` holding its key id (else ``encrypted``: a record this
    reader cannot open, not a damaged one) and must authenticate (else ``auth``); with ``keys``
    whose ``accept_plain`` is False an unencrypted record is refused (``plaintext``), and so is an
    intact record of a format version newer than this reader's (``newer``). Raises
    :class:`~tierkv.errors.CorruptRecord` on any failed check (``out``'s contents
    are then unspecified) and :class:`~tierkv.errors.InvalidArgument` for a bad ``out``,
    ``fingerprint`` or ``max_raw_bytes``.
    """
    _fingerprint_bytes(fingerprint)
    key = _key_bytes(key)
    if out is not None and (
        not isinstance(out, np.ndarray)
        or out.dtype != np.uint8
        or not out.flags.c_contiguous
        or not out.flags.writeable
    ):
        raise InvalidArgument("out must be a writable C-contiguous uint8 numpy array")
    view = _record_view(data)
    header = _check_record(view, max_raw_bytes)
    if header.key != key:
        raise CorruptRecord("key", f"record holds key {header.key.hex()}, expected {key.hex()}")
    if header.fingerprint != fingerprint:
        raise CorruptRecord("fingerprint", f"record fingerprint {header.fingerprint}, expected {fingerprint}")
    if header.encrypted:
        if keys is None or header.key_id is None or not keys.holds(header.key_id):
            raise CorruptRecord("encrypted", f"sealed with key id {(header.key_id or b'').hex()}, "
                                             "which this reader does not hold")
    elif keys is not None and not keys.accept_plain:
        raise CorruptRecord("plaintext", "not encrypted, and this reader serves encrypted records only")
    if out is None:
        result: U8Array = np.empty(header.raw_len, dtype=np.uint8)
    elif out.size != header.raw_len:
        raise CorruptRecord("size", f"raw length {header.raw_len}, out holds {out.size} bytes")
    else:
        result = out
    _open_and_decode(view, header, keys, result.reshape(-1))
    return result


def _open_and_decode(view: memoryview, header: RecordHeader, keys: KeyRing | None, dst: U8Array) -> None:
    """Decrypt (a sealed record, with a key ``keys`` holds) and decode the payload into ``dst``."""
    start = header.header_len
    if not header.encrypted:
        _decode_payload(view[start : start + header.stored_len], header, dst)
        return
    assert keys is not None and header.key_id is not None
    sealed = view[start : start + header.sealed_len]
    if header.codec == "none":
        keys.open_into(header.key_id, header.nonce, sealed, view[:start], dst)
        return
    plain = _scratch("opened", header.stored_len)
    keys.open_into(header.key_id, header.nonce, sealed, view[:start], plain)
    _decode_payload(plain.data, header, dst)


def verify_record(data: bytes | bytearray | memoryview, *, max_raw_bytes: int,
                  keys: KeyRing | None = None) -> RecordHeader:
    """Check a record completely (checksum and decoding included) without knowing its key.

    A sealed record is decrypted (authenticated) and decoded when ``keys`` holds its key id;
    otherwise only its structure and checksum are checked (the header's ``key_id`` and the
    caller's ring tell which). Returns the header so that the caller (``tierkv verify``) can
    compare its key and fingerprint with the record's path. Raises
    :class:`~tierkv.errors.CorruptRecord` like :func:`decode_record` (``auth``: a sealed record
    that does not authenticate).
    """
    view = _record_view(data)
    header = _check_record(view, max_raw_bytes)
    if header.encrypted and (keys is None or header.key_id is None or not keys.holds(header.key_id)):
        return header
    _open_and_decode(view, header, keys, np.empty(header.raw_len, dtype=np.uint8))
    return header

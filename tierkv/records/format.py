"""Persistent record format: one self-describing, checksummed record per block.

A record is ``header | payload | trailer``. The header (little-endian: 56 fixed bytes, the key, a
plane table for ``zstd-shuffle``, zero bytes up to a multiple of 64, or of a page (4096) for a ``none``
record of at least a page, so that its payload starts page-aligned) names the format version,
codec, checksum algorithm, layout fingerprint, key and sizes; the trailer is an xxh3-64 checksum of
header and payload. A reader checks the structure, the sizes against the caller's bound, the total
length and the checksum *before* it decompresses or hands over a byte, and it never allocates more
than ``max_raw_bytes`` for a block, whatever a header claims. docs/format.md describes the layout
byte by byte.

Codecs:

``none``
    the block bytes as they are.
``zstd``
    one zstd frame of the block.
``zstd-shuffle``
    the block is cut into ``elem_size``-byte elements and split into ``elem_size`` byte planes
    (plane ``i`` holds byte ``i`` of every element). Each plane is stored as a zstd frame only when
    that pays (it saves at least 10 %); otherwise it is stored raw. On bf16 KV data the plane of
    high bytes (sign and exponent) compresses well and the plane of low bytes (mantissa) does not,
    so the low plane is stored raw and costs nothing to decode. Bytes past the last whole element
    are stored raw after the planes.

Encryption (a tier with a :class:`~tierkv.records.encryption.KeyRing`): flag bit 0 of the header marks a
sealed record; a 24-byte seal block after the plane table names the cipher, the key id and the
record's fresh 96-bit nonce; the payload is AES-256-GCM ciphertext of the codec's output and the
16-byte GCM tag follows it, before the checksum. The associated data is the whole header, which
holds the record's place (namespace fingerprint, block hash and group): a record copied to another
place fails authentication. The checksum still covers every byte before it, so structure and
checksum can be verified without the key.

zstd contexts are not thread safe: each thread keeps its own, with scratch buffers, so records may
be encoded and decoded from worker threads concurrently.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt
import xxhash

from tierkv.errors import CorruptRecord, InvalidArgument
from tierkv.records.encryption import NONCE_LEN

__all__ = [
    "CHECKSUM_ALGORITHMS",
    "CODECS",
    "FIXED_HEADER_LEN",
    "FORMAT_VERSION",
    "HEADER_ALIGN",
    "MAGIC",
    "PAGE_ALIGN",
    "READ_VERSIONS",
    "FLAG_ENCRYPTED",
    "MAX_KEY_LEN",
    "MAX_RAW_LEN",
    "PLANE_ENTRY_LEN",
    "SEAL_LEN",
    "TAG_LEN",
    "TRAILER_LEN",
    "PlaneInfo",
    "RecordHeader",
    "header_align",
    "header_len_for",
    "none_header",
    "read_header",
]


#: Codec names, indexed by their codec id in the header.
CODECS: Final[tuple[str, ...]] = ("none", "zstd", "zstd-shuffle")


#: Checksum algorithm names, indexed by their id in the header (id 0 is invalid).
CHECKSUM_ALGORITHMS: Final[tuple[str, ...]] = ("", "xxh3_64")


#: First 8 bytes of every record (PNG-style: a high-bit byte, CR LF, ^Z, LF catch text-mode damage).
MAGIC: Final = b"\x89TKV\r\n\x1a\n"


#: the version this writer writes
FORMAT_VERSION: Final = 3


#: the versions this reader serves: 2 (payload 64-aligned) and 3 (page-aligned where it pays)
READ_VERSIONS: Final = frozenset((2, 3))


FIXED_HEADER_LEN: Final = 56


#: The header is padded with zero bytes to a multiple of this, so the payload starts 64-aligned in
#: the file: the kernel then copies it to a 64-aligned buffer a quarter faster (bench/fs_tier.py).
HEADER_ALIGN: Final = 64


#: Version 3 pads the header of a ``none`` record whose block is at least this long to a multiple of
#: it, so the block's bytes start on a page boundary: an ``O_DIRECT`` read can land them in an aligned
#: row with no copy. Smaller blocks and compressed payloads keep 64 (a page there would only cost).
PAGE_ALIGN: Final = 4096


PLANE_ENTRY_LEN: Final = 16


TRAILER_LEN: Final = 8


#: header flag: the payload is sealed (AES-256-GCM), a seal block follows the plane table
FLAG_ENCRYPTED: Final = 1


#: the seal block: cipher id, 3 reserved bytes, key id, nonce
SEAL_LEN: Final = 24


#: the GCM tag after a sealed payload
TAG_LEN: Final = 16


_CIPHER_AES256_GCM: Final = 1


#: No block is larger than this (1 TiB); a header claiming more is corrupt whatever the caller's bound.
MAX_RAW_LEN: Final = 1 << 40


MAX_KEY_LEN: Final = 0xFFFF


_CODEC_NONE, _CODEC_ZSTD, _CODEC_SHUFFLE = 0, 1, 2


_CHECKSUM_XXH3_64: Final = 1


_MODE_RAW, _MODE_ZSTD = 0, 1


# magic, version, codec, checksum algorithm, elem_size, plane count, key length, header length,
# flags, fingerprint, raw length, stored length
_FIXED: Final = struct.Struct("<8sHBBBBHII16sQQ")


# stored length, mode, 7 reserved bytes (zero)
_PLANE: Final = struct.Struct("<QB7s")


_TRAILER: Final = struct.Struct("<Q")


_VERSION: Final = struct.Struct("<H")


# cipher id, 3 reserved bytes (zero), key id, nonce
_SEAL: Final = struct.Struct("<B3s8s12s")


_RESERVED_PLANE: Final = bytes(7)


_ZSTD_BLOCK: Final = 128 << 10
_HEX_DIGITS: Final = frozenset("0123456789abcdef")


assert _FIXED.size == FIXED_HEADER_LEN and _PLANE.size == PLANE_ENTRY_LEN and _SEAL.size == SEAL_LEN


U8Array = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class PlaneInfo:
    """One byte plane of a ``zstd-shuffle`` record."""

    raw_len: int
    """Bytes in the plane: ``record raw_len // elem_size``."""
    stored_len: int
    """Bytes the plane takes in the payload."""
    compressed: bool
    """True when the plane is stored as a zstd frame, False when stored raw."""


@dataclass(frozen=True)
class RecordHeader:
    """The parsed header of a record (see docs/format.md)."""

    version: int
    codec: str
    fingerprint: str
    """Layout fingerprint, 32 lowercase hex characters."""
    key: bytes
    raw_len: int
    """Length of the block once decoded."""
    stored_len: int
    """Length of the payload between header and trailer."""
    header_len: int
    """Length of the header, key and plane table included; the payload starts here."""
    elem_size: int
    checksum_algorithm: str = "xxh3_64"
    planes: tuple[PlaneInfo, ...] = ()
    """Byte planes in payload order (``zstd-shuffle`` only)."""
    key_id: bytes | None = None
    """The id of the key that sealed the record (None: not encrypted)."""
    nonce: bytes = b""
    """The sealed record's GCM nonce."""

    @property
    def encrypted(self) -> bool:
        """Whether the payload is sealed (AES-256-GCM)."""
        return self.key_id is not None

    @property
    def sealed_len(self) -> int:
        """Bytes between header and checksum: the payload, and the tag of a sealed record."""
        return self.stored_len + (TAG_LEN if self.encrypted else 0)

    @property
    def record_len(self) -> int:
        """Total length of the record: header, payload, tag (sealed records) and trailer."""
        return self.header_len + self.sealed_len + TRAILER_LEN

    @property
    def tail_len(self) -> int:
        """Raw bytes after the planes of a ``zstd-shuffle`` record (a partial last element)."""
        return self.raw_len % self.elem_size if self.codec == "zstd-shuffle" else 0

def _zstd_bound(n: int) -> int:
    """ZSTD_COMPRESSBOUND: the most bytes zstd emits for ``n`` input bytes."""
    return n + (n >> 8) + (((_ZSTD_BLOCK - n) >> 11) if n < _ZSTD_BLOCK else 0)


def header_align(codec: str, raw_len: int, version: int = FORMAT_VERSION) -> int:
    """What a record's header is padded to a multiple of: :data:`PAGE_ALIGN` for a version 3
    ``none`` record of at least a page, else :data:`HEADER_ALIGN`."""
    return PAGE_ALIGN if version >= 3 and codec == "none" and raw_len >= PAGE_ALIGN else HEADER_ALIGN


def header_len_for(key_len: int, plane_count: int, encrypted: bool = False, align: int = HEADER_ALIGN) -> int:
    """The header length of a record with this key length and plane count (padding to a multiple of
    ``align`` included: :func:`header_align`)."""
    unpadded = FIXED_HEADER_LEN + key_len + plane_count * PLANE_ENTRY_LEN + (SEAL_LEN if encrypted else 0)
    return -(-unpadded // align) * align


def _fingerprint_bytes(fingerprint: str) -> bytes:
    if not isinstance(fingerprint, str) or len(fingerprint) != 32 or not set(fingerprint) <= _HEX_DIGITS:
        raise InvalidArgument(f"fingerprint must be 32 lowercase hex characters, got {fingerprint!r}")
    return bytes.fromhex(fingerprint)


def _key_bytes(key: bytes) -> bytes:
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise InvalidArgument(f"key must be bytes, got {type(key).__name__}")
    key = bytes(key)
    if not 1 <= len(key) <= MAX_KEY_LEN:
        raise InvalidArgument(f"key must be 1..{MAX_KEY_LEN} bytes, got {len(key)}")
    return key


def _record_view(data: bytes | bytearray | memoryview) -> memoryview:
    try:
        view = memoryview(data)
    except TypeError:
        raise InvalidArgument(
            f"record data must be bytes or a memoryview, not {type(data).__name__}"
        ) from None
    if not view.c_contiguous:
        raise InvalidArgument("record memoryview must be C-contiguous")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def none_header(*, key: bytes, fingerprint: str, raw_len: int, elem_size: int = 2,
                key_id: bytes | None = None) -> bytes:
    """The exact header (key and padding included) :func:`encode_record` writes for a ``none`` record.

    With ``key_id``: the header of a record sealed by that key, with an all-zero nonce (each
    record has its own; :func:`sealed_none_open` compares everything else).
    """
    key = _key_bytes(key)
    header_len = header_len_for(len(key), 0, key_id is not None, header_align("none", raw_len))
    seal = b"" if key_id is None else _SEAL.pack(_CIPHER_AES256_GCM, bytes(3), key_id, bytes(NONCE_LEN))
    return _FIXED.pack(MAGIC, FORMAT_VERSION, _CODEC_NONE, _CHECKSUM_XXH3_64, elem_size, 0, len(key),
                       header_len, 0 if key_id is None else FLAG_ENCRYPTED, _fingerprint_bytes(fingerprint),
                       raw_len, raw_len) + key + seal + bytes(header_len - FIXED_HEADER_LEN - len(key)
                                                              - len(seal))


def _parse_header(view: memoryview) -> RecordHeader:
    size = len(view)
    if size == 0:
        raise CorruptRecord("empty", "no bytes")
    if view[: min(size, len(MAGIC))] != MAGIC[: min(size, len(MAGIC))]:
        raise CorruptRecord("magic", "not a tierkv record")
    if size < FIXED_HEADER_LEN:
        raise CorruptRecord("truncated", f"{size} bytes, the fixed header alone is {FIXED_HEADER_LEN}")
    (
        _magic,
        version,
        codec_id,
        checksum_id,
        elem_size,
        plane_count,
        key_len,
        header_len,
        flags,
        fp,
        raw_len,
        stored_len,
    ) = _FIXED.unpack_from(view, 0)
    if version not in READ_VERSIONS:
        known = "/".join(str(v) for v in sorted(READ_VERSIONS))
        raise CorruptRecord("version", f"format version {version}, this reader knows {known}")
    if flags & ~FLAG_ENCRYPTED:
        raise CorruptRecord("version", f"unknown header flags {flags:#x}")
    encrypted = bool(flags & FLAG_ENCRYPTED)
    if codec_id >= len(CODECS):
        raise CorruptRecord("codec", f"unknown codec id {codec_id}")
    if checksum_id != _CHECKSUM_XXH3_64:
        raise CorruptRecord("checksum", f"unknown checksum algorithm id {checksum_id}")
    if elem_size == 0:
        raise CorruptRecord("size", "elem_size is 0")
    expected_planes = elem_size if codec_id == _CODEC_SHUFFLE else 0
    if plane_count != expected_planes:
        raise CorruptRecord(
            "codec", f"{plane_count} planes for codec {CODECS[codec_id]} of elem_size {elem_size}"
        )
    if key_len == 0:
        raise CorruptRecord("key", "empty key")
    if header_len != header_len_for(key_len, plane_count, encrypted,
                                    header_align(CODECS[codec_id], raw_len, version)):
        raise CorruptRecord("size", f"header length {header_len} does not match its key and plane table")
    if size < header_len:
        raise CorruptRecord("truncated", f"{size} bytes, the header is {header_len}")
    seal_at = FIXED_HEADER_LEN + key_len + plane_count * PLANE_ENTRY_LEN
    kid: bytes | None = None
    nonce = b""
    if encrypted:
        cipher, reserved, kid, nonce = _SEAL.unpack_from(view, seal_at)
        if cipher != _CIPHER_AES256_GCM or any(reserved):
            raise CorruptRecord("version", f"unknown cipher id {cipher} or reserved seal bytes set")
    padding = view[seal_at + (SEAL_LEN if encrypted else 0) : header_len]
    if any(padding):
        raise CorruptRecord("version", "header padding bytes are not zero")
    if raw_len > MAX_RAW_LEN:
        raise CorruptRecord("size", f"raw length {raw_len} exceeds {MAX_RAW_LEN}")

    planes: list[PlaneInfo] = []
    if codec_id == _CODEC_NONE:
        if stored_len != raw_len:
            raise CorruptRecord("size", f"stored length {stored_len} != raw length {raw_len} for codec none")
    elif codec_id == _CODEC_ZSTD:
        if stored_len > _zstd_bound(raw_len):
            raise CorruptRecord("size", f"stored length {stored_len} exceeds zstd's bound for {raw_len}")
    else:
        n = raw_len // elem_size
        total = raw_len - n * elem_size
        offset = FIXED_HEADER_LEN + key_len
        for i in range(plane_count):
            plane_stored, mode, reserved = _PLANE.unpack_from(view, offset + i * PLANE_ENTRY_LEN)
            if mode not in (_MODE_RAW, _MODE_ZSTD) or reserved != _RESERVED_PLANE:
                raise CorruptRecord("codec", f"plane {i}: unknown mode {mode} or reserved bytes set")
            if mode == _MODE_RAW and plane_stored != n:
                raise CorruptRecord("size", f"raw plane {i} stores {plane_stored} bytes, not {n}")
            if mode == _MODE_ZSTD and plane_stored > _zstd_bound(n):
                raise CorruptRecord("size", f"plane {i} stores {plane_stored} bytes, over zstd's bound")
            planes.append(PlaneInfo(raw_len=n, stored_len=plane_stored, compressed=mode == _MODE_ZSTD))
            total += plane_stored
        if stored_len != total:
            raise CorruptRecord("size", f"stored length {stored_len} != planes and tail ({total})")
    return RecordHeader(
        version=version,
        codec=CODECS[codec_id],
        fingerprint=fp.hex(),
        key=bytes(view[FIXED_HEADER_LEN : FIXED_HEADER_LEN + key_len]),
        raw_len=raw_len,
        stored_len=stored_len,
        header_len=header_len,
        elem_size=elem_size,
        checksum_algorithm=CHECKSUM_ALGORITHMS[checksum_id],
        planes=tuple(planes),
        key_id=kid,
        nonce=nonce,
    )


def read_header(data: bytes | bytearray | memoryview) -> RecordHeader:
    """Parse and structurally check a record's header; the payload and checksum are not checked.

    ``data`` must hold at least the header (the whole record is fine). Raises
    :class:`~tierkv.errors.CorruptRecord` with reason ``empty``, ``magic``, ``truncated``,
    ``version``, ``codec``, ``checksum`` (unknown algorithm), ``key`` or ``size``.
    """
    return _parse_header(_record_view(data))


def _newer_and_sound(view: memoryview) -> bool:
    """Whether ``view`` is a whole record of a version newer than this reader's: every version
    keeps the magic, the version at offset 8 and the trailer (xxh3-64 of all the bytes before it),
    so a newer record that is intact is told from a damaged one (a flipped version bit)."""
    if len(view) < FIXED_HEADER_LEN + TRAILER_LEN or _VERSION.unpack_from(view, 8)[0] <= FORMAT_VERSION:
        return False
    (stored_digest,) = _TRAILER.unpack_from(view, len(view) - TRAILER_LEN)
    return bool(xxhash.xxh3_64_intdigest(view[: len(view) - TRAILER_LEN]) == stored_digest)


def _check_record(view: memoryview, max_raw_bytes: int) -> RecordHeader:
    """Header, size bound, total length and checksum: everything short of decoding."""
    if isinstance(max_raw_bytes, bool) or not isinstance(max_raw_bytes, int) or max_raw_bytes < 0:
        raise InvalidArgument(f"max_raw_bytes must be a non-negative int, got {max_raw_bytes!r}")
    try:
        header = _parse_header(view)
    except CorruptRecord as exc:
        if exc.reason == "version" and _newer_and_sound(view):
            raise CorruptRecord("newer", f"format version {_VERSION.unpack_from(view, 8)[0]}, written by "
                                         f"a newer tierkv (this reader writes {FORMAT_VERSION})") from None
        raise
    if header.raw_len > max_raw_bytes:
        raise CorruptRecord("size", f"raw length {header.raw_len} exceeds the bound {max_raw_bytes}")
    if len(view) < header.record_len:
        raise CorruptRecord("truncated", f"{len(view)} bytes, the header declares {header.record_len}")
    if len(view) > header.record_len:
        raise CorruptRecord("size", f"{len(view)} bytes, the header declares {header.record_len}")
    end = header.header_len + header.sealed_len
    (stored_digest,) = _TRAILER.unpack_from(view, end)
    if xxhash.xxh3_64_intdigest(view[:end]) != stored_digest:
        raise CorruptRecord("checksum", "xxh3_64 mismatch")
    return header

"""Persistent record format: one self-describing, checksummed record per block.

A record is ``header | payload | trailer``. The header (little-endian: 56 fixed bytes, the key, a
plane table for ``zstd-shuffle``, zero bytes up to a multiple of 64) names the format version,
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

import os
import struct
import threading
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import xxhash
import zstandard

from tierkv.errors import CorruptRecord, InvalidArgument
from tierkv.records.encryption import KEY_ID_LEN, NONCE_LEN, KeyRing

__all__ = [
    "CHECKSUM_ALGORITHMS",
    "CODECS",
    "FIXED_HEADER_LEN",
    "FORMAT_VERSION",
    "HEADER_ALIGN",
    "MAGIC",
    "FLAG_ENCRYPTED",
    "MAX_KEY_LEN",
    "MAX_RAW_LEN",
    "PLANE_ENTRY_LEN",
    "SEAL_LEN",
    "TAG_LEN",
    "TRAILER_LEN",
    "PlaneInfo",
    "RecordHeader",
    "decode_record",
    "encode_record",
    "encode_record_parts",
    "header_len_for",
    "none_header",
    "none_parts_match",
    "read_header",
    "sealed_none_open",
    "verify_record",
]

#: Codec names, indexed by their codec id in the header.
CODECS: Final[tuple[str, ...]] = ("none", "zstd", "zstd-shuffle")
#: Checksum algorithm names, indexed by their id in the header (id 0 is invalid).
CHECKSUM_ALGORITHMS: Final[tuple[str, ...]] = ("", "xxh3_64")
#: First 8 bytes of every record (PNG-style: a high-bit byte, CR LF, ^Z, LF catch text-mode damage).
MAGIC: Final = b"\x89TKV\r\n\x1a\n"
FORMAT_VERSION: Final = 2
FIXED_HEADER_LEN: Final = 56
#: The header is padded with zero bytes to a multiple of this, so the payload starts 64-aligned in
#: the file: the kernel then copies it to a 64-aligned buffer a quarter faster (bench/fs_tier.py).
HEADER_ALIGN: Final = 64
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
# cipher id, 3 reserved bytes (zero), key id, nonce
_SEAL: Final = struct.Struct("<B3s8s12s")
_RESERVED_PLANE: Final = bytes(7)

#: A compressed plane is kept only if it is at most this fraction of the raw plane.
_PAYS: Final = 0.9
#: Planes shorter than this are stored raw without trying.
_MIN_COMPRESS: Final = 64
#: Thread-local scratch buffers up to this size are kept for reuse.
_SCRATCH_KEEP: Final = 8 << 20
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


def _zstd_bound(n: int) -> int:
    """ZSTD_COMPRESSBOUND: the most bytes zstd emits for ``n`` input bytes."""
    return n + (n >> 8) + (((_ZSTD_BLOCK - n) >> 11) if n < _ZSTD_BLOCK else 0)


def header_len_for(key_len: int, plane_count: int, encrypted: bool = False) -> int:
    """The header length of a record with this key length and plane count (padding included)."""
    unpadded = FIXED_HEADER_LEN + key_len + plane_count * PLANE_ENTRY_LEN + (SEAL_LEN if encrypted else 0)
    return -(-unpadded // HEADER_ALIGN) * HEADER_ALIGN


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
    header_len = header_len_for(len(key), plane_count, keys is not None)
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


def none_header(*, key: bytes, fingerprint: str, raw_len: int, elem_size: int = 2,
                key_id: bytes | None = None) -> bytes:
    """The exact header (key and padding included) :func:`encode_record` writes for a ``none`` record.

    With ``key_id``: the header of a record sealed by that key, with an all-zero nonce (each
    record has its own; :func:`sealed_none_open` compares everything else).
    """
    key = _key_bytes(key)
    header_len = header_len_for(len(key), 0, key_id is not None)
    seal = b"" if key_id is None else _SEAL.pack(_CIPHER_AES256_GCM, bytes(3), key_id, bytes(NONCE_LEN))
    return _FIXED.pack(MAGIC, FORMAT_VERSION, _CODEC_NONE, _CHECKSUM_XXH3_64, elem_size, 0, len(key),
                       header_len, 0 if key_id is None else FLAG_ENCRYPTED, _fingerprint_bytes(fingerprint),
                       raw_len, raw_len) + key + seal + bytes(header_len - FIXED_HEADER_LEN - len(key)
                                                              - len(seal))


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
    if version != FORMAT_VERSION:
        raise CorruptRecord("version", f"format version {version}, this reader knows {FORMAT_VERSION}")
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
    if header_len != header_len_for(key_len, plane_count, encrypted):
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


def _check_record(view: memoryview, max_raw_bytes: int) -> RecordHeader:
    """Header, size bound, total length and checksum: everything short of decoding."""
    if isinstance(max_raw_bytes, bool) or not isinstance(max_raw_bytes, int) or max_raw_bytes < 0:
        raise InvalidArgument(f"max_raw_bytes must be a non-negative int, got {max_raw_bytes!r}")
    header = _parse_header(view)
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
    whose ``accept_plain`` is False an unencrypted record is refused (``plaintext``). Raises
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

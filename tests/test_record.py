"""The persistent record format (tierkv.records.format): round trips, the byte layout, and refusal of every
corrupt, truncated, foreign, mismatched or hostile record."""

from __future__ import annotations

import struct
import tracemalloc
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt
import pytest
import torch
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierkv.errors import CorruptRecord, InvalidArgument
from tierkv.records import (
    CODECS,
    MAX_RAW_LEN,
    RecordHeader,
    decode_record,
    encode_record,
    read_header,
    verify_record,
)

# The layout as docs/format.md states it, written out independently of tierkv.records.format.
SPEC_MAGIC = b"\x89TKV\r\n\x1a\n"
SPEC_FIXED = struct.Struct("<8sHBBBBHII16sQQ")
SPEC_PLANE = struct.Struct("<QB7x")
CODEC_IDS = {"none": 0, "zstd": 1, "zstd-shuffle": 2}
FIXED_FIELDS = [0, 8, 10, 11, 12, 13, 14, 16, 20, 24, 40, 48, 56]

FP = "00112233445566778899aabbccddeeff"
OTHER_FP = "00112233445566778899aabbccddeefe"
KEY = bytes(range(100, 132)) + (3).to_bytes(4, "big")
MiB = 1 << 20

U8 = npt.NDArray[np.uint8]


def kv_like(dtype: torch.dtype, n_values: int, seed: int = 0) -> U8:
    """KV-cache-like values: per-channel scales, a few outlier channels, AR(1) along tokens."""
    gen = torch.Generator().manual_seed(seed)
    channels, tokens = 256, -(-n_values // 256)
    scale = 0.5 * torch.exp(0.6 * torch.randn(1, channels, generator=gen))
    scale = torch.where(torch.rand(1, channels, generator=gen) < 0.02, 20.0 * scale, scale)
    noise = torch.randn(tokens, channels, generator=gen)
    walk = torch.empty_like(noise)
    walk[0] = noise[0]
    for t in range(1, tokens):
        walk[t] = 0.9 * walk[t - 1] + 0.436 * noise[t]
    values = (scale * walk).reshape(-1)[:n_values].to(dtype)
    return values.contiguous().view(torch.uint8).numpy().copy()


DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "bf16": (torch.bfloat16, 2),
    "fp16": (torch.float16, 2),
    "fp32": (torch.float32, 4),
    "fp8": (torch.float8_e4m3fn, 1),
}


def encode(payload: object, codec: str = "none", **kw: object) -> bytes:
    return encode_record(key=KEY, fingerprint=FP, payload=payload, codec=codec, **kw)  # type: ignore[arg-type]


def decode(data: bytes | memoryview, max_raw_bytes: int = MiB, **kw: object) -> U8:
    args: dict[str, object] = {"key": KEY, "fingerprint": FP, "max_raw_bytes": max_raw_bytes, **kw}
    return decode_record(data, **args)  # type: ignore[arg-type]


def seal(body: bytes) -> bytes:
    """Append the trailer: xxh3_64 of everything before it, little-endian."""
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def reseal(record: bytes) -> bytes:
    return seal(record[:-8])


def build(
    *,
    codec: str,
    raw_len: int,
    payload: bytes,
    elem_size: int = 2,
    planes: tuple[tuple[int, int], ...] = (),
    key: bytes = KEY,
    fp: str = FP,
    version: int = 3,
    checksum_id: int = 1,
    flags: int = 0,
    padding: bytes | None = None,
) -> bytes:
    """A record written from the spec alone: planes are (stored_len, mode) pairs."""
    table = b"".join(SPEC_PLANE.pack(stored, mode) for stored, mode in planes)
    unpadded = 56 + len(key) + len(table)
    align = 4096 if version >= 3 and codec == "none" and raw_len >= 4096 else 64
    header_len = -(-unpadded // align) * align
    if padding is None:
        padding = bytes(header_len - unpadded)
    assert len(padding) == header_len - unpadded
    fixed = SPEC_FIXED.pack(
        SPEC_MAGIC,
        version,
        CODEC_IDS[codec],
        checksum_id,
        elem_size,
        len(planes),
        len(key),
        header_len,
        flags,
        bytes.fromhex(fp),
        raw_len,
        len(payload),
    )
    return seal(fixed + key + table + padding + payload)


def patch(record: bytes, offset: int, fmt: str, value: int) -> bytes:
    buf = bytearray(record)
    struct.pack_into(fmt, buf, offset, value)
    return bytes(buf)


def reason_of(fn: Callable[..., object], *args: object, **kwargs: object) -> str:
    """The reason of the CorruptRecord that ``fn(*args, **kwargs)`` must raise."""
    with pytest.raises(CorruptRecord) as info:
        fn(*args, **kwargs)
    return info.value.reason


def payload_cases() -> list[tuple[str, U8, int]]:
    cases = []
    for name, (dtype, size) in DTYPES.items():
        block = kv_like(dtype, 4096, seed=size)
        cases.append((name, block, size))
        cases.append((f"{name}-odd", block[: block.size - 1 - (size > 1)], size))
    cases.append(("tiny", np.frombuffer(b"\x01\x02\x03", dtype=np.uint8), 2))
    cases.append(("empty", np.zeros(0, dtype=np.uint8), 2))
    cases.append(("zeros", np.zeros(8192, dtype=np.uint8), 2))
    cases.append(("random", np.random.default_rng(1).integers(0, 256, 8192, dtype=np.uint8), 2))
    cases.append(("elem3", kv_like(torch.bfloat16, 3001, seed=3)[:6001], 3))
    return cases


PAYLOADS = payload_cases()


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize(("name", "block", "elem_size"), PAYLOADS, ids=[c[0] for c in PAYLOADS])
def test_round_trip(codec: str, name: str, block: U8, elem_size: int) -> None:
    original = block.copy()
    record = encode(block, codec, elem_size=elem_size)
    decoded = decode(record)
    assert decoded.dtype == np.uint8 and decoded.shape == (block.size,)
    assert np.array_equal(decoded, original)
    assert decoded.flags.writeable and not np.shares_memory(decoded, block)
    header = verify_record(record, max_raw_bytes=block.size)
    assert header == read_header(record)
    assert (header.codec, header.key, header.fingerprint) == (codec, KEY, FP)
    assert (header.raw_len, header.elem_size, header.record_len) == (block.size, elem_size, len(record))


@pytest.mark.parametrize("codec", CODECS)
def test_payload_types(codec: str) -> None:
    block = kv_like(torch.bfloat16, 2048)
    as_bytes = block.tobytes()
    wide = block.view(np.uint16).reshape(32, 64)
    expected = encode(block, codec)
    assert encode(as_bytes, codec) == expected
    assert encode(memoryview(as_bytes), codec) == expected
    assert encode(bytearray(as_bytes), codec) == expected
    assert encode(wide, codec) == expected
    assert encode(wide.data, codec) == expected


@pytest.mark.parametrize("codec", CODECS)
def test_decode_into_out(codec: str) -> None:
    block = kv_like(torch.bfloat16, 4096)
    record = encode(block, codec)
    out = np.full((64, 128), 0xAB, dtype=np.uint8)
    result = decode(record, out=out)
    assert result is out
    assert np.array_equal(out.reshape(-1), block)


@pytest.mark.parametrize("codec", CODECS)
def test_decode_into_a_view_of_a_larger_array(codec: str) -> None:
    block = kv_like(torch.bfloat16, 1024)
    record = encode(block, codec)
    pool = np.zeros((4, block.size), dtype=np.uint8)
    decode(record, out=pool[2])
    assert np.array_equal(pool[2], block)
    assert not pool[[0, 1, 3]].any()


def test_decode_from_a_memoryview_slice() -> None:
    block = kv_like(torch.bfloat16, 1024)
    record = encode(block, "zstd-shuffle")
    buffer = b"junk" + record + b"more junk"
    view = memoryview(buffer)[4 : 4 + len(record)]
    assert np.array_equal(decode(view), block)


def test_out_of_the_wrong_size_is_refused() -> None:
    record = encode(kv_like(torch.bfloat16, 1024), "zstd")
    assert reason_of(lambda: decode(record, out=np.empty(2047, dtype=np.uint8))) == "size"
    assert reason_of(lambda: decode(record, out=np.empty(2049, dtype=np.uint8))) == "size"


@pytest.mark.parametrize(
    "out",
    [
        np.empty(1024, dtype=np.uint16),
        np.empty(4096, dtype=np.uint8)[::2],
        np.empty((2, 2048), dtype=np.uint8).T,
    ],
    ids=["dtype", "strided", "fortran"],
)
def test_bad_out_is_an_invalid_argument(out: U8) -> None:
    record = encode(kv_like(torch.bfloat16, 1024))
    with pytest.raises(InvalidArgument):
        decode(record, out=out)
    readonly = np.empty(2048, dtype=np.uint8)
    readonly.flags.writeable = False
    with pytest.raises(InvalidArgument):
        decode(record, out=readonly)


@pytest.mark.parametrize("codec", CODECS)
def test_layout_matches_the_spec(codec: str) -> None:
    block = kv_like(torch.bfloat16, 4096)
    record = encode(block, codec)
    fields = SPEC_FIXED.unpack_from(record, 0)
    magic, version, codec_id, checksum_id, elem_size, n_planes, key_len, header_len, flags = fields[:9]
    fp, raw_len, stored_len = fields[9:]
    assert (magic, version, codec_id, checksum_id, elem_size) == (SPEC_MAGIC, 3, CODEC_IDS[codec], 1, 2)
    assert n_planes == (2 if codec == "zstd-shuffle" else 0)
    assert (key_len, flags, fp, raw_len) == (len(KEY), 0, bytes.fromhex(FP), block.size)
    unpadded = 56 + len(KEY) + 16 * n_planes
    # version 3: a none record of at least a page has its payload on a page boundary; others 64
    align = 4096 if codec == "none" else 64
    assert header_len % align == 0 and unpadded <= header_len < unpadded + align
    assert record[unpadded:header_len] == bytes(header_len - unpadded)
    assert record[56 : 56 + key_len] == KEY
    assert len(record) == header_len + stored_len + 8
    (digest,) = struct.unpack_from("<Q", record, len(record) - 8)
    assert digest == xxhash.xxh3_64_intdigest(record[:-8])
    payload = record[header_len : header_len + stored_len]
    if codec == "none":
        assert payload == block.tobytes()
    elif codec == "zstd":
        assert zstandard.ZstdDecompressor().decompress(payload) == block.tobytes()
    else:
        offset = 0
        for i in range(n_planes):
            stored, mode, reserved = struct.unpack_from("<QB7s", record, 56 + key_len + 16 * i)
            assert reserved == bytes(7)
            chunk = payload[offset : offset + stored]
            offset += stored
            plane = zstandard.ZstdDecompressor().decompress(chunk) if mode == 1 else chunk
            assert mode in (0, 1)
            assert plane == block[i::2].tobytes()
        assert offset == stored_len


def test_record_built_from_the_spec_is_read() -> None:
    block = kv_like(torch.bfloat16, 1000)
    lo, hi = block[0::2].tobytes(), block[1::2].tobytes()
    hi_frame = zstandard.ZstdCompressor(level=3).compress(hi)
    record = build(
        codec="zstd-shuffle",
        raw_len=block.size + 1,
        payload=lo + hi_frame + b"\x7f",
        planes=((1000, 0), (len(hi_frame), 1)),
    )
    expected = np.concatenate([block, np.array([0x7F], dtype=np.uint8)])
    assert np.array_equal(decode(record), expected)
    assert np.array_equal(
        decode(build(codec="none", raw_len=5, payload=b"hello")), np.frombuffer(b"hello", np.uint8)
    )


def test_shuffle_stores_what_pays() -> None:
    kv = kv_like(torch.bfloat16, 1 << 16)
    planes = read_header(encode(kv, "zstd-shuffle")).planes
    assert [p.compressed for p in planes] == [False, True]
    assert planes[0].stored_len == planes[0].raw_len == kv.size // 2
    assert planes[1].stored_len < planes[1].raw_len / 2
    zeros = read_header(encode(np.zeros(1 << 16, dtype=np.uint8), "zstd-shuffle")).planes
    assert [p.compressed for p in zeros] == [True, True]
    noise = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
    assert [p.compressed for p in read_header(encode(noise, "zstd-shuffle")).planes] == [False, False]
    fp32 = read_header(encode(kv_like(torch.float32, 1 << 15), "zstd-shuffle", elem_size=4)).planes
    assert fp32[3].compressed and not fp32[0].compressed


def test_shuffle_compresses_kv_data_better_than_zstd() -> None:
    kv = kv_like(torch.bfloat16, 1 << 17)
    none, plain, shuffled = (len(encode(kv, c)) for c in CODECS)
    assert none > plain > shuffled
    assert kv.size / shuffled > 1.3


@pytest.mark.parametrize("codec", CODECS)
def test_every_bit_flip_in_the_header_and_trailer_is_caught(codec: str) -> None:
    block = kv_like(torch.bfloat16, 512)
    record = encode(block, codec)
    header = read_header(record)
    positions = [*range(header.header_len), *range(len(record) - 8, len(record))]
    for pos in positions:
        for bit in range(8):
            damaged = bytearray(record)
            damaged[pos] ^= 1 << bit
            with pytest.raises(CorruptRecord):
                decode(bytes(damaged))
            with pytest.raises(CorruptRecord):
                verify_record(bytes(damaged), max_raw_bytes=MiB)


@pytest.mark.parametrize("codec", CODECS)
def test_every_payload_byte_flip_is_caught(codec: str) -> None:
    block = kv_like(torch.bfloat16, 512)
    record = encode(block, codec)
    header = read_header(record)
    for pos in range(header.header_len, header.header_len + header.stored_len):
        damaged = bytearray(record)
        damaged[pos] ^= 1 << (pos % 8)
        assert reason_of(decode, bytes(damaged)) == "checksum"


@pytest.mark.parametrize("codec", CODECS)
def test_truncation_at_every_field_boundary(codec: str) -> None:
    block = kv_like(torch.bfloat16, 1024)
    record = encode(block, codec)
    header = read_header(record)
    key_end = 56 + len(KEY)
    cuts = [
        *FIXED_FIELDS,
        key_end - 1,
        key_end,
        header.header_len,
        header.header_len + 1,
        header.header_len + header.stored_len // 2,
        len(record) - 8,
        len(record) - 1,
    ]
    if codec == "zstd-shuffle":
        cuts += [key_end + 16, key_end + 24]
    assert reason_of(lambda: decode(record[:0])) == "empty"
    for cut in sorted(set(cuts) - {0}):
        assert reason_of(decode, record[:cut]) == "truncated", cut
        assert reason_of(verify_record, record[:cut], max_raw_bytes=MiB) == "truncated"


def test_read_header_works_on_the_header_alone() -> None:
    record = encode(kv_like(torch.bfloat16, 1024), "zstd-shuffle")
    header = read_header(record)
    assert read_header(record[: header.header_len]) == header
    assert reason_of(lambda: read_header(record[: header.header_len - 1])) == "truncated"


def test_trailing_bytes_are_refused() -> None:
    record = encode(kv_like(torch.bfloat16, 256), "zstd")
    assert reason_of(lambda: decode(record + b"\0")) == "size"


def test_empty_data() -> None:
    assert reason_of(lambda: decode(b"")) == "empty"
    assert reason_of(lambda: decode(memoryview(b""))) == "empty"
    assert reason_of(lambda: read_header(b"")) == "empty"
    assert reason_of(lambda: verify_record(bytearray(), max_raw_bytes=MiB)) == "empty"


@pytest.mark.parametrize(
    "data",
    [
        b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + bytes(200),
        b"GIF8",
        b'{"not": "a record"}',
        bytes(np.random.default_rng(7).integers(0, 256, 4096, dtype=np.uint8)),
        zstandard.ZstdCompressor().compress(bytes(1000)),
        b"\x89",
    ],
    ids=["png", "gif-prefix", "json", "random", "bare-zstd", "one-byte"],
)
def test_foreign_data(data: bytes) -> None:
    expected = "truncated" if data == b"\x89" else "magic"
    assert reason_of(lambda: decode(data)) == expected
    assert reason_of(lambda: read_header(data)) == expected


def test_wrong_key_and_fingerprint() -> None:
    record = encode(kv_like(torch.bfloat16, 256), "zstd")
    assert (
        reason_of(lambda: decode_record(record, key=KEY[:-1] + b"\x04", fingerprint=FP, max_raw_bytes=MiB))
        == "key"
    )
    assert reason_of(lambda: decode_record(record, key=KEY[:-1], fingerprint=FP, max_raw_bytes=MiB)) == "key"
    assert (
        reason_of(lambda: decode_record(record, key=KEY, fingerprint=OTHER_FP, max_raw_bytes=MiB))
        == "fingerprint"
    )
    header = verify_record(record, max_raw_bytes=MiB)
    assert (header.key, header.fingerprint) == (KEY, FP)


def test_max_raw_bytes_smaller_than_the_record_is_refused() -> None:
    block = kv_like(torch.bfloat16, 1024)
    for codec in CODECS:
        record = encode(block, codec)
        assert reason_of(decode, record, max_raw_bytes=block.size - 1) == "size"
        assert reason_of(verify_record, record, max_raw_bytes=block.size - 1) == "size"
        assert np.array_equal(decode(record, max_raw_bytes=block.size), block)


def bounded_allocation(fn: Callable[[], object], limit: int = MiB) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(CorruptRecord) as info:
            fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < limit, peak
    assert info.value.reason == "size"


@pytest.mark.parametrize("codec", CODECS)
def test_absurd_sizes_are_refused_without_allocating(codec: str) -> None:
    record = encode(kv_like(torch.bfloat16, 256), codec)
    huge_raw = reseal(patch(record, 40, "<Q", 1 << 60))
    bounded_allocation(lambda: decode(huge_raw))
    bounded_allocation(lambda: read_header(huge_raw))
    bounded_allocation(lambda: verify_record(huge_raw, max_raw_bytes=1 << 62))
    huge_stored = reseal(patch(record, 48, "<Q", 1 << 62))
    bounded_allocation(lambda: decode(huge_stored))
    bounded_allocation(lambda: decode(huge_stored, max_raw_bytes=1 << 62))
    both = reseal(patch(patch(record, 40, "<Q", MAX_RAW_LEN), 48, "<Q", MAX_RAW_LEN))
    bounded_allocation(lambda: decode(both))


def test_consistent_but_large_sizes_are_truncated_without_allocating() -> None:
    record = build(codec="none", raw_len=1 << 34, payload=b"")
    record = reseal(patch(record, 48, "<Q", 1 << 34))
    tracemalloc.start()
    try:
        assert reason_of(lambda: decode(record, max_raw_bytes=1 << 35)) == "truncated"
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MiB


def test_plane_table_inconsistencies() -> None:
    lo = bytes(100)
    frame = zstandard.ZstdCompressor().compress(bytes(100))
    ok = build(codec="zstd-shuffle", raw_len=200, payload=lo + frame, planes=((100, 0), (len(frame), 1)))
    assert np.array_equal(decode(ok), np.zeros(200, dtype=np.uint8))
    raw_plane_wrong = build(
        codec="zstd-shuffle", raw_len=200, payload=lo[:99] + frame, planes=((99, 0), (len(frame), 1))
    )
    assert reason_of(lambda: decode(raw_plane_wrong)) == "size"
    bad_mode = build(
        codec="zstd-shuffle", raw_len=200, payload=lo + frame, planes=((100, 0), (len(frame), 2))
    )
    assert reason_of(lambda: decode(bad_mode)) == "codec"
    too_few = build(codec="zstd-shuffle", raw_len=200, payload=lo + lo, planes=((100, 0),))
    assert reason_of(lambda: decode(too_few)) == "codec"
    planes_on_zstd = build(codec="zstd", raw_len=100, payload=frame, planes=((100, 0),), elem_size=1)
    assert reason_of(lambda: decode(planes_on_zstd)) == "codec"
    reserved = bytearray(ok)
    reserved[56 + len(KEY) + 10] = 1
    assert reason_of(lambda: decode(reseal(bytes(reserved)))) == "codec"


def test_header_fields_with_a_valid_checksum() -> None:
    payload = b"abcdefgh"
    assert reason_of(lambda: decode(build(codec="none", raw_len=8, payload=payload, version=1))) == "version"
    assert reason_of(lambda: decode(build(codec="none", raw_len=8, payload=payload, version=0))) == "version"
    # a newer version, sound (its trailer checks): not this reader's to serve, not damage
    assert reason_of(lambda: decode(build(codec="none", raw_len=8, payload=payload, version=4))) == "newer"
    newer_flipped = bytearray(build(codec="none", raw_len=8, payload=payload, version=4))
    newer_flipped[-9] ^= 1
    assert reason_of(lambda: decode(bytes(newer_flipped))) == "version"
    assert decode(build(codec="none", raw_len=8, payload=payload, version=2)).tobytes() == payload
    odd_key = KEY + b"\x07"  # 56 + 37 bytes: 35 bytes of padding to 128
    padded = build(codec="none", raw_len=8, payload=payload, key=odd_key, padding=bytes(34) + b"\x01")
    assert reason_of(lambda: decode(padded, key=odd_key)) == "version"
    zero_padded = build(codec="none", raw_len=8, payload=payload, key=odd_key)
    assert decode(zero_padded, key=odd_key).tobytes() == payload
    assert reason_of(lambda: decode(build(codec="none", raw_len=8, payload=payload, flags=1))) == "version"
    assert (
        reason_of(lambda: decode(build(codec="none", raw_len=8, payload=payload, checksum_id=2)))
        == "checksum"
    )
    assert reason_of(lambda: decode(build(codec="none", raw_len=8, payload=payload, elem_size=0))) == "size"
    assert reason_of(lambda: decode(build(codec="none", raw_len=9, payload=payload))) == "size"
    assert reason_of(lambda: decode(build(codec="none", raw_len=8, payload=payload, key=b""))) == "key"
    record = build(codec="none", raw_len=8, payload=payload)
    assert reason_of(lambda: decode(reseal(patch(record, 10, "<B", 3)))) == "codec"
    assert reason_of(lambda: decode(reseal(patch(record, 16, "<I", 57 + len(KEY))))) == "size"
    # version 1's unpadded header length is not a version 2 or 3 header length
    assert reason_of(lambda: decode(reseal(patch(record, 16, "<I", 56 + len(KEY))))) == "size"


def zstd_record(frame: bytes, raw_len: int) -> bytes:
    return build(codec="zstd", raw_len=raw_len, payload=frame, elem_size=1)


def test_zstd_bomb_is_refused() -> None:
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(64 * MiB))
    assert len(bomb) < 4096
    record = zstd_record(bomb, 4096)
    tracemalloc.start()
    try:
        assert reason_of(lambda: decode(record)) == "decompress"
        assert reason_of(lambda: verify_record(record, max_raw_bytes=MiB)) == "decompress"
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MiB


def test_zstd_frame_without_content_size_is_refused() -> None:
    cctx = zstandard.ZstdCompressor(write_content_size=False)
    assert reason_of(lambda: decode(zstd_record(cctx.compress(bytes(64 * MiB)), 4096))) == "decompress"
    assert reason_of(lambda: decode(zstd_record(cctx.compress(bytes(4096)), 4096))) == "decompress"


def test_zstd_frames_that_decode_to_more_or_fewer_bytes_are_refused() -> None:
    cctx = zstandard.ZstdCompressor()
    exact = cctx.compress(bytes(4096))
    assert np.array_equal(decode(zstd_record(exact, 4096)), np.zeros(4096, dtype=np.uint8))
    assert reason_of(lambda: decode(zstd_record(exact + cctx.compress(bytes(10)), 4096))) == "decompress"
    assert reason_of(lambda: decode(zstd_record(cctx.compress(bytes(4095)), 4096))) == "decompress"
    assert reason_of(lambda: decode(zstd_record(exact[:-3], 4096))) == "decompress"
    assert reason_of(lambda: decode(zstd_record(exact + b"junk", 4096))) == "decompress"
    assert reason_of(lambda: decode(zstd_record(b"\0" * 16, 4096))) == "decompress"


def test_shuffle_plane_bomb_is_refused() -> None:
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(16 * MiB))
    record = build(
        codec="zstd-shuffle", raw_len=2000, payload=bytes(1000) + bomb, planes=((1000, 0), (len(bomb), 1))
    )
    assert reason_of(lambda: decode(record)) == "decompress"
    out = np.empty(2000, dtype=np.uint8)
    assert reason_of(lambda: decode(record, out=out)) == "decompress"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"codec": "lz4"}, "codec"),
        ({"codec": "ZSTD"}, "codec"),
        ({"fingerprint": FP.upper()}, "fingerprint"),
        ({"fingerprint": FP[:-1]}, "fingerprint"),
        ({"fingerprint": "g" * 32}, "fingerprint"),
        ({"key": b""}, "key"),
        ({"key": b"k" * 65536}, "key"),
        ({"key": "not bytes"}, "key"),
        ({"elem_size": 0}, "elem_size"),
        ({"elem_size": 256}, "elem_size"),
        ({"level": 23}, "level"),
        ({"level": 1.5}, "level"),
        ({"payload": np.zeros((8, 8), dtype=np.uint8)[:, ::2]}, "contiguous"),
        ({"payload": [1, 2, 3]}, "payload"),
    ],
)
def test_bad_encode_arguments(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"key": KEY, "fingerprint": FP, "payload": bytes(64), **kwargs}
    with pytest.raises(InvalidArgument, match=match):
        encode_record(**args)  # type: ignore[arg-type]


def test_bad_decode_arguments() -> None:
    record = encode(bytes(64))
    with pytest.raises(InvalidArgument):
        decode_record(record, key=KEY, fingerprint=FP.upper(), max_raw_bytes=MiB)
    with pytest.raises(InvalidArgument):
        decode_record(record, key=KEY, fingerprint=FP, max_raw_bytes=-1)
    with pytest.raises(InvalidArgument):
        verify_record(record, max_raw_bytes=-1)


def test_levels_round_trip() -> None:
    block = kv_like(torch.bfloat16, 4096)
    for level in (-5, 1, 3, 9):
        for codec in ("zstd", "zstd-shuffle"):
            assert np.array_equal(decode(encode(block, codec, level=level)), block)


def test_concurrent_threads() -> None:
    blocks = [kv_like(torch.bfloat16, 8192, seed=s) for s in range(8)]

    def work(i: int) -> bool:
        codec = CODECS[i % 3]
        block = blocks[i % len(blocks)]
        record = encode(block, codec, level=1 + i % 2)
        out = np.empty(block.size, dtype=np.uint8)
        return bool(np.array_equal(decode(record, out=out), block))

    with ThreadPoolExecutor(max_workers=4) as pool:
        assert all(pool.map(work, range(96)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    payload=st.binary(max_size=3000),
    codec=st.sampled_from(CODECS),
    elem_size=st.integers(1, 9),
    key=st.binary(min_size=1, max_size=80),
    fp=st.binary(min_size=16, max_size=16).map(bytes.hex),
    into_out=st.booleans(),
)
def test_round_trip_property(
    payload: bytes, codec: str, elem_size: int, key: bytes, fp: str, into_out: bool
) -> None:
    record = encode_record(key=key, fingerprint=fp, payload=payload, codec=codec, elem_size=elem_size)
    out = np.empty(len(payload), dtype=np.uint8) if into_out else None
    decoded = decode_record(record, key=key, fingerprint=fp, max_raw_bytes=len(payload), out=out)
    assert decoded.tobytes() == payload
    header = verify_record(record, max_raw_bytes=len(payload))
    assert isinstance(header, RecordHeader)
    assert (header.key, header.fingerprint, header.codec, header.raw_len) == (key, fp, codec, len(payload))


@settings(max_examples=300, deadline=None)
@given(
    payload=st.binary(min_size=1, max_size=2000),
    codec=st.sampled_from(CODECS),
    where=st.floats(0, 1, exclude_max=True),
    xor=st.integers(1, 255),
)
def test_any_single_byte_change_is_refused(payload: bytes, codec: str, where: float, xor: int) -> None:
    record = bytearray(encode(payload, codec))
    record[int(where * len(record))] ^= xor
    with pytest.raises(CorruptRecord):
        decode(bytes(record))


GOLDEN_NONE = """
89 54 4b 56 0d 0a 1a 0a 03 00 00 01 02 00 08 00 40 00 00 00 00 00 00 00 01 23 45 67 89 ab cd ef
01 23 45 67 89 ab cd ef 0e 00 00 00 00 00 00 00 0e 00 00 00 00 00 00 00 00 11 22 33 00 00 00 01
68 65 6c 6c 6f 2c 20 74 69 65 72 6b 76 21 be 33 44 8b b1 c6 e8 b5
"""
GOLDEN_SHUFFLE = """
89 54 4b 56 0d 0a 1a 0a 03 00 02 01 02 02 08 00 80 00 00 00 00 00 00 00 01 23 45 67 89 ab cd ef
01 23 45 67 89 ab cd ef 0f 00 00 00 00 00 00 00 0f 00 00 00 00 00 00 00 00 11 22 33 00 00 00 01
07 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 07 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00
00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00
68 6c 6f 20 69 72 76 65 6c 2c 74 65 6b 21 21 67 a7 3b 29 fb 85 78 4f
"""
# the same blocks in version 2, as the previous release wrote them (docs/format.md, "Version 2")
GOLDEN_NONE_V2 = """
89 54 4b 56 0d 0a 1a 0a 02 00 00 01 02 00 08 00 40 00 00 00 00 00 00 00 01 23 45 67 89 ab cd ef
01 23 45 67 89 ab cd ef 0e 00 00 00 00 00 00 00 0e 00 00 00 00 00 00 00 00 11 22 33 00 00 00 01
68 65 6c 6c 6f 2c 20 74 69 65 72 6b 76 21 1c 06 f7 a0 36 70 4c a0
"""
GOLDEN_SHUFFLE_V2 = """
89 54 4b 56 0d 0a 1a 0a 02 00 02 01 02 02 08 00 80 00 00 00 00 00 00 00 01 23 45 67 89 ab cd ef
01 23 45 67 89 ab cd ef 0f 00 00 00 00 00 00 00 0f 00 00 00 00 00 00 00 00 11 22 33 00 00 00 01
07 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 07 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00
00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00
68 6c 6f 20 69 72 76 65 6c 2c 74 65 6b 21 21 82 0f a6 76 2a 1f a1 30
"""


@pytest.mark.parametrize(
    ("payload", "golden"), [(b"hello, tierkv!", GOLDEN_NONE_V2), (b"hello, tierkv!!", GOLDEN_SHUFFLE_V2)]
)
def test_version_2_examples_in_the_format_doc_still_read(payload: bytes, golden: str) -> None:
    record = bytes.fromhex(golden)
    assert read_header(record).version == 2
    got = decode_record(record, key=bytes.fromhex("0011223300000001"),
                        fingerprint="0123456789abcdef0123456789abcdef", max_raw_bytes=len(payload))
    assert got.tobytes() == payload


def test_page_aligned_example_in_the_format_doc() -> None:
    """The 8 KiB ``none`` example: header 4096 bytes (zero from 64 on), the block at 0x1000."""
    key = bytes.fromhex("0011223300000001")
    block = bytes(range(256)) * 32
    record = encode_record(key=key, fingerprint="0123456789abcdef0123456789abcdef", payload=block)
    assert SPEC_FIXED.unpack_from(record)[7] == 0x1000
    assert record[64:0x1000] == bytes(0x1000 - 64) and record[0x1000:0x3000] == block
    assert len(record) == 0x3008
    assert struct.unpack("<Q", record[-8:])[0] == xxhash.xxh3_64_intdigest(record[:-8])


@pytest.mark.parametrize(
    ("codec", "payload", "golden"),
    [("none", b"hello, tierkv!", GOLDEN_NONE), ("zstd-shuffle", b"hello, tierkv!!", GOLDEN_SHUFFLE)],
)
def test_examples_in_the_format_doc(codec: str, payload: bytes, golden: str) -> None:
    key = bytes.fromhex("0011223300000001")
    fp = "0123456789abcdef0123456789abcdef"
    expected = bytes.fromhex(golden)
    assert encode_record(key=key, fingerprint=fp, payload=payload, codec=codec, elem_size=2) == expected
    decoded = decode_record(expected, key=key, fingerprint=fp, max_raw_bytes=len(payload))
    assert decoded.tobytes() == payload


GOLDEN_SEALED = """
89 54 4b 56 0d 0a 1a 0a 03 00 00 01 02 00 08 00 80 00 00 00 01 00 00 00 01 23 45 67 89 ab cd ef
01 23 45 67 89 ab cd ef 0e 00 00 00 00 00 00 00 0e 00 00 00 00 00 00 00 00 11 22 33 00 00 00 01
01 00 00 00 b7 a5 59 71 e9 98 cc 2b a0 a1 a2 a3 a4 a5 a6 a7 a8 a9 aa ab 00 00 00 00 00 00 00 00
00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00
8e 7d 10 41 2a e7 22 cb 0b 00 f5 b8 71 5b 76 5d cc a3 f1 c9 14 43 4a c9 af 79 90 30 02 6e 37 4d
ec c2 ed 5a 7e 66
"""


def test_the_encrypted_example_in_the_format_doc(monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    import tierkv.records.encode as record
    from tierkv.records.encryption import KeyRing

    key = bytes.fromhex("0011223300000001")
    fp = "0123456789abcdef0123456789abcdef"
    aes_key = bytes(range(32))
    expected = bytes.fromhex(GOLDEN_SEALED)
    monkeypatch.setattr(record.os, "urandom", lambda n: bytes(range(0xA0, 0xA0 + n)))
    ring = KeyRing(aes_key)
    assert encode_record(key=key, fingerprint=fp, payload=b"hello, tierkv!", keys=ring) == expected
    assert decode_record(expected, key=key, fingerprint=fp, max_raw_bytes=14, keys=ring).tobytes() == \
        b"hello, tierkv!"
    # as docs/format.md states it: key id, nonce, the header as associated data, the tag after the
    # ciphertext, the checksum over everything before the trailer
    header_len = SPEC_FIXED.unpack_from(expected)[7]
    seal = expected[56 + 8:56 + 8 + 24]
    assert seal[0] == 1 and seal[4:12] == hashlib.sha256(b"tierkv key id v1\x00" + aes_key).digest()[:8]
    sealed = expected[header_len:-8]
    plain = AESGCM(aes_key).decrypt(seal[12:24], sealed, expected[:header_len])
    assert plain == b"hello, tierkv!"
    assert struct.unpack("<Q", expected[-8:])[0] == xxhash.xxh3_64_intdigest(expected[:-8])

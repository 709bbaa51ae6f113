"""Record codecs on KV-cache-like data: compression ratio and throughput against memcpy.

    python bench/codec.py [--blocks 64] [--block-bytes 262144] [--repeats 5] [--dtype bf16]

Each block is encoded with :func:`tierkv.records.encode_record` and decoded with
:func:`tierkv.records.decode_record` into a preallocated array, so the figures include the header,
the xxh3 checksum and every check a reader makes. Throughputs are in MB/s of raw block bytes
(1 MB = 1e6 bytes), the median over ``--repeats`` rounds, and each is also given as a fraction of
a numpy copy of the same blocks into a preallocated array, timed in the same rounds.

The data model (generated with torch, seeded): one block is a run of ``[tokens, heads * head_dim]``
slabs (one layer's K or V for the block's tokens), channels adjacent in memory as in vLLM's cache.
Every channel has its own scale (log-normal), 2 % of channels are outliers 20x larger, keys and
values carry a per-channel offset, and along the tokens each channel follows an AR(1) process with
correlation ``--rho``, so neighbouring tokens are close but not equal.
"""

from __future__ import annotations

import benchmain  # first: Ctrl-C while the imports below load ends quietly

# isort: split

import argparse
import functools
import os
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import torch
import zstandard

from tierkv.records import CODECS, decode_record, encode_record, read_header

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
KEY = bytes(range(32)) + (0).to_bytes(4, "big")
FINGERPRINT = "5f0c1d2e3a4b5c6d7e8f90a1b2c3d4e5"


def kv_like_blocks(
    n_blocks: int,
    block_bytes: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    tokens: int = 16,
    heads: int = 8,
    head_dim: int = 128,
    rho: float = 0.9,
    seed: int = 0,
) -> list[npt.NDArray[np.uint8]]:
    """``n_blocks`` blocks of ``block_bytes`` bytes of KV-cache-like values (see the module doc)."""
    gen = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    channels = heads * head_dim
    values_per_block = block_bytes // itemsize
    slabs = -(-values_per_block // (tokens * channels))
    scale = 0.5 * torch.exp(0.6 * torch.randn(n_blocks, slabs, 1, channels, generator=gen))
    outlier = torch.rand(n_blocks, slabs, 1, channels, generator=gen) < 0.02
    scale = torch.where(outlier, 20.0 * scale, scale)
    offset = 0.5 * scale * torch.randn(n_blocks, slabs, 1, channels, generator=gen)
    noise = torch.randn(n_blocks, slabs, tokens, channels, generator=gen)
    walk = torch.empty_like(noise)
    walk[:, :, 0] = noise[:, :, 0]
    innovation = (1.0 - rho * rho) ** 0.5
    for t in range(1, tokens):
        walk[:, :, t] = rho * walk[:, :, t - 1] + innovation * noise[:, :, t]
    values = (offset + scale * walk).to(dtype).reshape(n_blocks, -1)[:, :values_per_block]
    raw = values.contiguous().view(torch.uint8).numpy()
    blocks = []
    for row in raw:
        block = np.zeros(block_bytes, dtype=np.uint8)
        block[: row.size] = row
        blocks.append(block)
    return blocks


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print one line per codec."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=benchmain.positive, default=64, help="blocks per round (default 64)")
    parser.add_argument(
        "--block-bytes", type=benchmain.positive, default=256 << 10, help="bytes per block (default 256 KiB)"
    )
    parser.add_argument("--repeats", type=benchmain.positive, default=5,
                        help="rounds; medians are reported (default 5)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="value type (default bf16)")
    parser.add_argument("--level", type=int, default=1, help="zstd level (default 1)")
    parser.add_argument("--rho", type=float, default=0.9, help="token-to-token correlation (default 0.9)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not -(1 << 17) <= args.level <= zstandard.MAX_COMPRESSION_LEVEL:
        parser.error(f"--level: a zstd level, -131072..{zstandard.MAX_COMPRESSION_LEVEL} (got {args.level})")

    dtype = DTYPES[args.dtype]
    elem_size = torch.empty((), dtype=dtype).element_size()
    blocks = kv_like_blocks(args.blocks, args.block_bytes, dtype=dtype, rho=args.rho, seed=args.seed)
    raw_total = args.blocks * args.block_bytes
    dst = np.empty(args.block_bytes, dtype=np.uint8)

    def encode_all(codec: str) -> list[bytes]:
        return [
            encode_record(
                key=KEY,
                fingerprint=FINGERPRINT,
                payload=b,
                codec=codec,
                elem_size=elem_size,
                level=args.level,
            )
            for b in blocks
        ]

    def decode_all(records: list[bytes]) -> None:
        for r in records:
            decode_record(r, key=KEY, fingerprint=FINGERPRINT, max_raw_bytes=args.block_bytes, out=dst)

    def copy_all() -> None:
        for b in blocks:
            np.copyto(dst, b)

    records = {codec: encode_all(codec) for codec in CODECS}
    for codec, recs in records.items():
        decode_all(recs)
        for original, rec in zip(blocks, recs, strict=True):
            decode_record(rec, key=KEY, fingerprint=FINGERPRINT, max_raw_bytes=args.block_bytes, out=dst)
            if not np.array_equal(dst, original):
                raise SystemExit(f"{codec}: round trip differs")

    memcpy_t: list[float] = []
    enc_t: dict[str, list[float]] = {c: [] for c in CODECS}
    dec_t: dict[str, list[float]] = {c: [] for c in CODECS}
    for _ in range(args.repeats):
        memcpy_t.append(_seconds(copy_all))
        for codec in CODECS:
            enc_t[codec].append(_seconds(functools.partial(encode_all, codec)))
            dec_t[codec].append(_seconds(functools.partial(decode_all, records[codec])))

    zstd_version = ".".join(map(str, zstandard.ZSTD_VERSION))
    memcpy_mbs = raw_total / statistics.median(memcpy_t) / 1e6
    print(
        f"tierkv codec bench: {args.blocks} blocks x {args.block_bytes} B {args.dtype}, level {args.level}, "
        f"rho {args.rho}, {args.repeats} repeats (medians); {os.cpu_count()} CPUs, {platform.machine()}, "
        f"zstd {zstd_version}, numpy {np.__version__}"
    )
    print(f"memcpy (numpy copy into a preallocated block): {memcpy_mbs:,.0f} MB/s")
    header = ("codec", "ratio", "compress MB/s", "x memcpy", "decompress MB/s", "x memcpy")
    print("{:<13} {:>6} {:>14} {:>9} {:>16} {:>9}".format(*header))
    for codec in CODECS:
        ratio = raw_total / sum(len(r) for r in records[codec])
        enc = raw_total / statistics.median(enc_t[codec]) / 1e6
        dec = raw_total / statistics.median(dec_t[codec]) / 1e6
        enc_x, dec_x = enc / memcpy_mbs, dec / memcpy_mbs
        print(f"{codec:<13} {ratio:6.3f} {enc:14,.0f} {enc_x:9.4f} {dec:16,.0f} {dec_x:9.4f}")

    counts: dict[int, list[int]] = {}
    for rec in records["zstd-shuffle"]:
        for i, plane in enumerate(read_header(rec).planes):
            counts.setdefault(i, [0, 0])[plane.compressed] += 1
    for i, (raw, compressed) in sorted(counts.items()):
        stored = sum(read_header(r).planes[i].stored_len for r in records["zstd-shuffle"]) / args.blocks
        plane_bytes = args.block_bytes // elem_size
        print(
            f"zstd-shuffle plane {i} (byte {i} of each value): stored raw in {raw}, compressed in "
            f"{compressed} of {args.blocks} records; ratio {plane_bytes / stored:.3f}"
        )


if __name__ == "__main__":
    benchmain.run(main)

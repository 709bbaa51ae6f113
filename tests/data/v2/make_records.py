"""Writes the version 2 records beside this file with the release that wrote version 2 (tierkv at
8d3a649): ``PYTHONPATH=<that checkout> python tests/data/v2/make_records.py``. tests/test_format_v2.py
reads them with the current code; :func:`block` and :func:`key` regenerate what they hold."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

#: (file name, codec, sealed): one record each
RECORDS = [("none", "none", False), ("zstd", "zstd", False), ("zstd-shuffle", "zstd-shuffle", False),
           ("none-sealed", "none", True)]
#: the namespace "tier-tests" of tierkv.testing.conformance_layout(), group 0 (4096-byte blocks)
FINGERPRINT = "1741f0244fcb80ac8b468a5674005536"
BLOCK_BYTES = 4096
#: the AES-256 key of the sealed record (test data only)
AES_KEY = bytes(range(32))


def block(i: int) -> bytes:
    """Record ``i``'s block: 2048 fp16-like values whose high bytes repeat (so zstd pays)."""
    values = (np.arange(BLOCK_BYTES // 2, dtype=np.uint32) * (37 + i)) % 1000 + 0x3C00
    return values.astype("<u2").tobytes()


def key(i: int) -> bytes:
    """Record ``i``'s key: a 32-byte block hash, then group 0 as 4 big-endian bytes."""
    return bytes([0xB2, i]) * 16 + (0).to_bytes(4, "big")


def main() -> None:
    from tierkv.records import FORMAT_VERSION, encode_record
    from tierkv.records.encryption import KeyRing

    assert FORMAT_VERSION == 2, "run this with the release that writes version 2"
    here = Path(__file__).parent
    for i, (name, codec, sealed) in enumerate(RECORDS):
        record = encode_record(key=key(i), fingerprint=FINGERPRINT, payload=block(i), codec=codec,
                               keys=KeyRing(AES_KEY) if sealed else None)
        (here / f"{name}.tkv").write_bytes(record)
        print(name, len(record), file=sys.stderr)


if __name__ == "__main__":
    main()

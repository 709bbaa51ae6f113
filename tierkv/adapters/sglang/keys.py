"""SGLang page keys as tierkv block hashes.

SGLang names a page by a 64-hex-digit SHA-256 chained over the page's tokens
(``get_storage_hash_str``); its 32 raw bytes are the block hash. A key that is not 64 hex digits
(SGLang never makes one, but the old key-value API takes any string) is hashed instead.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

__all__ = ["page_hashes", "salted"]

_HEX = frozenset("0123456789abcdefABCDEF")


def _one(key: str) -> bytes:
    if len(key) == 64 and _HEX.issuperset(key):
        return bytes.fromhex(key)
    return hashlib.sha256(b"tierkv-sglang-key\0" + key.encode("utf-8", "surrogatepass")).digest()


def page_hashes(keys: Sequence[str], salt: bytes | None = None) -> list[bytes]:
    """The block hash of each page key; with ``salt``, one that differs per salt (rank-sharded pools)."""
    out = [_one(k) for k in keys]
    return out if salt is None else [salted(h, salt) for h in out]


def salted(block_hash: bytes, salt: bytes) -> bytes:
    """``block_hash`` made specific to ``salt`` (e.g. a TP rank), still 32 bytes."""
    return hashlib.sha256(b"tierkv-sglang-shard\0" + salt + b"\0" + block_hash).digest()

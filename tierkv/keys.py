"""Block keys: ``block_hash + group_index.to_bytes(4, "big")``."""

from __future__ import annotations

from collections.abc import Sequence

from tierkv.errors import InvalidArgument

__all__ = ["GROUP_BYTES", "check_hashes", "key_group", "make_key", "record_hashes", "split_key"]

GROUP_BYTES = 4
MAX_HASH_BYTES = 1024


def make_key(block_hash: bytes, group_idx: int) -> bytes:
    """The key of one block: the hash followed by the 4-byte big-endian group index.

    These are the bytes vLLM's offload keys use.
    """
    if not isinstance(block_hash, (bytes, bytearray)):
        raise InvalidArgument(f"block hashes must be bytes, got {type(block_hash).__name__}")
    if not block_hash or len(block_hash) > MAX_HASH_BYTES:
        raise InvalidArgument(f"a block hash must be 1..{MAX_HASH_BYTES} bytes, got {len(block_hash)}")
    if not 0 <= group_idx < 1 << 32:
        raise InvalidArgument(f"group index out of range: {group_idx}")
    return bytes(block_hash) + group_idx.to_bytes(GROUP_BYTES, "big")


def split_key(key: bytes) -> tuple[bytes, int]:
    """The inverse of :func:`make_key`: ``(block_hash, group_idx)``."""
    if not isinstance(key, (bytes, bytearray)) or len(key) <= GROUP_BYTES:
        raise InvalidArgument("a key is a non-empty hash followed by 4 group-index bytes")
    return bytes(key[:-GROUP_BYTES]), int.from_bytes(key[-GROUP_BYTES:], "big")


def key_group(key: bytes) -> int:
    """The group index a key carries."""
    return int.from_bytes(key[-GROUP_BYTES:], "big")


def check_hashes(hashes: Sequence[bytes]) -> list[bytes]:
    """``hashes`` as a list of ``bytes``; refused when not a sequence of bytes (``bytearray`` is
    accepted), when one is empty or too long, or when one repeats within the call."""
    if isinstance(hashes, (bytes, bytearray, str)):
        raise InvalidArgument("hashes must be a sequence of bytes, not a single bytes/str value")
    if not isinstance(hashes, Sequence):
        raise InvalidArgument(
            f"hashes must be a sequence (list or tuple) of bytes, got {type(hashes).__name__}")
    if not hashes:
        return []
    if set(map(type, hashes)) == {bytes}:
        lengths = set(map(len, hashes))
        if min(lengths) > 0 and max(lengths) <= MAX_HASH_BYTES and len(set(hashes)) == len(hashes):
            return hashes if type(hashes) is list else list(hashes)
    seen: set[bytes] = set()
    out = []
    for i, h in enumerate(hashes):
        if not isinstance(h, (bytes, bytearray)):
            raise InvalidArgument(f"hashes[{i}] must be bytes, got {type(h).__name__}")
        if not h or len(h) > MAX_HASH_BYTES:
            raise InvalidArgument(f"hashes[{i}] must be 1..{MAX_HASH_BYTES} bytes long")
        b = bytes(h)
        if b in seen:
            raise InvalidArgument(f"duplicate hash at position {i} in one call")
        seen.add(b)
        out.append(b)
    return out


def record_hashes(hashes: list[bytes], per: int) -> list[bytes]:
    """The hash that keys each whole record ``hashes`` covers, when one record holds ``per``
    consecutive blocks and ``hashes[0]`` is a record's first block: the last hash of every run of
    ``per`` (a trailing run shorter than ``per`` has none)."""
    return hashes if per == 1 else hashes[per - 1::per]

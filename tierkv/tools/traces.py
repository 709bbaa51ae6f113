"""Request traces of prefix-cached LLM traffic (Mooncake's FAST'25 format) and their accounting.

A trace is JSON Lines, one request a line: ``timestamp`` (ms), ``input_length`` and
``output_length`` (tokens) and ``hash_ids``: the ids of the prompt's blocks of ``block_tokens``
tokens, chained (an id stands for the whole prefix up to its block), so two requests share a prefix
exactly as far as their ``hash_ids`` agree. docs/traffic.md describes it.

The accounting (the same in :mod:`tierkv.tools.replay` and in the offline bound here): a request
whose first ``n`` blocks are found hits ``min(n * block_tokens, input_length)`` tokens; the token
hit rate is the sum of those over the sum of ``input_length``. After its lookup every block of the
request is stored or touched, in order.
"""

from __future__ import annotations

import heapq
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

from tierkv.errors import InvalidArgument

__all__ = ["TraceRequest", "belady_hit_rate", "hit_tokens", "read_trace"]


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it came (ms), its prompt and output lengths, its block ids."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def hit_tokens(blocks: int, input_length: int, block_tokens: int) -> int:
    """Tokens a request hits when its first ``blocks`` blocks are found."""
    return min(blocks * block_tokens, input_length)


def _int(obj: dict[str, object], name: str, required: bool) -> int:
    v = obj.get(name)
    if v is None and not required:
        return 0
    if type(v) is not int or v < 0:
        raise ValueError(f"'{name}' must be a non-negative integer, got {json.dumps(v)[:40]}")
    return v


def _parse(text: str) -> TraceRequest:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"not a JSON object but {type(obj).__name__}")
    ts = obj.get("timestamp", 0)
    if type(ts) not in (int, float) or not math.isfinite(ts):
        raise ValueError(f"'timestamp' must be a number, got {json.dumps(ts)[:40]}")
    ids = obj.get("hash_ids")
    if not isinstance(ids, list):
        raise ValueError("'hash_ids' must be a list of integers")
    for x in ids:
        if type(x) is not int or not -(1 << 63) <= x < 1 << 63:
            raise ValueError(f"'hash_ids' holds {json.dumps(x)[:40]}, not a 64-bit integer")
    if len(set(ids)) != len(ids):
        raise ValueError("'hash_ids' repeats an id")
    return TraceRequest(float(ts), _int(obj, "input_length", True), _int(obj, "output_length", False),
                        tuple(ids))


def read_trace(path: str | os.PathLike[str], limit: int | None = None) -> list[TraceRequest]:
    """The first ``limit`` requests (all by default) of the trace at ``path``; blank lines are
    skipped. Raises :class:`InvalidArgument` naming the file, and the line of a malformed one."""
    out: list[TraceRequest] = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if limit is not None and len(out) >= limit:
                    break
                if not line.strip():
                    continue
                try:
                    out.append(_parse(line))
                except ValueError as exc:
                    where = f"{os.fspath(path)}:{lineno}"
                    raise InvalidArgument(f"{where}: malformed trace line: {exc}") from None
    except UnicodeDecodeError:
        raise InvalidArgument(f"{os.fspath(path)}: not a UTF-8 text file") from None
    except OSError as exc:
        raise InvalidArgument(f"{os.fspath(path)}: cannot read the trace: {exc.strerror or exc}") from None
    return out


def belady_hit_rate(requests: Sequence[TraceRequest], capacity: int | None, block_tokens: int) -> float:
    """The token hit rate of Belady's clairvoyant policy with ``capacity`` blocks (None: unbounded).

    Every access of a block is stamped with the position of its next access; a new block evicts
    the resident one used furthest in the future, or is not kept when that is itself (a bound:
    no policy that knows only the past evicts better, counted in blocks found).
    """
    total = sum(r.input_length for r in requests)
    if not total or (capacity is not None and capacity <= 0):
        return 0.0
    seq = [h for r in requests for h in r.hash_ids]
    never = len(seq)
    nxt = [never] * len(seq)
    last: dict[int, int] = {}
    for i in range(len(seq) - 1, -1, -1):
        nxt[i] = last.get(seq[i], never)
        last[seq[i]] = i
    cache: dict[int, int] = {}  # block -> position of its next access
    heap: list[tuple[int, int]] = []  # (-next access, block), stale entries skipped
    pos = hit = 0
    for r in requests:
        n = 0
        for h in r.hash_ids:
            if h not in cache:
                break
            n += 1
        hit += hit_tokens(n, r.input_length, block_tokens)
        for h in r.hash_ids:
            nu = nxt[pos]
            pos += 1
            if h not in cache and capacity is not None and len(cache) >= capacity:
                while cache.get(heap[0][1]) != -heap[0][0]:
                    heapq.heappop(heap)
                if -heap[0][0] <= nu:
                    continue  # the new block is the one needed last: keep the cache as it is
                del cache[heapq.heappop(heap)[1]]
            cache[h] = nu
            heapq.heappush(heap, (-nu, h))
        if len(heap) > 4 * len(cache) + 1024:
            heap = [(-v, k) for k, v in cache.items()]
            heapq.heapify(heap)
    return hit / total

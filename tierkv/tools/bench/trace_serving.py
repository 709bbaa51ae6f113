"""Mooncake traces scaled for an engine: reading, token ids per hash id, the cache ceiling.

A Mooncake FAST'25 trace (``FAST25-release/traces/*.jsonl`` of github.com/kvcache-ai/Mooncake) has
one JSON object a line: ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids``,
the ids of the prompt's 512-token blocks, chained (an id stands for its whole prefix: two requests
share an id only where they share every block before it). :func:`load_trace` reads it with
:func:`tierkv.tools.traces.read_trace` (the parser ``tierkv replay`` uses).

:class:`Scaling` makes a trace request an engine request small enough for a CPU engine: it keeps
the first ``ids_per_request`` hash ids; each id becomes one engine block of ``tokens_per_id``
tokens (vLLM's ``block_size``) drawn from a generator seeded by the id (:func:`id_tokens`), so
requests that share an id share that block's tokens and, ids being chained, the whole prefix before
it, and nothing else is shared; one more token, the request's own, ends every prompt
(:func:`prompt`), so every id block is full and cacheable (vLLM always computes a prompt's last
token). Output lengths are capped at ``max_output``. :func:`ceiling_tokens` is what an unbounded
prefix cache would serve under that scaling. Used by ``tierkv bench serving --trace``
(:mod:`tierkv.tools.bench.serving_trace`).
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass

from tierkv.errors import BenchError, InvalidArgument
from tierkv.tools.traces import TraceRequest, read_trace

__all__ = ["MOONCAKE_BLOCK_TOKENS", "Scaling", "TraceRequest", "ceiling_tokens", "id_tokens", "load_trace",
           "percentile", "prompt"]

#: the trace's block size (tokens per hash id)
MOONCAKE_BLOCK_TOKENS = 512


def load_trace(path: str | os.PathLike[str], limit: int | None = None) -> list[TraceRequest]:
    """The first ``limit`` requests of the trace at ``path`` (:func:`tierkv.tools.traces.read_trace`);
    a file that cannot be read, a malformed line or no request at all raise :class:`BenchError`."""
    try:
        out = read_trace(path, limit)
    except InvalidArgument as exc:
        raise BenchError(f"--trace {exc}") from None
    if not out:
        raise BenchError(f"--trace {os.fspath(path)}: no requests in it")
    return out


@dataclass(frozen=True)
class Scaling:
    """How a trace request becomes an engine request (see the module docstring)."""

    ids_per_request: int = 16
    tokens_per_id: int = 32
    max_output: int = 4

    def ids(self, req: TraceRequest) -> tuple[int, ...]:
        """The hash ids the scaled request keeps."""
        return req.hash_ids[:self.ids_per_request]

    def prompt_length(self, req: TraceRequest) -> int:
        """Tokens of the scaled prompt: one block per kept id, and the request's own last token."""
        return len(self.ids(req)) * self.tokens_per_id + 1

    def output_length(self, req: TraceRequest) -> int:
        """Output tokens: the trace's, capped (at least one)."""
        return max(1, min(req.output_length, self.max_output))


def id_tokens(hash_id: int, tokens: int, vocab: int, seed: int = 0, salt: str = "trace") -> list[int]:
    """The ``tokens`` token ids of one hash id's block: in ``[3, vocab)``, fixed by the id, the seed
    and ``salt`` (another salt draws blocks no trace request has)."""
    rng = random.Random(f"tierkv-{salt}:{seed}:{hash_id}")
    return [rng.randrange(3, vocab) for _ in range(tokens)]


def prompt(req: TraceRequest, index: int, scaling: Scaling, vocab: int, seed: int = 0) -> list[int]:
    """The scaled prompt of request number ``index``: its ids' blocks, then one token of its own."""
    out: list[int] = []
    for h in scaling.ids(req):
        out += id_tokens(h, scaling.tokens_per_id, vocab, seed)
    out.append(3 + (index * 7919 + seed) % (vocab - 3))
    return out


def ceiling_tokens(requests: Sequence[TraceRequest], scaling: Scaling) -> int:
    """Tokens an unbounded prefix cache would serve: for each request, the longest prefix of its
    kept ids that an earlier request's prompt began with, times ``tokens_per_id``."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    for req in requests:
        ids = scaling.ids(req)
        k = 0
        while k < len(ids) and ids[:k + 1] in seen:
            k += 1
        total += k * scaling.tokens_per_id
        seen.update(ids[:j] for j in range(1, len(ids) + 1))
    return total


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values``, linearly interpolated; None when empty."""
    xs = sorted(values)
    if not xs:
        return None
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

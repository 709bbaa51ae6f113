"""Restore only when it beats recompute: the cost model and the deadline on PENDING.

The engine recomputes a prefix at ``recompute_tokens_per_s`` (prefill throughput: a config value,
or measured by an engine adapter and set with :meth:`CostModel.set_rate`). Each lower tier's
gateway measures its read rate (bytes/s; a configured prior until the first load) and knows the
bytes already queued for loading ahead of a new request. For a request that would load blocks,
:meth:`CostModel.choose` picks the prefix length ``k`` that maximises the time saved::

    saved(k) = k * tokens_per_block / recompute_rate  -  load_time(k)

where ``load_time(k)`` sums, over the blocks the prefix needs that are not in the primary, their
bytes over their tier's read rate, plus the queue ahead on each tier used. Blocks already in the
primary cost nothing, so a resident prefix is always kept. Blocks past ``k`` are a MISS: the engine
recomputes them.

A restore from a lower tier also costs a wait that does not grow with its size: the promotion's
round trip, and the engine steps a request spends deferred until its blocks are READY (16-17 ms
median for a file tier, 6.5-8 ms for an in-memory tier in a vLLM engine: docs/performance.md,
"Serving a Mooncake trace"). Each tier's is measured (:meth:`CostModel.observe_fixed`: a restore's
wait less its blocks' read time) and charged once per request and tier: a restore of a few blocks
whose recompute takes less than that wait is declined. Engines that look keys up one at a time
(vLLM) get a per-request decision through :class:`RestoreRun`: the request's consecutive
lower-tier blocks are counted until enough of them pay for the wait (promoted then), or until the
engine asks for the first of them again (its scan restarted: the run is all there is; promoted
or declined as a whole).

Deadline: a request PENDING for longer than its deadline gets a MISS for what is not ready (the
ready prefix stays a HIT); its promotions go on and stay cached for later requests. The deadline is
``max_pending_s`` when set, else the recompute time of the blocks it waits for (with the cost
model on; at most :data:`FALLBACK_DEADLINE_S`), else :data:`FALLBACK_DEADLINE_S`.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tierkv.errors import InvalidArgument
from tierkv.observing.metrics import CostStats
from tierkv.quantities import MAX_RATE_TOKENS_S, MAX_WAIT_S

__all__ = ["FALLBACK_DEADLINE_S", "FIXED_SAMPLES", "CostModel", "Decision", "RestoreRun"]

log = logging.getLogger("tierkv.cost")

#: the deadline on PENDING when neither ``max_pending_s`` nor a recompute rate is known
FALLBACK_DEADLINE_S = 60.0
#: a tier's fixed restore wait is the median of its last this many restores
FIXED_SAMPLES = 15


@dataclass(frozen=True)
class Decision:
    """One request's choice: ``blocks`` of the ``usable`` prefix, and the estimates behind it."""

    blocks: int
    usable: int
    load_s: float
    recompute_s: float


@dataclass
class RestoreRun:
    """One request's consecutive blocks on lower tiers (one group), while the cost model weighs
    restoring them against recomputing them, and after: ``verdict`` None while undecided."""

    #: key -> the lower tier holding it, in the order the engine asked
    keys: dict[bytes, int] = field(default_factory=dict)
    verdict: bool | None = None
    #: once promoted: when, the tier and key whose READY answer ends the wait, the read estimate
    started: float | None = None
    tier: int = 0
    last: bytes = b""
    read_s: float = 0.0


class CostModel:
    """The recompute rate, the deadline rule, the choice of prefix, and their counters."""

    def __init__(self, tokens_per_block: int, recompute_tokens_per_s: float | None,
                 max_pending_s: float | None, enabled: bool = True) -> None:
        self.tokens_per_block = tokens_per_block
        self.rate = recompute_tokens_per_s
        self.max_pending_s = max_pending_s
        self.enabled = enabled
        self.decisions = 0
        self.blocks_recomputed = 0
        self.deadline_misses = 0
        self.last: Decision | None = None
        #: per lower tier: the last :data:`FIXED_SAMPLES` fixed restore waits measured (seconds)
        self._fixed: dict[int, deque[float]] = {}

    @property
    def active(self) -> bool:
        """True when prefixes are chosen by cost (a recompute rate is known)."""
        return self.enabled and self.rate is not None and self.rate > 0

    def set_rate(self, tokens_per_s: float) -> None:
        """The engine's measured prefill throughput (tokens/s). A value that is not a finite rate
        within [1e-3, 1e9] (inf would switch restores off, 0 or NaN mean nothing) is refused with
        :class:`~tierkv.errors.InvalidArgument`."""
        if isinstance(tokens_per_s, bool) or not (1e-3 <= float(tokens_per_s) <= MAX_RATE_TOKENS_S):
            raise InvalidArgument(f"recompute rate must be a finite number of tokens/s within [1e-3, "
                                  f"{MAX_RATE_TOKENS_S:g}], got {tokens_per_s!r}")
        self.rate = float(tokens_per_s)

    def recompute_s(self, blocks: int) -> float:
        """Seconds the engine takes to recompute ``blocks`` blocks (0 without a rate)."""
        return blocks * self.tokens_per_block / self.rate if self.rate else 0.0

    def deadline_s(self, waiting_blocks: int) -> float:
        """How long a request waiting for ``waiting_blocks`` blocks may stay PENDING."""
        if self.max_pending_s is not None:
            return min(self.max_pending_s, MAX_WAIT_S)
        if self.active and waiting_blocks > 0:
            return min(max(self.recompute_s(waiting_blocks), 0.05), FALLBACK_DEADLINE_S)
        return FALLBACK_DEADLINE_S

    def choose(self, usable: int, full_costs: Sequence[float],
               other_cost: Callable[[int], float], queue_s: Callable[[int], float]) -> Decision:
        """The prefix length to load among ``0..usable``.

        ``full_costs[i]``: seconds to load block ``i`` of the full groups (0 when resident);
        ``other_cost(k)``: seconds to load what the other groups need for a prefix of ``k``;
        ``queue_s(k)``: seconds of loads queued ahead on the tiers a prefix of ``k`` reads.
        """
        assert self.rate is not None
        per_block = self.tokens_per_block / self.rate
        best, best_saved, best_load = 0, 0.0, 0.0
        load_full = 0.0
        for k in range(1, usable + 1):
            load_full += full_costs[k - 1]
            load = load_full + other_cost(k) + queue_s(k)
            saved = k * per_block - load
            if saved >= best_saved:
                best, best_saved, best_load = k, saved, load
        decision = Decision(best, usable, best_load, best * per_block)
        self.decisions += 1
        self.blocks_recomputed += usable - best
        self.last = decision
        if log.isEnabledFor(logging.DEBUG):
            log.debug("cost model: load %d of %d usable blocks (load %.3f s vs recompute %.3f s at %.0f "
                      "tokens/s)", best, usable, best_load, best * per_block, self.rate)
        return decision

    def worth_loading(self, block_bytes: int, read_bytes_per_s: float) -> bool:
        """One block of a full-attention group, for engines that look keys up one by one: is
        reading it from a tier at ``read_bytes_per_s`` faster than recomputing its tokens? (For a
        prefix on one tier this is :meth:`choose`'s answer, block by block.)"""
        if not self.active:
            return True
        assert self.rate is not None
        worth = block_bytes / max(read_bytes_per_s, 1.0) <= self.tokens_per_block / self.rate
        self.decisions += 1
        if not worth:
            self.blocks_recomputed += 1
            if log.isEnabledFor(logging.DEBUG):
                log.debug("cost model: recompute a block (%d bytes at %.0f B/s vs %d tokens at %.0f "
                          "tokens/s)", block_bytes, read_bytes_per_s, self.tokens_per_block, self.rate)
        return worth

    def fixed_s(self, tier: int) -> float:
        """The wait a restore from lower tier ``tier`` costs whatever its size (0 until measured)."""
        seen = self._fixed.get(tier)
        return statistics.median(seen) if seen else 0.0

    def observe_fixed(self, tier: int, seconds: float) -> None:
        """A restore from ``tier`` waited ``seconds`` beyond its blocks' estimated read time."""
        seen = self._fixed.get(tier)
        if seen is None:
            seen = self._fixed[tier] = deque(maxlen=FIXED_SAMPLES)
        seen.append(min(max(0.0, seconds), FALLBACK_DEADLINE_S))

    def run_verdict(self, blocks: int, block_bytes: int, read_bytes_per_s: float, fixed_s: float,
                    complete: bool) -> bool | None:
        """Whether to restore a run of ``blocks`` consecutive lower-tier blocks (full-attention
        group): their recompute time against their read time plus the tier's fixed wait. True:
        restore (a run this long pays for the wait); False: recompute (no run would pay, a block
        reads slower than it recomputes, or the run is ``complete`` and too short); None: this
        run would not pay, a longer one would (the caller counts on). Counted when decided."""
        if not self.active:
            return True
        assert self.rate is not None
        per_block = self.tokens_per_block / self.rate
        read = block_bytes / max(read_bytes_per_s, 1.0)
        pays = read <= per_block and blocks * (per_block - read) >= fixed_s
        if not pays and not complete and read <= per_block:
            return None
        self.decisions += 1
        if not pays:
            self.blocks_recomputed += blocks
            if log.isEnabledFor(logging.DEBUG):
                log.debug("cost model: recompute a run of %d blocks (read %.4f s + wait %.4f s vs "
                          "recompute %.4f s)", blocks, blocks * read, fixed_s, blocks * per_block)
        return pays

    def snapshot(self) -> CostStats:
        """What the cost model knows and decided, for ``stats()``."""
        return CostStats(recompute_tokens_per_s=self.rate, decisions=self.decisions,
                         blocks_recomputed=self.blocks_recomputed,
                         last=None if self.last is None else dict(self.last.__dict__))

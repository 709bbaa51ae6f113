"""Whether a lower tier answers, as its gateway sees it, and the writes that wait for it.

A tier is down until it opened, and again after :data:`DOWN_AFTER_FAILURES` batches in a row
failed because it did not answer (errors such as ENOTCONN, EIO, a timeout; a full disk does not
count); a health check brings it back (:mod:`tierkv.availability`). While it is down lookups do
without it and the writes of blocks that failed wait in a bounded queue (:attr:`TierHealth.redo`).
"""

from __future__ import annotations

import collections
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence

from tierkv.backends.base import Tier
from tierkv.errors import unavailable
from tierkv.metrics import TierStats

__all__ = ["DOWN_AFTER_FAILURES", "TierHealth", "why"]

log = logging.getLogger("tierkv")

#: batches in a row that fail because the tier does not answer before it is taken for down
DOWN_AFTER_FAILURES = 3


def why(exc: BaseException) -> str:
    """One line on what failed; tierkv's backend errors are already free of credentials."""
    from tierkv.errors import BackendError

    if isinstance(exc, BackendError):
        return str(exc)[:300]
    return f"{type(exc).__name__}: {str(exc)[:200]}"


class TierHealth:
    """Up or down, why, and the retry queue of one tier (state changes under the gateway's lock)."""

    def __init__(self, index: int, tier: Tier, stats: TierStats, up: bool,
                 changed: Callable[[], None]) -> None:
        self.index = index
        self.tier = tier
        self.stats = stats
        self._changed = changed
        self.up = up
        self.down_reason = "" if up else "not opened yet"
        #: failed writes of blocks that may still be in the primary, written again once the tier
        #: is up: (group, key) -> attempts so far
        self.redo: OrderedDict[tuple[int, bytes], int] = OrderedDict()
        self._was_up = up
        self._unavailable_seen = 0
        #: the last batches of writes that failed wholly because the tier did not answer
        self._failing: collections.deque[tuple[int, list[bytes]]] = collections.deque(
            maxlen=DOWN_AFTER_FAILURES)
        self._failed_reads = 0

    def set_up(self, up: bool, reason: str = "") -> None:
        """The tier answers again (``up``), or it does not (``reason`` says why)."""
        if up == self.up:
            return
        self.up = up
        self.down_reason = "" if up else reason
        self._changed()  # lookups answer again: a tier that is down holds nothing
        if up:
            if self._was_up:
                log.info("tier %d (%s) answers again", self.index, self.tier.describe())
            self._was_up = True
        else:
            log.warning("tier %d (%s) is down: %s; lookups do without it, failed writes are retried "
                        "when it answers", self.index, self.tier.describe(), reason)

    def requeue(self, group: int, keys: Sequence[bytes], attempts: int = 1) -> None:
        """Queue failed writes for a retry (bounded: past ``retry_queue_blocks`` the oldest go,
        counted)."""
        limit = self.tier.config.retry_queue_blocks
        for k in keys:
            if limit <= 0:
                self.stats.stores_requeue_dropped += 1
                continue
            self.redo[(group, k)] = attempts
            self.redo.move_to_end((group, k))
            self.stats.stores_requeued += 1
            while len(self.redo) > limit:
                self.redo.popitem(last=False)
                self.stats.stores_requeue_dropped += 1

    def _unavailable_errors(self) -> int:
        """New errors that said the tier does not answer (the tier counts them) since last asked."""
        seen = self.tier.counters.get("unavailable_errors", 0)
        new, self._unavailable_seen = seen - self._unavailable_seen, seen
        return new

    def stored(self, group: int, failed: list[bytes], n_ok: int, raised: list[BaseException]) -> None:
        """A batch of writes ended with ``failed`` keys. Writes that failed because the tier does
        not answer (not a full disk, not a record too large) wait for a retry once the tier is
        taken for down, which several wholly failed batches in a row do."""
        if not failed:
            self._failing.clear()
            return
        down = [e for e in raised if unavailable(e)]
        if not (self._unavailable_errors() or down) or n_ok:
            return
        self._failing.append((group, failed))
        if len(self._failing) < DOWN_AFTER_FAILURES:
            return  # one failed batch is a fault; several in a row, an outage
        self.set_up(False, why(down[0]) if down else "writes fail: it does not answer")
        for g, keys in self._failing:
            self.requeue(g, keys)
        self._failing.clear()

    def read(self, found_any: bool, raised: BaseException | None = None) -> None:
        """A read or probe ended: found something, or failed (several in a row: down)."""
        if raised is None and found_any:
            self._failed_reads = 0
            return
        if raised is not None:
            if not unavailable(raised):
                return
            reason = why(raised)
        elif self._unavailable_errors():
            reason = "reads fail: it does not answer"
        else:
            return
        self._failed_reads += 1
        if self._failed_reads >= DOWN_AFTER_FAILURES:
            self.set_up(False, reason)

"""Whether a lower tier answers, as its gateway sees it, and the writes that wait for it.

A tier is down until it opened, and again (:meth:`TierHealth.set_up`) when:

* :data:`DOWN_AFTER_FAILURES` batches of writes in a row failed wholly because it did not answer
  (errors such as ENOTCONN, EIO, a refused connection, a timeout; a full disk does not count), or
  as many reads or probes in a row did;
* it *stalls*: writes have been waiting for it and none was answered for :data:`STALL_FACTOR` x
  its ``shed_after_s`` (a server that accepts connections and never answers: nothing fails until
  each request's deadline, and meanwhile its queue fills and stores are shed).

A health check brings it back (:mod:`tierkv.movement.availability`). While it is down lookups do without
it and its writes wait in a bounded queue (:attr:`TierHealth.redo`).

The retry queue's promise: a write that failed because the tier did not answer (a whole batch or
only part of one, the tier down or not) is queued, and so is every block shed while the tier was
stalling, every cascade started while it was down, and every store that would be shed while the
tier catches up (its queue not empty, or retries being written); each is written again once it answers
(a health check passed, or a write succeeded since), if the block is still ready in the primary.
Blocks the queue cannot keep are counted in ``stores_requeue_dropped``: past ``retry_queue_blocks``
(the oldest), gone from the primary by the time of the retry (evicted, or a staged copy), or whose
writes failed :data:`MAX_WRITE_ATTEMPTS` times.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from tierkv.backends.base import Tier
from tierkv.errors import unavailable
from tierkv.observing.metrics import TierStats

if TYPE_CHECKING:
    from tierkv.blocks.pool import SlotPool

__all__ = ["DOWN_AFTER_FAILURES", "MAX_WRITE_ATTEMPTS", "STALL_FACTOR", "Retry", "TierHealth", "why"]

log = logging.getLogger("tierkv")

#: batches in a row that fail because the tier does not answer before it is taken for down
DOWN_AFTER_FAILURES = 3
#: a tier whose waiting writes got no answer for this many times its ``shed_after_s`` is stalled
STALL_FACTOR = 3.0
#: writes of one block that fail because the tier does not answer before the block is given up
#: (counted in ``stores_requeue_dropped``)
MAX_WRITE_ATTEMPTS = 5

#: a retry the queue hands out: group, attempts so far, keys and their primary slots
Retry = tuple[int, int, list[bytes], list[int]]


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
        #: writes of blocks that may still be in the primary, written again once the tier
        #: answers: (group, key) -> failed attempts so far
        self.redo: OrderedDict[tuple[int, bytes], int] = OrderedDict()
        #: whether anything writes the queue (a store's :class:`~tierkv.movement.availability.TierWatch`);
        #: without, failed writes are only counted
        self.keeps_retries = False
        #: blocks of retries being written now (taken from :attr:`redo`)
        self.retrying = 0
        #: False from a batch of writes that failed wholly because the tier did not answer until
        #: a write succeeds or a health check passes: the retry queue waits meanwhile
        self.answers = True
        self._was_up = up
        #: times the tier was taken for down
        self.outages = 0
        self._unavailable_seen = 0
        #: wholly failed batches of writes in a row (the tier did not answer)
        self._failing = 0
        self._failed_reads = 0
        #: when a write last got an answer, and when writes last started waiting after none did
        self._answered_at = time.monotonic()
        self._waiting_since = 0.0
        #: blocks shed since the tier last answered a write: queued if it turns out to stall
        self._shed: OrderedDict[tuple[int, bytes], None] = OrderedDict()

    @property
    def stall_s(self) -> float:
        """Seconds waiting writes may go unanswered before the tier is taken for stalled."""
        return STALL_FACTOR * self.tier.config.shed_after_s

    def set_up(self, up: bool, reason: str = "") -> None:
        """The tier answers again (``up``), or it does not (``reason`` says why): what was shed
        while it stalled then joins the retry queue."""
        if not up and self._shed:
            shed, self._shed = self._shed, OrderedDict()
            for g, k in shed:
                self.requeue(g, [k], 0)
        if up:
            self.answered()
        if up == self.up:
            return
        self.up = up
        self.outages += not up
        self._failing = self._failed_reads = 0
        self.down_reason = "" if up else reason
        self._changed()  # lookups answer again: a tier that is down holds nothing
        if up:
            if self._was_up:
                log.info("tier %d (%s) answers again", self.index, self.tier.describe())
            self._was_up = True
        else:
            log.warning("tier %d (%s) is down: %s; lookups do without it, failed writes are retried "
                        "when it answers", self.index, self.tier.describe(), reason)

    def answered(self, now: float | None = None) -> None:
        """A write got an answer (or a health check passed): the queue may be written, and what
        was shed until now was backpressure, not a stall."""
        self.answers = True
        self._answered_at = time.monotonic() if now is None else now
        self._shed.clear()

    def waiting(self, now: float) -> None:
        """Writes start waiting for the tier after none did (the stall clock starts)."""
        self._waiting_since = now

    def check_stall(self, now: float, waiting: bool) -> bool:
        """Take the tier for down when ``waiting`` writes got no answer for :attr:`stall_s`;
        whether it is down."""
        if self.up and waiting:
            quiet = now - max(self._answered_at, self._waiting_since)
            if quiet >= self.stall_s:
                self.answers = False
                self.set_up(False, f"writes stalled: none answered for {quiet:.1f} s")
        return not self.up

    def shed(self, group: int, keys: Sequence[bytes]) -> None:
        """``keys`` were shed (already counted): kept aside, bounded, in case the tier stalls."""
        limit = self.tier.config.retry_queue_blocks
        for k in keys:
            if len(self._shed) >= limit:
                return
            self._shed[(group, k)] = None

    def requeue(self, group: int, keys: Sequence[bytes], attempts: int = 0, counted: bool = True) -> None:
        """Queue writes for a retry (bounded: past ``retry_queue_blocks`` the oldest go, counted;
        so does a block that failed :data:`MAX_WRITE_ATTEMPTS` times). ``counted``: count them in
        ``stores_requeued`` (not for a retry put back because the tier's queue was full). A
        gateway nothing retries for (:attr:`keeps_retries` False) queues nothing."""
        if not self.keeps_retries:
            return
        limit = self.tier.config.retry_queue_blocks
        for k in keys:
            if limit <= 0 or attempts >= MAX_WRITE_ATTEMPTS:
                self.stats.stores_requeue_dropped += 1
                continue
            self.redo[(group, k)] = attempts
            self.redo.move_to_end((group, k))
            if counted:
                self.stats.stores_requeued += 1
            while len(self.redo) > limit:
                self.redo.popitem(last=False)
                self.stats.stores_requeue_dropped += 1

    def due(self, pools: Mapping[int, SlotPool], limit: int) -> list[Retry]:
        """Take up to ``limit`` queued writes, oldest first, to write again now (the tier is up and
        answers): those still ready in the primary, by group and attempts; the others are
        counted in ``stores_requeue_dropped``. Call under the lock."""
        if not (self.up and self.answers):
            return []
        out: dict[tuple[int, int], tuple[list[bytes], list[int]]] = {}
        for _ in range(min(limit, len(self.redo))):
            (group, key), attempts = self.redo.popitem(last=False)
            pool = pools.get(group)
            slot = pool.slot_of(key) if pool is not None and pool.is_ready(key) else None
            if slot is None:
                self.stats.stores_requeue_dropped += 1  # it left the primary meanwhile
                continue
            keys, slots = out.setdefault((group, attempts), ([], []))
            keys.append(key)
            slots.append(slot)
        return [(g, a, keys, slots) for (g, a), (keys, slots) in out.items()]

    def _unavailable_errors(self) -> int:
        """New errors that said the tier does not answer (the tier counts them) since last asked."""
        seen = self.tier.counters.get("unavailable_errors", 0)
        new, self._unavailable_seen = seen - self._unavailable_seen, seen
        return new

    def stored(self, group: int, failed: list[bytes], n_ok: int, raised: list[BaseException],
               attempts: int = 0, unanswered: bool = False) -> None:
        """A batch of writes ended with ``failed`` keys (``attempts``: failed writes of them
        before this one; ``unanswered``: the tier counted records it could not write because it
        did not answer, during the batch's calls). Writes that failed because the tier does not
        answer (``unanswered``, or an exception that says so; not a full disk, not a record too
        large) are queued for a retry, whether the batch failed wholly or in part; several wholly
        failed batches in a row take the tier for down."""
        now = time.monotonic()
        if n_ok:
            self.answered(now)
        if not failed:
            self._failing = 0
            return
        down = [e for e in raised if unavailable(e)]
        if not (unanswered or down):
            self.answered(now)  # it answered: a refusal waiting will not cure (counted as failed)
            return
        self.requeue(group, failed, attempts + 1)
        if n_ok:
            return  # it answers: the queue is written at the next flush or health check
        self.answers = False
        if attempts:
            return  # a retry: a block that fails alone never takes the tier down; the check decides
        self._failing += 1
        if self._failing >= DOWN_AFTER_FAILURES:  # one failed batch is a fault; several in a row, an outage
            self.set_up(False, why(down[0]) if down else "writes fail: it does not answer")

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

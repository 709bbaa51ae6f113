"""The tier gateway: the one object that drives a lower tier.

Everything that reads, writes or probes a lower tier goes through its :class:`TierGateway`:
the store's cascades, promotions and probes, ``get``'s reads of evicted blocks, and the vLLM
secondary tier. The gateway owns the tier's presence cache, its bounds (bytes in flight for stores
and for loads, concurrent calls), its measured store latency and read rate, its counters, and the
conversion of backend errors into counted failures: nothing it runs raises into the caller's path.

Data moves between a tier and rows of a caller's tensor (a pool, an engine's buffer, ``get``'s
``out``) without intermediate copies where the rows allow: a tier with ``scattered_rows`` reads and
writes each block where its row lies, one call per batch; for other tiers runs of consecutive rows
move in place and scattered rows go through one staging buffer per batch (:func:`plan_rows`).

State changes are made under the lock the gateway is given (the store's), because lookups on other
threads read the presence cache; the coroutines run on the owner's event loop.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Sequence

import anyio
import torch

from tierkv.backends.base import Tier
from tierkv.movement.presence import Presence
from tierkv.movement.transfers import (
    LOAD_BATCH_BYTES,
    MIB,
    ByteBudget,
    OnBatch,
    OnRow,
    RateEstimate,
    RowPlan,
    batch_buffer,
    plan_rows,
    take_rows,
)
from tierkv.movement.transfers import (
    landed as row_landed,
)
from tierkv.observing.health import TierHealth, why
from tierkv.observing.metrics import HISTOGRAMS, Histogram, Metric, TierStats
from tierkv.tensors import as_bytes, scatter_rows

__all__ = ["TierGateway"]

log = logging.getLogger("tierkv")

EMA_ALPHA = 0.2


class TierGateway:
    """Drives one lower tier: ``store``, ``load`` (into caller rows) and ``probe``.

    Presence answers are cached (found for ``presence_ttl_s``, not found for ``negative_ttl_s``).
    Stores are admitted against the tier's queue: they are shed (counted) when the bytes waiting
    would exceed ``max_queued_bytes`` or the measured latency says the queue would take longer
    than ``shed_after_s``; otherwise they wait their turn for ``max_inflight_bytes``. Loads are
    never shed: they are cut into batches and throttled by their own ``max_inflight_bytes`` budget
    and ``read_concurrency`` limiter, so stores never delay them.
    """

    def __init__(self, index: int, tier: Tier, lock: threading.RLock | None = None, up: bool = True) -> None:
        self.index = index
        self.tier = tier
        self.cfg = tier.config
        self._lock = lock if lock is not None else threading.RLock()
        cfg = self.cfg
        self._write_limiter = anyio.CapacityLimiter(max(1, cfg.max_inflight_ops))
        self._read_limiter = anyio.CapacityLimiter(max(1, cfg.read_concurrency))
        self._store_budget = ByteBudget(cfg.max_inflight_bytes)
        self._load_budget = ByteBudget(cfg.max_inflight_bytes)
        self.max_queued_bytes = cfg.max_queued_bytes or 8 * cfg.max_inflight_bytes
        #: bytes of stores admitted and not finished (waiting or running)
        self.store_admitted_bytes = 0
        self.store_admitted_ops = 0
        self.ema_s_per_mib = 0.0
        self._rate = RateEstimate(cfg.read_bytes_per_s)
        self._loads_running = 0
        #: bytes of loads asked for and not landed yet (in flight or waiting for the budget)
        self.load_backlog_bytes = 0
        self.load_seconds = Histogram()
        self.store_seconds = Histogram()
        self.stats = TierStats(index=index, kind=tier.kind, describe=tier.describe())
        #: what is known of which keys the tier holds
        self.known = Presence(tier, self._lock, lambda: self.health.up)
        #: whether the tier answers, and the writes that wait for it (:mod:`tierkv.observing.health`)
        self.health = TierHealth(index, tier, self.stats, up, self.known.changed)
        tier.add_listener(self.known.on_tier_event)

    @property
    def up(self) -> bool:
        """Whether the tier answers (a tier that is down holds nothing, for lookups)."""
        return self.health.up

    # ---- presence (:class:`~tierkv.movement.presence.Presence`) ------------------------------------
    @property
    def probing(self) -> set[bytes]:
        """Keys whose presence is being probed now."""
        return self.known.probing

    @property
    def version(self) -> int:
        """Bumped whenever what the gateway knows of presence changes (lookups re-answer then)."""
        return self.known.version

    @property
    def fast(self) -> bool:
        """True when the tier answers presence from memory, without I/O."""
        return self.known.fast

    def presence(self, group: int, key: bytes, now: float) -> bool | None:
        """True / False when known, None when a probe is needed (False while the tier is down)."""
        return self.known.presence(group, key, now)

    def presence_many(self, group: int, keys: list[bytes], now: float) -> list[bool | None]:
        """:meth:`presence` of many keys."""
        return self.known.presence_many(group, keys, now)

    def note(self, key: bytes, present: bool, now: float | None = None) -> None:
        """Remember what a probe, a store or a load told about ``key``."""
        self.known.note(key, present, now)

    def note_many(self, keys: Sequence[bytes], present: Sequence[bool], now: float) -> None:
        """:meth:`note` of many keys at once."""
        self.known.note_many(keys, present, now)

    def forget(self, key: bytes) -> None:
        """Drop a cached presence answer."""
        self.known.forget(key)

    # ---- stores ---------------------------------------------------------------------------------
    def backlog_s(self, extra_bytes: int = 0) -> float:
        """Estimated seconds to write what is admitted (plus ``extra_bytes``), from measured latency."""
        mib = (self.store_admitted_bytes + extra_bytes) / MIB
        return self.ema_s_per_mib * mib / max(1, self.cfg.max_inflight_ops)

    def admit_store(self, nbytes: int) -> bool:
        """Whether a store of ``nbytes`` may be queued; when it may, it is counted as admitted.

        Call under the lock, then run :meth:`store` with the same ``nbytes``. Refused (shed):
        when the bytes admitted would exceed ``max_queued_bytes``, or when the tier's measured
        latency says they would take longer than ``shed_after_s`` to write.
        """
        if self.store_admitted_bytes:
            if self.store_admitted_bytes + nbytes > self.max_queued_bytes:
                return False
            if self.backlog_s(nbytes) > self.cfg.shed_after_s:
                return False
        if not self.store_admitted_ops:
            self.health.waiting(time.monotonic())
        self.store_admitted_bytes += nbytes
        self.store_admitted_ops += 1
        return True

    def shed(self, nkeys: int, group: int = 0, keys: Sequence[bytes] = ()) -> None:
        """Count ``nkeys`` blocks not written because :meth:`admit_store` refused them; ``keys``
        (of ``group``) are kept aside, and queued for a retry if the tier turns out to stall."""
        self.stats.stores_shed += nkeys
        if keys:
            self.health.shed(group, keys)

    def check_stall(self, now: float) -> bool:
        """Take the tier for down when its waiting writes got no answer for too long
        (:meth:`TierHealth.check_stall`); whether it is down. Call under the lock."""
        return self.health.check_stall(now, self.store_admitted_ops > 0)

    async def store(self, group: int, keys: list[bytes], src: torch.Tensor,
                    rows: Sequence[int] | None, nbytes: int, attempts: int = 0) -> list[bool]:
        """Write ``src[rows[i]]`` (or ``src[i]``) as ``keys[i]``; per key, whether it is stored.

        ``nbytes`` must have been admitted by :meth:`admit_store`. Waits its turn for the bytes
        in flight, then writes (runs of rows in place, scattered rows from one gathered copy);
        failures are counted, never raised, and those because the tier did not answer are queued
        for a retry (``attempts``: failed writes of these keys before, for a retry).
        ``src`` must not change until this returns.
        """
        ok = [False] * len(keys)
        block = src.shape[1] * src.element_size()
        rows = list(range(len(keys))) if rows is None else rows
        elapsed: float | None = None
        outages = self.health.outages
        acquired = False
        raised: list[BaseException] = []
        #: set when a call's records failed because the tier did not answer (it counted them)
        unanswered: list[bool] = []

        scattered = self._scattered(src)
        src8 = as_bytes(src, src.shape[0], block) if scattered else src

        async def put(plan: RowPlan) -> None:
            sub = [keys[i] for i in plan.positions]
            try:
                at = [rows[i] for i in plan.positions]
                data = src8 if scattered else take_rows(src, plan.run, at)
                async with self._write_limiter:
                    with self._lock:
                        self.stats.inflight_ops += 1
                    # the tier counts the records it could not write because it did not answer
                    # within this call (another call's may land in the window too: retried, bounded)
                    down_before = self.tier.counters.get("unavailable_errors", 0)
                    try:
                        res = await (self.tier.put_rows(group, sub, data, at) if scattered
                                     else self.tier.put(group, sub, data))
                    finally:
                        with self._lock:
                            self.stats.inflight_ops -= 1
                if not all(res) and self.tier.counters.get("unavailable_errors", 0) > down_before:
                    unanswered.append(True)
                if any(res):
                    with self._lock:
                        self.health.answered()  # the tier answers: not a stall
                for i, good in zip(plan.positions, res, strict=True):
                    ok[i] = bool(good)
            except Exception as exc:  # a failing lower tier never reaches the caller
                raised.append(exc)
                log.warning("writing %d blocks to tier %d (%s) failed: %s", len(sub), self.index,
                            self.tier.describe(), why(exc))

        try:
            await self._store_budget.acquire(nbytes)
            acquired = True
            t0 = time.monotonic()
            outages = self.health.outages  # from the moment it writes: not the wait for the budget
            async with anyio.create_task_group() as tg:
                for plan in plan_rows(rows, block, scattered=scattered):
                    tg.start_soon(put, plan)
            if any(ok):
                elapsed = time.monotonic() - t0
                self.store_seconds.observe(elapsed)
        finally:
            with self._lock:
                if acquired:
                    self._store_budget.release(nbytes)
                self.store_admitted_bytes -= nbytes
                self.store_admitted_ops -= 1
                self.note_many(keys, ok, time.monotonic())  # a failed store is never seen as present
                n_ok = sum(ok)
                self.stats.stores += n_ok
                self.stats.stores_failed += len(keys) - n_ok
                self.health.stored(group, [k for k, good in zip(keys, ok, strict=True) if not good], n_ok,
                                   raised, attempts, bool(unanswered))
                self.stats.bytes_written += n_ok * block
                # a write that waited out an outage (the tier went down meanwhile: a stall) says
                # nothing of the tier's speed: its sample would shed stores long after it answers
                if elapsed is not None and nbytes and self.health.outages == outages:
                    sample = elapsed / (nbytes / MIB)
                    self.ema_s_per_mib = sample if self.ema_s_per_mib == 0.0 else (
                        self.ema_s_per_mib + EMA_ALPHA * (sample - self.ema_s_per_mib))
        return ok

    # ---- loads ----------------------------------------------------------------------------------
    async def load(self, group: int, keys: Sequence[bytes], dest: torch.Tensor, rows: Sequence[int],
                   on_batch: OnBatch | None = None, on_row: OnRow | None = None) -> list[bool]:
        """Read ``keys[i]`` into row ``rows[i]`` of ``dest`` (``[n, block_bytes]`` bytes).

        The keys are read in batches, in order, as many at once as the tier's load budget allows;
        ``on_batch(positions, ok)`` is called under the lock as each batch lands, ``on_row`` (see
        :data:`OnRow`) as the tier verifies each block. The row of a key answered False holds
        unspecified bytes (a damaged record may have been read into it) and must not be used.
        Returns, per key, whether it was read; errors are counted, never raised.
        """
        block = dest.shape[1] * dest.element_size()
        ok = [False] * len(keys)
        if not keys:
            return ok

        scattered = self._scattered(dest)

        async def batch(plan: RowPlan, nbytes: int) -> None:
            try:
                got = await self._load_batch(group, plan, keys, rows, dest, block, on_row, scattered)
                with self._lock:
                    for i, f in zip(plan.positions, got, strict=True):
                        ok[i] = f
                    if on_batch is not None:
                        on_batch(plan.positions, got)
            finally:
                self._load_budget.release(nbytes)

        plans = plan_rows(rows, block, min(LOAD_BATCH_BYTES, max(block, self.cfg.max_inflight_bytes // 4)),
                          scattered)
        total = len(keys) * block
        with self._lock:
            self.load_backlog_bytes += total
        try:
            async with anyio.create_task_group() as tg:
                for plan in plans:
                    nbytes = len(plan.positions) * block
                    await self._load_budget.acquire(nbytes)  # in order: early blocks are read first
                    tg.start_soon(batch, plan, nbytes)
        finally:
            with self._lock:
                self.load_backlog_bytes -= total
        return ok

    @property
    def load_inflight_bytes(self) -> int:
        """Bytes of loads in flight now."""
        return self._load_budget.used

    def _scattered(self, rows: torch.Tensor) -> bool:
        """Whether blocks move straight between the tier and ``rows`` wherever they lie."""
        return self.tier.capabilities.scattered_rows and rows.device.type == "cpu"

    async def _load_batch(self, group: int, plan: RowPlan, keys_in: Sequence[bytes],
                          rows_in: Sequence[int], dest: torch.Tensor, block: int, on_row: OnRow | None,
                          scattered: bool) -> list[bool]:
        keys, rows = [keys_in[i] for i in plan.positions], [rows_in[i] for i in plan.positions]
        buf, direct = batch_buffer(dest, block, plan, scattered)
        t0 = time.monotonic()
        with self._lock:
            if self._loads_running == 0:
                self._rate.busy_since = t0
            self._loads_running += 1
        try:
            landed = None if on_row is None else functools.partial(
                row_landed, on_row, plan.positions, buf, rows if scattered else None)
            async with self._read_limiter:
                found = list(await (self.tier.get_rows(group, keys, buf, rows, landed) if scattered
                                    else self.tier.get(group, keys, buf, landed)))
            with self._lock:
                self.health.read(any(found))
        except Exception as exc:
            log.warning("reading %d blocks from tier %d (%s) failed: %s", len(keys), self.index,
                        self.tier.describe(), why(exc))
            with self._lock:
                self.tier.count("read_errors")
                self.health.read(False, exc)
            found = [False] * len(keys)
        finally:
            with self._lock:
                self._loads_running -= 1
        good = [j for j, f in enumerate(found) if f]
        if good and not direct:
            scatter_rows(dest, [rows[j] for j in good], buf if len(good) == len(keys) else buf[good])
        with self._lock:
            now = time.monotonic()
            self.load_seconds.observe(now - t0)
            self.note_many(keys, found, now)
            self.stats.hits += len(good)
            self.stats.misses += len(keys) - len(good)
            self.stats.bytes_read += len(good) * block
            self._rate.landed(len(good) * block, now)
        return found

    @property
    def read_bytes_per_s(self) -> float:
        """The tier's measured read rate (bytes/s; the configured prior until loads measure it)."""
        return self._rate.value

    def planning_rate(self, now: float) -> float:
        """The read rate the cost model plans with (:meth:`RateEstimate.planning`)."""
        return self._rate.planning(now)

    # ---- probes ---------------------------------------------------------------------------------
    async def probe(self, group: int, keys: list[bytes]) -> None:
        """Learn whether the tier holds ``keys`` (cached for the TTLs); errors count as absent."""
        try:
            async with self._read_limiter:
                found = await self.tier.contains(group, keys)
            with self._lock:
                self.note_many(keys, found, time.monotonic())
                self.stats.probes += len(keys)
                self.health.read(True)
        except Exception as exc:
            log.warning("probing tier %d (%s) failed: %s", self.index, self.tier.describe(), why(exc))
            with self._lock:
                self.tier.count("probe_errors")
                self.health.read(False, exc)
                now = time.monotonic()
                for k in keys:
                    self.note(k, False, now)
        finally:
            with self._lock:
                self.probing.difference_update(keys)

    # ---- stats ----------------------------------------------------------------------------------
    def drain_histograms(self) -> list[tuple[Metric, tuple[str, ...], list[float]]]:
        """Load and store durations observed since the last call, with their metric and labels."""
        labels = (str(self.index), self.tier.kind)
        return [(HISTOGRAMS["load_seconds"], labels, self.load_seconds.drain()),
                (HISTOGRAMS["store_seconds"], labels, self.store_seconds.drain())]

    def snapshot(self) -> TierStats:
        """Counters as of now (call under the lock)."""
        s = self.stats.model_copy()
        s.inflight_bytes = self._store_budget.used
        s.queued_bytes = self.store_admitted_bytes - self._store_budget.used
        s.load_inflight_bytes = self._load_budget.used
        s.store_s_per_mib = self.ema_s_per_mib
        s.read_bytes_per_s = self.read_bytes_per_s
        s.load_seconds = self.load_seconds.snapshot()
        s.store_seconds = self.store_seconds.snapshot()
        s.used_bytes = self.tier.used_bytes() if self.up else None
        s.backend = dict(self.tier.counters)
        s.up = int(self.up)
        s.requeue_waiting = len(self.health.redo)
        s.down_reason = self.health.down_reason
        return s

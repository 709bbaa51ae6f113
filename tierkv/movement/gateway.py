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

import collections
import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio
import torch

from tierkv.backends.base import Tier
from tierkv.observing.health import TierHealth, why
from tierkv.observing.metrics import HISTOGRAMS, Histogram, Metric, TierStats
from tierkv.tensors import as_bytes, row_span, scatter_rows

__all__ = ["ByteBudget", "RateEstimate", "RowPlan", "TierGateway", "plan_rows"]

log = logging.getLogger("tierkv")

MIB = 1 << 20
#: a read-rate estimate below the prior, unmeasured this long, is planned with the prior again
REPROBE_S = 5.0
#: the read-rate estimate is the median of this many recent samples (the prior counts as one
#: until real ones push it out): one stalled moment moves it by at most one rank, never replaces it
RATE_WINDOW = 5
#: the read-rate estimate stays within these bounds (bytes/s) whatever a sample says
MIN_RATE = 1e3
MAX_RATE = 1e12


class RateEstimate:
    """A tier's read rate from samples: the (upper) median of the last :data:`RATE_WINDOW`, bounded;
    a sample is the bytes a load landed over the time loads were in flight since the last one."""

    def __init__(self, prior: float) -> None:
        self.prior = float(prior)
        self.samples: collections.deque[float] = collections.deque([_bounded(prior)], maxlen=RATE_WINDOW)
        self.value = self.samples[0]
        #: when loads were last idle or last landed (the owner sets it as the first load starts)
        self.busy_since = 0.0
        self.last_sample = time.monotonic()

    def add(self, sample: float) -> float:
        """Take one sample (bytes/s; NaN, zero or less carry no information) and return the estimate."""
        if sample == sample and sample > 0:  # not NaN
            self.samples.append(_bounded(sample))
            ordered = sorted(self.samples)
            self.value = ordered[len(ordered) // 2]
        return self.value

    def landed(self, nbytes: int, now: float) -> None:
        """A load landed ``nbytes`` at ``now``: one sample, bytes over the time loads were busy."""
        busy = now - self.busy_since
        self.busy_since = now
        if nbytes > 0 and busy > 0:
            self.add(nbytes / busy)
            self.last_sample = now

    def planning(self, now: float) -> float:
        """The rate the cost model plans with: the estimate, or, when it has fallen below the prior
        and no load has measured it for :data:`REPROBE_S`, the prior again, so the next restore
        loads and measures (a tier the cost model stopped using would otherwise never be measured
        again: one slow moment would switch restores off for good)."""
        if self.value < self.prior and now - self.last_sample >= REPROBE_S:
            return self.prior
        return max(self.value, 1.0)


def _bounded(rate: float) -> float:
    return min(max(float(rate), MIN_RATE), MAX_RATE)


EMA_ALPHA = 0.2
PRESENCE_CACHE_ENTRIES = 1 << 20
#: keys a tier event updates per hold of the lock
LISTED_SLICE = 4096
#: runs of consecutive rows at least this long move in place; shorter ones are gathered
DIRECT_RUN_BYTES = 1 << 20
#: a load is cut into batches of about this many bytes, so blocks land (and become usable) as
#: they arrive and enough reads are in flight to keep the tier busy
LOAD_BATCH_BYTES = 64 << 20

OnBatch = Callable[[list[int], list[bool]], None]
#: ``on_row(position, row)``: the block at ``position`` of a load is verified in ``row``, in the
#: reading thread, before its batch lands
OnRow = Callable[[int, torch.Tensor], None]


@dataclass(frozen=True)
class RowPlan:
    """One batch of a transfer: positions (into the caller's keys) and whether they are one run."""

    positions: list[int]
    #: ``(start, stop)`` rows of the caller's tensor when the batch is a run, else None (gathered)
    run: tuple[int, int] | None


def plan_rows(rows: Sequence[int], block_bytes: int, batch_bytes: int = LOAD_BATCH_BYTES,
              scattered: bool = False) -> list[RowPlan]:
    """Cut a transfer of ``rows`` into batches, in key order.

    ``scattered`` (a tier that moves blocks where their rows lie): batches of about
    ``batch_bytes``, whatever the rows. Otherwise runs of consecutive rows at least
    :data:`DIRECT_RUN_BYTES` long (or the whole transfer) become in-place batches, split at
    ``batch_bytes``; the other positions are gathered into batches of about ``batch_bytes`` that
    go through a staging buffer.
    """
    per = max(1, batch_bytes // max(1, block_bytes))
    if scattered:
        return [RowPlan(list(range(a, min(len(rows), a + per))), None) for a in range(0, len(rows), per)]
    direct_min = max(1, DIRECT_RUN_BYTES // max(1, block_bytes))
    out: list[RowPlan] = []
    gathered: list[int] = []
    n = len(rows)
    start = 0
    for i in range(1, n + 1):
        if i < n and rows[i] == rows[i - 1] + 1:
            continue
        length = i - start
        if length >= direct_min or length == n:
            for a in range(start, i, per):
                b = min(i, a + per)
                out.append(RowPlan(list(range(a, b)), (rows[a], rows[a] + b - a)))
        else:
            gathered.extend(range(start, i))
            while len(gathered) >= per:
                out.append(RowPlan(gathered[:per], None))
                gathered = gathered[per:]
        start = i
    if gathered:
        out.append(RowPlan(gathered, None))
    out.sort(key=lambda p: p.positions[0])
    return out


class ByteBudget:
    """Bytes in flight, bounded; waiters are served first come, first served.

    A request larger than the bound proceeds once nothing else is in flight. Used from one event
    loop only.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiters: collections.deque[tuple[int, anyio.Event]] = collections.deque()

    def _fits(self, n: int) -> bool:
        return self.used == 0 or self.used + n <= self.limit

    async def acquire(self, n: int) -> None:
        """Wait until ``n`` bytes fit, in arrival order."""
        if not self._waiters and self._fits(n):
            self.used += n
            return
        ev = anyio.Event()
        entry = (n, ev)
        self._waiters.append(entry)
        try:
            await ev.wait()
        except BaseException:
            if ev.is_set():
                self.release(n)  # granted just as we were cancelled: give it back
            else:
                self._waiters.remove(entry)
                self._wake()
            raise

    def release(self, n: int) -> None:
        """Give ``n`` bytes back and wake the waiters that now fit."""
        self.used -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            n, ev = self._waiters.popleft()
            self.used += n
            ev.set()


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
        self._presence: OrderedDict[bytes, tuple[bool, float]] = OrderedDict()
        #: keys whose presence is being probed now
        self.probing: set[bytes] = set()
        #: bumped whenever what the gateway knows of presence changes (lookups re-answer then)
        self.version = 0
        #: whether the tier answers, and the writes that wait for it (:mod:`tierkv.observing.health`)
        self.health = TierHealth(index, tier, self.stats, up, self._presence_changed)
        tier.add_listener(self._on_tier_event)

    @property
    def up(self) -> bool:
        """Whether the tier answers (a tier that is down holds nothing, for lookups)."""
        return self.health.up

    def _presence_changed(self) -> None:
        self.version += 1

    # ---- presence -------------------------------------------------------------------------------
    @property
    def fast(self) -> bool:
        """True when the tier answers presence from memory, without I/O."""
        return self.tier.capabilities.fast_contains

    def presence(self, group: int, key: bytes, now: float) -> bool | None:
        """True / False when known, None when a probe is needed (False while the tier is down)."""
        if not self.up:
            return False
        entry = self._presence.get(key)
        if entry is not None and entry[1] < now:
            del self._presence[key]
            entry = None
        if entry is None or (self.fast and entry[0]):
            # a tier that is not fast may still know from memory (a file tier's complete ledger)
            ans = self.tier.contains_nowait(group, [key])
            return None if ans is None else ans[0]
        return entry[0]

    def presence_many(self, group: int, keys: list[bytes], now: float) -> list[bool | None]:
        """:meth:`presence` of many keys."""
        if not self.up:
            return [False] * len(keys)
        cache = self._presence
        get = cache.get
        out: list[bool | None] = []
        if self.fast:
            ans = self.tier.contains_nowait(group, keys)
            for j, k in enumerate(keys):
                e = get(k)
                if e is not None and e[1] >= now and not e[0]:
                    out.append(False)  # a read of it failed just now
                else:
                    out.append(None if ans is None else ans[j])
            return out
        unknown: list[int] = []
        for k in keys:
            e = get(k)
            if e is None:
                unknown.append(len(out))
                out.append(None)
            elif e[1] < now:
                del cache[k]
                unknown.append(len(out))
                out.append(None)
            else:
                out.append(e[0])
        if unknown:
            # a tier that is not fast may still know from memory (a file tier's complete ledger)
            ans = self.tier.contains_nowait(group, [keys[i] for i in unknown])
            if ans is not None:
                for i, a in zip(unknown, ans, strict=True):
                    out[i] = a
        return out

    def note(self, key: bytes, present: bool, now: float | None = None) -> None:
        """Remember what a probe, a store or a load told about ``key``.

        A tier that answers presence from memory needs only the negative answers: a read that
        failed keeps the key a MISS for ``negative_ttl_s`` instead of promoting it again and again.
        """
        self.version += 1
        if self.fast and present:
            self._presence.pop(key, None)
            return
        now = time.monotonic() if now is None else now
        ttl = self.cfg.presence_ttl_s if present else self.cfg.negative_ttl_s
        self._presence[key] = (present, now + ttl)
        self._presence.move_to_end(key)
        while len(self._presence) > PRESENCE_CACHE_ENTRIES:
            self._presence.popitem(last=False)

    def note_many(self, keys: Sequence[bytes], present: Sequence[bool], now: float) -> None:
        """:meth:`note` of many keys at once (what a load or a store of a batch told)."""
        self.version += 1
        cache = self._presence
        cfg = self.cfg
        absent = (False, now + cfg.negative_ttl_s)
        if self.fast:
            for k, f in zip(keys, present, strict=True):
                cache.pop(k, None)
                if not f:
                    cache[k] = absent
        else:
            found = (True, now + cfg.presence_ttl_s)
            for k, f in zip(keys, present, strict=True):
                cache.pop(k, None)  # re-inserted: the most recent end
                cache[k] = found if f else absent
        while len(cache) > PRESENCE_CACHE_ENTRIES:
            cache.popitem(last=False)

    def _on_tier_event(self, event: str, keys: list[bytes]) -> None:
        """A listing's keys are present (no probe before their first read); removed keys are
        forgotten (the next lookup probes again). In slices: lookups wait for none of it long."""
        if event not in ("listed", "removed"):
            return
        for i in range(0, len(keys), LISTED_SLICE):
            part = keys[i:i + LISTED_SLICE]
            with self._lock:
                if event == "listed":
                    self.note_many(part, [True] * len(part), time.monotonic())
                else:
                    for k in part:
                        self.forget(k)

    def forget(self, key: bytes) -> None:
        """Drop a cached presence answer."""
        self.version += 1
        self._presence.pop(key, None)

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
                data = src8 if scattered else _take_rows(src, plan.run, at)
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

        async def one(plan: RowPlan) -> None:
            got = await self._load_batch(group, plan, keys, rows, dest, block, on_row, scattered)
            with self._lock:
                for i, f in zip(plan.positions, got, strict=True):
                    ok[i] = f
                if on_batch is not None:
                    on_batch(plan.positions, got)

        async def budgeted(plan: RowPlan, nbytes: int) -> None:
            try:
                await one(plan)
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
                    tg.start_soon(budgeted, plan, nbytes)
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
        buf, direct = _batch_buffer(dest, block, plan, scattered)
        t0 = time.monotonic()
        with self._lock:
            if self._loads_running == 0:
                self._rate.busy_since = t0
            self._loads_running += 1
        try:
            landed = None if on_row is None else functools.partial(
                _landed, on_row, plan.positions, buf, rows if scattered else None)
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



def _batch_buffer(dest: torch.Tensor, block: int, plan: RowPlan,
                  scattered: bool) -> tuple[torch.Tensor, bool]:
    """Where a load batch is read to, and whether that is ``dest`` itself: the whole of it for a
    tier that reads into scattered rows, the run's rows of a CPU ``dest``, else a staging buffer."""
    if scattered:
        return as_bytes(dest, dest.shape[0], block), True
    if plan.run is not None and dest.device.type == "cpu":
        return row_span(as_bytes(dest, dest.shape[0], block), plan.run[0], plan.run[1]), True
    return torch.empty((len(plan.positions), block), dtype=torch.uint8), False


def _take_rows(src: torch.Tensor, run: tuple[int, int] | None, rows: list[int]) -> torch.Tensor:
    """The CPU rows of ``src`` to write: a view when they are one run on the CPU, else a copy."""
    if run is not None:
        t = row_span(src, run[0], run[1])
    else:
        t = src.index_select(0, torch.tensor(rows, dtype=torch.int64, device=src.device))
    return t if t.device.type == "cpu" else t.cpu()


def _landed(on_row: OnRow, positions: list[int], buf: torch.Tensor, rows: list[int] | None, j: int) -> None:
    """Block ``j`` of a batch, read into row ``j`` of ``buf`` (or row ``rows[j]``), is verified:
    tell ``on_row`` its load position."""
    on_row(positions[j], buf[j if rows is None else rows[j]])

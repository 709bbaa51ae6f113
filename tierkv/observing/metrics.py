"""Counters: the models ``TieredStore.stats()`` returns, and a Prometheus text exposition."""

from __future__ import annotations

import bisect
import collections
import itertools
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field

from tierkv.blocks.pool import PoolPlan, SlotPool

__all__ = ["LATENCY_BUCKETS", "CostStats", "GroupStats", "Histogram", "HistogramStats", "Metric",
           "histogram_samples", "StoreStats", "TierStats", "all_metrics", "samples",
           "tier_samples", "to_prometheus"]


#: upper bounds (seconds) of the latency histograms' buckets
LATENCY_BUCKETS: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                                      2.5, 5.0, 10.0, 30.0, 60.0)


class HistogramStats(BaseModel):
    """A latency histogram: cumulative counts per bucket upper bound (the last is +Inf)."""

    buckets: list[float] = Field(default_factory=lambda: list(LATENCY_BUCKETS))
    counts: list[int] = Field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    sum: float = 0.0
    count: int = 0


class Histogram:
    """Observations of a duration: bucket counts, sum and count; the recent observations are kept
    (bounded) for publishers that take raw values, such as vLLM's metrics."""

    def __init__(self) -> None:
        self._counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self._sum = 0.0
        self._count = 0
        self._recent: collections.deque[float] = collections.deque(maxlen=4096)

    def observe(self, seconds: float) -> None:
        """Count one duration."""
        self._counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self._sum += seconds
        self._count += 1
        self._recent.append(seconds)

    def snapshot(self) -> HistogramStats:
        """The histogram as of now (cumulative counts)."""
        counts = list(itertools.accumulate(self._counts))
        return HistogramStats(counts=counts, sum=self._sum, count=self._count)

    def drain(self) -> list[float]:
        """The observations since the last drain (at most the last 4096)."""
        out = list(self._recent)
        self._recent.clear()
        return out


class TierStats(BaseModel):
    """Counters of one tier. ``hits`` count blocks served from it (tier 0: lookups and loads)."""

    index: int
    kind: str
    describe: str
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    stores: int = 0
    stores_failed: int = 0
    stores_shed: int = 0
    promotions: int = 0
    promotions_failed: int = 0
    probes: int = 0
    stores_skipped: int = 0
    #: bytes of stores being written now, waiting behind them, and of loads being read now
    inflight_bytes: int = 0
    queued_bytes: int = 0
    load_inflight_bytes: int = 0
    inflight_ops: int = 0
    #: 1 while the tier answers (the primary always), 0 while it is down or not attached yet
    up: int = 1
    stores_requeued: int = 0
    stores_requeue_dropped: int = 0
    #: blocks waiting in the retry queue now (written once the tier answers)
    requeue_waiting: int = 0
    stores_abandoned: int = 0
    #: why the tier is down (empty while it is up)
    down_reason: str = ""
    store_s_per_mib: float = 0.0
    #: measured aggregate read rate (the configured prior until the first load)
    read_bytes_per_s: float = 0.0
    #: seconds per load batch and per store call
    load_seconds: HistogramStats = Field(default_factory=HistogramStats)
    store_seconds: HistogramStats = Field(default_factory=HistogramStats)
    used_bytes: int | None = None
    backend: dict[str, int] = Field(default_factory=dict)


class GroupStats(BaseModel):
    """State of one primary pool."""

    group: int
    kind: str
    slots: int
    block_bytes: int
    free: int
    writing: int
    ready: int
    pinned: int
    #: READY and unpinned: what the next allocation may evict (free + evictable = available)
    evictable: int
    evictions: int

    @classmethod
    def of(cls, group: int, kind: str, pool: SlotPool) -> GroupStats:
        """The state of ``pool``, the primary pool of ``group``."""
        c = pool.counts()
        return cls(group=group, kind=kind, slots=pool.num_slots, block_bytes=pool.block_bytes,
                   free=c["free"], writing=c["writing"], ready=c["ready"], pinned=c["pinned"],
                   evictable=c["evictable"], evictions=pool.evictions)


class CostStats(BaseModel):
    """The cost model: its recompute rate, how many choices it made, what it sent to recompute."""

    recompute_tokens_per_s: float | None = None
    decisions: int = 0
    #: blocks that could have been loaded but were cheaper to recompute
    blocks_recomputed: int = 0
    #: the last choice: blocks, usable, load_s, recompute_s
    last: dict[str, float] | None = None


class StoreStats(BaseModel):
    """Everything ``TieredStore.stats()`` reports."""

    plan: PoolPlan
    tiers: list[TierStats]
    groups: list[GroupStats]
    lookups: dict[str, int]
    requests_active: int
    admission_queue: int
    promotions_pending: int
    puts: int
    put_blocks_direct: int
    put_blocks_dropped: int
    #: blocks evicted from the primary while no lower tier held them (gone from every tier)
    evictions_unbacked: int
    leases_expired: int
    #: tier events not delivered to a listener that fell 65,536 events behind
    events_dropped: int = 0
    cost: CostStats = Field(default_factory=CostStats)
    #: requests that stayed PENDING past their deadline and recomputed what was not ready
    pending_deadline_miss: int = 0
    #: how long requests' prefixes stayed PENDING before an answer (HIT, or MISS at the deadline)
    pending_seconds: HistogramStats = Field(default_factory=HistogramStats)


@dataclass(frozen=True)
class Metric:
    """One series family of tierkv's single naming scheme: ``tierkv_<name>``, with labels."""

    name: str
    kind: Literal["counter", "gauge", "histogram"]
    doc: str
    labels: tuple[str, ...] = ()

    @property
    def full_name(self) -> str:
        """The exported name (``tierkv_`` prefix)."""
        return f"tierkv_{self.name}"


_TIER = ("tier", "kind")
_GROUP = ("group", "kind")

#: per tier: field of :class:`TierStats` -> metric
TIER_METRICS: dict[str, Metric] = {
    "hits": Metric("tier_hits_total", "counter", "Blocks served from the tier", _TIER),
    "misses": Metric("tier_misses_total", "counter", "Blocks asked of the tier that it did not have", _TIER),
    "bytes_read": Metric("tier_bytes_read_total", "counter", "Bytes read from the tier", _TIER),
    "bytes_written": Metric("tier_bytes_written_total", "counter", "Bytes written to the tier", _TIER),
    "stores": Metric("tier_stores_total", "counter", "Blocks written to the tier", _TIER),
    "stores_failed": Metric("tier_stores_failed_total", "counter", "Blocks whose write failed", _TIER),
    "stores_shed": Metric("tier_stores_shed_total", "counter",
                          "Blocks not written: shed under backpressure", _TIER),
    "stores_skipped": Metric("tier_stores_skipped_total", "counter",
                             "Blocks not written because the tier already holds them", _TIER),
    "promotions": Metric("tier_promotions_total", "counter", "Blocks promoted from the tier", _TIER),
    "promotions_failed": Metric("tier_promotions_failed_total", "counter",
                                "Promotions that failed (missing, corrupt, unreadable)", _TIER),
    "probes": Metric("tier_probes_total", "counter", "Presence probes sent to the tier", _TIER),
    "inflight_bytes": Metric("tier_inflight_bytes", "gauge", "Bytes of stores being written", _TIER),
    "queued_bytes": Metric("tier_queued_bytes", "gauge", "Bytes of stores waiting their turn", _TIER),
    "load_inflight_bytes": Metric("tier_load_inflight_bytes", "gauge", "Bytes of loads being read", _TIER),
    "read_bytes_per_s": Metric("tier_read_bytes_per_second", "gauge",
                               "Measured read rate of the tier (the cost model's input)", _TIER),
    "up": Metric("tier_up", "gauge", "1 while the tier answers, 0 while it is down or not attached", _TIER),
    "stores_requeued": Metric("tier_stores_requeued_total", "counter",
                              "Failed writes queued to be written again when the tier answers", _TIER),
    "stores_requeue_dropped": Metric("tier_stores_requeue_dropped_total", "counter",
                                     "Failed writes not retried (queue full, left the primary)", _TIER),
    "requeue_waiting": Metric("tier_requeue_waiting", "gauge",
                              "Blocks waiting in the retry queue for the tier to answer", _TIER),
    "stores_abandoned": Metric("tier_stores_abandoned_total", "counter",
                               "Blocks close() could not write within close_timeout_s", _TIER),
}
#: per tier, from the backend's own counters: name -> metric
BACKEND_METRICS: dict[str, Metric] = {
    "corrupt": Metric("tier_corrupt_records_total", "counter",
                      "Records that failed verification (a counted miss, removed)", _TIER),
    "evictions": Metric("tier_evictions_total", "counter",
                        "Blocks removed from the tier to stay within capacity_bytes", _TIER),
    "read_errors": Metric("tier_read_errors_total", "counter", "Reads that failed with an error", _TIER),
    "write_errors": Metric("tier_write_errors_total", "counter", "Writes that failed with an error", _TIER),
}
USED_BYTES = Metric("tier_used_bytes", "gauge", "Bytes the tier holds (as known to this process)", _TIER)
#: per primary pool: field of :class:`GroupStats` -> metric
GROUP_METRICS: dict[str, Metric] = {
    "slots": Metric("pool_slots", "gauge", "Slots of the group's primary pool", _GROUP),
    "free": Metric("pool_free", "gauge", "Free slots", _GROUP),
    "writing": Metric("pool_writing", "gauge", "Slots being written (stores, promotions)", _GROUP),
    "ready": Metric("pool_ready", "gauge", "Slots holding a ready block", _GROUP),
    "pinned": Metric("pool_pinned", "gauge", "Slots pinned by requests or cascades", _GROUP),
    "evictions": Metric("pool_evictions_total", "counter", "Blocks evicted from the pool", _GROUP),
}
#: store-wide: field of :class:`StoreStats` -> metric
STORE_METRICS: dict[str, Metric] = {
    "promotions_pending": Metric("promotions_pending", "gauge", "Blocks being promoted"),
    "admission_queue": Metric("admission_queue", "gauge", "Requests waiting for primary slots"),
    "requests_active": Metric("requests_active", "gauge", "Requests holding pins"),
    "put_blocks_dropped": Metric("put_blocks_dropped_total", "counter",
                                 "Blocks put that no tier took (no slot, every cascade shed)"),
    "evictions_unbacked": Metric("evictions_unbacked_total", "counter",
                                 "Blocks evicted from the primary while no lower tier held them"),
    "leases_expired": Metric("leases_expired_total", "counter", "Requests whose pins expired"),
    "pending_deadline_miss": Metric("pending_deadline_miss_total", "counter",
                                    "Requests PENDING past their deadline (they recomputed)"),
}
LOOKUPS = Metric("lookups_total", "counter", "Lookup answers", ("state",))

HISTOGRAMS: dict[str, Metric] = {
    "load_seconds": Metric("tier_load_seconds", "histogram", "Seconds per load batch from the tier", _TIER),
    "store_seconds": Metric("tier_store_seconds", "histogram", "Seconds per store call to the tier", _TIER),
    "pending_seconds": Metric("pending_seconds", "histogram",
                              "Seconds a request's prefix stayed PENDING before its answer"),
}

Sample = tuple[Metric, tuple[str, ...], float]
HistogramSample = tuple[Metric, tuple[str, ...], HistogramStats]


def histogram_samples(stats: StoreStats) -> list[HistogramSample]:
    """Every latency histogram of a store."""
    out: list[HistogramSample] = []
    for t in stats.tiers[1:]:
        labels = (str(t.index), t.kind)
        out += [(HISTOGRAMS["load_seconds"], labels, t.load_seconds),
                (HISTOGRAMS["store_seconds"], labels, t.store_seconds)]
    out.append((HISTOGRAMS["pending_seconds"], (), stats.pending_seconds))
    return out


def tier_samples(t: TierStats, tier_label: str | None = None) -> list[Sample]:
    """The samples of one tier (``tier_label`` replaces its index as the ``tier`` label)."""
    labels = (tier_label if tier_label is not None else str(t.index), t.kind)
    out: list[Sample] = [(m, labels, float(getattr(t, f))) for f, m in TIER_METRICS.items()]
    out += [(m, labels, float(t.backend.get(name, 0))) for name, m in BACKEND_METRICS.items()]
    if t.used_bytes is not None:
        out.append((USED_BYTES, labels, float(t.used_bytes)))
    return out


def samples(stats: StoreStats) -> list[Sample]:
    """Every sample of a store, in the one naming scheme."""
    out: list[Sample] = []
    for t in stats.tiers:
        out += tier_samples(t)
    for g in stats.groups:
        labels = (str(g.group), g.kind)
        out += [(m, labels, float(getattr(g, f))) for f, m in GROUP_METRICS.items()]
    out += [(LOOKUPS, (state,), float(v)) for state, v in sorted(stats.lookups.items())]
    out += [(m, (), float(getattr(stats, f))) for f, m in STORE_METRICS.items()]
    return out


def all_metrics() -> list[Metric]:
    """Every metric family a store exports."""
    return [*TIER_METRICS.values(), *BACKEND_METRICS.values(), USED_BYTES, *GROUP_METRICS.values(),
            LOOKUPS, *STORE_METRICS.values(), *HISTOGRAMS.values()]


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def to_prometheus(stats: StoreStats) -> str:
    """The samples in Prometheus text exposition format (no client library needed)."""
    by_family: dict[str, list[str]] = {}
    families: dict[str, Metric] = {}
    for m, labels, value in samples(stats):
        families[m.name] = m
        lab = ",".join(f'{k}="{_escape(v)}"' for k, v in zip(m.labels, labels, strict=True))
        text = f"{m.full_name}{{{lab}}} {value:g}" if lab else f"{m.full_name} {value:g}"
        by_family.setdefault(m.name, []).append(text)
    for m, labels, h in histogram_samples(stats):
        families[m.name] = m
        base = [f'{k}="{_escape(v)}"' for k, v in zip(m.labels, labels, strict=True)]
        rows = by_family.setdefault(m.name, [])
        for le, n in zip([*(f"{b:g}" for b in h.buckets), "+Inf"], h.counts, strict=True):
            bound = 'le="' + le + '"'
            rows.append(f"{m.full_name}_bucket{{{','.join([*base, bound])}}} {n}")
        lab = f"{{{','.join(base)}}}" if base else ""
        rows += [f"{m.full_name}_sum{lab} {h.sum:g}", f"{m.full_name}_count{lab} {h.count}"]
    lines = []
    for name, rows in by_family.items():
        m = families[name]
        lines += [f"# HELP {m.full_name} {m.doc}", f"# TYPE {m.full_name} {m.kind}", *rows]
    return "\n".join(lines) + "\n"

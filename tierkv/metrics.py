"""Counters: the models ``TieredStore.stats()`` returns, and a Prometheus text exposition."""

from __future__ import annotations

from pydantic import BaseModel, Field

from tierkv.pool import PoolPlan

__all__ = ["GroupStats", "StoreStats", "TierStats", "to_prometheus"]


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
    inflight_bytes: int = 0
    inflight_ops: int = 0
    store_s_per_mib: float = 0.0
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
    evictions: int


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
    leases_expired: int


def _line(name: str, value: float, **labels: object) -> str:
    lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return f"tierkv_{name}{{{lab}}} {value}" if lab else f"tierkv_{name} {value}"


def to_prometheus(stats: StoreStats) -> str:
    """The counters in Prometheus text exposition format (no client library needed)."""
    lines = []
    for t in stats.tiers:
        for field in ("hits", "misses", "bytes_read", "bytes_written", "stores", "stores_failed",
                      "stores_shed", "promotions", "promotions_failed", "probes"):
            lines.append(_line(f"tier_{field}_total", getattr(t, field), tier=t.index, kind=t.kind))
        lines.append(_line("tier_inflight_bytes", t.inflight_bytes, tier=t.index, kind=t.kind))
        for name, v in sorted(t.backend.items()):
            lines.append(_line(f"tier_backend_{name}_total", v, tier=t.index, kind=t.kind))
    for g in stats.groups:
        for field in ("slots", "free", "writing", "ready", "pinned"):
            lines.append(_line(f"pool_{field}", getattr(g, field), group=g.group, kind=g.kind))
        lines.append(_line("pool_evictions_total", g.evictions, group=g.group, kind=g.kind))
    for state, v in sorted(stats.lookups.items()):
        lines.append(_line("lookups_total", v, state=state))
    lines.append(_line("promotions_pending", stats.promotions_pending))
    lines.append(_line("admission_queue", stats.admission_queue))
    return "\n".join(lines) + "\n"

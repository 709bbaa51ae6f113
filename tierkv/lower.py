"""Runtime state the store keeps per lower tier: presence cache, backpressure, counters."""

from __future__ import annotations

import time
from collections import OrderedDict

import anyio

from tierkv.backends.base import Tier
from tierkv.metrics import TierStats

__all__ = ["LowerTier"]

MIB = 1 << 20
EMA_ALPHA = 0.2
PRESENCE_CACHE_ENTRIES = 1 << 20


class LowerTier:
    """A lower tier as the store drives it.

    Presence answers are cached (found for ``presence_ttl_s``, not found for ``negative_ttl_s``);
    cascades are admitted against bounds on in-flight bytes and operations and against the
    tier's measured store latency (an EMA of seconds per MiB), and shed past them. Reads have a
    limiter of their own so cascades never delay promotions.
    """

    def __init__(self, index: int, tier: Tier) -> None:
        self.index = index
        self.tier = tier
        cfg = tier.config
        self.cfg = cfg
        self.write_limiter = anyio.CapacityLimiter(max(1, cfg.max_inflight_ops))
        self.read_limiter = anyio.CapacityLimiter(max(1, cfg.read_concurrency))
        self.inflight_bytes = 0
        self.inflight_ops = 0
        self.ema_s_per_mib = 0.0
        self.stats = TierStats(index=index, kind=tier.kind, describe=tier.describe())
        self._presence: OrderedDict[bytes, tuple[bool, float]] = OrderedDict()
        self.probing: set[bytes] = set()

    @property
    def fast(self) -> bool:
        """True when presence is known without I/O."""
        return self.tier.capabilities.fast_contains

    def presence(self, group: int, key: bytes, now: float) -> bool | None:
        """True / False when known, None when a probe is needed."""
        entry = self._presence.get(key)
        if entry is not None and entry[1] < now:
            del self._presence[key]
            entry = None
        if self.fast and (entry is None or entry[0]):
            ans = self.tier.contains_nowait(group, [key])
            return None if ans is None else ans[0]
        return None if entry is None else entry[0]

    def note(self, key: bytes, present: bool, now: float | None = None) -> None:
        """Remember what a probe, a store or a read told about ``key``.

        A tier that answers presence from memory needs only the negative answers: a read that
        failed keeps the key a MISS for ``negative_ttl_s`` instead of promoting it again and again.
        """
        if self.fast and present:
            self._presence.pop(key, None)
            return
        now = time.monotonic() if now is None else now
        ttl = self.cfg.presence_ttl_s if present else self.cfg.negative_ttl_s
        self._presence[key] = (present, now + ttl)
        self._presence.move_to_end(key)
        while len(self._presence) > PRESENCE_CACHE_ENTRIES:
            self._presence.popitem(last=False)

    def forget(self, key: bytes) -> None:
        """Drop a cached presence answer."""
        self._presence.pop(key, None)

    def admit_store(self, nbytes: int) -> bool:
        """Whether a cascade of ``nbytes`` may start now; when it may, it is counted in flight."""
        cfg = self.cfg
        if self.inflight_bytes and self.inflight_bytes + nbytes > cfg.max_inflight_bytes:
            return False
        if self.inflight_ops >= cfg.max_inflight_ops * 4:
            return False
        queued_mib = (self.inflight_bytes + nbytes) / MIB
        est = self.ema_s_per_mib * queued_mib / max(1, cfg.max_inflight_ops)
        if self.inflight_bytes and est > cfg.shed_after_s:
            return False
        self.inflight_bytes += nbytes
        self.inflight_ops += 1
        return True

    def store_done(self, nbytes: int, seconds: float | None) -> None:
        """A cascade admitted by :meth:`admit_store` ended; ``seconds`` when it succeeded."""
        self.inflight_bytes -= nbytes
        self.inflight_ops -= 1
        if seconds is not None and nbytes:
            sample = seconds / (nbytes / MIB)
            if self.ema_s_per_mib == 0.0:
                self.ema_s_per_mib = sample
            else:
                self.ema_s_per_mib += EMA_ALPHA * (sample - self.ema_s_per_mib)

    def snapshot(self) -> TierStats:
        """Counters as of now."""
        s = self.stats.model_copy()
        s.inflight_bytes = self.inflight_bytes
        s.inflight_ops = self.inflight_ops
        s.store_s_per_mib = self.ema_s_per_mib
        s.used_bytes = self.tier.used_bytes()
        s.backend = dict(self.tier.counters)
        return s

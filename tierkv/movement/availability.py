"""Lower tiers that are down, slow to open or hung never hold the engine.

A store opens its primary at once and each lower tier in the background (:meth:`TierWatch.attach`):
its start waits for a tier at most ``open_timeout_s``; a tier that has not answered by then joins
when it answers (``required: true`` fails the start instead). While a tier is down (it never
opened, batches of writes failed, its writes stalled, reads or probes raised: :mod:`tierkv.observing.health`)
lookups do without it, its writes wait in a bounded queue, and a health check asks it every
``health_interval_s`` whether it answers again; once it does, the queued writes of blocks still in
the primary are written. A tier that is up but whose last batch of writes failed wholly is asked
the same way before its queue is written; a tier whose writes stall is found by the same check.

A tier whose first open fails for a reason that waiting will not cure (a bad setting, a missing
bucket, wrong credentials, no permission) fails the start with that error, as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

import anyio

from tierkv.backends.base import Tier
from tierkv.blocks.pool import SlotPool
from tierkv.bridge import LoopBridge
from tierkv.errors import BackendError, unavailable
from tierkv.movement.cascade import REDO_BATCH
from tierkv.movement.gateway import TierGateway

__all__ = ["LowerTiers", "Recascade", "TierWatch"]

#: ``recascade(group, keys, slots, gateway, attempts)``: write ``keys`` (in ``slots`` of the
#: primary) again to that tier only, after ``attempts`` failed writes
Recascade = Callable[[int, list[bytes], list[int], TierGateway, int], None]

log = logging.getLogger("tierkv")

#: the pause between two steps of writing a retry queue (each step is ``REDO_BATCH`` blocks at
#: most; a step the tier's queue has no room for goes back to the retry queue)
REDO_STEP_S = 0.1
#: the longest pause between two attempts to open a tier that is down
MAX_BACKOFF_S = 30.0


class TierWatch:
    """Attaches one lower tier in the background, checks it while it is down, writes its queue."""

    def __init__(self, bridge: LoopBridge, gateway: TierGateway, pools: Mapping[int, SlotPool],
                 recascade: Recascade) -> None:
        self._bridge = bridge
        self.gw = gateway
        gateway.health.keeps_retries = True  # this watch writes its retry queue
        self._pools = pools
        self._recascade = recascade
        #: set once the tier opened (or its first open failed for good: see :attr:`fatal`)
        self.settled = anyio.Event()
        self.fatal: BaseException | None = None
        self.opened = False
        #: why the last attempt to open failed ('' before one failed)
        self.last_error = ""

    @property
    def tier(self) -> Tier:
        """The tier watched."""
        return self.gw.tier

    async def attach(self) -> None:
        """Open the tier, again and again while it does not answer; then watch it."""
        delay = min(1.0, self.gw.cfg.health_interval_s)
        first = True
        while True:
            try:
                with anyio.fail_after(self.gw.cfg.open_timeout_s):
                    await self.tier.open()
                break
            except Exception as exc:
                if first and not unavailable(exc):
                    self.fatal = exc
                    self._bridge.set_event(self.settled)
                    return
                with self._bridge.lock:
                    why = (f"no answer within open_timeout_s={self.gw.cfg.open_timeout_s:g}"
                           if isinstance(exc, TimeoutError) else str(exc)[:300] or type(exc).__name__)
                    self.gw.health.down_reason = self.last_error = why
                if first:
                    log.warning("tier %d (%s) did not open: %s; the store works without it and "
                                "attaches it when it answers", self.gw.index, self.tier.describe(), why)
                first = False
            await anyio.sleep(delay)
            delay = min(MAX_BACKOFF_S, delay * 2)
        self.opened = True
        with self._bridge.lock:
            self.gw.health.set_up(True)
        self._bridge.set_event(self.settled)
        self._bridge.spawn(self._background)
        await self._watch()

    async def _background(self) -> None:
        try:
            await self.tier.background()
        except Exception:
            log.exception("background work of tier %d (%s) failed", self.gw.index, self.tier.describe())

    async def _watch(self) -> None:
        """Every ``health_interval_s``: whether its writes stall; while down, or up with queued
        writes after a batch failed wholly, ask whether it answers; then write what waits in the
        retry queue (in steps of ``REDO_BATCH`` blocks, ``REDO_STEP_S`` apart)."""
        interval = self.gw.cfg.health_interval_s
        health = self.gw.health
        pause = interval
        while True:
            await anyio.sleep(pause)
            pause = interval
            with self._bridge.lock:
                self.gw.check_stall(time.monotonic())
                ask = not self.gw.up or (bool(health.redo) and not health.answers)
            if ask:
                try:
                    with anyio.fail_after(max(interval, self.gw.cfg.open_timeout_s)):
                        await self.tier.check()
                except Exception as exc:
                    with self._bridge.lock:
                        if self.gw.up:
                            health.read(False, exc)  # several in a row: down
                        if not self.gw.up:
                            health.down_reason = (str(exc)[:300] or type(exc).__name__) if not isinstance(
                                exc, TimeoutError) else "no answer to the health check"
                    continue
                with self._bridge.lock:
                    health.set_up(True)
            if self._redo():
                pause = min(interval, REDO_STEP_S)

    def _redo(self) -> bool:
        """Cascade again, to this tier, queued blocks still ready in the primary (one step);
        whether the queue holds more."""
        with self._bridge.lock:
            redo = self.gw.health.redo
            if not redo or not (self.gw.up and self.gw.health.answers):
                return False
            for group, attempts, keys, slots in self.gw.health.due(self._pools, REDO_BATCH):
                self._recascade(group, keys, slots, self.gw, attempts)
            return bool(redo)


class LowerTiers:
    """A store's lower tiers, from start to close: one :class:`TierWatch` each; the start's wait;
    close's bounds (``close_timeout_s``) and what it leaves behind."""

    def __init__(self, bridge: LoopBridge, gateways: Sequence[TierGateway], pools: Mapping[int, SlotPool],
                 recascade: Recascade) -> None:
        self._bridge = bridge
        self.gateways = list(gateways)
        self.watches = [TierWatch(bridge, gw, pools, recascade) for gw in self.gateways]

    def start(self) -> None:
        """Open every lower tier in the background."""
        for w in self.watches:
            self._bridge.spawn(w.attach)

    async def wait_open(self) -> None:
        """Wait for each lower tier up to its ``open_timeout_s`` (all at once); raise for a tier
        set up wrong, or a ``required`` one that did not open."""
        t0 = time.monotonic()
        for w in self.watches:
            left = w.gw.cfg.open_timeout_s - (time.monotonic() - t0)
            with anyio.move_on_after(max(0.0, left)):
                await w.settled.wait()
        for w in self.watches:
            if w.fatal is not None:
                raise w.fatal
        for w in self.watches:
            if w.gw.cfg.required and not w.opened:
                why = w.last_error or "no answer"
                raise BackendError(f"tier {w.gw.index} ({w.tier.describe()}) is required and did not open "
                                   f"within open_timeout_s={w.gw.cfg.open_timeout_s:g}: {why}")

    def close_bound(self) -> float:
        """Seconds ``close()`` may wait for the lower tiers: the longest ``close_timeout_s``."""
        return max((gw.cfg.close_timeout_s for gw in self.gateways), default=0.0)

    def abandon_unwritten(self, pending: Mapping[int, int]) -> None:
        """Cascades still running past the bound (``pending``: blocks per tier index): counted,
        and no longer waited for."""
        for gw in self.gateways:
            n = pending.get(gw.index, 0)
            if n:
                gw.stats.stores_abandoned += n
                gw.tier.abandon()
                log.warning("close: %d blocks were not written to tier %d (%s) within close_timeout_s=%g",
                            n, gw.index, gw.tier.describe(), gw.cfg.close_timeout_s)

    async def abandon_at(self, deadline: float) -> None:
        """At ``deadline`` (half a second at least), stop waiting for any tier's I/O."""
        await anyio.sleep(max(0.5, deadline - time.monotonic()))
        for gw in self.gateways:
            gw.tier.abandon()

    async def close(self, deadline: float) -> None:
        """Close every lower tier, last first, each cut at ``deadline`` (half a second at least)."""
        for gw in reversed(self.gateways):
            with anyio.move_on_after(max(0.5, deadline - time.monotonic())) as scope:
                try:
                    await gw.tier.close()  # not shielded: its bound must be able to cut it
                except Exception:
                    log.exception("closing tier %s failed", gw.tier.describe())
            if scope.cancelled_caught:
                gw.tier.abandon()
                log.warning("closing tier %d (%s) did not end within close_timeout_s=%g: left to "
                            "end on its own", gw.index, gw.tier.describe(), gw.cfg.close_timeout_s)

"""Lower tiers that are down, slow to open or hung never hold the engine.

A store opens its primary at once and each lower tier in the background (:meth:`TierWatch.attach`):
its start waits for a tier at most ``open_timeout_s``; a tier that has not answered by then joins
when it answers (``required: true`` fails the start instead). While a tier is down (it never
opened, a whole batch of writes failed, a read or probe raised) lookups do without it, its writes
wait in a bounded queue, and a health check asks it every ``health_interval_s`` whether it answers
again; once it does, the queued writes of blocks still in the primary are written.

A tier whose first open fails for a reason that waiting will not cure (a bad setting, a missing
bucket, wrong credentials, no permission) fails the start with that error, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import anyio

from tierkv.backends.base import Tier
from tierkv.backends.fsio import unavailable
from tierkv.bridge import LoopBridge
from tierkv.gateway import TierGateway
from tierkv.pool import SlotPool

__all__ = ["TierWatch"]

log = logging.getLogger("tierkv")

#: blocks re-cascaded per step of the retry queue
REDO_BATCH = 256
#: the longest pause between two attempts to open a tier that is down
MAX_BACKOFF_S = 30.0


class TierWatch:
    """Attaches one lower tier in the background, checks it while it is down, writes its queue."""

    def __init__(self, bridge: LoopBridge, gateway: TierGateway, pools: Mapping[int, SlotPool],
                 recascade: Callable[[int, list[bytes], list[int], TierGateway], None]) -> None:
        self._bridge = bridge
        self.gw = gateway
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
                    self.gw.down_reason = self.last_error = why
                if first:
                    log.warning("tier %d (%s) did not open: %s; the store works without it and "
                                "attaches it when it answers", self.gw.index, self.tier.describe(), why)
                first = False
            await anyio.sleep(delay)
            delay = min(MAX_BACKOFF_S, delay * 2)
        self.opened = True
        with self._bridge.lock:
            self.gw.set_up(True)
        self._bridge.set_event(self.settled)
        self._bridge.spawn(self._background)
        await self._watch()

    async def _background(self) -> None:
        try:
            await self.tier.background()
        except Exception:
            log.exception("background work of tier %d (%s) failed", self.gw.index, self.tier.describe())

    async def _watch(self) -> None:
        """While down: ask every ``health_interval_s`` whether it answers; while up: write what
        waits in the retry queue."""
        interval = self.gw.cfg.health_interval_s
        while True:
            await anyio.sleep(interval)
            if not self.gw.up:
                try:
                    with anyio.fail_after(max(interval, self.gw.cfg.open_timeout_s)):
                        await self.tier.check()
                except Exception as exc:
                    with self._bridge.lock:
                        self.gw.down_reason = (str(exc)[:300] or type(exc).__name__) if not isinstance(
                            exc, TimeoutError) else "no answer to the health check"
                    continue
                with self._bridge.lock:
                    self.gw.set_up(True)
            self._redo()

    def _redo(self) -> None:
        """Cascade again, to this tier, the queued blocks still ready in the primary."""
        with self._bridge.lock:
            gw = self.gw
            if not gw.redo or not gw.up:
                return
            by_group: dict[int, tuple[list[bytes], list[int]]] = {}
            for _ in range(min(REDO_BATCH, len(gw.redo))):
                (group, key), _attempts = gw.redo.popitem(last=False)
                pool = self._pools.get(group)
                slot = pool.slot_of(key) if pool is not None and pool.is_ready(key) else None
                if slot is None:
                    gw.stats.stores_requeue_dropped += 1  # it left the primary meanwhile
                    continue
                keys, slots = by_group.setdefault(group, ([], []))
                keys.append(key)
                slots.append(slot)
            for group, (keys, slots) in by_group.items():
                self._recascade(group, keys, slots, gw)

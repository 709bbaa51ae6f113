"""TieredStore: the facade over the primary pool, its lower tiers and the work between them.

Data paths (docs/design.md has the module map):

- put ↓: :meth:`TieredStore.put` writes rows into primary slots (:mod:`tierkv.blocks.pool`); the
  :class:`~tierkv.movement.cascade.Cascader` writes them on through each lower tier's
  :class:`~tierkv.movement.gateway.TierGateway` to its backend.
- restore ↑: :meth:`TieredStore.lookup_prefix` asks the :class:`~tierkv.movement.lookup.Resolver`,
  which admits promotions (:class:`~tierkv.blocks.admission.Admission`); each is a gateway ``load``
  straight into the reserved pool rows, batch by batch; :meth:`TieredStore.get` copies the
  rows out in one batched copy per run of ready blocks.

Engines that copy blocks themselves use :attr:`TieredStore.engine`
(:class:`~tierkv.movement.engine.EngineSlots`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

import anyio
import torch

from tierkv.backends.base import Tier, TierContext
from tierkv.backends.pooltier import PoolTier
from tierkv.backends.registry import get_backend
from tierkv.blocks.admission import Admission, Request
from tierkv.blocks.pool import SlotPool
from tierkv.bridge import LoopBridge, locked
from tierkv.config import StoreConfig
from tierkv.errors import ConfigError, InvalidArgument, StoreClosed
from tierkv.layout import Layout
from tierkv.movement.availability import LowerTiers
from tierkv.movement.costmodel import CostModel
from tierkv.movement.engine import EngineSlots, Reservation, pool_for
from tierkv.movement.gateway import TierGateway
from tierkv.movement.lookup import KeyState, Lookup, PrefixLookup
from tierkv.movement.parts import Parts
from tierkv.movement.writer import put_blocks
from tierkv.observing.events import ListenerThread, subscribe
from tierkv.observing.exporter import start_metrics
from tierkv.observing.metrics import HISTOGRAMS, GroupStats, StoreStats, TierStats
from tierkv.units import RecordUnits

__all__ = ["KeyState", "Lookup", "PrefixLookup", "Reservation", "TieredStore"]

log = logging.getLogger("tierkv")


class TieredStore:
    """A tiered block store. Use as ``async with TieredStore(config) as store:``.

    ``lookup`` and ``lookup_prefix`` never await: they read in-memory state and start background
    work (presence probes, promotions). ``put`` returns once the blocks are in the primary; the
    cascade to lower tiers runs in the background (``flush`` waits for it). The synchronous
    methods may be called from any thread while the store runs on its asyncio loop.

    With ``layout.blocks_per_record = N > 1`` the calls still take one hash and one row per block,
    starting at a record's first block; ``stats``, :attr:`engine` and ``lend_slots`` count and name
    records (:mod:`tierkv.units`).
    """

    def __new__(cls, config: StoreConfig | Mapping[str, Any]) -> TieredStore:
        if cls is TieredStore and _daemon_of(config) is not None:  # served by the daemon (docs/daemon.md)
            from tierkv.daemon.client import DaemonStore

            return super().__new__(DaemonStore)
        return super().__new__(cls)

    def __init__(self, config: StoreConfig | Mapping[str, Any]) -> None:
        self.config = StoreConfig.coerce(config)
        self.layout: Layout = self.config.layout
        self.fingerprint = self.config.fingerprint
        self._units = RecordUnits(self.layout)
        self._tiers = _make_tiers(self.config, self._units)
        self._primary = primary = _primary_of(self._tiers)
        self._bridge = LoopBridge("tierkv store")
        self._lock = self._bridge.lock
        self._open = False
        self._pools: dict[int, SlotPool] = {}
        self._gateways: list[TierGateway] = []
        self._parts: Parts | None = None
        self._metrics: Any = None
        self._lower = LowerTiers(self._bridge, [], {}, lambda *_: None)
        self._listeners: list[ListenerThread] = []
        self._primary_stats = TierStats(index=0, kind=primary.kind, describe=primary.describe())
        self._lookups = {s.value: 0 for s in Lookup}
        self._cost = CostModel(self._units.records.tokens_per_block, self.config.recompute_tokens_per_s,
                               self.config.max_pending_s, enabled=self.config.cost_model)
        self._counts = {"puts": 0, "put_blocks_direct": 0, "put_blocks_dropped": 0, "evictions_unbacked": 0}

    # ---- lifecycle ------------------------------------------------------------------------------
    async def __aenter__(self) -> TieredStore:
        await self.open()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def open(self) -> None:
        """Open the primary, start background work, and open the lower tiers: each is waited for
        at most its ``open_timeout_s``; one that has not answered by then joins when it answers
        (``required: true`` fails the start instead; so does a tier set up wrong). Prefer
        ``async with``."""
        if self._open:
            return
        await self._primary.open()
        try:
            self._pools = self._primary.pools
            self._gateways = [TierGateway(i, t, self._lock, up=False)
                              for i, t in enumerate(self._tiers[1:], start=1)]
            self._parts = Parts.build(
                layout=self._units.records, pools=self._pools, gateways=self._gateways, bridge=self._bridge,
                cost=self._cost, admission_config=self.config.admission, primary_stats=self._primary_stats,
                check_open=self._check_open, counts=self._counts)
            self._metrics = start_metrics(self.config, self.stats)
            await self._bridge.start()
        except BaseException:
            await _close_all([self._primary])
            raise
        self._open = True
        parts = self._wired()
        parts.ledger.open = True
        self._bridge.spawn(parts.admission.sweep_leases, self.config.pin_lease_s, self._lock,
                           parts.ledger.changed)
        self._bridge.spawn(_guarded, self._primary.background)
        self._lower = LowerTiers(self._bridge, self._gateways, self._pools, parts.cascader.retry)
        self._lower.start()
        try:
            await self._lower.wait_open()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.close()
            raise

    def _wired(self) -> Parts:
        """The parts of the open store (:class:`StoreClosed` before it opens)."""
        if self._parts is None:
            raise StoreClosed("the store is not open: use 'async with TieredStore(config) as store'")
        return self._parts

    async def close(self) -> None:
        """Wait for admitted cascades (each tier at most its ``close_timeout_s``), stop background
        work, close every tier (each within its ``close_timeout_s``).

        What a tier could not write in time is counted (``stores_abandoned``) and logged; a hung
        tier's I/O is left to end on its own. May be called from any task or inside a timeout:
        when cancelled while it waits for cascades, it still stops the background work and closes
        the tiers before it returns.
        """
        if not self._open:
            return
        lower = self._lower
        deadline = time.monotonic() + lower.close_bound()
        try:
            with anyio.move_on_after(lower.close_bound()):
                await self.flush()
            if self._parts is not None:
                with self._lock:
                    pending = dict(self._parts.cascader.pending)
                lower.abandon_unwritten(pending)
        finally:
            with self._lock:
                self._open = False
                if self._parts is not None:
                    self._parts.ledger.open = False
            metrics, self._metrics = self._metrics, None
            with anyio.CancelScope(shield=True):
                await _stop(self._bridge, lower, deadline, metrics, self._primary, self._listeners)
            for pool in self._pools.values():
                pool.release()

    def _check_open(self) -> None:
        if not self._open:
            raise StoreClosed("the store is not open: use 'async with TieredStore(config) as store'")

    @property
    def tiers(self) -> list[Tier]:
        """The tier objects, primary first."""
        return list(self._tiers)

    @property
    def metrics_url(self) -> str | None:
        """Where the store serves Prometheus metrics (with ``metrics_port``), else None."""
        return None if self._metrics is None else str(self._metrics.url)

    @property
    def engine(self) -> EngineSlots:
        """The slot API for engine adapters (see :mod:`tierkv.movement.engine`)."""
        self._check_open()
        return self._wired().engine

    # ---- validation -----------------------------------------------------------------------------
    def _keys(self, group: int, hashes: Sequence[bytes],
              whole: str = "") -> tuple[SlotPool, list[bytes], int]:
        """The pool of ``group`` and :meth:`RecordUnits.keys` of ``hashes``."""
        self._check_open()
        pool = pool_for(self._pools, self.layout, group)
        return (pool, *self._units.keys(group, hashes, whole))

    # ---- put ------------------------------------------------------------------------------------
    async def put(self, group: int, hashes: Sequence[bytes], blocks: torch.Tensor) -> None:
        """Store ``blocks[i]`` as block ``hashes[i]`` of ``group``.

        Returns once the blocks are in the primary (readable at once); cascades to lower tiers run
        in the background. Blocks already held are not written again. Blocks that find no free or
        evictable slot go straight to the lower tiers from a private copy; when no tier takes them
        either they are dropped and counted (``put_blocks_dropped``).

        With ``blocks_per_record = N > 1`` the blocks are stored as whole records of ``N``;
        the last ``len(hashes) % N`` blocks (a record not yet full) are not stored anywhere and
        look up as MISS (the engine recomputes them, fewer than ``N`` blocks).
        """
        with self._lock:
            pool, keys, n = self._keys(group, hashes)
            src = self._units.rows(blocks, group, n, len(keys), "blocks", pool.device)
            self._counts["puts"] += 1
            parts = self._wired()
        await put_blocks(self._lock, parts.ledger, group, keys, src, parts.cascader, parts.committed,
                         self._counts)

    async def flush(self) -> None:
        """Wait until every admitted cascade has finished (or failed, counted in ``stats()``), then
        write the retry queue of every lower tier that is up and answers (a tier that is down keeps
        its queue until its health check: docs/tiers.md, "Outages, stalls and the retry queue")."""
        if self._parts is not None:
            await self._parts.cascader.flush()

    async def idle(self) -> None:
        """Wait until no cascade, promotion or probe is in flight (for tests and simulations)."""
        while (self._parts is not None and self._parts.cascader.running) or self._bridge.busy:
            await self.flush()
            await self._bridge.wait_idle()

    # ---- lookups --------------------------------------------------------------------------------
    @locked
    def lookup(self, group: int, hashes: Sequence[bytes],
               request_id: str | None = None) -> list[Lookup]:
        """Per block: HIT (ready in the primary), PENDING (on its way) or MISS. Never awaits.

        A block held only by a lower tier gets a primary slot reserved now and is promoted in the
        background; with ``request_id`` every HIT or PENDING block is pinned for that request until
        it loads the block (``get(..., request_id=)``) or is released.
        """
        return [st.lookup for st in self.lookup_states(group, hashes, request_id)]

    @locked
    def lookup_states(self, group: int, hashes: Sequence[bytes],
                      request_id: str | None = None) -> list[KeyState]:
        """:meth:`lookup` with the reason behind each answer (see :class:`KeyState`).

        With several blocks to a record, a block's answer is its record's, and the blocks of a
        trailing record not yet full are MISS (``stats().lookups`` counts records)."""
        _, keys, n = self._keys(group, hashes)
        parts = self._wired()
        with _asking(parts.admission, request_id) as req:
            states = parts.keys.states(group, keys, req)
        for st in states:
            self._lookups[st.lookup.value] += 1
        return self._units.states(states, n)

    def lookup_prefix(self, hashes: Sequence[bytes], request_id: str | None = None) -> PrefixLookup:
        """The longest usable prefix over every prefix-cacheable group (docs/design.md).

        ``blocks`` is the longest prefix whose needed blocks are all known to exist somewhere;
        ``state`` is HIT when they are all ready in the primary and no probe can lengthen it,
        PENDING when waiting gives a ready or longer prefix, MISS when there is nothing at all.
        A prefix needing more blocks of a group than its pool has falls back to the longest that fits.
        With several blocks to a record, ``blocks`` is a multiple of ``blocks_per_record``.
        """
        with self._lock:  # not @locked: the restore's walk is one call shorter (docs/design.md)
            self._check_open()
            parts = self._wired()
            with _asking(parts.admission, request_id) as req:
                result = parts.resolver.prefix(self._units.prefix_hashes(hashes), req)
            self._lookups[result.state.value] += 1
            return self._units.prefix(result)

    @locked
    def release(self, request_id: str) -> None:
        """Drop every pin ``request_id`` holds and its place in the admission queue."""
        self._check_open()
        if type(request_id) is not str:
            raise InvalidArgument(f"request_id must be a str, got {type(request_id).__name__}")
        self._wired().ledger.release(request_id)

    # ---- get / borrow -------------------------------------------------------------------------
    async def get(self, group: int, hashes: Sequence[bytes], out: torch.Tensor,
                  request_id: str | None = None) -> None:
        """Copy blocks into the rows of ``out``, waiting for PENDING ones.

        Blocks not in the primary are promoted from the first lower tier that holds them and
        copied out as they land (read aside and copied when the pool has no room now); no tier
        reads into ``out``, so cancelling ``get`` always returns at once. Raises
        :class:`BlockMissing` when a block is held by no tier (``out`` rows are then unspecified).
        With ``request_id``, that request's pins on these blocks are dropped once they are copied.
        With several blocks to a record, ``hashes`` covers whole records (else InvalidArgument).
        """
        with self._lock:
            pool, keys, n = self._keys(group, hashes, whole="get")
            out8 = self._units.rows(out, group, n, len(keys), "out", pool.device, writable=True)
            parts = self._wired()
            req = parts.admission.request(request_id)
        await parts.reader.get(group, pool, keys, out8, req)

    @contextlib.asynccontextmanager
    async def borrow(self, group: int, hashes: Sequence[bytes],
                     request_id: str | None = None) -> AsyncIterator[torch.Tensor]:
        """Lend the primary's rows of resident blocks, without copying them out.

        ``async with store.borrow(g, hashes) as rows:`` gives ``rows``, a ``[len(hashes),
        block_bytes]`` uint8 tensor: a view of the pool itself when the blocks sit in consecutive
        slots (after a promotion they usually do), else one gathered copy. The blocks stay pinned
        (neither evicted nor rewritten) until the block exits; PENDING blocks are waited for.
        Raises :class:`BlockMissing` when a block is not in the primary (``lookup_prefix`` brings
        blocks from lower tiers; ``get`` reads them directly). With ``request_id``, that request's
        pins on these blocks are dropped on exit too. With several blocks to a record, ``hashes``
        covers whole records (:class:`InvalidArgument` otherwise).
        """
        with self._lock:
            pool, keys, _ = self._keys(group, hashes, whole="borrow")
            parts = self._wired()
            req = parts.admission.request(request_id)
        async with parts.reader.borrow(group, pool, keys, req) as rows:
            yield self._units.block_rows(rows, group)

    @contextlib.contextmanager
    def lend_slots(self, group: int, hashes: Sequence[bytes]) -> Iterator[list[int] | None]:
        """:meth:`borrow` without the wait or the event loop, from any thread: the primary's slots
        of blocks all ready now (rows ``store.tiers[0].pools[group].tensor[slot]``), pinned until
        the ``with`` block exits; None, nothing pinned, when one is not. Counted as hits.

        With several blocks to a record it names one slot per record (``hashes`` covers whole
        records): block ``j`` lies at byte ``(j % N) * block_bytes`` of slot ``j // N``."""
        with self._lock:
            pool, keys, _ = self._keys(group, hashes, whole="lend_slots")
            reader = self._wired().reader
        with reader.lend(group, pool, keys) as slots:
            yield slots

    # ---- state ----------------------------------------------------------------------------------
    def subscribe_tier_events(self, listener: Callable[[int, str, list[bytes]], None]) -> None:
        """Call ``listener(tier_index, "stored" | "removed", keys)`` as blocks appear in or leave a
        lower tier: written by a cascade; evicted for capacity, found corrupt, or gone from a listing
        (another process evicted them, ``tierkv verify --repair`` removed them). Primary pool
        evictions are :meth:`EngineSlots.subscribe_evictions`'s. The listener runs on a thread of
        its own, never on the store's event loop (:mod:`tierkv.observing.events`)."""
        self._listeners.append(subscribe(self._tiers[1:], listener))

    @locked
    def latency_observations(self) -> list[tuple[Any, tuple[str, ...], list[float]]]:
        """The durations observed since the last call, per histogram and labels (the metric of
        :data:`tierkv.observing.metrics.HISTOGRAMS`), for publishers that take raw values (vLLM's metrics)."""
        out = [o for gw in self._gateways for o in gw.drain_histograms()]
        if self._parts is not None:
            out.append((HISTOGRAMS["pending_seconds"], (), self._parts.resolver.pending_seconds.drain()))
        return [o for o in out if o[2]]

    def set_recompute_rate(self, tokens_per_s: float) -> None:
        """Tell the cost model the engine's prefill throughput (tokens/s), e.g. as measured."""
        self._cost.set_rate(tokens_per_s)

    @locked
    def has_pending_work(self) -> bool:
        """True while cascades, promotions, probes or queued requests are in flight."""
        parts = self._parts
        busy = parts is not None and bool(parts.cascader.running or parts.admission.queue)
        return busy or self._bridge.busy

    @locked
    def check(self) -> list[str]:
        """Consistency problems in the store's accounting (empty when sound): slots leaked or
        owned twice, counts that disagree, pins no request or cascade accounts for.

        For tests and debugging; it walks every slot, so it is not meant for a hot path.
        """
        return self._parts.ledger.problems() if self._parts is not None else []

    @locked
    def stats(self) -> StoreStats:
        """Counters per tier and per group, the pool plan, lookups and admission state."""
        groups = [GroupStats.of(g, self.layout.groups[g].kind, pool) for g, pool in self._pools.items()]
        prim = self._primary_stats.model_copy()
        prim.used_bytes = self._primary.used_bytes()
        prim.backend = dict(self._primary.counters)
        parts = self._parts
        counts = {**self._counts, "put_blocks_dropped": self._counts["put_blocks_dropped"] + (
            parts.cascader.dropped if parts else 0)}
        return StoreStats(
            plan=self._primary.planned(), tiers=[prim] + [gw.snapshot() for gw in self._gateways],
            groups=groups, lookups=dict(self._lookups), cost=self._cost.snapshot(),
            pending_deadline_miss=self._cost.deadline_misses,
            events_dropped=sum(lt.dropped for lt in self._listeners),
            **(parts.stats_fields() if parts else _NO_PARTS), **counts)


@contextlib.contextmanager
def _asking(admission: Admission, request_id: str | None) -> Iterator[Request]:
    """The request ``request_id`` names, or an anonymous call's for the length of the block."""
    req = admission.request(request_id)
    if req is not None:
        yield req
        return
    call = admission.anonymous()
    try:
        yield call
    finally:
        admission.end_call(call)


async def _guarded(fn: Callable[[], Awaitable[None]]) -> None:
    try:
        await fn()
    except Exception:
        log.exception("background work of a tier failed")


def _daemon_of(config: object) -> object:
    """The ``daemon`` a config names; None for none, or for what is no config (``__init__`` says why)."""
    if isinstance(config, StoreConfig):
        return config.daemon
    return config.get("daemon") if isinstance(config, Mapping) else None


def _make_tiers(config: StoreConfig, units: RecordUnits) -> list[Tier]:
    """The configured tiers, primary first. Pool tiers size their slots by records; the others name
    the layout as configured (their manifest's layout must hash to the fingerprint)."""
    ctxs = [TierContext(layout=layout, namespace=config.namespace, fingerprint=config.fingerprint,
                        max_concurrent_requests=config.max_concurrent_requests, policy=config.policy)
            for layout in (units.records, units.layout)]
    backends = [get_backend(tc.kind) for tc in config.tiers]
    return [cls(tc, ctxs[0 if issubclass(cls, PoolTier) else 1])
            for cls, tc in zip(backends, config.tiers, strict=True)]


def _primary_of(tiers: list[Tier]) -> PoolTier:
    primary = tiers[0]
    if not isinstance(primary, PoolTier):
        raise ConfigError(f"tiers.0: the primary must be a slot-pool tier (cpu or device), "
                          f"not {primary.kind!r}")
    return primary


#: :meth:`Parts.stats_fields` of a store that is not open
_NO_PARTS: dict[str, Any] = {"requests_active": 0, "admission_queue": 0, "promotions_pending": 0,
                             "leases_expired": 0}


async def _stop(bridge: LoopBridge, lower: LowerTiers, deadline: float, metrics: Any, primary: Tier,
                listeners: list[ListenerThread]) -> None:
    """Stop a closing store's background work and metrics, then close its tiers and listeners."""
    async with anyio.create_task_group() as tg:
        # background work stuck on a tier that does not answer is left behind
        tg.start_soon(lower.abandon_at, deadline)
        await bridge.stop()
        tg.cancel_scope.cancel()
    if metrics is not None:
        metrics.close()
    await lower.close(deadline)
    await _close_all([primary])
    for lt in listeners:
        await anyio.to_thread.run_sync(lt.close, abandon_on_cancel=True)


async def _close_all(tiers: list[Tier]) -> None:
    """Close ``tiers``, last first, even when cancelled; a failure is logged and the rest still close."""
    with anyio.CancelScope(shield=True):
        for t in reversed(tiers):
            try:
                await t.close()
            except Exception:
                log.exception("closing tier %s failed", t.describe())

"""``DaemonStore``: the store an engine gets from ``TieredStore(config)`` when ``config.daemon`` is set.

It answers the public API (``put``, ``get``, ``lookup``, ``lookup_prefix``, ``release``,
``flush``, ``stats``) through the daemon (:mod:`tierkv.daemon.server`): messages on the socket,
block bytes copied once between the caller's tensors and the daemon's pool, which this process maps.

While the daemon cannot be reached, nothing waits on it: lookups are MISS, ``get`` raises
:class:`BlockMissing`, puts are dropped and counted (``put_blocks_dropped``), ``release`` does
nothing; a later call reattaches when the daemon is back. A ``get`` of blocks whose slots this
store knows copies them without a message, checked against the daemon's slot table
(:mod:`tierkv.daemon.direct`); otherwise it copies rows pinned for it: the
daemon keeps a dropped connection's pins for its ``drop_grace_s`` (at least 1 s) and a restarted
daemon never reuses the old pool's pages, so a copy that began on the pinning connection and ended
within :data:`SAFE_COPY_S` read what was pinned. One that took longer and whose pins were not
confirmed released by that connection raises
:class:`BlockMissing` instead of returning what it copied.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any

import anyio
import torch

from tierkv.backends.base import Tier
from tierkv.blocks.pool import PoolPlan
from tierkv.config import StoreConfig
from tierkv.daemon.direct import DirectReads, gather
from tierkv.daemon.link import Link
from tierkv.daemon.puts import DaemonPuts
from tierkv.daemon.slots import DaemonSlots, user_request
from tierkv.daemon.subscription import Subscription
from tierkv.errors import BlockMissing, InvalidArgument, StoreClosed, TierUnavailable
from tierkv.keys import GROUP_BYTES, check_hashes
from tierkv.movement.lookup import KeyState, Lookup, PrefixLookup
from tierkv.observing.metrics import StoreStats
from tierkv.store import TieredStore
from tierkv.units import RecordUnits

__all__ = ["DaemonStore"]

log = logging.getLogger("tierkv.daemon")

_LOOKUP = {"h": Lookup.HIT, "p": Lookup.PENDING, "m": Lookup.MISS}
_CPU = torch.device("cpu")
#: the longest a call waits for the daemon's answer when ``max_pending_s`` does not bound it lower
CALL_TIMEOUT_S = 5.0
#: a get's copy that ends this soon after the daemon pinned its rows needs no confirmation (the
#: daemon keeps a dropped connection's pins at least 1 s: ``drop_grace_s``)
SAFE_COPY_S = 0.5
#: how long ``flush`` waits for the daemon's cascades
FLUSH_TIMEOUT_S = 3600.0


class DaemonStore(TieredStore):
    """A store served by the tierkv daemon at ``config.daemon`` (see the module docstring)."""

    def __init__(self, config: StoreConfig | Mapping[str, Any]) -> None:
        self.config = StoreConfig.coerce(config)
        if self.config.daemon is None:
            raise InvalidArgument("DaemonStore needs a config with 'daemon' (the daemon's socket path)")
        self.layout = self.config.layout
        self._units = RecordUnits(self.layout)
        self.fingerprint = self.config.fingerprint
        pending = self.config.max_pending_s
        self._timeout = min(CALL_TIMEOUT_S, pending) if pending is not None else CALL_TIMEOUT_S
        self._link = Link(self.config.daemon, self.config.namespace, self.layout, self._timeout)
        self._open = False
        self._ids = itertools.count(1)
        self._local = {"put_blocks_dropped": 0, "lookups_unreachable": 0}
        self._slots = DaemonSlots(self._link)
        self._direct = DirectReads()
        self._puts = DaemonPuts(self._link, self._units, self._slots, self._direct, self._local)
        self._feeds: list[Subscription] = []
        #: whether each of the daemon's lower tiers (1 first) keeps its data on this machine, as
        #: the daemon said when a tier event subscription last attached (empty before)
        self.lower_tiers_local: list[bool] = []

    # ---- lifecycle ------------------------------------------------------------------------------
    async def open(self) -> None:
        """Connect to the daemon; when it is not there, the store opens anyway and connects later.

        :class:`InvalidArgument` when the daemon refuses this store (a namespace it does not
        serve, a layout its pool cannot hold); a refusal on a later reconnection is logged, and
        the store answers as while the daemon is unreachable."""
        if self._open:
            return
        self._open = True
        self._link.closed = False
        try:
            self._link.call({"op": "stats"}, retry=False)
        except TierUnavailable as exc:
            log.warning("%s; lookups are MISS until it answers", exc)
        except InvalidArgument:
            self._open = False
            raise
        self._link.refusal_raises = False

    async def close(self) -> None:
        """Hang up: the daemon drops this store's pins and unfinished puts."""
        if self._open:
            self._report(force=True)
            self._puts.give_back()
        self._open = False
        self._link.close()
        self._slots.close()
        for feed in self._feeds:
            feed.close()
        self._feeds.clear()

    def _check_open(self) -> None:
        if not self._open:
            raise StoreClosed("the store is not open: use 'async with TieredStore(config) as store'")

    @property
    def connected(self) -> bool:
        """Whether the store is attached to the daemon now."""
        return self._link.connected

    @property
    def tiers(self) -> list[Tier]:
        """None in this process: the daemon holds the tiers."""
        return []

    @property
    def metrics_url(self) -> str | None:
        """Where the daemon serves its store's metrics (its ``metrics_port``), as it said when this
        store last attached; None when it does not."""
        return self._link.metrics_url

    @property
    def engine(self) -> DaemonSlots:  # type: ignore[override]
        """The slot API over the daemon's pool, for adapters that copy rows themselves."""
        self._check_open()
        return self._slots

    def _record_keys(self, group: int, hashes: Sequence[bytes], whole: str = "") -> tuple[list[bytes], int]:
        """The keys of the whole records ``hashes`` covers and its number of blocks (checked)."""
        self._rows(group, ())
        return self._units.keys(group, hashes, whole)

    def _rows(self, group: int, hashes: Sequence[bytes]) -> tuple[list[bytes], int]:
        """Checked hashes and the group's block bytes."""
        self._check_open()
        hs = check_hashes(hashes)
        spec = self.layout.group(group)
        if spec.kind == "scratch":
            raise InvalidArgument(f"group {group} has no pool")
        return hs, spec.block_bytes

    # ---- put ------------------------------------------------------------------------------------
    async def put(self, group: int, hashes: Sequence[bytes], blocks: torch.Tensor) -> None:
        """Store ``blocks[i]`` as block ``hashes[i]`` of ``group`` in the daemon's pool; dropped and
        counted (``put_blocks_dropped``) when the daemon is not reachable or has no room. With
        several blocks to a record, as :meth:`TieredStore.put` (whole records only)."""
        keys, n = self._record_keys(group, hashes)
        src = self._units.rows(blocks, group, n, len(keys), "blocks", _CPU)
        if keys:
            self._puts.put(group, check_hashes(hashes), keys, src)

    def _report(self, force: bool = False) -> None:
        """Tell the daemon of the blocks this store read from the pool by itself, when a batch is
        due (:class:`~tierkv.daemon.direct.DirectReads`)."""
        for msg in self._direct.touches(force):
            with contextlib.suppress(TierUnavailable):
                self._link.call(msg, reply=False, retry=False)

    async def flush(self) -> None:
        """Wait until the daemon's store has written its cascades down (all clients' blocks)."""
        self._report(force=True)
        with contextlib.suppress(TierUnavailable):
            self._link.call({"op": "flush"}, timeout_s=FLUSH_TIMEOUT_S)

    async def idle(self) -> None:
        """As :meth:`flush`."""
        await self.flush()

    # ---- lookups --------------------------------------------------------------------------------
    def _ask(self, msg: dict[str, Any], request_id: str | None, misses: int) -> dict[str, Any] | None:
        """A lookup's answer; None, counting ``misses`` lookups answered MISS, when the daemon is
        not reachable."""
        if request_id is not None:
            msg["r"] = user_request(request_id)
        try:
            answer, _ = self._link.call(msg)
        except TierUnavailable:
            self._local["lookups_unreachable"] += misses
            return None
        return answer

    def lookup(self, group: int, hashes: Sequence[bytes], request_id: str | None = None) -> list[Lookup]:
        """Per block: HIT, PENDING or MISS, as :meth:`TieredStore.lookup`; all MISS while the daemon
        is not reachable. Never waits longer than ``max_pending_s`` (or 5 s)."""
        hs, _ = self._rows(group, hashes)
        answer = self._ask({"op": "lookup", "g": group, "h": [h.hex() for h in hs]}, request_id, len(hs))
        return [Lookup.MISS] * len(hs) if answer is None else [_LOOKUP[c] for c in answer["s"]]

    def lookup_prefix(self, hashes: Sequence[bytes], request_id: str | None = None) -> PrefixLookup:
        """As :meth:`TieredStore.lookup_prefix`; ``(0, MISS)`` while the daemon is not reachable."""
        self._check_open()
        hs = check_hashes(hashes)
        answer = self._ask({"op": "prefix", "h": [h.hex() for h in hs]}, request_id, 1)
        if answer is None:
            return PrefixLookup(blocks=0, state=Lookup.MISS)
        return PrefixLookup(blocks=int(answer["n"]), state=Lookup(answer["s"]))

    def lookup_states(self, group: int, hashes: Sequence[bytes],
                      request_id: str | None = None) -> list[KeyState]:
        """As :meth:`TieredStore.lookup_states`; all MISS while the daemon is not reachable."""
        hs, _ = self._rows(group, hashes)
        answer = self._ask({"op": "states", "g": group, "h": [h.hex() for h in hs]}, request_id, len(hs))
        return [KeyState.MISS] * len(hs) if answer is None else [KeyState(k) for k in answer["k"]]

    def release(self, request_id: str) -> None:
        """Drop every pin ``request_id`` holds (nothing to do while the daemon is not reachable)."""
        self._check_open()
        if type(request_id) is not str:
            raise InvalidArgument(f"request_id must be a str, got {type(request_id).__name__}")
        self._slots.forget(request_id)
        with contextlib.suppress(TierUnavailable):
            self._link.call({"op": "release", "r": user_request(request_id)}, retry=False)

    # ---- get ------------------------------------------------------------------------------------
    async def get(self, group: int, hashes: Sequence[bytes], out: torch.Tensor,
                  request_id: str | None = None) -> None:
        """Copy blocks into the rows of ``out`` (a CPU tensor), waiting for PENDING ones.

        Raises :class:`BlockMissing` naming the blocks no tier holds, or all of them when the
        daemon is not reachable (or went away while they were copied). With several blocks to a
        record, ``hashes`` covers whole records (else :class:`InvalidArgument`), as in-process.
        """
        keys, n = self._record_keys(group, hashes, whole="get")
        out8 = self._units.rows(out, group, n, len(keys), "out", _CPU, writable=True)
        if not keys:
            return
        if request_id is None and self._direct.get(self._link.current(), group, keys, out8):
            self._report()  # every record was READY in its known slot before and after the copy
            return
        hs = check_hashes(hashes)
        rid = user_request(request_id) if request_id is not None else f"g:{next(self._ids)}"
        msg = {"g": group, "h": [h.hex() for h in hs], "r": rid}  # pinned by block, a slot per record
        records = {**msg, "h": [k[:-GROUP_BYTES].hex() for k in keys]}  # unpinned by record
        pending = self.config.max_pending_s or 60.0
        deadline = time.monotonic() + pending + self._timeout
        nap = 0.0005
        everything = list(range(len(hs)))
        while True:
            try:
                answer, gen = self._link.call({"op": "pin", **msg})
            except TierUnavailable:
                raise BlockMissing("the tierkv daemon is not reachable", missing=everything) from None
            states: str = answer["s"]
            if "m" in states or time.monotonic() > deadline:
                self._unpin(records, request_id, confirm=False)
                missing = [i for i, c in enumerate(states) if c != "h"]
                raise BlockMissing(f"{len(missing)} of {len(hs)} blocks are held by no tier", missing=missing)
            if "p" not in states:
                break
            await anyio.sleep(nap)
            nap = min(nap * 2, 0.005)
        pinned_at = time.monotonic()
        at = self._link.attached(gen)
        pool = at.pools.get(group) if at is not None else None
        copied = pool is not None
        if pool is not None:
            gather(pool, answer["slots"], out8)
            assert at is not None
            self._direct.learn(at.pool_id, keys, answer["slots"])
        # the rows stay pinned for the daemon's drop grace even if the connection broke meanwhile,
        # and a restarted daemon never reuses the old pool's pages: a copy that started on the
        # connection that pinned them and ended well within the grace read the pinned bytes
        quick = time.monotonic() - pinned_at < SAFE_COPY_S
        if not (self._unpin(records, request_id, confirm=not quick) in (gen, True) and copied):
            raise BlockMissing("the tierkv daemon went away while the blocks were copied", missing=everything)

    def _unpin(self, msg: dict[str, Any], request_id: str | None, confirm: bool) -> int | bool | None:
        """Drop a get's pins. With ``confirm``: the generation of the connection that confirmed it
        (None when none did); the rows stayed in place until then. Without: True, unanswered."""
        op = {"op": "release", "r": msg["r"]} if request_id is None else {"op": "unpin", **msg}
        try:
            if not confirm:
                self._link.call({**op, "nr": True}, reply=False, retry=False)
                return True
            _, gen = self._link.call(op, retry=False)
        except TierUnavailable:
            return None if confirm else True
        return gen

    @contextlib.asynccontextmanager
    async def borrow(self, group: int, hashes: Sequence[bytes],
                     request_id: str | None = None) -> AsyncIterator[torch.Tensor]:
        """The blocks' rows, as :meth:`TieredStore.borrow` gives them, but always a copy of this
        call's own (a :meth:`get`, blocks below the pool read too): a view of the daemon's pool
        would outlive its pins if the connection dropped while the caller still read it."""
        keys, n = self._record_keys(group, hashes, whole="borrow")
        rows = torch.empty((n, self.layout.group(group).block_bytes), dtype=torch.uint8)
        if keys:
            await self.get(group, hashes, rows, request_id=request_id)
        yield rows

    @contextlib.contextmanager
    def lend_slots(self, group: int, hashes: Sequence[bytes]) -> Iterator[list[int] | None]:
        """Not available through the daemon (use :meth:`get`, or :attr:`engine` to copy rows of the
        daemon's pool yourself, each slot named with its pool)."""
        raise InvalidArgument("lend_slots is not available through the tierkv daemon: the rows are the "
                              "daemon's and a slot means something only with its pool; use get, or "
                              "store.engine (key_state, ready_slots, pool_of)")
        yield None  # pragma: no cover

    # ---- state ----------------------------------------------------------------------------------
    def subscribe_tier_events(self, listener: Callable[[int, str, list[bytes]], None]) -> None:
        """Call ``listener(tier_index, "stored" | "removed", keys)`` as blocks appear in or leave
        the daemon's lower tiers (every client's blocks: the tiers are the daemon's), on a thread of
        this store's subscription, in place when this returns while the daemon is reachable. Events
        while the daemon is away are not replayed."""
        self._check_open()

        def attached(instance: str, answer: dict[str, Any]) -> None:
            local = answer.get("local")
            if isinstance(local, list):
                self.lower_tiers_local = [bool(x) for x in local]

        def frame(msg: dict[str, Any]) -> None:
            event, tier = msg.get("e"), msg.get("t")
            if event not in ("stored", "removed") or type(tier) is not int:
                return
            try:
                listener(tier, event, [bytes.fromhex(k) for k in msg.get("k", [])])
            except Exception:
                log.exception("a tier event listener failed")
        feed = Subscription(self._link.path, self._link.hello, "tier", self._timeout, attached, frame)
        self._feeds.append(feed)
        if self._link.connected:
            feed.attached.wait(self._timeout)

    def latency_observations(self) -> list[tuple[Any, tuple[str, ...], list[float]]]:
        """None in this process: the daemon's store observes them."""
        return []

    def set_recompute_rate(self, tokens_per_s: float) -> None:
        """Ignored: the daemon's store keeps its own cost model."""

    def has_pending_work(self) -> bool:
        """False: the work runs in the daemon."""
        return False

    def check(self) -> list[str]:
        """Consistency problems of this process's side: none is kept here."""
        return []

    def stats(self) -> StoreStats:
        """The daemon's store's counters (shared by every client of this namespace and layout), plus
        this process's puts dropped and lookups answered MISS while the daemon was not reachable."""
        self._report(force=True)
        try:
            answer, _ = self._link.call({"op": "stats"})
            st = StoreStats.model_validate(answer["stats"])
        except TierUnavailable:
            plan = PoolPlan(capacity_bytes=0, max_concurrent_requests=self.config.max_concurrent_requests,
                            groups=[])
            st = StoreStats(plan=plan, tiers=[], groups=[], lookups={v.value: 0 for v in Lookup},
                            requests_active=0, admission_queue=0, promotions_pending=0, puts=0,
                            put_blocks_direct=0, put_blocks_dropped=0, evictions_unbacked=0, leases_expired=0)
        lookups = dict(st.lookups)
        lookups["miss"] = lookups.get("miss", 0) + self._local["lookups_unreachable"]
        dropped = st.put_blocks_dropped + self._local["put_blocks_dropped"]
        return st.model_copy(update={"lookups": lookups, "put_blocks_dropped": dropped})


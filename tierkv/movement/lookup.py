"""Answering lookups: where each block is, what a request may use, what work to start.

:class:`Resolver` reads in-memory state only (primary pools, the gateways' presence caches, the
blocks staged for cascades, promotions in flight) and never awaits. For each call it returns the
answer and the :class:`Work` the store must start: promotions admitted for the request (slots
reserved and pinned by :class:`~tierkv.blocks.admission.Admission`) and presence probes of slow tiers.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from tierkv.blocks.admission import Admission, Promotion, Request, Want
from tierkv.blocks.ledger import BlockLedger
from tierkv.blocks.pool import SlotState
from tierkv.blocks.prefix import needed_blocks
from tierkv.keys import GROUP_BYTES, check_hashes
from tierkv.layout import Layout
from tierkv.movement.costmodel import CostModel
from tierkv.movement.gateway import TierGateway
from tierkv.movement.promotion import Promoter
from tierkv.observing.metrics import Histogram

__all__ = ["KeyState", "Lookup", "PrefixLookup", "Resolver", "Work"]


class Lookup(str, enum.Enum):
    """The answer for one block: ready now, on its way, or nowhere."""

    HIT = "hit"
    PENDING = "pending"
    MISS = "miss"


class KeyState(str, enum.Enum):
    """Why a block is HIT, PENDING or MISS: what engine adapters need to answer their own API."""

    READY = "ready"  #: in a READY primary slot (HIT)
    STORING = "storing"  #: reserved by a store that has not completed yet (PENDING)
    PROMOTING = "promoting"  #: a promotion into a reserved slot is in flight (PENDING)
    PROBING = "probing"  #: presence on a slow tier is being probed, or a cascade holds it (PENDING)
    QUEUED = "queued"  #: held by a lower tier, waiting in FIFO order for a primary slot (PENDING)
    MISS = "miss"  #: nowhere, or can never fit this request's pool share (MISS)

    @property
    def lookup(self) -> Lookup:
        """The public answer for this state."""
        if self is KeyState.READY:
            return Lookup.HIT
        return Lookup.MISS if self is KeyState.MISS else Lookup.PENDING


@dataclass(frozen=True)
class PrefixLookup:
    """``blocks``: the longest usable prefix known now; ``state`` as in :class:`Lookup`."""

    blocks: int
    state: Lookup


@dataclass
class Work:
    """What a lookup asks the store to start."""

    promotions: list[Promotion] = field(default_factory=list)
    #: (tier position, group) -> keys whose presence must be probed
    probes: dict[tuple[int, int], list[bytes]] = field(default_factory=dict)


# a block's status, as small ints: resident in the primary, unknown (a cascade from a staged copy
# may bring it), absent everywhere, held by lower tier ``p`` (``_TIER + p``), or not known either
# way on lower tier ``p``, the first that may hold it (``_MAYBE + p``: a probe is on its way)
_READY, _WRITING, _UNKNOWN, _ABSENT, _TIER = 0, 1, 2, 3, 4
_MAYBE = 1 << 16


def _known(st: int) -> bool:
    """Resident, or held by a known lower tier."""
    return st < _UNKNOWN or _TIER <= st < _MAYBE
#: a prefix's blocks are located in chunks of this many, up to the first one found nowhere
_CHUNK = 256


class Resolver:
    """Lookups over the store's state (call under the store's lock)."""

    def __init__(self, layout: Layout, ledger: BlockLedger, gateways: Sequence[TierGateway],
                 admission: Admission, promoter: Promoter, cost: CostModel | None = None) -> None:
        self.layout = layout
        self.cost = cost if cost is not None else CostModel(layout.tokens_per_block, None, None)
        #: how long prefixes stayed PENDING before their answer
        self.pending_seconds = Histogram()
        self.pools = pools = ledger.pools
        self.gateways = gateways
        self.admission = admission
        self.promoter = promoter
        self.staged: Collection[bytes] = ledger.staged
        self.promoting: Collection[bytes] = ledger.promoting
        self._tails = {g: g.to_bytes(GROUP_BYTES, "big") for g in layout.cacheable_groups}
        self._full = [g for g in layout.cacheable_groups if layout.groups[g].kind == "full"]
        #: the prefix-cacheable groups of full attention
        self.full_groups = self._full
        self._other = [g for g in layout.cacheable_groups if layout.groups[g].kind != "full"]
        self._capacity = {g: p.num_slots for g, p in pools.items()}

    # ---- where a block is -----------------------------------------------------------------------
    def locate(self, group: int, key: bytes, now: float, work: Work | None) -> int:
        """Status of a block not resident in the primary; probes what is unknown into ``work``."""
        maybe = -1
        for p, gw in enumerate(self.gateways):
            known = gw.presence(group, key, now)
            if known is True:
                return _TIER + p
            if known is None:
                if maybe < 0:
                    maybe = p
                if work is not None and key not in gw.probing:
                    work.probes.setdefault((p, group), []).append(key)
        if key in self.staged:
            return _UNKNOWN
        return _MAYBE + maybe if maybe >= 0 else _ABSENT

    def held_by(self, group: int, key: bytes) -> int | None:
        """Position of a lower tier known to hold ``key`` now, or None (for the admission queue)."""
        st = self.locate(group, key, time.monotonic(), None)
        return st - _TIER if _TIER <= st < _MAYBE else None

    def _status(self, group: int, key: bytes, now: float, work: Work) -> int:
        pool = self.pools[group]
        s = pool.index.get(key)
        if s is not None:
            return _READY if pool.state[s] is SlotState.READY else _WRITING
        return self.locate(group, key, now, work)

    # ---- prefixes -------------------------------------------------------------------------------
    def _version(self) -> int:
        return sum(gw.version for gw in self.gateways)

    def prefix(self, hashes: Sequence[bytes], req: Request) -> PrefixLookup:
        """The longest usable prefix over every prefix-cacheable group (docs/design.md); starts
        the promotions and probes the answer counts on."""
        answer, work = self._prefix_work(hashes, req)
        if work.promotions or work.probes:
            self.promoter.start(work.promotions, work.probes)
        return answer

    def _prefix_work(self, hashes: Sequence[bytes], req: Request) -> tuple[PrefixLookup, Work]:
        now = time.monotonic()
        if req.memo.hashes is None or req.memo.hashes != hashes:
            req.memo.hashes = list(check_hashes(hashes))
            req.memo.keys = {}
            req.memo.answer = None
            req.pending.since = None
            req.pending.gave_up = False
        elif self.overdue(req, now, req.pending.deadline_s):
            # PENDING past its deadline: what is ready is a HIT, the rest a MISS (recomputed); its
            # promotions go on and stay cached for later requests
            req.memo.answer = None
            return self._ready_prefix(req.memo.hashes, req), Work()
        elif req.memo.answer is not None:
            # the same prefix, asked again while what it waits for is still on its way: its own
            # promotions stream in (none failed; its blocks are pinned), or the presence probes it
            # waits for have not answered; the PENDING answer stands, at no cost
            if req.waiting > 0 and not req.memo.stale:
                return req.memo.answer, Work()
            if req.waiting == 0 and req.memo.version == self._version():
                return req.memo.answer, Work()
        answer, work, probing = self._prefix(req.memo.hashes, req)
        req.memo.answer = None
        req.memo.version = None
        if req.named and answer.state is Lookup.PENDING:
            if req.pending.since is None:
                req.pending.since = now
            req.pending.deadline_s = self.cost.deadline_s(req.waiting)
            if req.waiting > 0:
                req.memo.answer = answer
            elif probing and req.rid not in self.admission.queue:
                req.memo.answer = answer
                req.memo.version = self._version()
        elif answer.state is not Lookup.PENDING:
            if req.pending.since is not None:
                self.pending_seconds.observe(now - req.pending.since)
            req.pending.since = None
        req.memo.stale = False
        return answer, work

    def overdue(self, req: Request, now: float, deadline_s: float) -> bool:
        """The deadline on PENDING, the one rule for lookups and the engine's ``key_state``: True
        when ``req`` has given up waiting, now or before. It gives up once its PENDING clock (from
        its first PENDING answer) passes ``deadline_s``: counted, its PENDING time observed, and
        its pins on blocks not ready yet dropped (it will not wait for them)."""
        if req.pending.gave_up:
            return True
        if req.pending.since is None or now - req.pending.since <= deadline_s:
            return False
        req.pending.gave_up = True
        self.cost.deadline_misses += 1
        self.pending_seconds.observe(now - req.pending.since)
        self._unpin_unready(req)
        return True

    def _unpin_unready(self, req: Request) -> None:
        """Drop ``req``'s pins on blocks not ready yet (it will not wait for them any more)."""
        for key, g in list(req.pins.items()):
            s = self.pools[g].index.get(key)
            if s is None or self.pools[g].state[s] is not SlotState.READY:
                self.admission.unpin(req, key)

    def _ready_prefix(self, hashes: list[bytes], req: Request) -> PrefixLookup:
        """The longest prefix whose needed blocks are all READY in the primary (pinned for ``req``)."""

        def ready(g: int, i: int) -> bool:
            pool = self.pools[g]
            s = pool.index.get(hashes[i] + self._tails[g])
            return s is not None and pool.state[s] is SlotState.READY

        n = len(hashes)
        for g in self._full:
            upper = min(n, self._capacity[g])
            n = next((i for i in range(upper) if not ready(g, i)), upper)
        k = self._longest(n, ready) if self._other else n
        for g, rng in needed_blocks(self.layout, k).items():
            pool = self.pools[g]
            for i in rng:
                key = hashes[i] + self._tails[g]
                self.admission.pin(req, g, key, pool.index[key])
        return PrefixLookup(k, Lookup.HIT if k else Lookup.MISS)

    def _statuses(self, group: int, keys: list[bytes], slots: list[int | None], now: float,
                  work: Work) -> list[int]:
        """The status of each key (``slots``: its primary slot or None); probes go into ``work``."""
        state, ready = self.pools[group].state, SlotState.READY
        out = [-1 if s is None else _READY if state[s] is ready else _WRITING for s in slots]
        todo = [i for i, st in enumerate(out) if st < 0]
        maybe: dict[int, int] = {}
        for p, gw in enumerate(self.gateways):
            if not todo:
                break
            present = gw.presence_many(group, [keys[i] for i in todo], now)
            later = []
            probing = gw.probing
            for i, pr in zip(todo, present, strict=True):
                if pr is True:
                    out[i] = _TIER + p
                    continue
                if pr is None:
                    maybe.setdefault(i, p)
                    if keys[i] not in probing:
                        work.probes.setdefault((p, group), []).append(keys[i])
                later.append(i)
            todo = later
        staged = self.staged
        for i in todo:
            out[i] = _UNKNOWN if keys[i] in staged else _MAYBE + maybe[i] if i in maybe else _ABSENT
        return out

    def _prefix(self, hashes: list[bytes], req: Request) -> tuple[PrefixLookup, Work, bool]:
        """The answer, the work to start, and whether it waits for presence probes."""
        n = len(hashes)
        now = time.monotonic()
        work = Work()
        keys = req.memo.keys
        statuses: dict[tuple[int, int], int] = {}

        def keys_of(g: int) -> list[bytes]:
            ks = keys.get(g)
            if ks is None:
                tail = self._tails[g]
                ks = keys[g] = [h + tail for h in hashes]
            return ks

        def key(g: int, i: int) -> bytes:
            return keys_of(g)[i]

        def status(g: int, i: int) -> int:
            st = statuses.get((g, i))
            if st is None:
                st = statuses[(g, i)] = self._status(g, key(g, i), now, work)
            return st

        # full groups: the leading run of resident blocks in one pass, then the rest in chunks
        known = maybe = n
        resident: dict[int, list[int | None]] = {}
        for g in self._full:
            upper = min(n, self._capacity[g])
            ks = keys_of(g)
            slots = resident[g] = list(map(self.pools[g].index.get, ks[:upper]))
            try:
                run = slots.index(None)
            except ValueError:
                run = upper
            k_known = i = run
            while i < upper:
                stop = min(upper, i + _CHUNK)
                chunk = self._statuses(g, ks[i:stop], slots[i:stop], now, work)
                for j, st in enumerate(chunk):
                    statuses[(g, i + j)] = st
                absent = chunk.index(_ABSENT) if _ABSENT in chunk else len(chunk)
                if k_known == i:
                    k_known = i + next((j for j, st in enumerate(chunk[:absent]) if not _known(st)), absent)
                i += absent
                if absent < len(chunk):
                    break
            known = min(known, k_known)
            maybe = min(maybe, i)
        if self._other:
            known = self._longest(known, lambda g, i: _known(status(g, i)))
            maybe = self._longest(maybe, lambda g, i: status(g, i) != _ABSENT)
        probing = bool(work.probes) or any(not _known(st) for st in statuses.values())
        guess = maybe > known and self.admission.mode == "queue" and self._may_guess(maybe, status)
        if guess:
            # every block of the longer prefix fits in free slots: promote the ones whose presence
            # is still being probed right away (the read is the probe; one that finds nothing
            # frees its slot), instead of waiting for the probes and then for the reads
            known = maybe
            work.probes.clear()
        if known == 0:
            return PrefixLookup(0, Lookup.PENDING if maybe else Lookup.MISS), work, probing
        if self.cost.active:
            chosen = _cut_by_cost(self, known, resident, status)
            if chosen < known:
                known = maybe = chosen  # the rest is recomputed: nothing to wait for there
                if known == 0:
                    return PrefixLookup(0, Lookup.MISS), Work(), False

        all_ready = True
        wants: dict[int, list[Want]] = {}
        admission = self.admission
        runs: list[tuple[int, list[bytes], list[int]]] = []
        pin: list[tuple[int, bytes, int]] = []
        for g in self._full:
            pool = self.pools[g]
            slots = resident[g]
            try:
                run = slots.index(None, 0, known)
            except ValueError:
                run = known
            head: list[int] = slots[:run]  # type: ignore[assignment]
            if run:
                runs.append((g, keys[g][:run], head))
                if pool.writing and any(pool.state[s] is not SlotState.READY for s in head):
                    all_ready = False
            for i in range(run, known):
                all_ready = self._claim(g, key(g, i), status(g, i), pin, wants) and all_ready
        for g in self._other:
            for i in self.layout.groups[g].blocks_needed(known):
                all_ready = self._claim(g, key(g, i), status(g, i), pin, wants) and all_ready
        if req.named or wants:
            # pins before admission, so its evictions never take a block this call answers for (a
            # call without request_id that starts nothing needs none: nothing can evict meanwhile)
            for g, ks, ss in runs:
                admission.pin_many(req, g, ks, ss)
            for g, k, s in pin:
                admission.pin(req, g, k, s)
        if wants:
            started = admission.admit(req, wants)
            if started is None and admission.mode == "naive":
                return PrefixLookup(0, Lookup.MISS), work, probing
            if started:
                work.promotions += started
        state = Lookup.HIT if all_ready and maybe == known else Lookup.PENDING
        return PrefixLookup(known, state), work, probing

    def _may_guess(self, k: int, status: Callable[[int, int], int]) -> bool:
        """Whether the blocks a prefix of ``k`` needs that are not resident all sit on lower tiers
        (known or maybe) and fit in each pool's free slots (no eviction for a guess)."""
        for g, rng in needed_blocks(self.layout, k).items():
            missing = 0
            for i in rng:
                st = status(g, i)
                if st == _UNKNOWN or st == _ABSENT:
                    return False
                if st >= _TIER:
                    missing += 1
            if missing > self.pools[g].free_count:
                return False
        return True

    def _claim(self, g: int, key: bytes, st: int, pin: list[tuple[int, bytes, int]],
               wants: dict[int, list[Want]]) -> bool:
        """Note a resident block to pin, or add a lower tier's block to the wants; True if READY."""
        if st >= _TIER:
            wants.setdefault(g, []).append((key, (st - _MAYBE) if st >= _MAYBE else (st - _TIER)))
            return False
        s = self.pools[g].index.get(key)
        if s is not None:
            pin.append((g, key, s))
        return st == _READY

    def _longest(self, upper: int, has: object) -> int:
        """The largest ``k <= upper`` whose non-full groups hold what a prefix of ``k`` needs."""
        for k in range(upper, 0, -1):
            if all(self._group_ok(g, k, has) for g in self._other):
                return k
        return 0

    def _group_ok(self, g: int, k: int, has: object) -> bool:
        need = self.layout.groups[g].blocks_needed(k)
        if len(need) > self._capacity[g]:
            return False
        return all(has(g, i) for i in need)  # type: ignore[operator]


def _cut_by_cost(r: Resolver, usable: int, resident: Mapping[int, list[int | None]],
                 status: Callable[[int, int], int]) -> int:
    """The prefix length worth loading for ``r``'s lookup, by the cost model
    (:class:`~tierkv.movement.costmodel.CostModel`)."""
    gws = r.gateways
    now = time.monotonic()
    rate = [gw.planning_rate(now) for gw in gws]
    first_use: dict[int, int] = {}

    def cost(g: int, i: int, k: int) -> float:
        st = status(g, i)
        if st < _TIER:
            return 0.0
        p = st - (_MAYBE if st >= _MAYBE else _TIER)
        first_use.setdefault(p, k)
        return r.layout.groups[g].block_bytes / rate[p]

    full = [0.0] * usable
    any_load = False
    for g in r._full:
        slots = resident[g]
        for i in range(usable):
            if i < len(slots) and slots[i] is not None:
                continue
            c = cost(g, i, i + 1)
            full[i] += c
            any_load = any_load or c > 0

    def other(k: int) -> float:
        return sum(cost(g, i, k) for g in r._other for i in r.layout.groups[g].blocks_needed(k))

    if not any_load and not other(usable):
        return usable

    def queue(k: int) -> float:
        # the loads queued ahead on each tier used, and its fixed wait, once per request
        return sum(gws[p].load_backlog_bytes / rate[p] + r.cost.fixed_s(p)
                   for p, first in first_use.items() if first <= k)

    return r.cost.choose(usable, full, other, queue).blocks

"""Answering lookups: where each block is, what a request may use, what work to start.

:class:`Resolver` reads in-memory state only (primary pools, the gateways' presence caches, the
blocks staged for cascades, promotions in flight) and never awaits. For each call it returns the
answer and the :class:`Work` the store must start: promotions admitted for the request (slots
reserved and pinned by :class:`~tierkv.admission.Admission`) and presence probes of slow tiers.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from tierkv.admission import Admission, Promotion, Request, Want
from tierkv.gateway import TierGateway
from tierkv.keys import GROUP_BYTES, check_hashes
from tierkv.layout import Layout
from tierkv.pool import SlotPool, SlotState

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


# a block's status, as small ints: resident in the primary, unknown (a probe or a cascade may bring
# it), absent everywhere, or held by lower tier ``p`` (``_TIER + p``)
_READY, _WRITING, _UNKNOWN, _ABSENT, _TIER = 0, 1, 2, 3, 4


class Resolver:
    """Lookups over the store's state (call under the store's lock)."""

    def __init__(self, layout: Layout, pools: Mapping[int, SlotPool], gateways: Sequence[TierGateway],
                 admission: Admission, staged: Collection[bytes], promoting: Collection[bytes]) -> None:
        self.layout = layout
        self.pools = pools
        self.gateways = gateways
        self.admission = admission
        self.staged = staged
        self.promoting = promoting
        self._tails = {g: g.to_bytes(GROUP_BYTES, "big") for g in layout.cacheable_groups}
        self._full = [g for g in layout.cacheable_groups if layout.groups[g].kind == "full"]
        self._other = [g for g in layout.cacheable_groups if layout.groups[g].kind != "full"]
        self._capacity = {g: p.num_slots for g, p in pools.items()}

    # ---- where a block is -----------------------------------------------------------------------
    def locate(self, group: int, key: bytes, now: float, work: Work | None) -> int:
        """Status of a block not resident in the primary; probes what is unknown into ``work``."""
        unknown = key in self.staged
        for p, gw in enumerate(self.gateways):
            known = gw.presence(group, key, now)
            if known is True:
                return _TIER + p
            if known is None:
                unknown = True
                if work is not None and key not in gw.probing:
                    work.probes.setdefault((p, group), []).append(key)
        return _UNKNOWN if unknown else _ABSENT

    def held_by(self, group: int, key: bytes) -> int | None:
        """Position of a lower tier known to hold ``key`` now, or None (for the admission queue)."""
        st = self.locate(group, key, time.monotonic(), None)
        return st - _TIER if st >= _TIER else None

    def _status(self, group: int, key: bytes, now: float, work: Work) -> int:
        pool = self.pools[group]
        s = pool.index.get(key)
        if s is not None:
            return _READY if pool.state[s] is SlotState.READY else _WRITING
        return self.locate(group, key, now, work)

    # ---- per block ------------------------------------------------------------------------------
    def states(self, group: int, keys: list[bytes], req: Request) -> tuple[list[KeyState], Work]:
        """Per key: its :class:`KeyState`; HIT and PENDING blocks are pinned for ``req``."""
        pool = self.pools[group]
        work = Work()
        now = time.monotonic()
        out: list[KeyState] = []
        promos: list[Want] = []
        promo_pos: list[int] = []
        admission = self.admission
        for i, k in enumerate(keys):
            s = pool.index.get(k)
            if s is not None:
                if pool.state[s] is SlotState.READY:
                    out.append(KeyState.READY)
                else:
                    out.append(KeyState.PROMOTING if k in self.promoting else KeyState.STORING)
                admission.pin(req, group, k, s)
                continue
            st = self.locate(group, k, now, work)
            if st >= _TIER:
                out.append(KeyState.PROMOTING)
                promos.append((k, st - _TIER))
                promo_pos.append(i)
            else:
                out.append(KeyState.PROBING if st == _UNKNOWN else KeyState.MISS)
        if promos:
            room = max(0, pool.num_slots - admission.pinned_in(req, group))
            for i in promo_pos[room:]:
                out[i] = KeyState.MISS
            if room:
                started = admission.admit(req, {group: promos[:room]})
                if started is None:
                    late = KeyState.MISS if admission.mode == "naive" else KeyState.QUEUED
                    for i in promo_pos[:room]:
                        out[i] = late
                else:
                    work.promotions += started
        return out, work

    # ---- prefixes -------------------------------------------------------------------------------
    def prefix(self, hashes: Sequence[bytes], req: Request) -> tuple[PrefixLookup, Work]:
        """The longest usable prefix over every prefix-cacheable group (docs/design.md)."""
        if req.last_hashes is None or req.last_hashes != hashes:
            req.last_hashes = list(check_hashes(hashes))
            req.last_keys = {}
        hashes = req.last_hashes
        n = len(hashes)
        now = time.monotonic()
        work = Work()
        keys = req.last_keys
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

        # full groups: the leading run of resident blocks in one pass, then block by block
        known = maybe = n
        resident: dict[int, list[int | None]] = {}
        for g in self._full:
            upper = min(n, self._capacity[g])
            slots = resident[g] = list(map(self.pools[g].index.get, keys_of(g)[:upper]))
            try:
                run = slots.index(None)
            except ValueError:
                run = upper
            k_known = k_maybe = run
            i = run
            while i < upper:
                st = status(g, i)
                if st == _ABSENT:
                    break
                if k_known == i and st != _UNKNOWN:
                    k_known = i + 1
                i += 1
            k_maybe = i
            known = min(known, k_known)
            maybe = min(maybe, k_maybe)
        if self._other:
            known = self._longest(known, lambda g, i: status(g, i) != _UNKNOWN and status(g, i) != _ABSENT)
            maybe = self._longest(maybe, lambda g, i: status(g, i) != _ABSENT)
        if known == 0:
            return PrefixLookup(0, Lookup.PENDING if maybe else Lookup.MISS), work

        all_ready = True
        wants: dict[int, list[Want]] = {}
        admission = self.admission
        for g in self._full:
            pool = self.pools[g]
            slots = resident[g]
            try:
                run = slots.index(None, 0, known)
            except ValueError:
                run = known
            head = slots[:run]
            if run:
                admission.pin_many(req, g, keys[g][:run], head)  # type: ignore[arg-type]
                if pool.writing and any(pool.state[s] is not SlotState.READY for s in head):  # type: ignore[index]
                    all_ready = False
            for i in range(run, known):
                all_ready = self._claim(g, i, key(g, i), status(g, i), req, wants) and all_ready
        for g in self._other:
            for i in self.layout.groups[g].blocks_needed(known):
                all_ready = self._claim(g, i, key(g, i), status(g, i), req, wants) and all_ready
        if wants:
            started = admission.admit(req, wants)
            if started is None and admission.mode == "naive":
                return PrefixLookup(0, Lookup.MISS), work
            if started:
                work.promotions += started
        state = Lookup.HIT if all_ready and maybe == known else Lookup.PENDING
        return PrefixLookup(known, state), work

    def _claim(self, g: int, i: int, key: bytes, st: int, req: Request, wants: dict[int, list[Want]]) -> bool:
        """Pin a resident block for ``req`` or add a lower tier's block to its wants; True if READY."""
        if st >= _TIER:
            wants.setdefault(g, []).append((key, st - _TIER))
            return False
        s = self.pools[g].index.get(key)
        if s is not None:
            self.admission.pin(req, g, key, s)
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

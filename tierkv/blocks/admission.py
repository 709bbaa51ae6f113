"""Admission: requests, their pins and leases, and the FIFO queue for primary slots.

Pure state, no event loop and no I/O: callers ask it to admit a request's promotions and it
*returns* the promotions to start (slots reserved and pinned), or queues the request. The store
starts what it returns; tests drive it directly.

Rules (docs/design.md, "Admission"):

- A request either gets every slot it asks for at once, or holds none while it waits: it gives
  its pins back when it joins the queue, so no two requests can wait on each other.
- The queue is first come, first served; when slots free up, :meth:`Admission.service` admits
  the head at once, without waiting for it to ask again.
- ``mode="naive"`` (a full pool is a MISS) exists only for comparisons.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import anyio

from tierkv.blocks.pool import SlotPool
from tierkv.errors import InvalidArgument

if TYPE_CHECKING:
    from tierkv.movement.costmodel import RestoreRun

__all__ = ["Admission", "PendingClock", "PrefixMemo", "Promotion", "Request", "SlotWriter", "Want"]

log = logging.getLogger("tierkv")

#: a block a request wants promoted: its key and the position of the lower tier that holds it
Want = tuple[bytes, int]


@dataclass(eq=False)
class PrefixMemo:
    """A request's last ``lookup_prefix``: its hashes (already checked) and the keys made from
    them, and its PENDING answer, kept while it stands: until the blocks its own promotions still
    have to land have landed or one of them failed (``stale``), or, when it waited for presence
    probes, until the gateways learned something (``version``)."""

    hashes: list[bytes] | None = None
    keys: dict[int, list[bytes]] = field(default_factory=dict)
    answer: Any = None
    stale: bool = False
    version: int | None = None


@dataclass(eq=False)
class PendingClock:
    """Since when a request's current prefix has been PENDING, how long it may be, and whether it
    gave up (the deadline rule: ``Resolver.overdue``)."""

    since: float | None = None
    deadline_s: float = 60.0
    gave_up: bool = False


@dataclass(eq=False)
class Request:
    """One request's pins (key -> group) and, while queued, what it waits for (group -> keys)."""

    rid: str | None
    last_seen: float
    pins: dict[bytes, int] = field(default_factory=dict)
    wants: dict[int, list[bytes]] = field(default_factory=dict)
    #: when it joined the admission queue (None: not queued)
    queued_at: float | None = None
    #: blocks its own promotions still have to land
    waiting: int = 0
    memo: PrefixMemo = field(default_factory=PrefixMemo)
    pending: PendingClock = field(default_factory=PendingClock)
    #: group -> its run of lower-tier blocks the cost model weighs as one (engines that look keys
    #: up one at a time: :class:`~tierkv.movement.costmodel.RestoreRun`)
    runs: dict[int, RestoreRun] = field(default_factory=dict)

    @property
    def named(self) -> bool:
        """False for the request of a call made without ``request_id`` (pins for the call only)."""
        return self.rid is not None


@dataclass(frozen=True)
class Promotion:
    """Blocks of one group to copy from one lower tier into reserved, pinned primary slots."""

    group: int
    tier: int
    keys: list[bytes]
    slots: list[int]
    #: each slot's allocation token (:meth:`tierkv.blocks.pool.SlotPool.land`): the promotion's proof
    #: that the slot is still its own when its read lands
    tokens: list[int]
    #: the request that asked for them (None: a call without ``request_id``)
    request: Request | None = None

    def landed(self, ok: list[bool]) -> None:
        """Some of the blocks landed (or failed): the asking request waits for fewer."""
        req = self.request
        if req is not None:
            req.waiting -= len(ok)
            if not all(ok):
                req.memo.stale = True


class SlotWriter(Protocol):
    """What admission asks of the one writer of the primary's slots (the store's
    :class:`~tierkv.blocks.ledger.BlockLedger`): every pin, unpin, allocation and abandoned write."""

    def allocate_pinned(self, group: int, keys: list[bytes]) -> tuple[list[int], list[int]]: ...

    def pin_slots(self, group: int, slots: list[int]) -> None: ...

    def unpin_key(self, group: int, key: bytes) -> None: ...

    def unpin_keys(self, group: int, keys: list[bytes]) -> None: ...

    def abandon_slot(self, group: int, slot: int, token: int) -> bool: ...


class Admission:
    """Requests, pins and the admission queue over a store's primary pools. It reads the pools; its
    changes to their slots (pins, allocations) are made by ``slots``, the ledger, which attaches
    itself on creation."""

    def __init__(self, pools: Mapping[int, SlotPool], mode: Literal["queue", "naive"] = "queue",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pools = pools
        self.slots: SlotWriter | None = None
        self.mode = mode
        self.clock = clock
        self.requests: dict[str, Request] = {}
        #: request ids waiting for slots, first come first served
        self.queue: OrderedDict[str, None] = OrderedDict()
        #: requests whose pins were dropped because they made no call for the lease
        self.leases_expired = 0
        #: calls without ``request_id`` that hold pins across awaits (a ``get``, a ``borrow``)
        self.calls: set[Request] = set()

    # ---- requests and pins ----------------------------------------------------------------------
    def request(self, request_id: str | None) -> Request | None:
        """The named request (created on first use, its lease refreshed), or None."""
        if request_id is None:
            return None
        if type(request_id) is not str:
            raise InvalidArgument(f"request_id must be a str, got {type(request_id).__name__}")
        now = self.clock()
        req = self.requests.get(request_id)
        if req is None:
            req = self.requests[request_id] = Request(request_id, now)
        req.last_seen = now
        return req

    def anonymous(self) -> Request:
        """A request for one call made without ``request_id``; release it with :meth:`end_call`."""
        return Request(None, self.clock())

    def open_call(self) -> Request:
        """An anonymous request for a call that holds pins across awaits: known to :meth:`drop`
        and :meth:`count_pins` until :meth:`end_call`."""
        req = self.anonymous()
        self.calls.add(req)
        return req

    def end_call(self, req: Request) -> None:
        """Drop the pins an anonymous call took (no queue service: its HITs must not be evicted)."""
        self.calls.discard(req)
        for key in list(req.pins):
            self.unpin(req, key)

    def _writer(self) -> SlotWriter:
        if self.slots is None:
            raise RuntimeError("admission has no slot writer: create the BlockLedger over it")
        return self.slots

    def pin(self, req: Request | None, group: int, key: bytes, slot: int) -> None:
        """``req`` needs ``key`` (in ``slot``) to stay until it loads it or is released."""
        if req is None or key in req.pins:
            return
        self._writer().pin_slots(group, [slot])
        req.pins[key] = group

    def pin_many(self, req: Request, group: int, keys: list[bytes], slots: list[int]) -> None:
        """:meth:`pin` of many keys of one group (the caller checked they are resident).

        Pins do not refresh recency: a pinned block cannot be evicted, and :meth:`unpin` refreshes
        it when the request is done with it.
        """
        pins = req.pins
        if not pins:
            self._writer().pin_slots(group, slots)
            req.pins = dict.fromkeys(keys, group)
            return
        new = [i for i, k in enumerate(keys) if k not in pins]
        if not new:
            return
        if len(new) < len(keys):
            keys = [keys[i] for i in new]
            slots = [slots[i] for i in new]
        self._writer().pin_slots(group, slots)
        pins.update(dict.fromkeys(keys, group))

    def unpin(self, req: Request, key: bytes) -> None:
        """``req`` no longer needs ``key``."""
        group = req.pins.pop(key, None)
        if group is not None:
            self._writer().unpin_key(group, key)

    def unpin_many(self, req: Request, group: int, keys: Sequence[bytes]) -> None:
        """:meth:`unpin` of many keys of one group."""
        pins = req.pins
        held = [k for k in keys if pins.pop(k, None) is not None]
        if held:
            self._writer().unpin_keys(group, held)

    def abandon(self, group: int, key: bytes, slot: int, token: int) -> bool:
        """A write into ``slot`` (allocation ``token``, holding ``key``) failed: free the slot and
        forget every pin on ``key``. False, and nothing changes, when the slot is no longer that
        write's (a later allocation holds it: its pins are its own)."""
        if not self._writer().abandon_slot(group, slot, token):
            return False
        for req in self.requests.values():
            req.pins.pop(key, None)
        for req in self.calls:
            req.pins.pop(key, None)
        return True

    def release(self, request_id: str) -> bool:
        """Drop every pin ``request_id`` holds and its place in the queue; False when unknown."""
        req = self.requests.pop(request_id, None)
        self.queue.pop(request_id, None)
        if req is None:
            return False
        pins, req.pins = req.pins, {}
        groups = set(pins.values())
        if len(groups) == 1:
            by_group = {groups.pop(): list(pins)}
        else:
            by_group = {g: [] for g in groups}
            for key, group in pins.items():
                by_group[group].append(key)
        for group, keys in by_group.items():
            self._writer().unpin_keys(group, keys)
        return True

    def expired(self, lease_s: float) -> list[str]:
        """Ids of requests that made no call for ``lease_s`` seconds."""
        cutoff = self.clock() - lease_s
        return [r.rid for r in self.requests.values() if r.last_seen < cutoff and r.rid is not None]

    async def sweep_leases(self, lease_s: float, lock: threading.RLock, changed: Callable[[], None]) -> None:
        """For ever: release the requests that made no call for ``lease_s`` seconds (counted in
        :attr:`leases_expired`), then tell ``changed`` (under ``lock``)."""
        while True:
            await anyio.sleep(min(1.0, lease_s / 4))
            with lock:
                for rid in self.expired(lease_s):
                    log.info("request %s made no call for %.1fs: its pins expired", rid, lease_s)
                    self.release(rid)
                    self.leases_expired += 1
                changed()

    def pinned_in(self, req: Request, group: int) -> int:
        """How many keys of ``group`` ``req`` pins."""
        return sum(1 for g in req.pins.values() if g == group)

    # ---- admission ------------------------------------------------------------------------------
    def admit(self, req: Request, wants: Mapping[int, list[Want]]) -> list[Promotion] | None:
        """Reserve slots for every wanted block at once and return the promotions to start.

        None when the request must wait: it is queued (named requests) and holds no pins then.
        """
        if self.mode == "naive":
            if all(self.pools[g].available() >= len(items) for g, items in wants.items()):
                return self._start_all(req, wants)
            return None
        if self.queue and (not req.named or next(iter(self.queue)) != req.rid):
            if req.named:
                self._enqueue(req, wants)
            return None
        for g, items in wants.items():
            if self.pools[g].available() < len(items):
                if req.named:
                    self._enqueue(req, wants)
                return None
        if req.named:
            assert req.rid is not None
            self.queue.pop(req.rid, None)
            req.wants = {}
        return self._start_all(req, wants)

    def _enqueue(self, req: Request, wants: Mapping[int, list[Want]]) -> None:
        """Queue ``req``; it gives back its pins and keeps the blocks they held among its wants."""
        assert req.rid is not None
        merged = {g: [k for k, _ in items] for g, items in wants.items()}
        for key, g in req.pins.items():
            merged.setdefault(g, []).append(key)
        req.wants = {g: list(dict.fromkeys(keys)) for g, keys in merged.items()}
        if req.rid not in self.queue:
            self.queue[req.rid] = None
            req.queued_at = self.clock()
        for key in list(req.pins):
            self.unpin(req, key)

    def service(self, locate: Callable[[int, bytes], int | None]) -> list[Promotion]:
        """Admit waiting requests in FIFO order while their wants fit; the promotions to start.

        ``locate(group, key)`` is the position of a lower tier known to hold ``key``, or None.
        """
        started: list[Promotion] = []
        while self.queue:
            rid = next(iter(self.queue))
            req = self.requests.get(rid)
            if req is None:
                self.queue.pop(rid)
                continue
            wants: dict[int, list[Want]] = {}
            pinned_now: list[tuple[int, bytes, int]] = []
            for g, keys in req.wants.items():
                pool = self.pools[g]
                for k in keys:
                    s = pool.slot_of(k)
                    if s is not None:
                        pinned_now.append((g, k, s))
                        continue
                    where = locate(g, k)
                    if where is not None:
                        wants.setdefault(g, []).append((k, where))
            # the blocks it will pin are no longer evictable: count them out of what is available
            held: dict[int, int] = {}
            for g, k, _ in pinned_now:
                if self.pools[g].evictable(k):
                    held[g] = held.get(g, 0) + 1
            if any(self.pools[g].available() - held.get(g, 0) < len(items) for g, items in wants.items()):
                break
            self.queue.pop(rid)
            req.wants = {}
            req.queued_at = None
            for g, k, s in pinned_now:
                self.pin(req, g, k, s)
            started += self._start_all(req, wants)
        return started

    def reserve(self, call: Request, group: int, wants: list[Want]) -> list[Promotion] | None:
        """Slots for a call's own promotions (a ``get`` of blocks not resident), pinned for
        ``call``; None when they are not available now or requests wait in the queue (they come
        first: a call never takes the slots a queued request waits for)."""
        if self.queue or self.pools[group].available() < len(wants):
            return None
        return self._start_all(call, {group: wants})

    def _start_all(self, req: Request, wants: Mapping[int, list[Want]]) -> list[Promotion]:
        out: list[Promotion] = []
        for g, items in wants.items():
            if not items:
                continue
            keys = [k for k, _ in items]
            slots, tokens = self._writer().allocate_pinned(g, keys)
            owner = req if req.named else None
            # the keys are new to the pool, so no request pinned them before
            req.pins.update(dict.fromkeys(keys, g))
            tiers = {tier for _, tier in items}
            if len(tiers) == 1:
                out.append(Promotion(g, tiers.pop(), keys, slots, tokens, owner))
                continue
            by_tier: dict[int, Promotion] = {}
            for (key, tier), s, t in zip(items, slots, tokens, strict=True):
                p = by_tier.get(tier)
                if p is None:
                    p = by_tier[tier] = Promotion(g, tier, [], [], [], owner)
                p.keys.append(key)
                p.slots.append(s)
                p.tokens.append(t)
            out += by_tier.values()
        if req.named:
            req.waiting += sum(len(p.keys) for p in out)
        return out

    def count_pins(self, group: int, pool: SlotPool, expected: list[int]) -> list[str]:
        """Add the pins requests and calls hold on ``group``'s slots to ``expected`` (per slot);
        the pins on keys no slot holds, as problems."""
        problems = []
        for req in [*self.requests.values(), *self.calls]:
            for key, grp in req.pins.items():
                if grp != group:
                    continue
                s = pool.slot_of(key)
                if s is None:
                    who = f"request {req.rid!r}" if req.named else "a call"
                    problems.append(f"group {group}: {who} pins {key.hex()}, not resident")
                else:
                    expected[s] += 1
        return problems

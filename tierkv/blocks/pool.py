"""Per-group slot pools: one preallocated tensor per group, slot states and pins, batched copies."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence

import torch
from pydantic import BaseModel

from tierkv.blocks.policy import EvictionPolicy, make_policy
from tierkv.blocks.poolmemory import allocate_pool_tensor, shared_pool_tensors
from tierkv.blocks.slottable import SlotTable
from tierkv.errors import CapacityError, InvalidArgument
from tierkv.layout import Layout
from tierkv.tensors import contiguous_run, wide_view

__all__ = [
    "GroupPlan",
    "PoolPlan",
    "SlotPool",
    "SlotState",
    "allocate_pool_tensor",
    "plan_pools",
    "shared_pool_tensors",
]


class SlotState(enum.IntEnum):
    """The life of a slot: free, being written (a put or a promotion in flight), ready to read."""

    FREE = 0
    WRITING = 1
    READY = 2


class GroupPlan(BaseModel):
    """What pool sizing chose for one group, and why."""

    group: int
    kind: str
    slots: int
    block_bytes: int
    bytes: int
    floor: int
    reason: str


class PoolPlan(BaseModel):
    """Slots and bytes per prefix-cacheable group."""

    capacity_bytes: int | None
    max_concurrent_requests: int
    groups: list[GroupPlan]

    @property
    def total_bytes(self) -> int:
        """Bytes the pools take together."""
        return sum(g.bytes for g in self.groups)

    def slots(self) -> dict[int, int]:
        """Group index -> slot count."""
        return {g.group: g.slots for g in self.groups}


def plan_pools(
    capacity_bytes: int | None,
    layout: Layout,
    max_concurrent_requests: int,
    slots: Mapping[int, int] | None = None,
) -> PoolPlan:
    """Size one pool per prefix-cacheable group.

    Every recurrent group gets its floor of ``max_concurrent_requests * states_per_request`` slots
    (one state per request can never be shared between requests in flight). What the budget has
    left is split between the full and sliding-window groups so that each holds the same number of
    blocks, i.e. covers the same number of tokens: a prefix of ``k`` blocks needs ``k`` blocks in
    every full group. A model with only recurrent groups gives them the rest, equally in slots.
    An explicit ``slots`` entry is honoured as given, even below the floor, and said so in the plan.
    """
    if max_concurrent_requests <= 0:
        raise CapacityError(f"max_concurrent_requests must be > 0, got {max_concurrent_requests}")
    overrides = dict(slots or {})
    cacheable = layout.cacheable_groups
    for g, n in overrides.items():
        if g not in cacheable:
            raise CapacityError(f"slots override for group {g}, which is not a prefix-cacheable group")
        if n <= 0:
            raise CapacityError(f"slots override for group {g} must be > 0, got {n}")
    if capacity_bytes is not None and capacity_bytes <= 0:
        raise CapacityError(f"capacity_bytes must be > 0, got {capacity_bytes}")
    if capacity_bytes is None and set(overrides) != set(cacheable):
        raise CapacityError("a pool tier needs capacity_bytes, or a slots entry for every group")

    plans: dict[int, GroupPlan] = {}
    budget = capacity_bytes if capacity_bytes is not None else 0
    for g in cacheable:
        spec = layout.groups[g]
        floor = max_concurrent_requests * spec.states_per_request if spec.kind == "recurrent" else 1
        if g in overrides:
            n = overrides[g]
            note = "explicit slots override" + (f" (below the floor of {floor})" if n < floor else "")
            plans[g] = GroupPlan(group=g, kind=spec.kind, slots=n, block_bytes=spec.block_bytes,
                                 bytes=n * spec.block_bytes, floor=floor, reason=note)
            budget -= n * spec.block_bytes
    if capacity_bytes is not None and budget < 0:
        raise CapacityError(
            f"slots overrides take {capacity_bytes - budget} bytes, more than capacity_bytes={capacity_bytes}"
        )
    rest = [g for g in cacheable if g not in plans]
    if not rest:
        return PoolPlan(capacity_bytes=capacity_bytes, max_concurrent_requests=max_concurrent_requests,
                        groups=[plans[g] for g in cacheable])
    floors = {}
    for g in rest:
        spec = layout.groups[g]
        floors[g] = max_concurrent_requests * spec.states_per_request if spec.kind == "recurrent" else 1
    floor_bytes = sum(floors[g] * layout.groups[g].block_bytes for g in rest)
    if floor_bytes > budget:
        detail = ", ".join(
            f"group {g} ({layout.groups[g].kind}): {floors[g]} x {layout.groups[g].block_bytes} B"
            for g in rest
        )
        raise CapacityError(
            f"capacity_bytes={capacity_bytes} is too small for the pool floor of {floor_bytes} bytes"
            f" ({detail}; max_concurrent_requests={max_concurrent_requests})"
        )
    budget -= floor_bytes
    growers = [g for g in rest if layout.groups[g].kind != "recurrent"] or rest
    per_row = sum(layout.groups[g].block_bytes for g in growers)
    extra_rows = budget // per_row if per_row else 0
    for g in rest:
        spec = layout.groups[g]
        n = floors[g] + (extra_rows if g in growers else 0)
        if spec.kind == "recurrent":
            why = (f"floor {floors[g]} = max_concurrent_requests {max_concurrent_requests}"
                   f" x states_per_request {spec.states_per_request}")
            if g in growers:
                why += f", plus {extra_rows} from the remaining budget"
        else:
            why = f"equal share of the budget left after floors ({n} blocks per group)"
        plans[g] = GroupPlan(group=g, kind=spec.kind, slots=n, block_bytes=spec.block_bytes,
                             bytes=n * spec.block_bytes, floor=floors[g], reason=why)
    return PoolPlan(capacity_bytes=capacity_bytes, max_concurrent_requests=max_concurrent_requests,
                    groups=[plans[g] for g in cacheable])


class SlotPool:
    """The slots of one group: a preallocated ``[slots, block_bytes]`` tensor plus slot states.

    A slot is FREE, WRITING (its bytes are being filled) or READY. Pins count users that need the
    slot to stay (a request that looked it up, a cascade reading it, a load copying it out); only
    READY slots without pins may be evicted, in the order the eviction policy gives.

    Each allocation of a slot gets a new generation (:attr:`gen`): a writer that fills a slot
    across awaits (a promotion, an engine's reservation) keeps ``(slot, generation)`` as its
    token and ends its write only with it (:meth:`land`, :meth:`abandon`). :meth:`free` never
    frees a WRITING slot, so nobody but its writer can give it back while bytes are on their way
    into it; a write whose token no longer matches is refused and remembered
    (:attr:`refused`, reported by :meth:`problems`).
    """

    def __init__(self, group: int, block_bytes: int, slots: int, device: torch.device | str = "cpu",
                 policy: str = "lru", tensor: torch.Tensor | None = None) -> None:
        if slots <= 0:
            raise CapacityError(f"group {group}: a pool needs at least one slot")
        self.group = group
        self.block_bytes = block_bytes
        self.num_slots = slots
        self.device = torch.device(device)
        if tensor is not None:
            if tuple(tensor.shape) != (slots, block_bytes) or tensor.dtype != torch.uint8:
                raise CapacityError(f"group {group}: a pool tensor must be uint8 [{slots}, {block_bytes}]")
            self.tensor, self.pinned_memory = tensor, tensor.is_pinned()
        else:
            self.tensor, self.pinned_memory = allocate_pool_tensor(slots, block_bytes, self.device)
        self._wide = wide_view(self.tensor)
        self.state = [SlotState.FREE] * slots
        self.pins = [0] * slots
        self.slot_key: list[bytes | None] = [None] * slots
        self.index: dict[bytes, int] = {}
        #: per slot, how many times it was allocated: a writer's token is (slot, generation)
        self.gen = [0] * slots
        #: writes refused because their slot was no longer theirs: (slot, token's generation,
        #: slot's generation); never happens while every writer keeps to its token
        self.refused: list[tuple[int, int, int]] = []
        self._free = list(range(slots - 1, -1, -1))
        self.policy: EvictionPolicy = make_policy(policy, slots)
        self.evictions = 0
        #: slots in WRITING state
        self.writing = 0
        self._evictable = 0
        #: called with the keys each allocation evicted (engine adapters turn them into events)
        self.on_evict: Callable[[list[bytes]], None] | None = None
        #: each slot's key and version for readers in other processes (a daemon's pool), or None
        self.table: SlotTable | None = None

    # ---- queries -------------------------------------------------------------------------------
    def slot_of(self, key: bytes) -> int | None:
        """The slot holding ``key`` (WRITING or READY), or None."""
        return self.index.get(key)

    def is_ready(self, key: bytes) -> bool:
        """True when ``key`` is in a READY slot."""
        s = self.index.get(key)
        return s is not None and self.state[s] is SlotState.READY

    def evictable(self, key: bytes) -> bool:
        """True when ``key`` sits in a READY slot with no pins."""
        s = self.index.get(key)
        return s is not None and self.state[s] is SlotState.READY and self.pins[s] == 0

    @property
    def free_count(self) -> int:
        """Slots that hold nothing."""
        return len(self._free)

    def available(self) -> int:
        """Slots that could be had now: free ones plus READY unpinned ones."""
        return len(self._free) + self._evictable

    def counts(self) -> dict[str, int]:
        """Slots per state, plus pinned slots."""
        c = {"free": 0, "writing": 0, "ready": 0, "pinned": 0, "evictable": self._evictable}
        for s in range(self.num_slots):
            c[self.state[s].name.lower()] += 1
            if self.pins[s]:
                c["pinned"] += 1
        return c

    def problems(self) -> list[str]:
        """Inconsistencies in the slot accounting (empty when sound): for tests and debugging."""
        out = []
        free = self._free
        g = self.group
        if len(free) != len(set(free)):
            out.append(f"group {g}: a slot is free twice")
        resident = set(self.index.values())
        if len(resident) != len(self.index):
            out.append(f"group {g}: a slot is owned twice")
        if resident & set(free):
            out.append(f"group {g}: a slot is both free and owned")
        if len(resident) + len(free) != self.num_slots:
            out.append(f"group {g}: a slot leaked")
        for k, s in self.index.items():
            if self.slot_key[s] != k or self.state[s] is SlotState.FREE:
                out.append(f"group {g}: slot {s} does not hold its key")
        for s in free:
            if self.state[s] is not SlotState.FREE or self.pins[s]:
                out.append(f"group {g}: free slot {s} is not clean")
        evictable = sum(1 for s in range(self.num_slots)
                        if self.state[s] is SlotState.READY and self.pins[s] == 0)
        if evictable != self._evictable:
            out.append(f"group {g}: evictable count {self._evictable}, actually {evictable}")
        writing = sum(1 for s in range(self.num_slots) if self.state[s] is SlotState.WRITING)
        if writing != self.writing:
            out.append(f"group {g}: writing count {self.writing}, actually {writing}")
        out += [f"group {g}: a write into slot {s} (allocation {t}) was refused: the slot is allocation {n}"
                f" now" for s, t, n in self.refused[:8]]
        return out

    # ---- transitions ---------------------------------------------------------------------------
    def allocate(self, keys: Sequence[bytes]) -> tuple[list[int], list[bytes]] | None:
        """Slots for ``keys`` in WRITING state, all or none; evicts what it must.

        Returns ``(slots, evicted_keys)``, or None when not enough slots are free or evictable
        (nothing changes then). Keys must not be resident already.
        """
        need = len(keys)
        victims: list[bytes] = []
        if need > len(self._free):
            victims = self.policy.victims(need - len(self._free), self.evictable)
            if len(victims) < need - len(self._free):
                return None
        for v in victims:
            self._drop(self.index[v], evicted=True)
        self.evictions += len(victims)
        if victims and self.on_evict is not None:
            self.on_evict(victims)
        slots = sorted(self._free.pop() for _ in keys)  # adjacent slots copy as one run
        self.writing += len(slots)
        table = self.table
        for key, s in zip(keys, slots, strict=True):
            self.state[s] = SlotState.WRITING
            self.slot_key[s] = key
            self.index[key] = s
            self.gen[s] += 1
            if table is not None:
                table.allocated(s, key)
        return slots, victims

    def tokens(self, slots: Sequence[int]) -> list[int]:
        """The current generation of each of ``slots``: the tokens a writer keeps (see class docs)."""
        return [self.gen[s] for s in slots]

    def owns(self, s: int, token: int) -> bool:
        """True when slot ``s`` is still WRITING under the allocation ``token`` names."""
        return self.gen[s] == token and self.state[s] is SlotState.WRITING

    def land(self, slots: Sequence[int], tokens: Sequence[int]) -> list[bool]:
        """A writer's bytes are complete: WRITING -> READY for each slot still its own.

        Per slot, False (and remembered in :attr:`refused`) when the slot is no longer the
        writer's: its bytes must not be served under any key.
        """
        ok = [self.owns(s, t) for s, t in zip(slots, tokens, strict=True)]
        self.mark_ready([s for s, f in zip(slots, ok, strict=True) if f])
        self.refused += [(s, t, self.gen[s]) for s, t, f in zip(slots, tokens, ok, strict=True) if not f]
        return ok

    def rekey(self, s: int, token: int, old: bytes, new: bytes) -> bool:
        """A WRITING slot reserved under ``old`` (allocation ``token``) is to hold ``new`` (not
        resident) instead; False, nothing changed, when either does not hold."""
        if not self.owns(s, token) or self.slot_key[s] != old or new in self.index:
            return False
        del self.index[old]
        self.index[new] = s
        self.slot_key[s] = new
        if self.table is not None:
            self.table.allocated(s, new)  # still WRITING: its version is odd
        return True

    def abandon(self, slots: Sequence[int], tokens: Sequence[int]) -> list[bool]:
        """A writer gives up: free each slot still its own (its key becomes invisible at once).

        Per slot, whether it was the writer's (False: another allocation holds it now, untouched).
        """
        ok = [self.owns(s, t) for s, t in zip(slots, tokens, strict=True)]
        for s, f in zip(slots, ok, strict=True):
            if f:
                self._drop(s)
        return ok

    def mark_ready(self, slots: Sequence[int]) -> None:
        """WRITING -> READY: the bytes are complete and may be served."""
        for s in slots:
            if self.state[s] is SlotState.WRITING:
                self.writing -= 1
                self.state[s] = SlotState.READY
                if self.pins[s] == 0:
                    self._evictable += 1
                key = self.slot_key[s]
                assert key is not None
                self.policy.insert(key)
                if self.table is not None:
                    self.table.ready(s)

    def free(self, slots: Sequence[int]) -> None:
        """Give READY slots back (a delete, a clear); their keys become invisible at once.

        A WRITING slot is left as it is: only its writer ends it (:meth:`abandon`), so no slot
        is handed to another key while bytes are still on their way into it.
        """
        for s in slots:
            if self.state[s] is SlotState.READY:
                self._drop(s)

    def _drop(self, s: int, evicted: bool = False) -> None:
        if self.table is not None:
            self.table.freed(s)  # first: a reader copying the slot now throws its copy away
        if self.state[s] is SlotState.READY and self.pins[s] == 0:
            self._evictable -= 1
        elif self.state[s] is SlotState.WRITING:
            self.writing -= 1
        key = self.slot_key[s]
        if key is not None:
            self.index.pop(key, None)
            self.policy.remove(key, evicted)
        self.slot_key[s] = None
        self.state[s] = SlotState.FREE
        self.pins[s] = 0
        self._free.append(s)

    def pin(self, s: int) -> None:
        """One more user needs slot ``s`` to stay."""
        if self.pins[s] == 0 and self.state[s] is SlotState.READY:
            self._evictable -= 1
        self.pins[s] += 1

    def pin_many(self, slots: Sequence[int]) -> None:
        """:meth:`pin` of many slots at once."""
        pins, state, ready = self.pins, self.state, SlotState.READY
        taken = 0
        for s in slots:
            if pins[s] == 0 and state[s] is ready:
                taken += 1
            pins[s] += 1
        self._evictable -= taken

    def unpin(self, s: int) -> None:
        """One user of slot ``s`` is done."""
        if self.pins[s] > 0:
            self.pins[s] -= 1
            if self.pins[s] == 0 and self.state[s] is SlotState.READY:
                self._evictable += 1

    def unpin_keys(self, keys: Sequence[bytes]) -> None:
        """:meth:`unpin` of the slots holding ``keys`` (those still resident), each then touched."""
        index, pins, state, ready = self.index, self.pins, self.state, SlotState.READY
        freed = 0
        held = []
        for k in keys:
            s = index.get(k)
            if s is None:
                continue
            held.append(k)
            if pins[s] > 0:
                pins[s] -= 1
                if pins[s] == 0 and state[s] is ready:
                    freed += 1
        self._evictable += freed
        self.policy.touch_many(held)

    def touch(self, key: bytes) -> None:
        """Record a use of ``key`` for the eviction policy."""
        self.policy.touch(key)

    def touch_many(self, keys: Sequence[bytes]) -> None:
        """:meth:`touch` of each of ``keys``, in order."""
        self.policy.touch_many(keys)

    # ---- data ----------------------------------------------------------------------------------
    def _check_rows(self, t: torch.Tensor, n: int, what: str) -> None:
        if not isinstance(t, torch.Tensor):
            raise InvalidArgument(f"{what} must be a torch.Tensor, got {type(t).__name__}")
        nbytes = t.element_size() * (t.shape[-1] if t.dim() else 1)
        if t.dim() != 2 or t.shape[0] != n or nbytes != self.block_bytes:
            raise InvalidArgument(
                f"{what}: expected a 2-D tensor of {n} rows of {self.block_bytes} bytes,"
                f" got shape {tuple(t.shape)} of {t.dtype}"
            )
        if not t.is_contiguous():
            raise InvalidArgument(f"{what} must be contiguous")

    def write(self, slots: Sequence[int], src: torch.Tensor) -> None:
        """Copy rows of ``src`` (``[len(slots), block_bytes]`` bytes) into ``slots``, batched."""
        self._check_rows(src, len(slots), "blocks")
        if not slots:
            return
        src8 = src.view(torch.uint8).reshape(len(slots), self.block_bytes)
        if src8.device != self.device:
            src8 = src8.to(self.device, non_blocking=self.pinned_memory)
        run = contiguous_run(slots)
        if run is not None:
            self.tensor[run[0]:run[1]].copy_(src8)
            return
        idx = torch.tensor(slots, dtype=torch.int64, device=self.device)
        self._wide.index_copy_(0, idx, src8.view(self._wide.dtype))

    def read(self, slots: Sequence[int], out: torch.Tensor) -> None:
        """Copy ``slots`` into the rows of ``out`` (``[len(slots), block_bytes]`` bytes), batched."""
        self._check_rows(out, len(slots), "out")
        if not slots:
            return
        out8 = out.view(torch.uint8).reshape(len(slots), self.block_bytes)
        run = contiguous_run(slots)
        if run is not None:
            out8.copy_(self.tensor[run[0]:run[1]])
            return
        idx = torch.tensor(slots, dtype=torch.int64, device=self.device)
        if out8.device == self.device:
            torch.index_select(self._wide, 0, idx, out=out8.view(self._wide.dtype))
        else:
            out8.copy_(torch.index_select(self.tensor, 0, idx))

    def row(self, s: int) -> torch.Tensor:
        """The bytes of slot ``s`` as a view."""
        return self.tensor[s]

    def release(self) -> None:
        """Give the pool's memory back now (the store closed), not whenever the garbage collector
        gets to the store: freeing gigabytes takes tens of milliseconds, which a collection would
        charge to whatever runs next. Views handed out (borrowed rows) keep their own memory."""
        self.tensor = self._wide = torch.empty((0, self.block_bytes), dtype=torch.uint8, device=self.device)

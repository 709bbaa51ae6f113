"""A Hypothesis state machine drives a small store and checks it against a dict model.

Pools are tiny so eviction, promotion, pins and the admission queue all happen. After every step
pool accounting is checked (no slot leaked or owned twice) and every byte served is compared with
the model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import ClassVar

import anyio.from_thread
import torch
from helpers import FULL, REC, SW, hybrid_layout
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tierkv import BlockMissing, Lookup, TieredStore
from tierkv.keys import make_key
from tierkv.pool import SlotState

LAYOUT = hybrid_layout(bb=64, window=2)
GROUPS = (FULL, SW, REC)
HASHES = [hashlib.sha256(bytes([i])).digest() for i in range(10)]


def data_for(g: int, h: bytes) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(h + bytes([g])).digest()[:7], "big")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (LAYOUT.groups[g].block_bytes,), dtype=torch.uint8, generator=gen)


hash_lists = st.lists(st.sampled_from(HASHES), min_size=1, max_size=4, unique=True)
groups = st.sampled_from(GROUPS)
rids = st.sampled_from(["a", "b", "c", None])


class StoreMachine(RuleBasedStateMachine):
    lower: ClassVar[dict[str, object]] = {"kind": "memory"}
    #: with faults injected, a stored block may be missing (a counted miss), never wrong
    faults = False

    def __init__(self) -> None:
        super().__init__()
        self._cm = anyio.from_thread.start_blocking_portal()
        self.portal = self._cm.__enter__()
        cfg = {"layout": LAYOUT, "namespace": "model", "max_concurrent_requests": 2, "policy": "arc",
               "tiers": [{"kind": "cpu", "slots": {FULL: 3, SW: 2, REC: 2}}, self.lower]}
        self._store_cm = self.portal.wrap_async_context_manager(TieredStore(cfg))
        self.store: TieredStore = self._store_cm.__enter__()
        self.model: dict[tuple[int, bytes], torch.Tensor] = {}

    def teardown(self) -> None:
        self._store_cm.__exit__(None, None, None)
        self._cm.__exit__(None, None, None)

    @rule(g=groups, hs=hash_lists)
    def put(self, g: int, hs: list[bytes]) -> None:
        data = torch.stack([data_for(g, h) for h in hs])
        self.portal.call(self.store.put, g, hs, data)
        for h in hs:
            self.model[(g, h)] = data_for(g, h)

    @rule(g=groups, hs=hash_lists, rid=rids)
    def lookup(self, g: int, hs: list[bytes], rid: str | None) -> None:
        res = self.portal.call(lambda: self.store.lookup(g, hs, request_id=rid))
        for h, r in zip(hs, res, strict=True):
            if (g, h) not in self.model:
                assert r is Lookup.MISS, "a block never stored must be a MISS"
            if r is Lookup.HIT:
                assert self.store.pools[g].is_ready(make_key(h, g))

    @rule(hs=hash_lists, rid=rids)
    def lookup_prefix(self, hs: list[bytes], rid: str | None) -> None:
        res = self.portal.call(lambda: self.store.lookup_prefix(hs, request_id=rid))
        for g in GROUPS:
            for i in LAYOUT.groups[g].blocks_needed(res.blocks):
                assert (g, hs[i]) in self.model, "a prefix must only count stored blocks"

    @rule(g=groups, hs=hash_lists, rid=rids)
    def get(self, g: int, hs: list[bytes], rid: str | None) -> None:
        out = torch.zeros((len(hs), LAYOUT.groups[g].block_bytes), dtype=torch.uint8)
        expect_missing = [i for i, h in enumerate(hs) if (g, h) not in self.model]
        try:
            self.portal.call(lambda: self.store.get(g, hs, out, request_id=rid))
            assert not expect_missing
            missing: list[int] = []
        except BlockMissing as exc:
            missing = exc.missing
            if self.faults:
                assert set(expect_missing) <= set(missing)
            else:
                assert missing == expect_missing
        for i, h in enumerate(hs):
            if (g, h) in self.model and i not in missing:
                assert torch.equal(out[i], self.model[(g, h)]), "served bytes differ from the model"

    @rule(rid=st.sampled_from(["a", "b", "c"]))
    def release(self, rid: str) -> None:
        self.portal.call(self.store.release, rid)

    @rule()
    def settle(self) -> None:
        self.portal.call(self.store.idle)

    @precondition(lambda self: bool(self.model))
    @rule()
    def evict_everything_unpinned(self) -> None:
        def drop() -> None:
            for pool in self.store.pools.values():
                pool.free([s for s in range(pool.num_slots)
                           if pool.pins[s] == 0 and pool.state[s] is SlotState.READY])

        self.portal.call(self.store.flush)
        self.portal.call(drop)

    def _pools(self) -> Iterator[tuple[int, object]]:
        yield from self.store.pools.items()

    @invariant()
    def pool_accounting(self) -> None:
        def check() -> None:
            for g, pool in self.store.pools.items():
                free = pool._free
                assert len(free) == len(set(free)), f"group {g}: a slot is free twice"
                resident = set(pool.index.values())
                assert len(resident) == len(pool.index), f"group {g}: a slot is owned twice"
                assert not resident & set(free), f"group {g}: a slot is both free and owned"
                assert len(resident) + len(free) == pool.num_slots, f"group {g}: a slot leaked"
                for k, s in pool.index.items():
                    assert pool.slot_key[s] == k and pool.state[s] is not SlotState.FREE
                for s in free:
                    assert pool.state[s] is SlotState.FREE and pool.pins[s] == 0
                evictable = sum(1 for s in range(pool.num_slots)
                                if pool.state[s] is SlotState.READY and pool.pins[s] == 0)
                assert pool.available() == len(free) + evictable
                request_pins = [0] * pool.num_slots
                for req in self.store._requests.values():
                    for key, grp in req.pins.items():
                        if grp == g:
                            s = pool.slot_of(key)
                            assert s is not None, "a request pins a key that is not resident"
                            request_pins[s] += 1
                if self.store._cascades == 0:
                    assert request_pins == pool.pins, f"group {g}: pins do not match requests"

        self.portal.call(check)


class FaultyStoreMachine(StoreMachine):
    lower: ClassVar[dict[str, object]] = {"kind": "faulty", "inner": {"kind": "memory"},
                                          "fail_every": 3, "ops": ["get", "put"]}
    faults = True


_settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestStoreModel = StoreMachine.TestCase
TestStoreModel.settings = _settings
TestFaultyStoreModel = FaultyStoreMachine.TestCase
TestFaultyStoreModel.settings = _settings

"""A Hypothesis state machine drives a small store and checks it against a dict model.

Pools are tiny so eviction, promotion, pins and the admission queue all happen. After every step
pool accounting is checked (no slot leaked or owned twice) and every byte served is compared with
the model.
"""

from __future__ import annotations

import hashlib
import tempfile
from concurrent.futures import Future
from typing import ClassVar

import anyio
import anyio.from_thread
import torch
from helpers import FULL, REC, SW, hybrid_layout
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tierkv import BlockMissing, Lookup, TieredStore
from tierkv.keys import make_key

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
    extra: ClassVar[dict[str, object]] = {}
    #: with faults injected, a stored block may be missing (a counted miss), never wrong
    faults = False

    def __init__(self) -> None:
        super().__init__()
        self._cm = anyio.from_thread.start_blocking_portal()
        self.portal = self._cm.__enter__()
        cfg = {"layout": LAYOUT, "namespace": "model", "max_concurrent_requests": 2, "policy": "arc",
               **self.extra,
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
                assert self.store.engine.ready_slots(g, [make_key(h, g)])[0] is not None

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
        self.portal.call(self.store.flush)
        self.portal.call(self.store.engine.clear)

    @invariant()
    def pool_accounting(self) -> None:
        problems = self.portal.call(self.store.check)  # type: ignore[arg-type]
        assert not problems, problems


class DeadlineStoreMachine(StoreMachine):
    """Promotions slower than the deadline on PENDING, and gets cancelled while they wait: requests
    give up and recompute, promotions land later, and nothing leaks."""

    lower: ClassVar[dict[str, object]] = {"kind": "faulty", "inner": {"kind": "memory"},
                                          "delay_s": 0.03, "ops": ["get"]}
    extra: ClassVar[dict[str, object]] = {"max_pending_s": 0.01}

    @rule(d=st.sampled_from([0.005, 0.02, 0.05]))
    def wait(self, d: float) -> None:
        self.portal.call(anyio.sleep, d)

    @rule(g=groups, hs=hash_lists, rid=rids)
    def get_cancelled(self, g: int, hs: list[bytes], rid: str | None) -> None:
        out = torch.zeros((len(hs), LAYOUT.groups[g].block_bytes), dtype=torch.uint8)

        async def cut_short() -> None:
            with anyio.move_on_after(0.01):
                try:
                    await self.store.get(g, hs, out, request_id=rid)
                except BlockMissing:
                    pass

        self.portal.call(cut_short)


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
TestDeadlineStoreModel = DeadlineStoreMachine.TestCase
TestDeadlineStoreModel.settings = settings(max_examples=30, stateful_step_count=25, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])


class ConcurrentStoreMachine(StoreMachine):
    """Steps that start work and leave it running (#46): gets, puts and lookups overlap, promotions
    land while others evict, and gets are cancelled mid-wait. Every row a get returns must be its
    own key's block, whenever it lands; the accounting is checked after every step."""

    #: a put started and not run yet, or a promotion cut short, may leave a block missing: never wrong
    faults = True

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory()
        self.lower = {"kind": "fsspec", "url": f"file://{self._dir.name}"}
        super().__init__()
        self.running: list[tuple[Future[None], int, list[bytes], torch.Tensor]] = []

    @rule(g=groups, hs=hash_lists, rid=rids, cut=st.sampled_from([None, 0.001, 0.004]))
    def start_get(self, g: int, hs: list[bytes], rid: str | None, cut: float | None) -> None:
        out = torch.zeros((len(hs), LAYOUT.groups[g].block_bytes), dtype=torch.uint8)
        missing: list[int] = []

        async def get() -> None:
            with anyio.move_on_after(cut if cut is not None else 30) as scope:
                try:
                    await self.store.get(g, hs, out, request_id=rid)
                except BlockMissing as exc:
                    missing.extend(exc.missing)
            if scope.cancelled_caught:
                missing.extend(range(len(hs)))  # rows of a cancelled get are unspecified

        fut = self.portal.start_task_soon(get)
        self.running.append((fut, g, hs, out))
        self.missing_of[id(out)] = missing

    @rule(g=groups, hs=hash_lists)
    def start_put(self, g: int, hs: list[bytes]) -> None:
        data = torch.stack([data_for(g, h) for h in hs])
        for h in hs:
            self.model[(g, h)] = data_for(g, h)
        self.portal.start_task_soon(self.store.put, g, hs, data)

    @rule(g=groups, hs=hash_lists, rid=rids)
    def lookup(self, g: int, hs: list[bytes], rid: str | None) -> None:
        # a file tier answers presence by probing: a block never stored may be PENDING a while
        res = self.portal.call(lambda: self.store.lookup(g, hs, request_id=rid))
        for h, r in zip(hs, res, strict=True):
            if (g, h) not in self.model:
                assert r is not Lookup.HIT, "a block never stored must not be a HIT"

    @rule(hs=hash_lists, rid=rids)
    def lookup_prefix(self, hs: list[bytes], rid: str | None) -> None:
        res = self.portal.call(lambda: self.store.lookup_prefix(hs, request_id=rid))
        if res.state is Lookup.HIT:
            for g in GROUPS:
                for i in LAYOUT.groups[g].blocks_needed(res.blocks):
                    assert (g, hs[i]) in self.model, "a HIT prefix must only count stored blocks"

    @rule(d=st.sampled_from([0.0, 0.001, 0.005]))
    def let_it_run(self, d: float) -> None:
        self.portal.call(anyio.sleep, d)

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def finish_one(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.running) - 1))
        self._finish(self.running.pop(i))

    def _finish(self, item: tuple[Future[None], int, list[bytes], torch.Tensor]) -> None:
        fut, g, hs, out = item
        fut.result(timeout=30)
        missing = self.missing_of.pop(id(out))
        for i, h in enumerate(hs):
            if i not in missing:
                assert torch.equal(out[i], data_for(g, h)), "a get returned another key's block"

    @property
    def missing_of(self) -> dict[int, list[int]]:
        if not hasattr(self, "_missing_of"):
            self._missing_of: dict[int, list[int]] = {}
        return self._missing_of

    def teardown(self) -> None:
        while self.running:
            self._finish(self.running.pop())
        super().teardown()
        self._dir.cleanup()


TestConcurrentStoreModel = ConcurrentStoreMachine.TestCase
TestConcurrentStoreModel.settings = settings(max_examples=80, stateful_step_count=40, deadline=None,
                                             suppress_health_check=[HealthCheck.too_slow])

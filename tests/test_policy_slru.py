"""The ``slru`` eviction policy (tierkv.blocks.segmented) through the EvictionPolicy interface, in a slot
pool, and against LRU on generated traffic (docs/traffic.md)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.blocks.policy import DEFAULT_POLICY, POLICIES, EvictionPolicy, LRUPolicy, SLRUPolicy, make_policy
from tierkv.blocks.pool import SlotPool, SlotState
from tierkv.config import StoreConfig
from tierkv.layout import GroupSpec, Layout


def k(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\x00\x00\x00\x00"


def always(_: bytes) -> bool:
    return True


# ---- the interface --------------------------------------------------------------------------------

def test_slru_is_the_default_and_known_by_name() -> None:
    assert DEFAULT_POLICY == "slru" and "slru" in POLICIES and "lru" in POLICIES
    assert isinstance(make_policy("slru", 8), SLRUPolicy)
    layout = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=64)])
    assert StoreConfig(layout=layout, tiers=[{"kind": "cpu", "slots": {0: 4}}]).policy == "slru"


def test_share_zero_is_lru_exactly() -> None:
    """With no protected share (and chains not reordered) the policy orders keys exactly as LRU
    does, on random operations."""
    rng = random.Random(1)
    a, b = SLRUPolicy(32, shares=(0.0,), chains=False), LRUPolicy()
    resident: set[bytes] = set()
    for step in range(3000):
        key = k(rng.randrange(48))
        if key in resident:
            for p in (a, b):
                p.touch(key)
        else:
            if len(resident) == 32:
                va, vb = a.victims(3, always), b.victims(3, always)
                assert va == vb, step
                for p in (a, b):
                    p.remove(va[0])
                resident.discard(va[0])
            for p in (a, b):
                p.insert(key)
            resident.add(key)
        assert len(a) == len(b) == len(resident)


def test_probation_goes_first_and_reuse_protects() -> None:
    p = SLRUPolicy(8, shares=(0.5,), chains=False)
    for i in range(6):
        p.insert(k(i))
    p.touch(k(0))  # used again: protected
    assert p.victims(6, always) == [k(1), k(2), k(3), k(4), k(5), k(0)]
    assert p.victim(always) == k(1)


def test_protected_overflow_is_demoted_not_lost() -> None:
    p = SLRUPolicy(4, shares=(0.5,), chains=False)  # protected holds 2
    for i in range(4):
        p.insert(k(i))
    for i in range(4):
        p.touch(k(i))  # each is protected in turn; the oldest two are demoted to probation
    assert len(p) == 4
    assert p.victims(4, always) == [k(0), k(1), k(2), k(3)]


def test_a_ghost_comes_back_protected() -> None:
    p = SLRUPolicy(8, shares=(0.5,), chains=False)
    for i in range(4):
        p.insert(k(i))
    p.remove(k(0), evicted=True)  # evicted: remembered
    p.remove(k(1), evicted=False)  # freed on purpose: forgotten
    p.insert(k(0))
    p.insert(k(1))
    p.insert(k(9))
    # k(0) skipped probation; k(1) came back as new as k(9)
    assert p.victims(5, always) == [k(2), k(3), k(1), k(9), k(0)]


def test_victims_never_offer_what_may_not_go_and_change_nothing() -> None:
    p = SLRUPolicy(16, shares=(0.5,))
    for i in range(10):
        p.insert(k(i))
    for i in (2, 5, 7):
        p.touch(k(i))
    pinned = {k(0), k(5), k(9)}
    first = p.victims(20, lambda key: key not in pinned)
    assert first == p.victims(20, lambda key: key not in pinned)  # no state changed
    assert not set(first) & pinned and len(first) == 7
    assert p.victims(2, lambda key: key not in pinned) == first[:2]
    assert p.victims(3, lambda _: False) == [] and p.victim(lambda _: False) is None
    assert p.victims(0, always) == []
    assert make_policy("slru", 4).victim(always) is None


def test_a_chain_goes_from_its_end() -> None:
    """Blocks used as one chain (each right after the one before it) are evicted deepest first
    once the next chain starts: a block is of use only with every block before it."""
    p = SLRUPolicy(16, shares=(0.0,))
    for i in range(4):
        p.insert(k(i))  # chain 0-1-2-3
    p.touch_many([k(0), k(1)])  # a request found 0-1 (its own chain: 0 has no parent)
    p.insert(k(10))  # ... and stored 10 after 1
    p.touch(k(0))  # the next request starts
    assert p.victims(6, always) == [k(3), k(2), k(10), k(1), k(0)]
    lru = LRUPolicy()
    for i in range(4):
        lru.insert(k(i))
    lru.touch_many([k(0), k(1)])
    lru.insert(k(10))
    lru.touch(k(0))
    assert lru.victims(5, always) == [k(2), k(3), k(1), k(10), k(0)]  # LRU: the root before its blocks


def test_unknown_keys_are_ignored() -> None:
    p = SLRUPolicy(4)
    p.insert(k(1))
    p.touch(k(99))
    p.touch_many([k(98), k(1)])
    p.remove(k(97))
    assert len(p) == 1 and p.victims(4, always) == [k(1)]
    p.insert(k(1))  # inserting a resident key is a touch, not a second entry
    assert len(p) == 1


def test_it_moves_away_from_lru_when_reuse_pays() -> None:
    """A hot set used again and again, scanned through by keys seen once: the shadows see that a
    protected share keeps the hot set, and the policy adopts one (it starts as LRU)."""
    p = SLRUPolicy(64)
    assert p.share == 0.0
    rng = random.Random(3)
    keys = [k(rng.randrange(40)) if rng.random() < 0.4 else k(1000 + i) for i in range(20000)]
    hits = _run_keys(p, 64, keys)
    lru = _run_keys(LRUPolicy(), 64, keys)
    assert p.share > 0 and p.switches >= 1
    assert hits > 1.3 * lru


def _run_keys(p: EvictionPolicy, capacity: int, keys: list[bytes]) -> int:
    resident: set[bytes] = set()
    hits = 0
    for key in keys:
        if key in resident:
            hits += 1
            p.touch(key)
            continue
        if len(resident) == capacity:
            v = p.victims(1, always)[0]
            p.remove(v)
            resident.discard(v)
        p.insert(key)
        resident.add(key)
    return hits


# ---- in a slot pool ---------------------------------------------------------------------------------

_ops = st.lists(st.tuples(st.sampled_from(["alloc", "ready", "pin", "unpin", "free", "touch"]),
                          st.integers(0, 63), st.integers(1, 3)), max_size=80)


@pytest.mark.parametrize("shares", [(0.0,), (0.5,), (0.0, 0.5, 0.95)])
@given(ops=_ops)
@settings(max_examples=100, deadline=None)
def test_in_a_pool_only_ready_unpinned_slots_are_evicted(shares: tuple[float, ...],
                                                         ops: list[tuple[str, int, int]]) -> None:
    pool = SlotPool(0, 8, 6, policy="slru")
    pool.policy = SLRUPolicy(6, shares=shares, period=4)
    n = 0
    for op, a, m in ops:
        s = a % pool.num_slots
        if op == "alloc":
            keep = {key: sl for key, sl in pool.index.items()
                    if pool.state[sl] is not SlotState.READY or pool.pins[sl]}
            got = pool.allocate([k(n + j) for j in range(m)])
            n += m
            if got is not None:
                assert not set(got[1]) & set(keep)  # pinned and in-flight slots never go
                assert all(pool.index.get(key) == sl for key, sl in keep.items())
        elif op == "ready":
            pool.mark_ready([x for x in range(6) if pool.state[x] is SlotState.WRITING][:m])
        elif op == "pin" and pool.state[s] is not SlotState.FREE:
            pool.pin(s)
        elif op == "unpin":
            pool.unpin(s)
        elif op == "free":
            pool.free([s])
        elif op == "touch" and pool.slot_key[s] is not None:
            key = pool.slot_key[s]
            assert key is not None
            pool.touch(key)
        assert pool.problems() == []
        assert len(pool.policy) == sum(1 for x in pool.state if x is SlotState.READY)


# ---- against LRU on generated prefix traffic -------------------------------------------------------

def _replay(p: EvictionPolicy, capacity: int, requests: list[list[int]], tokens: int = 512) -> float:
    """Token hit rate of ``requests`` (chains of block ids, full blocks) through a pool driven the
    way a store drives it: the prefix found is touched, then runs of held blocks are touched and
    runs of new ones stored (evicting what the policy picks)."""
    resident: set[int] = set()
    hit = total = 0
    for ids in requests:
        n = 0
        while n < len(ids) and ids[n] in resident:
            n += 1
        hit += n * tokens
        total += len(ids) * tokens
        p.touch_many([k(i) for i in ids[:n]])
        for i in ids[n:]:
            if i in resident:
                p.touch(k(i))
                continue
            if len(resident) >= capacity:
                v = p.victims(1, always)[0]
                p.remove(v)
                resident.discard(int.from_bytes(v[:8], "big"))
            p.insert(k(i))
            resident.add(i)
    return hit / total


def conversations(n: int, seed: int) -> list[list[int]]:
    """Shared documents read again and again among one-off prompts: reuse that LRU loses to the
    one-offs in between, the structure of real traffic (docs/traffic.md)."""
    rng = random.Random(seed)
    docs = [[d * 100 + j for j in range(6)] for d in range(12)]
    out, fresh = [], 10**6
    for _ in range(n):
        if rng.random() < 0.35:
            out.append(docs[rng.randrange(len(docs))] + [fresh])
            fresh += 1
        else:
            out.append(list(range(fresh, fresh + 6)))
            fresh += 6
    return out


def recency_only(n: int, seed: int) -> list[list[int]]:
    """Each request continues one of the last few: recency is all there is to know."""
    rng = random.Random(seed)
    chains: list[list[int]] = []
    out, fresh = [], 0
    for _ in range(n):
        if chains and rng.random() < 0.8:
            c = chains[-1 - rng.randrange(min(3, len(chains)))]
            c = [*c, fresh, fresh + 1]
            fresh += 2
        else:
            c = list(range(fresh, fresh + 4))
            fresh += 4
        chains.append(c)
        out.append(c)
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_slru_beats_lru_where_reuse_hides_behind_one_offs(seed: int) -> None:
    reqs = conversations(6000, seed)
    lru = _replay(LRUPolicy(), 64, reqs)
    slru = _replay(SLRUPolicy(64), 64, reqs)
    assert slru > 1.3 * lru, (slru, lru)


@pytest.mark.parametrize("capacity", [16, 64, 256])
def test_slru_is_never_worse_where_recency_is_all(capacity: int) -> None:
    reqs = recency_only(4000, 2)
    lru = _replay(LRUPolicy(), capacity, reqs)
    slru = _replay(SLRUPolicy(capacity), capacity, reqs)
    assert slru >= lru * 0.999, (slru, lru)


def test_touch_many_is_touch_of_each_key_in_order() -> None:
    rng = random.Random(7)
    a, b = SLRUPolicy(64, rate=2, period=16), SLRUPolicy(64, rate=2, period=16)
    resident: list[bytes] = []
    for _ in range(400):
        new = [k(rng.randrange(300)) for _ in range(rng.randrange(1, 6))]
        for key in new:
            if key not in resident:
                for p in (a, b):
                    p.insert(key)
                resident.append(key)
        while len(resident) > 64:
            v = a.victim(lambda _: True)
            assert v == b.victim(lambda _: True)
            assert v is not None
            for p in (a, b):
                p.remove(v)
            resident.remove(v)
        used = rng.sample(resident, min(len(resident), rng.randrange(1, 12)))
        a.touch_many(used)
        for key in used:
            b.touch(key)
        assert a.victims(64, lambda _: True) == b.victims(64, lambda _: True)
        assert (a.share, a.switches) == (b.share, b.switches)

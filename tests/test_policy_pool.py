"""Eviction policies, slot pools (states, pins, eviction, batched copies) and pool sizing."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.blocks.policy import ARCPolicy, LRUPolicy, make_policy
from tierkv.blocks.pool import SlotPool, SlotState, plan_pools, shared_pool_tensors
from tierkv.errors import CapacityError, ConfigError, InvalidArgument
from tierkv.layout import GroupSpec, Layout
from tierkv.tensors import contiguous_run


def k(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\x00\x00\x00\x00"


# ---- policies ------------------------------------------------------------------------------------

def test_lru_order_and_touch() -> None:
    p = LRUPolicy()
    for i in range(4):
        p.insert(k(i))
    assert len(p) == 4
    assert p.victim(lambda _: True) == k(0)
    p.touch(k(0))
    assert p.victim(lambda _: True) == k(1)
    p.remove(k(1))
    assert len(p) == 3
    assert p.victim(lambda _: True) == k(2)
    p.touch(k(99))  # unknown key: ignored, not inserted
    assert len(p) == 3


def test_lru_victim_skips_refused() -> None:
    p = LRUPolicy()
    for i in range(4):
        p.insert(k(i))
    assert p.victim(lambda key: key not in (k(0), k(1))) == k(2)
    assert p.victim(lambda key: key == k(3)) == k(3)
    assert p.victim(lambda _: False) is None


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_victim_none_when_empty(name: str) -> None:
    assert make_policy(name, 4).victim(lambda _: True) is None


def test_arc_victim_skips_refused() -> None:
    p = ARCPolicy(4)
    for i in range(3):
        p.insert(k(i))
    p.touch(k(2))  # T1 = [0, 1], T2 = [2]
    assert p.victim(lambda _: True) == k(0)
    assert p.victim(lambda key: key != k(0)) == k(1)
    # nothing acceptable in T1: falls through to T2
    assert p.victim(lambda key: key == k(2)) == k(2)
    assert p.victim(lambda _: False) is None


def test_arc_scan_resistance_in_pool() -> None:
    """A key used twice survives a one-time scan that makes an LRU pool evict it."""

    def run(policy: str) -> bool:
        pool = SlotPool(0, 8, 4, policy=policy)
        hot = k(1000)
        slots, _ = pool.allocate([hot])  # type: ignore[misc]
        pool.mark_ready(slots)
        pool.touch(hot)  # second use
        for i in range(12):  # a scan: each key used once
            got = pool.allocate([k(i)])
            assert got is not None
            pool.mark_ready(got[0])
        return pool.is_ready(hot)

    assert run("lru") is False
    assert run("arc") is True


def test_arc_scan_resistance_policy() -> None:
    arc, lru = ARCPolicy(4), LRUPolicy()
    resident: dict[str, set[bytes]] = {"arc": set(), "lru": set()}
    for name, p in (("arc", arc), ("lru", lru)):
        hot = k(1000)
        p.insert(hot)
        p.touch(hot)
        resident[name].add(hot)
        for i in range(10):
            if len(resident[name]) == 4:
                v = p.victim(lambda _: True)
                assert v is not None
                p.remove(v)
                resident[name].discard(v)
            p.insert(k(i))
            resident[name].add(k(i))
    assert k(1000) in resident["arc"]
    assert k(1000) not in resident["lru"]


def test_arc_ghost_hit_adapts_target() -> None:
    # Without a ghost hit: a T1 key is the victim ahead of T2 keys.
    plain = ARCPolicy(2)
    plain.insert(k(0))
    plain.touch(k(0))
    plain.insert(k(1))
    plain.touch(k(1))
    plain.insert(k(2))
    assert plain.victim(lambda _: True) == k(2)

    # A key evicted from T1 that comes back (a B1 ghost hit) grows T1's target p, so a T2 key
    # is now evicted ahead of the single T1 key.
    p = ARCPolicy(2)
    p.insert(k(0))
    p.touch(k(0))      # T2 = [0]
    p.insert(k(1))     # T1 = [1]
    assert p.victim(lambda _: True) == k(1)
    p.remove(k(1))     # evicted: B1 = [1]
    assert p.p == 0
    p.insert(k(1))     # ghost hit -> T2, p grows
    assert p.p >= 1
    assert len(p) == 2
    p.insert(k(2))     # T1 = [2]
    assert p.victim(lambda _: True) == k(0)


def test_arc_b2_ghost_hit_shrinks_target() -> None:
    p = ARCPolicy(2)
    p.insert(k(0))
    p.remove(k(0))
    p.insert(k(0))  # B1 hit: p = 1
    assert p.p == 1
    p.remove(k(0))  # k0 was in T2 -> B2
    p.insert(k(0))  # B2 hit: p back down
    assert p.p == 0


def test_arc_ghost_lists_bounded() -> None:
    p = ARCPolicy(3)
    for i in range(50):
        p.insert(k(i))
        p.remove(k(i))
    assert len(p) == 0
    # only the last `capacity` ghosts are remembered: an old one coming back is a plain miss
    before = p.p
    p.insert(k(0))
    assert p.p == before
    p.insert(k(49))
    assert p.p > before


@pytest.mark.parametrize("name", ["LRU", "fifo", "", "arc "])
def test_make_policy_refuses_unknown(name: str) -> None:
    with pytest.raises(ConfigError) as info:
        make_policy(name, 4)
    assert repr(name) in str(info.value)


def test_make_policy_known() -> None:
    assert isinstance(make_policy("lru", 4), LRUPolicy)
    arc = make_policy("arc", 7)
    assert isinstance(arc, ARCPolicy) and arc.capacity == 7


# ---- slot pool: states, pins, eviction -----------------------------------------------------------

def fill(pool: SlotPool, keys: list[bytes]) -> list[int]:
    got = pool.allocate(keys)
    assert got is not None
    pool.mark_ready(got[0])
    return got[0]


def snapshot(pool: SlotPool) -> tuple:
    return (list(pool.state), list(pool.pins), list(pool.slot_key), dict(pool.index),
            pool.free_count, pool.available(), pool.evictions)


def test_pool_refuses_zero_slots() -> None:
    with pytest.raises(CapacityError):
        SlotPool(0, 8, 0)


def test_allocate_all_or_none() -> None:
    pool = SlotPool(0, 8, 4)
    fill(pool, [k(0), k(1)])
    s = pool.allocate([k(2)])
    assert s is not None  # WRITING
    pool.pin(pool.slot_of(k(0)))  # type: ignore[arg-type]
    before = snapshot(pool)
    # free 1 + evictable 1 (k1) = 2 < 3
    assert pool.allocate([k(10), k(11), k(12)]) is None
    assert snapshot(pool) == before
    assert pool.is_ready(k(0)) and pool.is_ready(k(1))
    assert pool.slot_of(k(10)) is None
    # exactly enough: 2
    got = pool.allocate([k(10), k(11)])
    assert got is not None
    slots, evicted = got
    assert evicted == [k(1)]
    assert len(set(slots)) == 2
    assert all(pool.state[x] is SlotState.WRITING for x in slots)
    assert pool.slot_of(k(1)) is None and not pool.is_ready(k(1))
    assert pool.evictions == 1


def test_allocate_prefers_free_slots() -> None:
    pool = SlotPool(0, 8, 4)
    fill(pool, [k(0)])
    got = pool.allocate([k(1), k(2), k(3)])
    assert got is not None and got[1] == []
    assert pool.is_ready(k(0))


def test_eviction_follows_lru() -> None:
    pool = SlotPool(0, 8, 3, policy="lru")
    fill(pool, [k(0), k(1), k(2)])
    pool.touch(k(0))
    assert pool.allocate([k(3)])[1] == [k(1)]  # type: ignore[index]
    assert pool.allocate([k(4)])[1] == [k(2)]  # type: ignore[index]
    # k3 is still WRITING, so k0 is the only candidate
    assert pool.allocate([k(5)])[1] == [k(0)]  # type: ignore[index]
    assert pool.allocate([k(6)]) is None


def test_eviction_order_multi() -> None:
    pool = SlotPool(0, 8, 4)
    fill(pool, [k(0), k(1), k(2), k(3)])
    pool.touch(k(1))
    pool.touch(k(0))
    got = pool.allocate([k(10), k(11), k(12)])
    assert got is not None
    assert got[1] == [k(2), k(3), k(1)]
    assert pool.is_ready(k(0))


def test_pinned_and_writing_never_evicted() -> None:
    pool = SlotPool(0, 8, 3)
    a = fill(pool, [k(0)])[0]
    pool.pin(a)
    wb = pool.allocate([k(1)])
    assert wb is not None
    fill(pool, [k(2)])
    assert not pool.evictable(k(0)) and not pool.evictable(k(1)) and pool.evictable(k(2))
    assert pool.available() == 1
    got = pool.allocate([k(3)])
    assert got is not None and got[1] == [k(2)]
    before = snapshot(pool)
    assert pool.allocate([k(4)]) is None
    assert snapshot(pool) == before
    assert pool.is_ready(k(0))
    assert pool.slot_of(k(1)) == wb[0][0]
    # two pins need two unpins
    pool.pin(a)
    pool.unpin(a)
    assert pool.allocate([k(4)]) is None
    pool.unpin(a)
    got = pool.allocate([k(4)])
    assert got is not None and got[1] == [k(0)]


def test_writing_is_invisible_until_ready() -> None:
    pool = SlotPool(0, 8, 2)
    got = pool.allocate([k(0)])
    assert got is not None
    assert pool.slot_of(k(0)) == got[0][0]
    assert not pool.is_ready(k(0))
    assert not pool.evictable(k(0))
    pool.mark_ready(got[0])
    assert pool.is_ready(k(0))


def test_free_makes_keys_invisible() -> None:
    pool = SlotPool(0, 8, 3)
    slots = fill(pool, [k(0), k(1)])
    w = pool.allocate([k(2)])
    assert w is not None
    assert pool.available() == 2
    pool.free([slots[0], w[0][0]])
    # a slot being written is its writer's to end: free leaves it, abandon with its token frees it
    assert pool.slot_of(k(2)) == w[0][0] and pool.free_count == 1
    assert pool.abandon(w[0], [t + 1 for t in pool.tokens(w[0])]) == [False]
    assert pool.abandon(w[0], pool.tokens(w[0])) == [True]
    for key in (k(0), k(2)):
        assert pool.slot_of(key) is None
        assert not pool.is_ready(key)
        assert not pool.evictable(key)
    assert pool.is_ready(k(1))
    assert pool.free_count == 2
    assert pool.available() == 3
    pool.free([slots[0]])  # freeing a free slot is harmless
    assert pool.free_count == 2
    # the freed key is not offered as a victim any more
    got = pool.allocate([k(5), k(6), k(7)])
    assert got is not None and got[1] == [k(1)]


def test_counts() -> None:
    pool = SlotPool(0, 8, 5)
    s = fill(pool, [k(0), k(1)])
    pool.allocate([k(2)])
    pool.pin(s[1])
    assert pool.counts() == {"free": 2, "writing": 1, "ready": 2, "pinned": 1, "evictable": 1}


def _brute_available(pool: SlotPool) -> int:
    return sum(
        1 for s in range(pool.num_slots)
        if pool.state[s] is SlotState.FREE or (pool.state[s] is SlotState.READY and pool.pins[s] == 0)
    )


_ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "ready", "pin", "unpin", "free", "touch"]),
              st.integers(0, 7), st.integers(1, 3)),
    max_size=60,
)


@pytest.mark.parametrize("policy", ["lru", "arc"])
@given(ops=_ops)
@settings(max_examples=150, deadline=None)
def test_available_matches_brute_force(policy: str, ops: list[tuple[str, int, int]]) -> None:
    pool = SlotPool(0, 8, 6, policy=policy)
    next_key = 0
    for op, a, n in ops:
        s = a % pool.num_slots
        if op == "alloc":
            keys = [k(next_key + j) for j in range(n)]
            next_key += n
            before = snapshot(pool)
            can = pool.available()
            got = pool.allocate(keys)
            if got is None:
                assert can < n
                assert snapshot(pool) == before
            else:
                assert can >= n
                slots, evicted = got
                assert len(slots) == n == len(set(slots))
                for key in evicted:
                    assert pool.slot_of(key) is None
                for key, sl in zip(keys, slots, strict=True):
                    assert pool.slot_of(key) == sl and pool.state[sl] is SlotState.WRITING
        elif op == "ready":
            pool.mark_ready([x for x in range(pool.num_slots) if pool.state[x] is SlotState.WRITING][:n])
        elif op == "pin":
            if pool.state[s] is not SlotState.FREE:
                pool.pin(s)
        elif op == "unpin":
            pool.unpin(s)
        elif op == "free":
            pool.free([s])
        elif op == "touch":
            key = pool.slot_key[s]
            if key is not None:
                pool.touch(key)
        assert pool.available() == _brute_available(pool)
        assert pool.free_count == sum(1 for x in pool.state if x is SlotState.FREE)
        assert all(pool.index[key] == sl for sl, key in enumerate(pool.slot_key) if key is not None)
        assert len(pool.index) == pool.num_slots - pool.free_count
        # the policy tracks exactly the READY keys
        assert len(pool.policy) == sum(1 for x in pool.state if x is SlotState.READY)


# ---- slot pool: batched copies -------------------------------------------------------------------

def _rand_rows(n: int, block_bytes: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, block_bytes), dtype=torch.uint8, generator=g)
    return raw.view(dtype) if dtype != torch.uint8 else raw


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("block_bytes", [8, 12, 4096])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("slots", [[1, 2, 3], [5, 0, 3], [4], [6, 2, 4, 0]])
def test_write_read_round_trip(block_bytes: int, dtype: torch.dtype, slots: list[int]) -> None:
    pool = SlotPool(0, block_bytes, 8)
    pool.tensor.zero_()
    src = _rand_rows(len(slots), block_bytes, dtype, seed=block_bytes + len(slots))
    assert src.shape[1] * src.element_size() == block_bytes
    pool.write(slots, src)
    # every row landed in its own slot, nothing else changed
    for i, s in enumerate(slots):
        assert torch.equal(pool.row(s), _bytes(src[i]))
    for s in set(range(8)) - set(slots):
        assert int(pool.row(s).count_nonzero()) == 0
    out = torch.empty_like(src)
    pool.read(slots, out)
    assert torch.equal(_bytes(out), _bytes(src))
    # reading in another order and into another dtype gives the matching rows
    rev = list(reversed(slots))
    out8 = torch.empty((len(rev), block_bytes), dtype=torch.uint8)
    pool.read(rev, out8)
    assert torch.equal(out8, _bytes(src).flip(0))


def test_write_read_empty() -> None:
    pool = SlotPool(0, 12, 2)
    pool.write([], torch.empty((0, 12), dtype=torch.uint8))
    pool.read([], torch.empty((0, 3), dtype=torch.float32))


@pytest.mark.parametrize("bad", [
    torch.empty((2, 8), dtype=torch.uint8),        # 8 bytes per row, pool has 12
    torch.empty((3, 12), dtype=torch.uint8),       # 3 rows for 2 slots
    torch.empty((1, 12), dtype=torch.uint8),       # 1 row for 2 slots
    torch.empty((24,), dtype=torch.uint8),         # 1-D
    torch.empty((2, 1, 12), dtype=torch.uint8),    # 3-D
    torch.empty((2, 12), dtype=torch.float32),     # 48 bytes per row
    torch.empty((2, 6), dtype=torch.float32),      # 24 bytes per row
    torch.empty((12, 2), dtype=torch.uint8).t(),   # right shape, not contiguous
    torch.tensor(5, dtype=torch.uint8),            # 0-D
])
def test_write_read_refuse_wrong_shapes(bad: torch.Tensor) -> None:
    pool = SlotPool(0, 12, 4)
    pool.tensor.fill_(7)
    with pytest.raises(InvalidArgument):
        pool.write([0, 2], bad)
    with pytest.raises(InvalidArgument):
        pool.read([0, 2], bad)
    assert bool((pool.tensor == 7).all())


def test_write_refuses_non_tensor() -> None:
    pool = SlotPool(0, 4, 2)
    with pytest.raises(InvalidArgument):
        pool.write([0], b"abcd")  # type: ignore[arg-type]


def test_contiguous_run() -> None:
    assert contiguous_run([3, 4, 5]) == (3, 6)
    assert contiguous_run([0]) == (0, 1)
    assert contiguous_run([]) is None
    assert contiguous_run([5, 4, 3]) is None
    assert contiguous_run([0, 2, 1]) is None
    assert contiguous_run([0, 2, 2]) is None
    assert contiguous_run([1, 1]) is None


# ---- pool sizing ---------------------------------------------------------------------------------

def hybrid(spr: int = 2) -> Layout:
    return Layout(tokens_per_block=16, groups=[
        GroupSpec(kind="full", block_bytes=1000),
        GroupSpec(kind="scratch", block_bytes=10),
        GroupSpec(kind="sliding_window", block_bytes=2000, window_blocks=4),
        GroupSpec(kind="recurrent", block_bytes=5000, states_per_request=spr),
    ])


def test_plan_recurrent_floor_and_equal_shares() -> None:
    # floor: recurrent 3 x 2 = 6 slots (30000 B) + one block each for full and sliding (3000 B)
    cap = 30000 + 3000 + 10 * 3000 + 2999
    plan = plan_pools(cap, hybrid(), max_concurrent_requests=3)
    assert plan.slots() == {0: 11, 2: 11, 3: 6}
    assert 1 not in plan.slots()
    assert [g.group for g in plan.groups] == [0, 2, 3]
    assert plan.total_bytes <= cap
    assert plan.total_bytes == 11 * 1000 + 11 * 2000 + 6 * 5000
    by = {g.group: g for g in plan.groups}
    assert by[3].floor == 6
    assert by[3].bytes == 30000
    assert by[0].kind == "full" and by[2].kind == "sliding_window"
    assert "max_concurrent_requests" in by[3].reason


def test_plan_exact_floor() -> None:
    plan = plan_pools(33000, hybrid(), max_concurrent_requests=3)
    assert plan.slots() == {0: 1, 2: 1, 3: 6}
    assert plan.total_bytes == 33000


def test_plan_below_floor_raises() -> None:
    with pytest.raises(CapacityError) as info:
        plan_pools(32999, hybrid(), max_concurrent_requests=3)
    msg = str(info.value)
    assert isinstance(info.value, ConfigError)
    assert "floor" in msg
    assert "33000" in msg
    assert "group 3" in msg


def test_plan_override_below_floor_is_honoured() -> None:
    plan = plan_pools(100_000, hybrid(), max_concurrent_requests=3, slots={3: 2})
    by = {g.group: g for g in plan.groups}
    assert by[3].slots == 2
    assert by[3].floor == 6
    assert "below the floor" in by[3].reason
    assert plan.total_bytes <= 100_000
    assert by[0].slots == by[2].slots
    # an override at or above the floor is not called "below the floor"
    plan2 = plan_pools(100_000, hybrid(), max_concurrent_requests=3, slots={3: 6})
    assert "below the floor" not in {g.group: g for g in plan2.groups}[3].reason


def test_plan_all_overrides_without_capacity() -> None:
    plan = plan_pools(None, hybrid(), max_concurrent_requests=3, slots={0: 4, 2: 5, 3: 1})
    assert plan.slots() == {0: 4, 2: 5, 3: 1}
    with pytest.raises(CapacityError):
        plan_pools(None, hybrid(), max_concurrent_requests=3, slots={0: 4})


@pytest.mark.parametrize("cap", [0, -1])
def test_plan_refuses_capacity(cap: int) -> None:
    with pytest.raises(CapacityError, match="capacity_bytes"):
        plan_pools(cap, hybrid(), max_concurrent_requests=3)


@pytest.mark.parametrize("slots", [{1: 4}, {7: 4}, {0: 0}])
def test_plan_refuses_bad_overrides(slots: dict[int, int]) -> None:
    with pytest.raises(CapacityError):
        plan_pools(10**9, hybrid(), max_concurrent_requests=3, slots=slots)


def test_plan_overrides_above_capacity() -> None:
    with pytest.raises(CapacityError):
        plan_pools(10_000, hybrid(), max_concurrent_requests=3, slots={0: 11})


def test_plan_refuses_bad_concurrency() -> None:
    with pytest.raises(CapacityError):
        plan_pools(10**9, hybrid(), max_concurrent_requests=0)


def test_plan_recurrent_only() -> None:
    lay = Layout(tokens_per_block=16, groups=[
        GroupSpec(kind="recurrent", block_bytes=100, states_per_request=1),
        GroupSpec(kind="recurrent", block_bytes=300, states_per_request=2),
    ])
    plan = plan_pools(10_000, lay, max_concurrent_requests=4)
    s = plan.slots()
    assert s[0] >= 4 and s[1] >= 8
    assert s[0] - 4 == s[1] - 8  # the rest, equally in slots
    assert plan.total_bytes <= 10_000
    assert 10_000 - plan.total_bytes < 400


_kinds = st.sampled_from(["full", "sliding_window", "recurrent", "scratch"])


@st.composite
def _layouts(draw: st.DrawFn) -> Layout:
    n = draw(st.integers(1, 5))
    groups = []
    for _ in range(n):
        kind = draw(_kinds)
        bb = draw(st.integers(1, 5000))
        if kind == "sliding_window":
            groups.append(GroupSpec(kind=kind, block_bytes=bb, window_blocks=draw(st.integers(1, 8))))
        elif kind == "recurrent":
            groups.append(GroupSpec(kind=kind, block_bytes=bb,
                                    states_per_request=draw(st.integers(1, 3))))
        else:
            groups.append(GroupSpec(kind=kind, block_bytes=bb))
    if not any(g.cacheable for g in groups):
        groups.append(GroupSpec(kind="full", block_bytes=draw(st.integers(1, 5000))))
    return Layout(tokens_per_block=16, groups=groups)


@given(layout=_layouts(), cap=st.integers(1, 2_000_000), mcr=st.integers(1, 16))
@settings(max_examples=200, deadline=None)
def test_plan_properties(layout: Layout, cap: int, mcr: int) -> None:
    floor = {
        g: (mcr * layout.groups[g].states_per_request if layout.groups[g].kind == "recurrent" else 1)
        for g in layout.cacheable_groups
    }
    floor_bytes = sum(floor[g] * layout.groups[g].block_bytes for g in floor)
    if cap < floor_bytes:
        with pytest.raises(CapacityError, match="floor"):
            plan_pools(cap, layout, mcr)
        return
    plan = plan_pools(cap, layout, mcr)
    s = plan.slots()
    assert sorted(s) == list(layout.cacheable_groups)
    assert plan.total_bytes <= cap
    for g, n in s.items():
        assert n >= floor[g]
    growers = [g for g in s if layout.groups[g].kind != "recurrent"]
    if growers:
        assert len({s[g] for g in growers}) == 1
        for g in s:
            if layout.groups[g].kind == "recurrent":
                assert s[g] == floor[g]
    else:
        growers = list(s)
        assert len({s[g] - floor[g] for g in growers}) == 1
    # no whole row of the growers is left unused
    assert cap - plan.total_bytes < sum(layout.groups[g].block_bytes for g in growers)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs a tmpfs at /dev/shm (Linux)")
def test_a_shared_pool_has_its_pages_in_place_and_a_second_mapping_keeps_the_bytes() -> None:
    """A shared pool (``shm_path``, how the vLLM adapter shares its pool with the workers) is
    populated when it is mapped: a restore into never-touched shared pages took a page fault every
    4 KiB (0.44 GB/s against 4.9 into mapped pages). Mapping it again (a worker) keeps its bytes."""
    layout = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=64 << 10),
                                                 GroupSpec(kind="full", block_bytes=4000)])
    plan = plan_pools(None, layout, 1, {0: 32, 1: 8})
    path = f"/dev/shm/tierkv-test-{os.getpid()}.pool"
    try:
        pools = shared_pool_tensors(path, plan)
        size = 32 * (64 << 10) + 8 * 4096  # each group's bytes rounded up to 4 KiB
        assert os.stat(path).st_size == size
        assert os.stat(path).st_blocks * 512 >= size, "the pool's pages are not allocated yet"
        pools[0][5].fill_(7)
        pools[1][7].fill_(9)
        again = shared_pool_tensors(path, plan)
        assert bool((again[0][5] == 7).all()) and bool((again[1][7] == 9).all())
        assert int(again[0].sum()) == 7 * (64 << 10) and int(again[1].sum()) == 9 * 4000
    finally:
        os.unlink(path)

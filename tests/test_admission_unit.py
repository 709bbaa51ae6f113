"""Admission as pure state: no event loop, no tiers; pools, requests, pins and the FIFO queue."""

from __future__ import annotations

import pytest

from tierkv.blocks.admission import Admission, Promotion
from tierkv.blocks.ledger import BlockLedger
from tierkv.blocks.pool import SlotPool
from tierkv.errors import InvalidArgument

FULL, REC = 0, 3
TIER = 0  # position of the (only) lower tier


def key(n: int, group: int = FULL) -> bytes:
    return n.to_bytes(8, "big") + group.to_bytes(4, "big")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def setup(full: int = 8, rec: int = 2, mode: str = "queue") -> tuple[Admission, dict[int, SlotPool], Clock]:
    pools = {FULL: SlotPool(FULL, 16, full), REC: SlotPool(REC, 32, rec)}
    clock = Clock()
    admission = Admission(pools, mode, clock=clock)  # type: ignore[arg-type]
    BlockLedger(pools, admission, lambda ev: ev.set())  # the writer of the pools' slots
    return admission, pools, clock


def land(pools: dict[int, SlotPool], promos: list[Promotion]) -> None:
    """What the store does when promotions succeed: their slots become READY."""
    for p in promos:
        pools[p.group].mark_ready(p.slots)
        p.landed([True] * len(p.keys))


def wants(group: int, *ns: int) -> dict[int, list[tuple[bytes, int]]]:
    return {group: [(key(n, group), TIER) for n in ns]}


def problems(pools: dict[int, SlotPool]) -> list[str]:
    return [p for pool in pools.values() for p in pool.problems()]


def test_admit_reserves_and_pins_every_slot_at_once() -> None:
    adm, pools, _ = setup()
    req = adm.request("a")
    assert req is not None
    promos = adm.admit(req, {**wants(FULL, 1, 2, 3), **wants(REC, 3)})
    assert promos is not None
    assert sorted((p.group, len(p.keys)) for p in promos) == [(FULL, 3), (REC, 1)]
    assert all(p.request is req for p in promos)
    assert req.waiting == 4
    assert len(req.pins) == 4 and pools[FULL].counts()["writing"] == 3
    assert all(pools[g].pins[s] == 1 for p in promos for g, s in ((p.group, s) for s in p.slots))
    assert not problems(pools)


def test_a_request_that_cannot_have_all_its_slots_waits_holding_none() -> None:
    adm, pools, _ = setup(rec=1)
    a, b = adm.request("a"), adm.request("b")
    assert a is not None and b is not None
    pa = adm.admit(a, {**wants(FULL, 1), **wants(REC, 1)})
    assert pa is not None
    land(pools, pa)
    # b holds a resident full block, then needs the only recurrent slot, which a pins
    s = pools[FULL].allocate([key(9)])
    assert s is not None
    pools[FULL].mark_ready(s[0])
    adm.pin(b, FULL, key(9), s[0][0])
    assert adm.admit(b, {**wants(FULL, 2), **wants(REC, 2)}) is None
    assert list(adm.queue) == ["b"]
    assert b.pins == {} and pools[FULL].pins[s[0][0]] == 0, "a queued request gives its pins back"
    assert b.wants == {FULL: [key(2), key(9)], REC: [key(2, REC)]}, "and keeps what they held as wants"
    assert not problems(pools)


def test_the_queue_is_first_come_first_served_and_serviced_when_slots_free() -> None:
    adm, pools, _ = setup(rec=1)
    a, b, c = (adm.request(r) for r in "abc")
    assert a is not None and b is not None and c is not None
    pa = adm.admit(a, wants(REC, 1))
    assert pa is not None
    land(pools, pa)
    assert adm.admit(b, wants(REC, 2)) is None
    assert adm.admit(c, wants(REC, 3)) is None
    assert list(adm.queue) == ["b", "c"]
    # c asks again while b waits ahead of it: still queued, never served first
    assert adm.admit(c, wants(REC, 3)) is None
    present = {key(2, REC): TIER, key(3, REC): TIER}
    assert adm.service(lambda g, k: present.get(k)) == [], "a pins the only slot"
    adm.release("a")
    started = adm.service(lambda g, k: present.get(k))
    assert [(p.keys, p.request) for p in started] == [([key(2, REC)], b)]
    assert list(adm.queue) == ["c"]
    assert not problems(pools)


def test_service_counts_the_blocks_it_pins_as_taken() -> None:
    """Regression: a queued request wanting a resident block plus a promotion was admitted when the
    only evictable slot was that very block, and the promotion then found no slot."""
    adm, pools, _ = setup(full=2)
    got = pools[FULL].allocate([key(1), key(9)])
    assert got is not None
    pools[FULL].mark_ready(got[0])
    other = adm.request("other")
    assert other is not None
    adm.pin(other, FULL, key(9), got[0][1])  # key(9) stays pinned; key(1) is the only evictable slot
    a = adm.request("a")
    assert a is not None
    adm.queue["a"] = None
    a.wants = {FULL: [key(1), key(2)]}  # key(1) resident, key(2) on the lower tier
    assert pools[FULL].available() == 1
    assert adm.service(lambda g, k: TIER) == [], "pinning key(1) leaves no slot for key(2)"
    assert list(adm.queue) == ["a"] and a.pins == {}
    adm.release("other")
    started = adm.service(lambda g, k: TIER)
    assert [p.keys for p in started] == [[key(2)]] and key(1) in a.pins
    assert not problems(pools)


def test_release_drops_every_pin_and_the_queue_place() -> None:
    adm, pools, _ = setup()
    a = adm.request("a")
    assert a is not None
    promos = adm.admit(a, wants(FULL, 1, 2))
    assert promos is not None
    land(pools, promos)
    assert sum(pools[FULL].pins) == 2
    assert adm.release("a") is True
    assert sum(pools[FULL].pins) == 0 and "a" not in adm.requests
    assert adm.release("a") is False
    assert pools[FULL].available() == 8


def test_release_in_two_groups_keeps_other_requests_pins_and_refreshes_recency() -> None:
    adm, pools, _ = setup(full=4, rec=2)
    a, b = adm.request("a"), adm.request("b")
    assert a is not None and b is not None
    pa = adm.admit(a, {**wants(FULL, 1, 2, 3), **wants(REC, 1)})
    assert pa is not None
    land(pools, pa)
    pb = adm.admit(b, wants(FULL, 4))
    assert pb is not None
    land(pools, pb)
    two = pools[FULL].slot_of(key(2))
    assert two is not None
    adm.pin(b, FULL, key(2), two)  # b needs block 2 too
    assert adm.release("b") is True
    assert pools[FULL].pins[two] == 1 and pools[FULL].available() == 1  # a's pins stay
    assert adm.release("a") is True
    assert sum(pools[REC].pins) == 0 and sum(pools[FULL].pins) == 0
    assert pools[FULL].available() == 4 and pools[REC].available() == 2
    # releases count as uses: b's block 4, then a's blocks in the order a pinned them
    assert pools[FULL].policy.victims(4, lambda k: True) == [key(4), key(1), key(2), key(3)]
    assert not problems(pools)


def test_abandon_frees_a_failed_promotion_and_every_pin_on_it() -> None:
    adm, pools, _ = setup()
    a, b = adm.request("a"), adm.request("b")
    assert a is not None and b is not None
    promos = adm.admit(a, wants(FULL, 1))
    assert promos is not None
    slot, token = promos[0].slots[0], promos[0].tokens[0]
    adm.pin(b, FULL, key(1), slot)  # b looked the block up while it was in flight
    assert adm.abandon(FULL, key(1), slot, token)
    assert key(1) not in a.pins and key(1) not in b.pins
    assert pools[FULL].slot_of(key(1)) is None and pools[FULL].pins[slot] == 0
    promos[0].landed([False])
    assert a.memo.stale and a.waiting == 0
    assert not problems(pools)


def test_an_old_promotion_cannot_end_a_newer_one_of_the_same_key() -> None:
    """Regression (#46): a promotion whose block landed, was evicted and is promoted again by a
    newer promotion, failed what was left of its own work with the key: it freed the newer
    promotion's slot while that read was in flight, the slot went to another key and the late
    read landed in it (``get`` returned another key's block)."""
    adm, pools, _ = setup()
    a, b = adm.request("a"), adm.request("b")
    assert a is not None and b is not None
    old = adm.admit(a, wants(FULL, 1))
    assert old is not None
    s_old, t_old = old[0].slots[0], old[0].tokens[0]
    assert pools[FULL].land([s_old], [t_old]) == [True]
    adm.release("a")
    pools[FULL].free([s_old])  # evicted
    new = adm.admit(b, wants(FULL, 1))
    assert new is not None
    s_new, t_new = new[0].slots[0], new[0].tokens[0]
    # the old promotion's token names its own allocation, not the new one, even where the slot is
    # the same one: it can neither free nor land the new promotion's slot
    assert not adm.abandon(FULL, key(1), s_old, t_old)
    assert pools[FULL].slot_of(key(1)) == s_new and key(1) in b.pins
    pools[FULL].free([s_new])  # nobody but the writer ends a WRITING slot
    assert pools[FULL].slot_of(key(1)) == s_new
    assert pools[FULL].land([s_old], [t_old]) == [False]
    assert problems(pools), "a refused landing is reported"
    assert pools[FULL].land([s_new], [t_new]) == [True]


def test_anonymous_calls_never_collide_with_a_request_named_empty() -> None:
    """Regression: ``request_id=""`` was the id anonymous lookups used: releasing it dropped theirs."""
    adm, pools, _ = setup()
    named = adm.request("")
    assert named is not None and named.named
    anon = adm.anonymous()
    assert not anon.named and anon is not named
    got = pools[FULL].allocate([key(1)])
    assert got is not None
    pools[FULL].mark_ready(got[0])
    adm.pin(named, FULL, key(1), got[0][0])
    adm.pin(anon, FULL, key(1), got[0][0])
    assert pools[FULL].pins[got[0][0]] == 2
    adm.end_call(anon)
    assert pools[FULL].pins[got[0][0]] == 1, "the anonymous call drops only its own pin"
    adm.release("")
    assert pools[FULL].pins[got[0][0]] == 0


def test_leases_expire_by_the_clock() -> None:
    adm, _, clock = setup()
    adm.request("old")
    clock.now += 10
    adm.request("new")
    assert adm.expired(5.0) == ["old"]
    clock.now += 10
    assert sorted(adm.expired(5.0)) == ["new", "old"]


def test_request_ids_must_be_strings() -> None:
    adm, _, _ = setup()
    with pytest.raises(InvalidArgument):
        adm.request(b"bytes")  # type: ignore[arg-type]


def test_naive_mode_refuses_instead_of_queueing() -> None:
    adm, pools, _ = setup(rec=1, mode="naive")
    a, b = adm.request("a"), adm.request("b")
    assert a is not None and b is not None
    pa = adm.admit(a, wants(REC, 1))
    assert pa is not None
    land(pools, pa)
    assert adm.admit(b, wants(REC, 2)) is None
    assert not adm.queue, "naive admission never queues: the caller answers MISS"


def test_pin_many_pins_each_key_once_per_request() -> None:
    adm, pools, _ = setup()
    got = pools[FULL].allocate([key(i) for i in range(4)])
    assert got is not None
    pools[FULL].mark_ready(got[0])
    req = adm.request("r")
    assert req is not None
    keys = [key(i) for i in range(4)]
    adm.pin_many(req, FULL, keys, got[0])
    adm.pin_many(req, FULL, keys, got[0])
    assert pools[FULL].pins[:4] == [1, 1, 1, 1]
    assert pools[FULL].available() == 4
    assert not problems(pools)

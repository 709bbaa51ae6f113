"""One conformance suite every tier backend's test class subclasses.

Subclasses set ``kind`` and override :meth:`TierTests.tier_config` and the oracle hooks
:meth:`TierTests.oracle_set` / :meth:`TierTests.oracle_get`, which reach the backend's storage
without going through the tier (a dict, a pool tensor, a file). Tests for capabilities a backend
does not declare are skipped; every other test runs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, ClassVar

import pytest
import torch

from tierkv.backends.base import Tier, TierContext
from tierkv.backends.registry import get_backend
from tierkv.keys import make_key
from tierkv.layout import GroupSpec, Layout

__all__ = ["TierTests", "conformance_layout"]

FULL, SCRATCH, RECURRENT = 0, 1, 2


def conformance_layout() -> Layout:
    """A small hybrid layout: full (4 KiB), scratch (512 B), recurrent (8 KiB) at 0, 1, 2."""
    return Layout(tokens_per_block=16, groups=[
        GroupSpec(kind="full", block_bytes=4096),
        GroupSpec(kind="scratch", block_bytes=512),
        GroupSpec(kind="recurrent", block_bytes=8192, states_per_request=2),
    ])


def _blocks(n: int, nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=g)


def _hashes(n: int, salt: int = 0) -> list[bytes]:
    return [salt.to_bytes(4, "big") + i.to_bytes(28, "big") for i in range(n)]


class TierTests:
    """The conformance suite. ``kind`` names the backend; hooks give the oracle."""

    kind: ClassVar[str]
    namespace: ClassVar[str] = "conformance"
    #: the backend reports every row it verified to ``get``'s ``landed`` (a hint others may skip)
    reports_rows: ClassVar[bool] = False

    @pytest.fixture
    def anyio_backend(self) -> str:
        return "asyncio"

    # ---- hooks a subclass provides ----------------------------------------------------------------
    def tier_config(self) -> dict[str, Any]:
        """The config dict of the tier under test (``kind`` included)."""
        return {"kind": self.kind}

    async def oracle_set(self, tier: Tier, group: int, key: bytes, data: bytes) -> None:
        """Place ``data`` under ``key`` bypassing the tier's own API."""
        raise NotImplementedError

    async def oracle_get(self, tier: Tier, group: int, key: bytes) -> bytes | None:
        """Read what the backend holds under ``key`` bypassing the tier's own API."""
        raise NotImplementedError

    # ---- helpers ----------------------------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        return conformance_layout()

    def context(self) -> TierContext:
        layout = self.layout
        return TierContext(layout=layout, namespace=self.namespace,
                           fingerprint=layout.fingerprint(self.namespace), max_concurrent_requests=4)

    def make(self, **overrides: Any) -> Tier:
        cfg = {**self.tier_config(), **overrides}
        cls = get_backend(cfg["kind"])
        return cls(cls.config_model.model_validate(cfg), self.context())

    @pytest.fixture
    async def tier(self) -> AsyncIterator[Tier]:
        t = self.make()
        await t.open()
        try:
            yield t
        finally:
            await t.close()

    def bb(self, group: int) -> int:
        return self.layout.groups[group].block_bytes

    def skip_unless(self, tier: Tier, capability: str) -> None:
        if not getattr(tier.capabilities, capability):
            pytest.skip(f"{self.kind} does not declare {capability}")

    # ---- the suite --------------------------------------------------------------------------------
    @pytest.mark.anyio
    async def test_put_get_round_trip(self, tier: Tier) -> None:
        for group in (FULL, RECURRENT):
            keys = [make_key(h, group) for h in _hashes(5)]
            data = _blocks(5, self.bb(group), seed=group)
            assert await tier.put(group, keys, data) == [True] * 5
            out = torch.zeros_like(data)
            assert await tier.get(group, keys, out) == [True] * 5
            assert torch.equal(out, data)

    @pytest.mark.anyio
    async def test_put_is_visible_to_the_oracle(self, tier: Tier) -> None:
        keys = [make_key(h, FULL) for h in _hashes(3)]
        data = _blocks(3, self.bb(FULL), seed=7)
        await tier.put(FULL, keys, data)
        for i, k in enumerate(keys):
            assert await self.oracle_get(tier, FULL, k) == data[i].numpy().tobytes()

    @pytest.mark.anyio
    async def test_oracle_writes_are_served(self, tier: Tier) -> None:
        key = make_key(b"\x42" * 32, RECURRENT)
        payload = _blocks(1, self.bb(RECURRENT), seed=3)[0].numpy().tobytes()
        await self.oracle_set(tier, RECURRENT, key, payload)
        out = torch.zeros((1, self.bb(RECURRENT)), dtype=torch.uint8)
        assert await tier.get(RECURRENT, [key], out) == [True]
        assert out[0].numpy().tobytes() == payload

    @pytest.mark.anyio
    async def test_missing_keys_are_false_not_errors(self, tier: Tier) -> None:
        keys = [make_key(h, FULL) for h in _hashes(4, salt=9)]
        out = torch.full((4, self.bb(FULL)), 7, dtype=torch.uint8)
        assert await tier.get(FULL, keys, out) == [False] * 4
        assert await tier.contains(FULL, keys) == [False] * 4

    @pytest.mark.anyio
    async def test_mixed_batch(self, tier: Tier) -> None:
        keys = [make_key(h, FULL) for h in _hashes(6, salt=2)]
        data = _blocks(6, self.bb(FULL), seed=11)
        await tier.put(FULL, keys[::2], data[::2].contiguous())
        out = torch.zeros_like(data)
        seen: list[tuple[int, bytes]] = []

        def landed(i: int) -> None:  # what the row holds when the tier says it is verified
            seen.append((i, out[i].numpy().tobytes()))

        found = await tier.get(FULL, keys, out, landed)
        assert found == [True, False] * 3
        assert torch.equal(out[::2], data[::2])
        assert await tier.contains(FULL, keys) == [True, False] * 3
        assert len({i for i, _ in seen}) == len(seen)  # once per row at most
        assert all(found[i] and row == data[i].numpy().tobytes() for i, row in seen)
        if self.reports_rows:
            assert sorted(i for i, _ in seen) == [0, 2, 4]

    @pytest.mark.anyio
    async def test_scattered_rows(self, tier: Tier) -> None:
        self.skip_unless(tier, "scattered_rows")
        bb = self.bb(FULL)
        keys = [make_key(h, FULL) for h in _hashes(5, salt=6)]
        data = _blocks(5, bb, seed=13)
        src = torch.zeros((12, bb), dtype=torch.uint8)
        at = [7, 2, 9, 4, 0]
        src[at] = data
        assert await tier.put_rows(FULL, keys[:4], src, at[:4]) == [True] * 4  # the last never stored
        dest = torch.full((12, bb), 0xA5, dtype=torch.uint8)
        to = [3, 11, 0, 6, 8]
        seen: list[int] = []
        found = await tier.get_rows(FULL, keys, dest, to, seen.append)
        assert found == [True] * 4 + [False]
        for i in range(4):
            assert torch.equal(dest[to[i]], data[i])
        others = [r for r in range(12) if r not in to]
        assert bool((dest[others] == 0xA5).all()), "rows no key was read into are left alone"
        assert len(set(seen)) == len(seen) and set(seen) <= {0, 1, 2, 3}
        if self.reports_rows:
            assert sorted(seen) == [0, 1, 2, 3]
        again = torch.zeros((4, bb), dtype=torch.uint8)  # what put_rows stored reads back through get
        assert await tier.get(FULL, keys[:4], again) == [True] * 4
        assert torch.equal(again, data[:4])

    @pytest.mark.anyio
    async def test_groups_do_not_share_keys(self, tier: Tier) -> None:
        h = b"\x01" * 32
        a = _blocks(1, self.bb(FULL), seed=1)
        await tier.put(FULL, [make_key(h, FULL)], a)
        out = torch.zeros((1, self.bb(RECURRENT)), dtype=torch.uint8)
        assert await tier.get(RECURRENT, [make_key(h, RECURRENT)], out) == [False]

    @pytest.mark.anyio
    async def test_overwrite_keeps_one_value(self, tier: Tier) -> None:
        key = make_key(b"\x05" * 32, FULL)
        a, b = _blocks(2, self.bb(FULL), seed=5)
        await tier.put(FULL, [key], a[None].contiguous())
        await tier.put(FULL, [key], b[None].contiguous())
        out = torch.zeros((1, self.bb(FULL)), dtype=torch.uint8)
        assert await tier.get(FULL, [key], out) == [True]
        assert torch.equal(out[0], a) or torch.equal(out[0], b)

    @pytest.mark.anyio
    async def test_contains_nowait(self, tier: Tier) -> None:
        self.skip_unless(tier, "fast_contains")
        keys = [make_key(h, FULL) for h in _hashes(2, salt=4)]
        await tier.put(FULL, keys[:1], _blocks(1, self.bb(FULL), seed=2))
        assert tier.contains_nowait(FULL, keys) == [True, False]

    @pytest.mark.anyio
    async def test_delete(self, tier: Tier) -> None:
        self.skip_unless(tier, "deletable")
        keys = [make_key(h, FULL) for h in _hashes(3, salt=5)]
        await tier.put(FULL, keys, _blocks(3, self.bb(FULL), seed=6))
        await tier.delete(FULL, keys[:2])
        assert await tier.contains(FULL, keys) == [False, False, True]
        assert await self.oracle_get(tier, FULL, keys[0]) is None
        await tier.delete(FULL, [make_key(b"\x77" * 32, FULL)])

    @pytest.mark.anyio
    async def test_list_keys(self, tier: Tier) -> None:
        self.skip_unless(tier, "listable")
        keys = [make_key(h, RECURRENT) for h in _hashes(3, salt=6)]
        await tier.put(RECURRENT, keys, _blocks(3, self.bb(RECURRENT), seed=8))
        await tier.put(FULL, [make_key(b"\x09" * 32, FULL)], _blocks(1, self.bb(FULL), seed=9))
        assert sorted(await tier.list_keys(RECURRENT)) == sorted(keys)

    def small_capacity(self) -> int:
        """A capacity that holds only a few full-group blocks (plus any fixed floor)."""
        return 4 * self.bb(FULL) + 16 * 1024

    @pytest.mark.anyio
    async def test_capacity_is_bounded(self) -> None:
        cap = self.small_capacity()
        tier = self.make(capacity_bytes=cap)
        await tier.open()
        try:
            self.skip_unless(tier, "bounded")
            keys = [make_key(h, FULL) for h in _hashes(20, salt=8)]
            data = _blocks(20, self.bb(FULL), seed=12)
            for i in range(20):
                await tier.put(FULL, keys[i:i + 1], data[i:i + 1])
            used = tier.used_bytes()
            assert used is not None and used <= cap
            found = await tier.contains(FULL, keys)
            assert found[-1], "the most recent block must survive"
            assert not all(found)
            out = torch.zeros_like(data)
            ok = await tier.get(FULL, keys, out)
            for i, f in enumerate(ok):
                if f:
                    assert torch.equal(out[i], data[i])
        finally:
            await tier.close()

    @pytest.mark.anyio
    async def test_persistent_across_reopen(self) -> None:
        first = self.make()
        await first.open()
        try:
            self.skip_unless(first, "persistent")
            keys = [make_key(h, FULL) for h in _hashes(3, salt=10)]
            data = _blocks(3, self.bb(FULL), seed=13)
            await first.put(FULL, keys, data)
        finally:
            await first.close()
        second = self.make()
        await second.open()
        try:
            out = torch.zeros_like(data)
            assert await second.get(FULL, keys, out) == [True] * 3
            assert torch.equal(out, data)
        finally:
            await second.close()

    @pytest.mark.anyio
    async def test_serves_a_tiered_store(self) -> None:
        """The tier behind a TieredStore: put, evict from the primary, get back the same bytes."""
        from tierkv.store import TieredStore

        probe = self.make()
        primary: dict[str, Any]
        if probe.capabilities.slot_pool:
            primary = {**self.tier_config(), "slots": {FULL: 4, RECURRENT: 2}}
            lower: list[dict[str, Any]] = [{"kind": "memory"}]
        else:
            primary = {"kind": "cpu", "slots": {FULL: 4, RECURRENT: 2}}
            lower = [self.tier_config()]
        cfg = {"layout": self.layout, "namespace": self.namespace, "max_concurrent_requests": 2,
               "tiers": [primary, *lower]}
        hashes = _hashes(12, salt=12)
        data = _blocks(12, self.bb(FULL), seed=14)
        async with TieredStore(cfg) as store:
            await store.put(FULL, hashes, data)
            await store.flush()
            out = torch.zeros_like(data)
            await store.get(FULL, hashes, out)
            assert torch.equal(out, data)

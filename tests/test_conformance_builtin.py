"""The conformance suite against the built-in in-process tiers: memory, cpu, device."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tierkv.backends.base import Tier
from tierkv.backends.memory import MemoryTier
from tierkv.backends.pooltier import PoolTier
from tierkv.testing import TierTests


class TestMemoryTier(TierTests):
    kind = "memory"
    reports_rows = True

    async def oracle_set(self, tier: Tier, group: int, key: bytes, data: bytes) -> None:
        assert isinstance(tier, MemoryTier)
        tier._data[key] = data
        tier._used += len(data)

    async def oracle_get(self, tier: Tier, group: int, key: bytes) -> bytes | None:
        assert isinstance(tier, MemoryTier)
        return tier._data.get(key)


class _PoolOracle(TierTests):
    def tier_config(self) -> dict[str, Any]:
        return {"kind": self.kind, "capacity_bytes": 1 << 20}

    def small_capacity(self) -> int:
        return 4 * self.bb(0) + 4 * 2 * self.bb(2)  # 4 full blocks + the recurrent floor

    async def oracle_set(self, tier: Tier, group: int, key: bytes, data: bytes) -> None:
        assert isinstance(tier, PoolTier)
        pool = tier.pools[group]
        got = pool.allocate([key])
        assert got is not None
        (slot,), _ = got
        pool.tensor[slot].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        pool.mark_ready([slot])

    async def oracle_get(self, tier: Tier, group: int, key: bytes) -> bytes | None:
        assert isinstance(tier, PoolTier)
        pool = tier.pools[group]
        if not pool.is_ready(key):
            return None
        return pool.tensor[pool.index[key]].cpu().numpy().tobytes()


class TestCpuTier(_PoolOracle):
    kind = "cpu"


_devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class TestDeviceTier(_PoolOracle):
    kind = "device"

    @pytest.fixture(autouse=True, params=_devices)
    def _device(self, request: pytest.FixtureRequest) -> None:
        self.device = request.param

    def tier_config(self) -> dict[str, Any]:
        return {**super().tier_config(), "device": self.device}


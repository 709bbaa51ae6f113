"""``memory``: blocks as bytes in a dict, bounded by ``capacity_bytes`` with LRU eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from tierkv.backends.base import Capabilities, RowLanded, Tier, TierConfig, TierContext

__all__ = ["MemoryTier", "MemoryTierConfig"]


class MemoryTierConfig(TierConfig):
    """Settings of the ``memory`` tier (``capacity_bytes`` unset: unbounded)."""

    kind: str = "memory"


class MemoryTier(Tier):
    """A dict of bytes in this process: a fast second tier, and the reference for tests."""

    kind = "memory"
    capabilities = Capabilities(fast_contains=True)
    config_model = MemoryTierConfig

    def __init__(self, config: TierConfig, context: TierContext) -> None:
        super().__init__(config, context)
        self._data: OrderedDict[bytes, bytes] = OrderedDict()
        self._used = 0

    async def put(self, group: int, keys: Sequence[bytes], blocks: torch.Tensor) -> list[bool]:
        """Copy each row into the dict; evicts least recently used blocks past capacity."""
        rows = blocks.view(torch.uint8).reshape(len(keys), -1).cpu().numpy()
        cap = self.config.capacity_bytes
        ok = []
        for key, row in zip(keys, rows, strict=True):
            data = row.tobytes()
            if cap is not None and len(data) > cap:
                ok.append(False)
                continue
            old = self._data.pop(key, None)
            if old is not None:
                self._used -= len(old)
            self._data[key] = data
            self._used += len(data)
            while cap is not None and self._used > cap:
                _, evicted = self._data.popitem(last=False)
                self._used -= len(evicted)
                self.count("evictions")
            ok.append(key in self._data)
        return ok

    async def get(self, group: int, keys: Sequence[bytes], out: torch.Tensor,
                  landed: RowLanded | None = None) -> list[bool]:
        """Copy held blocks into the rows of ``out`` (``landed(i)`` after each)."""
        out8 = out.view(torch.uint8).reshape(len(keys), -1)
        found = []
        for i, key in enumerate(keys):
            data = self._data.get(key)
            if data is None or len(data) != out8.shape[1]:
                found.append(False)
                continue
            self._data.move_to_end(key)
            out8[i].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            found.append(True)
            if landed is not None:
                landed(i)
        return found

    async def contains(self, group: int, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether it is held."""
        return [k in self._data for k in keys]

    def contains_nowait(self, group: int, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether it is held (no I/O needed)."""
        return [k in self._data for k in keys]

    async def delete(self, group: int, keys: Sequence[bytes]) -> None:
        """Remove keys."""
        for k in keys:
            old = self._data.pop(k, None)
            if old is not None:
                self._used -= len(old)

    async def list_keys(self, group: int) -> list[bytes]:
        """Keys held for ``group``."""
        tail = group.to_bytes(4, "big")
        return [k for k in self._data if k.endswith(tail)]

    def used_bytes(self) -> int:
        """Bytes held."""
        return self._used

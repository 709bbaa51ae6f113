"""``cpu`` and ``device``: slot-pool tiers, one preallocated tensor per group.

Either may be the primary (tier 0), the one tier that can hand blocks to an engine; the store then
drives its pools directly. Used as a lower tier, it behaves like any other tier.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Sequence

import torch
from pydantic import field_validator

from tierkv.backends.base import Capabilities, RowLanded, Tier, TierConfig, TierContext
from tierkv.blocks.pool import PoolPlan, SlotPool, plan_pools, shared_pool_tensors
from tierkv.errors import CapacityError, ConfigError

__all__ = ["CpuTier", "CpuTierConfig", "DeviceTier", "DeviceTierConfig", "PoolTier"]


class CpuTierConfig(TierConfig):
    """Settings of the ``cpu`` pool (pinned memory when CUDA is present)."""

    kind: str = "cpu"
    #: explicit slot counts per group index; honoured even below the computed floor
    slots: dict[int, int] | None = None
    #: keep the pools in this shared file (e.g. ``/dev/shm/tierkv-<engine>``) so that another
    #: process (an engine's worker) can map the same slots; removed on close when ``shm_owner``
    shm_path: str | None = None
    shm_owner: bool = True


class DeviceTierConfig(CpuTierConfig):
    """Settings of the ``device`` pool: ``device`` is ``"cuda"``, ``"cuda:N"`` or ``"cpu"``."""

    kind: str = "device"
    device: str = "cuda"

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str) -> str:
        try:
            torch.device(v)
        except RuntimeError as exc:
            raise ValueError(f"not a torch device: {v!r}") from exc
        return v


class PoolTier(Tier):
    """Per-group slot pools on one device."""

    capabilities = Capabilities(fast_contains=True, slot_pool=True)

    def __init__(self, config: TierConfig, context: TierContext) -> None:
        super().__init__(config, context)
        self.pools: dict[int, SlotPool] = {}
        self.plan: PoolPlan | None = None
        self._shm_fd: int | None = None

    def _device(self) -> torch.device:
        return torch.device("cpu")

    def planned(self) -> PoolPlan:
        """The pools' plan: the one in use once open, else the one ``open`` would make."""
        if self.plan is not None:
            return self.plan
        assert isinstance(self.config, CpuTierConfig)
        return plan_pools(self.config.capacity_bytes, self.context.layout,
                          self.context.max_concurrent_requests, self.config.slots)

    async def open(self) -> None:
        """Plan the pools and allocate them once."""
        assert isinstance(self.config, CpuTierConfig)
        device = self._device()
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"tier {self.kind!r}: device {device} requested but CUDA is not available")
        self.plan = self.planned()
        shared = None
        if self.config.shm_path is not None:
            if device.type != "cpu":
                raise ConfigError(f"tier {self.kind!r}: shm_path needs a cpu pool, not {device}")
            self._lock_shm(self.config.shm_path)
            try:
                shared = shared_pool_tensors(self.config.shm_path, self.plan)
            except (OSError, RuntimeError) as exc:
                self._unlock_shm()
                path, size = self.config.shm_path, self.plan.total_bytes
                raise CapacityError(f"tier {self.kind!r}: cannot map the shared pool at {path} "
                                    f"({size} bytes): {exc}") from None
        pools = {}
        for p in self.plan.groups:
            try:
                pools[p.group] = SlotPool(p.group, p.block_bytes, p.slots, device, self.context.policy,
                                          tensor=None if shared is None else shared[p.group])
            except (RuntimeError, MemoryError, OverflowError) as exc:
                self._unlock_shm()
                raise CapacityError(
                    f"tier {self.kind!r}: cannot allocate the pool of group {p.group} ({p.slots} slots x "
                    f"{p.block_bytes} bytes = {p.bytes} bytes): {str(exc).splitlines()[0][:200]}") from None
        self.pools = pools

    def _lock_shm(self, path: str) -> None:
        """Hold an exclusive lock on the shared pool file while open: a second store given the same
        ``shm_path`` would share (and serve) this one's slots, and delete its file on close."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(f"shm_path {path} is in use by another open store: give each store its own"
                              " shm_path") from None
        self._shm_fd = fd

    def _unlock_shm(self) -> None:
        if self._shm_fd is not None:
            os.close(self._shm_fd)  # releases the lock
            self._shm_fd = None

    async def close(self) -> None:
        """Drop the pools (and the shared file, when this tier owns it)."""
        self.pools = {}
        assert isinstance(self.config, CpuTierConfig)
        if self._shm_fd is None:
            return  # never opened, or refused at open: the file is another store's
        if self.config.shm_path is not None and self.config.shm_owner:
            try:
                os.unlink(self.config.shm_path)
            except FileNotFoundError:
                pass
        self._unlock_shm()

    async def put(self, group: int, keys: Sequence[bytes], blocks: torch.Tensor) -> list[bool]:
        """Write blocks into slots, evicting as needed; keys without a slot are not stored."""
        pool = self.pools[group]
        todo = [i for i, k in enumerate(keys) if pool.slot_of(k) is None]
        pool.touch_many(keys)
        while todo:
            got = pool.allocate([keys[i] for i in todo[: max(1, pool.available())]])
            if got is None:
                break
            slots, evicted = got
            self.count("evictions", len(evicted))
            take = todo[: len(slots)]
            idx = torch.tensor(take, dtype=torch.int64)
            src = blocks if len(take) == len(keys) else blocks.index_select(0, idx.to(blocks.device))
            pool.write(slots, src.contiguous())
            pool.mark_ready(slots)
            todo = todo[len(slots):]
        return [pool.is_ready(k) for k in keys]

    async def get(self, group: int, keys: Sequence[bytes], out: torch.Tensor,
                  landed: RowLanded | None = None) -> list[bool]:
        """Copy READY blocks out."""
        pool = self.pools[group]
        found = [pool.is_ready(k) for k in keys]
        rows = [i for i, f in enumerate(found) if f]
        if rows:
            slots = [pool.index[keys[i]] for i in rows]
            for i in rows:
                pool.touch(keys[i])
            if len(rows) == len(keys):
                pool.read(slots, out)
            else:
                tmp = torch.empty((len(rows), pool.block_bytes), dtype=torch.uint8, device=out.device)
                pool.read(slots, tmp)
                idx = torch.tensor(rows, dtype=torch.int64, device=out.device)
                out.view(torch.uint8).reshape(len(keys), -1).index_copy_(0, idx, tmp)
        return found

    async def contains(self, group: int, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether it is READY."""
        pool = self.pools[group]
        return [pool.is_ready(k) for k in keys]

    def contains_nowait(self, group: int, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether it is READY."""
        pool = self.pools[group]
        return [pool.is_ready(k) for k in keys]

    async def delete(self, group: int, keys: Sequence[bytes]) -> None:
        """Free the slots of unpinned keys."""
        pool = self.pools[group]
        pool.free([s for k in keys if (s := pool.slot_of(k)) is not None and pool.pins[s] == 0])

    async def list_keys(self, group: int) -> list[bytes]:
        """READY keys of ``group``."""
        pool = self.pools[group]
        return [k for k in pool.index if pool.is_ready(k)]

    def used_bytes(self) -> int:
        """Bytes of READY and WRITING slots."""
        return sum((p.num_slots - p.free_count) * p.block_bytes for p in self.pools.values())

    def describe(self) -> str:
        """Kind and device."""
        return f"{self.kind} on {self._device()}"


class CpuTier(PoolTier):
    """Slot pools in host memory."""

    kind = "cpu"
    config_model = CpuTierConfig


class DeviceTier(PoolTier):
    """Slot pools on an accelerator (``device: cuda:N``), or on ``cpu`` for tests."""

    kind = "device"
    config_model = DeviceTierConfig

    def _device(self) -> torch.device:
        assert isinstance(self.config, DeviceTierConfig)
        return torch.device(self.config.device)

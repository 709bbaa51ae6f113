"""The worker side: copies between vLLM's KV cache tensors and tierkv's shared CPU pool.

Block ``b`` of vLLM group position ``i`` is, per layer ref ``r`` of that group, the first
``r.page_size_bytes`` bytes of row ``b`` of ``kv_caches.tensors[r.tensor_idx]``. In tierkv's pool a
row holds one offloaded block: ``blocks_per_chunk`` engine blocks (vLLM's ``block_size`` /
``blocks_per_chunk`` setting; 1 by default) one after the other, and each of them, for each rank,
its refs' pages one after the other. Engine block ``j`` of a request sits in the row of its chunk
``j // blocks_per_chunk`` at sub-block ``j % blocks_per_chunk``.

The copies themselves are tierkv's :class:`~tierkv.transfer.DeviceTransfer` (batched, on a stream
of their own on CUDA, ordered after the compute stream, timed by events); this module only maps
vLLM's transfer specs onto it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from tierkv.adapter import Copy, DeviceTransfer
from tierkv.adapters.vllm.manager import TierKVLoadStoreSpec

__all__ = ["GroupCopy", "PoolRows", "TierKVWorker", "group_copies"]

#: the rows of a pool a transfer spec names (``TierKVLoadStoreSpec.pool``), None when this process
#: cannot reach them (a daemon's pool that is gone)
PoolRows = Callable[[str], "dict[int, torch.Tensor] | None"]

log = logging.getLogger("tierkv.vllm")


@dataclass
class GroupCopy:
    """How one offloaded group's blocks map between the engine's tensors and a pool row."""

    group_id: int
    refs: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)  # (tensor, page, offset)
    rank_bytes: int = 0


def group_copies(kv_caches: CanonicalKVCaches, group_ids: list[int]) -> list[GroupCopy]:
    """Per offloaded group (in vLLM's order): its tensors, page sizes and offsets in a pool row."""
    out = []
    for pos, gid in enumerate(group_ids):
        gc = GroupCopy(gid)
        for ref in kv_caches.group_data_refs[pos]:
            t = kv_caches.tensors[ref.tensor_idx].tensor
            page = int(ref.page_size_bytes)
            gc.refs.append((t, page, gc.rank_bytes))
            gc.rank_bytes += page
        out.append(gc)
    return out


class TierKVWorker(OffloadingWorker):  # type: ignore[misc,unused-ignore]
    """Transfers between the engine's KV caches and tierkv's pool; a transfer never fails."""

    def __init__(self, copies: list[GroupCopy], pools: dict[int, torch.Tensor] | PoolRows, rank: int = 0,
                 world_size: int = 1, blocks_per_chunk: int = 1) -> None:
        self.copies = copies
        if callable(pools):
            self.pools: PoolRows = pools
        else:
            own = pools
            self.pools = lambda _: own
        self.rank = rank
        self.world_size = world_size
        self.blocks_per_chunk = blocks_per_chunk
        device = next((t.device for c in copies for t, _, _ in c.refs), torch.device("cpu"))
        self.transfer = DeviceTransfer(device)
        self.device = self.transfer.device
        self.cuda = self.transfer.cuda
        self.stream = self.transfer.stream

    def _copies(self, gpu: GPULoadStoreSpec, ours: TierKVLoadStoreSpec, store: bool) -> list[Copy]:
        block_ids = torch.as_tensor(gpu.block_ids, dtype=torch.int64)
        sizes = [int(x) for x in gpu.group_sizes]
        firsts = [int(x) for x in (getattr(gpu, "block_indices", None) or [0] * len(sizes))]
        per = self.blocks_per_chunk
        out = []
        start = 0
        ours_groups = ours.groups.tolist()
        taken = 0
        pools = self.pools(ours.pool)
        if pools is None:
            if not store:
                # the scheduler pinned these rows in a pool this process never mapped and that is
                # gone now (the daemon restarted twice within a step): nothing correct to load
                raise RuntimeError(f"tierkv: the pool {ours.pool!r} of this load is gone")
            log.warning("tierkv: a store into pool %r skipped: the daemon serving it is gone", ours.pool)
            return []
        for pos, n in enumerate(sizes):
            if n == 0:
                continue
            gc = self.copies[pos]
            blocks = block_ids[start:start + n]
            start += n
            skip = firsts[pos] % per  # a load may start inside its first chunk
            chunks = -(-(skip + n) // per)
            slots = ours.slots[taken:taken + chunks]
            if len(slots) != chunks or any(g != gc.group_id for g in ours_groups[taken:taken + chunks]):
                raise RuntimeError(f"transfer specs disagree for group {gc.group_id}: {n} engine blocks,"
                                   f" tierkv slots {ours_groups[taken:taken + chunks]}")
            if store and (skip or n % per):
                # a stored row must be whole: part of it would keep another block's bytes
                raise RuntimeError(f"group {gc.group_id}: a store of {n} engine blocks from block "
                                   f"{firsts[pos]} does not cover whole chunks of {per}")
            taken += chunks
            pool = pools[gc.group_id]
            sub_bytes = self.world_size * gc.rank_bytes
            base = self.rank * gc.rank_bytes
            for sub in range(per):
                js = [j for j in range(n) if (skip + j) % per == sub]
                if not js:
                    continue
                rows = torch.as_tensor([slots[(skip + j) // per] for j in js], dtype=torch.int64)
                sel = blocks if per == 1 else blocks[torch.as_tensor(js, dtype=torch.int64)]
                at = sub * sub_bytes + base
                out += [Copy(t, sel, page, pool, rows, at + off) for t, page, off in gc.refs]
        return out

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """Copy engine blocks into pool slots."""
        assert isinstance(dst_spec, TierKVLoadStoreSpec)
        self.transfer.store(job_id, self._copies(src_spec, dst_spec, store=True))
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        """Copy pool slots into engine blocks.

        ``expedited`` (vLLM 0.33: a load the engine waits for in this step) changes nothing: on
        the CPU platform every load is done on return; on CUDA the engine calls ``wait`` for it.
        """
        assert isinstance(src_spec, TierKVLoadStoreSpec)
        self.transfer.load(job_id, self._copies(dst_spec, src_spec, store=False))
        return True

    def get_finished(self) -> list[TransferResult]:
        """Jobs done since the last call, in submission order."""
        return [TransferResult(job_id=f.job_id, success=True, transfer_size=f.nbytes,
                               transfer_time=f.seconds) for f in self.transfer.finished()]

    def wait(self, job_ids: set[int]) -> None:
        """Block until these jobs are done (they are still reported by ``get_finished``)."""
        self.transfer.wait(job_ids)

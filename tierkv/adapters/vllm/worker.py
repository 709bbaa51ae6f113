"""The worker side: copies between vLLM's KV cache tensors and tierkv's shared CPU pool.

Block ``b`` of vLLM group position ``i`` is, per layer ref ``r`` of that group, the first
``r.page_size_bytes`` bytes of row ``b`` of ``kv_caches.tensors[r.tensor_idx]``. In tierkv's pool a
block row holds, for each rank, its refs' pages one after the other.

On the CPU platform a transfer is one batched gather/scatter per ref, done when ``submit_*``
returns. On CUDA, copies run on the worker's own stream through pinned staging buffers, as vLLM's
own CPU offloading does: the stream first waits for the compute stream (a store must not read KV
the model is still writing, a load must not race pending writes to its blocks), jobs run in
submission order, events around each job time it, and ``get_finished`` reports jobs whose end
event has completed. The CUDA path has not run yet (no GPU machine; docs/vllm.md).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from tierkv.adapters.vllm.manager import TierKVLoadStoreSpec

__all__ = ["GroupCopy", "TierKVWorker", "group_copies"]

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


@dataclass
class _Job:
    job_id: int
    nbytes: int
    start: float
    start_event: Any = None
    end_event: Any = None
    finish: Any = None  # CPU work to run once the device copy has completed


class TierKVWorker(OffloadingWorker):  # type: ignore[misc,unused-ignore]
    """Transfers between the engine's KV caches and tierkv's pool; a transfer never fails."""

    def __init__(self, copies: list[GroupCopy], pools: dict[int, torch.Tensor], rank: int = 0) -> None:
        self.copies = copies
        self.pools = pools
        self.rank = rank
        self._pos = {c.group_id: i for i, c in enumerate(copies)}
        self._done: list[TransferResult] = []
        self._pending: dict[int, _Job] = {}
        self.device = next((t.device for c in copies for t, _, _ in c.refs), torch.device("cpu"))
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None  # type: ignore[no-untyped-call]

    def _begin(self) -> Any:
        """CUDA: order this job after the compute stream's work so far; its start event."""
        if not self.cuda:
            return None
        assert self.stream is not None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record(self.stream)
        return start

    def _pairs(self, gpu: GPULoadStoreSpec, ours: TierKVLoadStoreSpec) -> list[tuple[GroupCopy, Any, Any]]:
        block_ids = torch.as_tensor(gpu.block_ids, dtype=torch.int64)
        sizes = [int(x) for x in gpu.group_sizes]
        out = []
        start = 0
        ours_groups = ours.groups.tolist()
        taken = 0
        for pos, n in enumerate(sizes):
            if n == 0:
                continue
            gc = self.copies[pos]
            blocks = block_ids[start:start + n]
            start += n
            slots = ours.slots[taken:taken + n]
            if len(slots) != n or any(g != gc.group_id for g in ours_groups[taken:taken + n]):
                raise RuntimeError(f"transfer specs disagree for group {gc.group_id}: {n} engine blocks,"
                                   f" tierkv slots {ours_groups[taken:taken + n]}")
            taken += n
            out.append((gc, blocks, torch.as_tensor(slots, dtype=torch.int64)))
        return out

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """Copy engine blocks into pool slots."""
        assert isinstance(dst_spec, TierKVLoadStoreSpec)
        t0 = time.perf_counter()
        start = self._begin()
        nbytes = 0
        finish = []
        for gc, blocks, slots in self._pairs(src_spec, dst_spec):
            pool = self.pools[gc.group_id]
            base = self.rank * gc.rank_bytes
            for t, page, off in gc.refs:
                lo, hi = base + off, base + off + page
                if self.cuda:
                    with torch.cuda.stream(self.stream):
                        staged = torch.empty((len(blocks), page), dtype=torch.int8, pin_memory=True)
                        staged.copy_(t[blocks.to(t.device), :page], non_blocking=True)
                    finish.append((pool, slots, lo, hi, staged))
                else:
                    pool[slots, lo:hi] = t[blocks, :page].view(torch.uint8)
                nbytes += len(blocks) * page
        self._submit(job_id, nbytes, t0, start, finish)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        """Copy pool slots into engine blocks.

        ``expedited`` (vLLM 0.33: a load the engine waits for in this step) changes nothing: on
        the CPU platform every load is done on return; on CUDA the engine calls ``wait`` for it.
        """
        assert isinstance(src_spec, TierKVLoadStoreSpec)
        t0 = time.perf_counter()
        start = self._begin()
        nbytes = 0
        for gc, blocks, slots in self._pairs(dst_spec, src_spec):
            pool = self.pools[gc.group_id]
            base = self.rank * gc.rank_bytes
            for t, page, off in gc.refs:
                lo, hi = base + off, base + off + page
                rows = pool[slots, lo:hi]
                if self.cuda:
                    staged = rows.pin_memory()
                    with torch.cuda.stream(self.stream):
                        dev = staged.to(t.device, non_blocking=True)
                        t[blocks.to(t.device), :page] = dev.view(torch.int8)
                else:
                    t[blocks, :page] = rows.view(torch.int8)
                nbytes += len(blocks) * page
        self._submit(job_id, nbytes, t0, start, [])
        return True

    def _submit(self, job_id: int, nbytes: int, t0: float, start: Any, finish: list[Any]) -> None:
        if not self.cuda:
            self._done.append(TransferResult(job_id=job_id, success=True, transfer_size=nbytes,
                                             transfer_time=time.perf_counter() - t0))
            return
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end.record(self.stream)
        self._pending[job_id] = _Job(job_id, nbytes, t0, start, end, finish)

    def _complete(self, job: _Job) -> None:
        for pool, slots, lo, hi, staged in job.finish or []:
            pool[slots, lo:hi] = staged.view(torch.uint8)
        seconds = job.start_event.elapsed_time(job.end_event) * 1e-3
        self._done.append(TransferResult(job_id=job.job_id, success=True, transfer_size=job.nbytes,
                                         transfer_time=seconds))

    def get_finished(self) -> list[TransferResult]:
        """Jobs done since the last call, in submission order."""
        for job_id in list(self._pending):  # one stream: jobs end in the order they were submitted
            if not self._pending[job_id].end_event.query():
                break
            self._complete(self._pending.pop(job_id))
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Block until these jobs are done (they are still reported by ``get_finished``)."""
        for job_id in list(self._pending):
            if not job_ids & self._pending.keys():
                break
            job = self._pending.pop(job_id)
            job.end_event.synchronize()
            self._complete(job)

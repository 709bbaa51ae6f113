"""Batched copies between an engine's device tensors and rows of a CPU pool.

:class:`DeviceTransfer` is what an engine adapter's worker needs to move KV pages between its
cache tensors (on a GPU, or on the CPU) and tierkv's CPU pool, and depends on torch only:

- a *store* (device to host) gathers rows of device tensors into pool rows; a *load* (host to
  device) scatters pool rows into device tensor rows. On CUDA each copy is one batched gather or
  scatter; on the CPU, one memcpy per row.
- On CUDA, copies run on a stream of their own, through pinned staging buffers. Before each job
  the stream waits for the compute stream (a store must not read KV the model is still writing; a
  load must not race writes still queued for its blocks). Jobs run in submission order; events
  around each job time it; :meth:`DeviceTransfer.finished` reports jobs whose end event has
  completed, in order, and :meth:`DeviceTransfer.wait` blocks until given jobs are done.
- On the CPU, a job is done when ``submit`` returns.

``scripts/dev gpu-check`` runs this module's CUDA tests and measures it against plain
``Tensor.copy_`` of the same bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Copy", "DeviceTransfer", "Finished"]


@dataclass(frozen=True)
class Copy:
    """Rows ``device_rows`` of ``device_tensor`` (their first ``nbytes`` bytes) and pool rows.

    ``pool_rows`` index ``pool`` (a CPU uint8 tensor), whose columns ``[offset, offset + nbytes)``
    hold the pages.
    """

    device_tensor: torch.Tensor
    device_rows: torch.Tensor
    nbytes: int
    pool: torch.Tensor
    pool_rows: torch.Tensor
    offset: int = 0

    @property
    def size(self) -> int:
        """Bytes this copy moves."""
        return int(self.device_rows.numel()) * self.nbytes


@dataclass(frozen=True)
class Finished:
    """A job that has completed: its id, bytes moved and seconds taken (device time on CUDA)."""

    job_id: int
    nbytes: int
    seconds: float


@dataclass
class _Job:
    job_id: int
    nbytes: int
    start_event: Any = None
    end_event: Any = None
    #: CPU work to run once the device copies have completed (staging -> pool rows)
    finish: list[Callable[[], None]] = field(default_factory=list)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s rows as bytes (a view)."""
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


class DeviceTransfer:
    """Copies between device tensors and CPU pool rows; see the module docstring."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None  # type: ignore[no-untyped-call]
        self._pending: dict[int, _Job] = {}
        self._done: list[Finished] = []

    def _begin(self, job_id: int) -> _Job:
        job = _Job(job_id, 0)
        if self.cuda:
            assert self.stream is not None
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            job.start_event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            job.start_event.record(self.stream)
        return job

    def store(self, job_id: int, copies: Sequence[Copy]) -> None:
        """Device rows -> pool rows, for every copy of the job."""
        t0 = time.perf_counter()
        job = self._begin(job_id)
        for c in copies:
            lo, hi = c.offset, c.offset + c.nbytes
            src = _bytes(c.device_tensor)
            if self.cuda:
                with torch.cuda.stream(self.stream):
                    staged = torch.empty((int(c.device_rows.numel()), c.nbytes), dtype=torch.uint8,
                                         pin_memory=True)
                    staged.copy_(src[c.device_rows.to(src.device), :c.nbytes], non_blocking=True)
                job.finish.append(_landing(c.pool, c.pool_rows, lo, hi, staged))
            else:
                _copy_rows(c.pool, c.pool_rows, lo, src, c.device_rows, 0, c.nbytes)
            job.nbytes += c.size
        self._submit(job, t0)

    def load(self, job_id: int, copies: Sequence[Copy]) -> None:
        """Pool rows -> device rows, for every copy of the job."""
        t0 = time.perf_counter()
        job = self._begin(job_id)
        for c in copies:
            lo = c.offset
            dst = _bytes(c.device_tensor)
            if self.cuda:
                n = int(c.pool_rows.numel())
                staged = torch.empty((n, c.nbytes), dtype=torch.uint8, pin_memory=True)
                _copy_rows(staged, torch.arange(n), 0, c.pool, c.pool_rows, lo, c.nbytes)
                with torch.cuda.stream(self.stream):
                    on_device = staged.to(dst.device, non_blocking=True)
                    dst[c.device_rows.to(dst.device), :c.nbytes] = on_device
                job.finish.append(_keep_alive(staged))
            else:
                _copy_rows(dst, c.device_rows, 0, c.pool, c.pool_rows, lo, c.nbytes)
            job.nbytes += c.size
        self._submit(job, t0)

    def _submit(self, job: _Job, t0: float) -> None:
        if not self.cuda:
            self._done.append(Finished(job.job_id, job.nbytes, time.perf_counter() - t0))
            return
        job.end_event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        job.end_event.record(self.stream)
        self._pending[job.job_id] = job

    def _complete(self, job: _Job) -> None:
        for step in job.finish:
            step()
        seconds = job.start_event.elapsed_time(job.end_event) * 1e-3
        self._done.append(Finished(job.job_id, job.nbytes, seconds))

    def finished(self) -> list[Finished]:
        """Jobs done since the last call, in submission order."""
        for job_id in list(self._pending):  # one stream: jobs end in the order they were submitted
            if not self._pending[job_id].end_event.query():
                break
            self._complete(self._pending.pop(job_id))
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Block until these jobs are done (they are still reported by :meth:`finished`)."""
        for job_id in list(self._pending):
            if not job_ids & self._pending.keys():
                break
            job = self._pending.pop(job_id)
            job.end_event.synchronize()
            self._complete(job)

    @property
    def pending(self) -> int:
        """Jobs submitted and not yet completed."""
        return len(self._pending)


def _copy_rows(dst: torch.Tensor, dst_rows: torch.Tensor, dst_lo: int, src: torch.Tensor,
               src_rows: torch.Tensor, src_lo: int, nbytes: int) -> None:
    """``dst[dst_rows[i], dst_lo:+nbytes] = src[src_rows[i], src_lo:+nbytes]`` for every ``i``, on
    the CPU: one memcpy per row (torch's indexed copy of uint8 rows moves them a byte at a time, at
    a tenth of the speed; a KV page is kilobytes, so the loop's overhead is small)."""
    d, s = dst.detach().numpy(), src.detach().numpy()
    for a, b in zip(dst_rows.tolist(), src_rows.tolist(), strict=True):
        d[a, dst_lo:dst_lo + nbytes] = s[b, src_lo:src_lo + nbytes]


def _landing(pool: torch.Tensor, rows: torch.Tensor, lo: int, hi: int,
             staged: torch.Tensor) -> Callable[[], None]:
    def land() -> None:
        _copy_rows(pool, rows, lo, staged, torch.arange(int(rows.numel())), 0, hi - lo)

    return land


def _keep_alive(staged: torch.Tensor) -> Callable[[], None]:
    """A finish step that holds the pinned staging buffer until the copy from it has completed."""

    def release() -> None:
        assert staged is not None

    return release

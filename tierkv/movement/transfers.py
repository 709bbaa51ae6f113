"""How a gateway moves bytes: batches of rows (:func:`plan_rows`), the bytes-in-flight budgets
(:class:`ByteBudget`), the read-rate estimate planning uses (:class:`RateEstimate`), and where a
batch lands."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio
import torch

from tierkv.tensors import as_bytes, row_span

__all__ = ["DIRECT_RUN_BYTES", "LOAD_BATCH_BYTES", "MAX_RATE", "MIB", "MIN_RATE", "RATE_WINDOW", "REPROBE_S",
           "ByteBudget", "OnBatch", "OnRow", "RateEstimate", "RowPlan", "batch_buffer", "landed", "plan_rows",
           "take_rows"]

MIB = 1 << 20
#: a read-rate estimate below the prior, unmeasured this long, is planned with the prior again
REPROBE_S = 5.0
#: the read-rate estimate is the median of this many recent samples (the prior counts as one
#: until real ones push it out): one stalled moment moves it by at most one rank, never replaces it
RATE_WINDOW = 5
#: the read-rate estimate stays within these bounds (bytes/s) whatever a sample says
MIN_RATE = 1e3
MAX_RATE = 1e12


class RateEstimate:
    """A tier's read rate from samples: the (upper) median of the last :data:`RATE_WINDOW`, bounded;
    a sample is the bytes a load landed over the time loads were in flight since the last one."""

    def __init__(self, prior: float) -> None:
        self.prior = float(prior)
        self.samples: collections.deque[float] = collections.deque([_bounded(prior)], maxlen=RATE_WINDOW)
        self.value = self.samples[0]
        #: when loads were last idle or last landed (the owner sets it as the first load starts)
        self.busy_since = 0.0
        self.last_sample = time.monotonic()

    def add(self, sample: float) -> float:
        """Take one sample (bytes/s; NaN, zero or less carry no information) and return the estimate."""
        if sample == sample and sample > 0:  # not NaN
            self.samples.append(_bounded(sample))
            ordered = sorted(self.samples)
            self.value = ordered[len(ordered) // 2]
        return self.value

    def landed(self, nbytes: int, now: float) -> None:
        """A load landed ``nbytes`` at ``now``: one sample, bytes over the time loads were busy."""
        busy = now - self.busy_since
        self.busy_since = now
        if nbytes > 0 and busy > 0:
            self.add(nbytes / busy)
            self.last_sample = now

    def planning(self, now: float) -> float:
        """The rate the cost model plans with: the estimate, or, when it has fallen below the prior
        and no load has measured it for :data:`REPROBE_S`, the prior again, so the next restore
        loads and measures (a tier the cost model stopped using would otherwise never be measured
        again: one slow moment would switch restores off for good)."""
        if self.value < self.prior and now - self.last_sample >= REPROBE_S:
            return self.prior
        return max(self.value, 1.0)


def _bounded(rate: float) -> float:
    return min(max(float(rate), MIN_RATE), MAX_RATE)


#: runs of consecutive rows at least this long move in place; shorter ones are gathered
DIRECT_RUN_BYTES = 1 << 20
#: a load is cut into batches of about this many bytes, so blocks land (and become usable) as
#: they arrive and enough reads are in flight to keep the tier busy
LOAD_BATCH_BYTES = 64 << 20

OnBatch = Callable[[list[int], list[bool]], None]
#: ``on_row(position, row)``: the block at ``position`` of a load is verified in ``row``, in the
#: reading thread, before its batch lands
OnRow = Callable[[int, torch.Tensor], None]


@dataclass(frozen=True)
class RowPlan:
    """One batch of a transfer: positions (into the caller's keys) and whether they are one run."""

    positions: list[int]
    #: ``(start, stop)`` rows of the caller's tensor when the batch is a run, else None (gathered)
    run: tuple[int, int] | None


def plan_rows(rows: Sequence[int], block_bytes: int, batch_bytes: int = LOAD_BATCH_BYTES,
              scattered: bool = False) -> list[RowPlan]:
    """Cut a transfer of ``rows`` into batches, in key order.

    ``scattered`` (a tier that moves blocks where their rows lie): batches of about
    ``batch_bytes``, whatever the rows. Otherwise runs of consecutive rows at least
    :data:`DIRECT_RUN_BYTES` long (or the whole transfer) become in-place batches, split at
    ``batch_bytes``; the other positions are gathered into batches of about ``batch_bytes`` that
    go through a staging buffer.
    """
    per = max(1, batch_bytes // max(1, block_bytes))
    if scattered:
        return [RowPlan(list(range(a, min(len(rows), a + per))), None) for a in range(0, len(rows), per)]
    direct_min = max(1, DIRECT_RUN_BYTES // max(1, block_bytes))
    out: list[RowPlan] = []
    gathered: list[int] = []
    n = len(rows)
    start = 0
    for i in range(1, n + 1):
        if i < n and rows[i] == rows[i - 1] + 1:
            continue
        length = i - start
        if length >= direct_min or length == n:
            for a in range(start, i, per):
                b = min(i, a + per)
                out.append(RowPlan(list(range(a, b)), (rows[a], rows[a] + b - a)))
        else:
            gathered.extend(range(start, i))
            while len(gathered) >= per:
                out.append(RowPlan(gathered[:per], None))
                gathered = gathered[per:]
        start = i
    if gathered:
        out.append(RowPlan(gathered, None))
    out.sort(key=lambda p: p.positions[0])
    return out


class ByteBudget:
    """Bytes in flight, bounded; waiters are served first come, first served.

    A request larger than the bound proceeds once nothing else is in flight. Used from one event
    loop only.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiters: collections.deque[tuple[int, anyio.Event]] = collections.deque()

    def _fits(self, n: int) -> bool:
        return self.used == 0 or self.used + n <= self.limit

    async def acquire(self, n: int) -> None:
        """Wait until ``n`` bytes fit, in arrival order."""
        if not self._waiters and self._fits(n):
            self.used += n
            return
        ev = anyio.Event()
        entry = (n, ev)
        self._waiters.append(entry)
        try:
            await ev.wait()
        except BaseException:
            if ev.is_set():
                self.release(n)  # granted just as we were cancelled: give it back
            else:
                self._waiters.remove(entry)
                self._wake()
            raise

    def release(self, n: int) -> None:
        """Give ``n`` bytes back and wake the waiters that now fit."""
        self.used -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            n, ev = self._waiters.popleft()
            self.used += n
            ev.set()



def batch_buffer(dest: torch.Tensor, block: int, plan: RowPlan,
                  scattered: bool) -> tuple[torch.Tensor, bool]:
    """Where a load batch is read to, and whether that is ``dest`` itself: the whole of it for a
    tier that reads into scattered rows, the run's rows of a CPU ``dest``, else a staging buffer."""
    if scattered:
        return as_bytes(dest, dest.shape[0], block), True
    if plan.run is not None and dest.device.type == "cpu":
        return row_span(as_bytes(dest, dest.shape[0], block), plan.run[0], plan.run[1]), True
    return torch.empty((len(plan.positions), block), dtype=torch.uint8), False


def take_rows(src: torch.Tensor, run: tuple[int, int] | None, rows: list[int]) -> torch.Tensor:
    """The CPU rows of ``src`` to write: a view when they are one run on the CPU, else a copy."""
    if run is not None:
        t = row_span(src, run[0], run[1])
    else:
        t = src.index_select(0, torch.tensor(rows, dtype=torch.int64, device=src.device))
    return t if t.device.type == "cpu" else t.cpu()


def landed(on_row: OnRow, positions: list[int], buf: torch.Tensor, rows: list[int] | None, j: int) -> None:
    """Block ``j`` of a batch, read into row ``j`` of ``buf`` (or row ``rows[j]``), is verified:
    tell ``on_row`` its load position."""
    on_row(positions[j], buf[j if rows is None else rows[j]])

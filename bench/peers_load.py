"""How busy the machine was while bench/peers.py timed a phase: the CPUs other processes used.

Two ratios of one run can only agree with the next run's when the systems got the same CPUs both
times; on a shared machine they do not (what the others run changes from minute to minute, and the
systems differ in how much CPU they need per byte). :class:`CpuMeter` reads ``/proc/stat`` (every
CPU's busy time, ``steal`` included: time the hypervisor gave elsewhere) and the CPU time of this
process and all its descendants (``/proc/<pid>/stat``: their threads, and the children they
reaped) before and after a phase; the difference is what the rest of the machine used, in CPUs.
Kernel threads count as the rest, including those working for the bench (page-cache writeback,
I/O completion), so a phase that writes a lot reads a little busier than it was. Linux only;
elsewhere every figure is None.
"""

from __future__ import annotations

import os
import time

__all__ = ["CpuMeter", "Sample", "cpu_pressure"]

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

Sample = tuple[float, float, float]  # (monotonic seconds, machine busy CPU-seconds, ours)


def cpu_pressure() -> str | None:
    """``/proc/pressure/cpu``'s "some" line (the share of time tasks waited for a CPU), or None."""
    try:
        with open("/proc/pressure/cpu") as f:
            return f.readline().strip()
    except OSError:
        return None


class CpuMeter:
    """CPU used by processes outside this process tree between two :meth:`sample` calls."""

    def __init__(self, root: int | None = None) -> None:
        self.root = root or os.getpid()

    @staticmethod
    def _busy() -> float:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal ...: everything but idle and iowait
        return (sum(v[:8]) - v[3] - v[4]) / TICK

    def _ours(self) -> float:
        parent: dict[int, int] = {}
        ticks: dict[int, int] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    text = f.read()
            except OSError:
                continue
            fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
            pid = int(name)
            parent[pid] = int(fields[1])
            ticks[pid] = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
        total = 0
        for pid, t in ticks.items():
            p = pid
            while p > 1 and p != self.root:
                p = parent.get(p, 0)
            if p == self.root:
                total += t
        return total / TICK

    def sample(self) -> Sample | None:
        try:
            return time.monotonic(), self._busy(), self._ours()
        except (OSError, ValueError, IndexError):
            return None

    @staticmethod
    def others(a: Sample | None, b: Sample | None) -> float | None:
        """CPUs (on average) that processes outside the tree used from ``a`` to ``b``."""
        if a is None or b is None or b[0] <= a[0]:
            return None
        return max(0.0, ((b[1] - a[1]) - (b[2] - a[2])) / (b[0] - a[0]))

"""Reader processes: page-cache reads of records straight into a pool in shared memory.

An engine's scheduler process holds the GIL most of the time (vLLM's step loop spins while a
request waits for its blocks), and every system call of a reader thread waits for it again: in
such a process a restore read 128 MiB at a quarter of the speed of the same code alone. Where the
rows a tier reads into lie in a shared file mapping (:mod:`tierkv.blocks.sharedmem`: the vLLM
adapter's pool, a ``cpu`` tier with ``shm_path``), helper processes with their own GIL map the
same file and read there instead.

A helper reads only what the page cache holds (``RWF_NOWAIT``) and only unencrypted ``none``
records it can verify in place (:func:`~tierkv.records.none_parts_match`: header, key and
checksum; an encrypted tier reads in its own threads). It answers
each record with its size when verified, else 0, and the driver then reads that record in its own
threads as it would have (a cold record, a damaged one, another codec, an absent file): so a
helper never decides a verdict other than "verified". A helper that dies is counted and not used
again; one whose parent dies sees its request pipe close and exits. Helpers run in their own
session, so a terminal's Ctrl-C reaches the parent only, which then closes them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from tierkv.blocks.sharedmem import SharedRegion, region_of

__all__ = ["Item", "ReaderProcess", "ReaderProcesses", "supported"]

#: one record for a helper: (region id, offset in the region, row length, path, expected header)
Item = tuple[int, int, int, str, bytes]
_STOP_S = 2.0
#: a helper maps regions up to this size populated (page tables filled at start, so its first
#: reads take no page faults); larger ones (a host's whole CPU offload region) it maps lazily:
#: page tables for 100 GiB would cost each helper 200 MiB and seconds of start-up
POPULATE_MAX_BYTES = 8 << 30


def supported() -> bool:
    """Whether helpers can run here: non-blocking page-cache reads (Linux) and a Python to start."""
    return getattr(os, "RWF_NOWAIT", None) is not None and bool(sys.executable)


class ReaderProcess:
    """One helper process; :meth:`read` hands it a batch and waits for its answers."""

    def __init__(self, regions: list[SharedRegion]) -> None:
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        specs = [f"{r.id}:{r.fd}:{r.size}:{int(r.size <= POPULATE_MAX_BYTES)}" for r in regions]
        root = str(Path(__file__).resolve().parents[3])  # holds the package
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path}
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tierkv.backends.fsspec._readchild", str(req_r), str(rep_w), *specs],
                pass_fds=(req_r, rep_w, *(r.fd for r in regions)), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env)
        finally:
            os.close(req_r)
            os.close(rep_w)
        self._send = Connection(req_w, readable=False)
        self._recv = Connection(rep_r, writable=False)
        self.regions = frozenset(r.id for r in regions)
        self.state = "starting"
        self._lock = threading.Lock()

    def ready(self) -> bool:
        """True once the helper has mapped the regions (never waits)."""
        return self.wait_ready(0.0)

    def wait_ready(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the helper to be ready (0: not at all); whether it is."""
        if self.state == "starting" and self._lock.acquire(timeout=max(0.0, timeout)):
            try:
                if self.state == "starting" and self._recv.poll(max(0.0, timeout)):
                    self.state = "ready" if self._recv.recv() == "ready" else "dead"
            except (EOFError, OSError):
                self.state = "dead"
            finally:
                self._lock.release()
        return self.state == "ready"

    def read(self, items: list[Item], per_request: int = 0,
             answered: Callable[[int, list[int]], None] | None = None) -> list[int]:
        """Per item, the verified record's size, or 0 (the caller reads it itself).

        With ``per_request``, the items go in requests of that many, two in flight, and
        ``answered(start, sizes)`` runs as each request's answer comes back, while the helper
        reads the next one (the caller copies verified rows out as the rest are read). Answers
        received before the helper died keep their sizes: those rows were verified, and a dead
        helper writes nothing more."""
        n = len(items)
        out = [0] * n
        step = per_request if 0 < per_request < n else max(n, 1)
        starts = list(range(0, n, step))
        with self._lock:
            if self.state != "ready":
                return out
            sent, clean = 0, False
            try:
                for k, start in enumerate(starts):
                    while sent < len(starts) and sent <= k + 1:
                        self._send.send(items[starts[sent]:starts[sent] + step])
                        sent += 1
                    got = self._recv.recv()
                    if not isinstance(got, list) or len(got) != min(step, n - start):
                        break
                    out[start:start + len(got)] = got
                    if answered is not None:
                        answered(start, got)
                else:
                    clean = True
            except (EOFError, OSError):
                pass
            finally:
                if not clean:
                    # died, answered nonsense, or a callback raised: nothing more of it is used, and
                    # no write of its may land in rows the caller now reads itself
                    if self.state == "ready":
                        self.state = "dead"
                    self._end()
            return out

    def _end(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()

    def close(self) -> None:
        """Close its pipes (it exits on that) and wait for it; kill it when it does not go.

        A batch in progress ends first (killed when it takes over two seconds), so no write of
        the helper's lands after its reader has returned."""
        if not self._lock.acquire(timeout=_STOP_S):
            self.proc.kill()
            self._lock.acquire()
        try:
            if self.state != "dead":
                self.state = "closed"
            for conn in (self._send, self._recv):
                try:
                    conn.close()
                except OSError:
                    pass
        finally:
            self._lock.release()
        try:
            self.proc.wait(_STOP_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ReaderProcesses:
    """``count`` helpers over the shared regions that are live when they start."""

    def __init__(self, count: int, regions: list[SharedRegion]) -> None:
        self.regions = {r.id for r in regions}
        self.procs: list[ReaderProcess] = []
        try:
            for _ in range(count):
                self.procs.append(ReaderProcess(regions))
        except OSError:
            self.close()
            raise

    def ready(self) -> list[ReaderProcess]:
        """The helpers that can take a batch now."""
        out = []
        for p in self.procs:
            if p.ready():
                out.append(p)
            elif p.state == "dead" and p.proc.poll() is None:
                p.close()
        return out

    def wait_ready(self, timeout: float) -> int:
        """Wait, at most ``timeout`` seconds in all, until every helper is ready (or dead); how
        many are ready."""
        deadline = time.monotonic() + timeout
        return sum(p.wait_ready(deadline - time.monotonic()) for p in self.procs)

    def dead(self) -> int:
        """How many helpers died (or answered what they should not)."""
        return sum(p.state == "dead" for p in self.procs)

    def items(self, paths: list[str], inplace: list[tuple[bytes, Any]]
              ) -> tuple[list[int], list[Item], bool]:
        """The positions whose rows lie in a region the helpers map, their items, and whether
        some row lies in a region mapped after the helpers started (they cannot reach it)."""
        positions: list[int] = []
        items: list[Item] = []
        unknown = False
        for i, (header, row) in enumerate(inplace):
            found = region_of(row.ctypes.data, row.nbytes)
            if found is None:
                continue
            if found[0].id in self.regions:
                positions.append(i)
                items.append((found[0].id, found[1], row.nbytes, paths[i], header))
            else:
                unknown = True
        return positions, items, unknown

    def close(self) -> None:
        """Stop every helper."""
        for p in self.procs:
            p.close()

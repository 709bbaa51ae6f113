"""Batch record I/O (tierkv.records.batchio): the C module against its Python fallback, a plain
Python loop and fio, on records of 256 KiB, 1 MiB and 2 MiB in one directory.

    python bench/batchio.py [--sizes 256,1024,2048] [--mib 256] [--threads 4] [--batch 32]
                            [--repeats 3] [--dir DIR] [--no-drop-caches] [--json FILE]

Per size, ``--mib`` MiB of records (one file each), written then read with a warm page cache
(every file read once, untimed, first) and a cold one (``sync`` then ``echo 3 >
/proc/sys/vm/drop_caches``, as root; else each file's pages dropped with ``posix_fadvise``).
Every system uses ``--threads`` threads:

- *native*: ``tierkv.records._batchio``, calls of ``--batch`` records from each of ``--threads``
  threads (as the tier's I/O threads call it);
  writes as the local tier's defaults make them: temporary file then rename, no fsync
  (``fsync: false``), ``O_DIRECT`` for records of 64 KiB and more (``direct_io: auto``); reads
  buffered (the tier reads buffered, docs/design.md);
- *python*: the pure-Python fallback, the same calls;
- *loop*: a plain Python loop on each thread: ``open / write / close`` of a temporary name then
  ``os.replace`` (buffered), and ``open / readinto / close``;
- *fio psync*: ``fio --ioengine=psync --numjobs=--threads --bs=<record> --filesize=<record>``
  over as many files (``--direct=1`` for writes: the device's rate, as the tier writes; buffered
  reads, like everyone's);
- *fio libaio*: ``--ioengine=libaio --direct=1 --iodepth=--threads``, one job: the device with
  the same number of requests in flight (writes and cold reads).

MB/s (1 MB = 1e6 bytes), medians of ``--repeats`` rounds; ``+sync``: stores counting a ``sync``
after them (what buffered writes still owe the device). ``x fio``: native / fio psync of the
same phase; ``x loop``: native / the loop; both per round, then the median. ``cpu``: CPU time of
this process (every thread, ``getrusage``) per MiB moved: on a shared machine steadier than MB/s.
``warm busy``: a warm load again while another thread of the process runs pure-Python code (an
engine's scheduler, say); ``spin``: that thread's speed meanwhile, as a fraction of its speed
alone (measured at the start).
The systems run in a different order each round; warm loads take the median of three passes. fio
reads every record into the same small buffer (cache-hot), the others into rows of one large
array, as a pool is: warm, fio is an upper bound rather than a like-for-like figure. Last, the
xxh3_64 checksum of every row just read (``xxhash.xxh3_64(row)``, which releases the GIL while it
hashes), what a verified load adds.
"""

from __future__ import annotations

import benchmain  # first: Ctrl-C while the imports below load ends quietly

# isort: split

import argparse
import contextlib
import functools
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import xxhash

from tierkv.records import batchio
from tierkv.records.tempnames import temp_name

PHASES = ("store", "warm", "cold")
#: warm loads are short (a page-cache copy): each round takes the median of this many passes
WARM_PASSES = 3
SYSTEMS = ("native", "python", "loop", "fio psync", "fio libaio")


def drop_caches(root: str) -> None:
    """Empty the page cache (root), else drop the pages of every file under ``root``."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return
    except OSError:
        pass
    for d, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def read_once(paths: list[str]) -> None:
    for p in paths:
        with open(p, "rb") as f:
            while f.read(8 << 20):
                pass


class Ours:
    """The native module, its fallback or the plain loop, on ``threads`` threads."""

    def __init__(self, name: str, size: int, count: int, threads: int, batch: int) -> None:
        self.name, self.size, self.threads, self.batch = name, size, threads, batch
        rng = np.random.default_rng(size)
        self.data = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(min(count, 8))]
        self.rows = np.ones((count, size), np.uint8)  # touched, as a serving pool is
        self.count = count
        self.pool = ThreadPoolExecutor(threads)

    def paths(self, root: str) -> list[str]:
        return [f"{root}/r{i:06d}" for i in range(self.count)]

    def _parts(self, root: str) -> list[tuple[str, str, Any]]:
        return [(p, temp_name(p), self.data[i % len(self.data)]) for i, p in enumerate(self.paths(root))]

    def _split(self, n: int) -> list[range]:
        step = -(-n // self.threads)
        return [range(i, min(n, i + step)) for i in range(0, n, step)]

    def store(self, root: str) -> None:
        items = self._parts(root)
        if self.name == "loop":
            def loop(r: range) -> None:
                for i in r:
                    final, tmp, buf = items[i]
                    with open(tmp, "wb") as f:
                        f.write(buf)
                    os.replace(tmp, final)

            list(self.pool.map(loop, self._split(len(items))))
            return
        impl = batchio.implementation(self.name)

        def batches(r: range) -> None:
            for i in range(r.start, r.stop, self.batch):
                j = min(r.stop, i + self.batch)
                sizes, _, _ = impl.write_batch(items[i:j], False, 0o600, True, 65536)
                if any(s != self.size for s in sizes):
                    raise OSError(f"{self.name}: a write failed: {sizes}")

        list(self.pool.map(batches, self._split(len(items))))

    def load(self, root: str) -> None:
        paths = self.paths(root)
        if self.name == "loop":
            rows = self.rows

            def loop(r: range) -> None:
                for i in r:
                    with open(paths[i], "rb", buffering=0) as f:
                        f.readinto(rows[i])

            list(self.pool.map(loop, self._split(len(paths))))
            return
        impl = batchio.implementation(self.name)

        def batches(r: range) -> None:
            for i in range(r.start, r.stop, self.batch):
                j = min(r.stop, i + self.batch)
                got = impl.read_batch(paths[i:j], list(self.rows[i:j]), False, False)
                if any(g != self.size for g in got):
                    raise OSError(f"{self.name}: a read failed: {got}")

        list(self.pool.map(batches, self._split(len(paths))))

    def checksums(self) -> None:
        """xxh3_64 of every row, as a verifying load would (streaming: the GIL is released)."""
        for row in self.rows:
            xxhash.xxh3_64(row).intdigest()

    def check(self) -> None:
        for i in (0, self.count - 1):
            if not np.array_equal(self.rows[i], self.data[i % len(self.data)]):
                raise AssertionError(f"{self.name}: record {i} read back wrong")
        self.rows[:] = 0


def fio(root: str, phase: str, engine: str, size: int, count: int, threads: int) -> float:
    """MB/s of one fio run over ``count`` files of ``size`` bytes in ``root``."""
    jobs = 1 if engine == "libaio" else threads
    direct = engine == "libaio" or phase == "store"
    cmd = ["fio", "--name=rec", f"--directory={root}", f"--rw={'write' if phase == 'store' else 'read'}",
           f"--bs={size}", f"--filesize={size}", f"--nrfiles={count // jobs}", f"--numjobs={jobs}",
           f"--ioengine={engine}", f"--direct={int(direct)}", "--group_reporting", "--output-format=json",
           "--file_service_type=sequential", "--openfiles=1", "--fallocate=none", "--create_on_open=1",
           f"--iodepth={threads if engine == 'libaio' else 1}", "--invalidate=0"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["write" if phase == "store" else "read"]
    if not side["runtime"]:
        return float("nan")
    return float(side["io_bytes"]) / (float(side["runtime"]) / 1000) / 1e6


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return ru.ru_utime + ru.ru_stime


#: iterations per second of :class:`Busy`'s loop with nothing else running in this process
SPIN_IDLE = [0.0]


class Busy:
    """A thread running pure-Python code, as an engine's scheduler does, for a ``with`` block:
    ``rate``: its iterations per second meanwhile."""

    def __init__(self) -> None:
        self.n, self.stop, self.rate = 0, False, 0.0
        self.thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        while not self.stop:
            self.n += 1

    def __enter__(self) -> Busy:
        self.t = time.perf_counter()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop = True
        self.thread.join()
        self.rate = self.n / (time.perf_counter() - self.t)


def timed(fn: Callable[[], None], cpu: list[float] | None = None) -> float:
    """Wall seconds of ``fn()``; its CPU seconds (all threads) appended to ``cpu``."""
    c, t = _cpu(), time.perf_counter()
    fn()
    t = time.perf_counter() - t
    if cpu is not None:
        cpu.append(_cpu() - c)
    return t


def one_round(base: str, size: int, count: int, args: argparse.Namespace, ours: dict[str, Ours], turn: int
              ) -> dict[str, dict[str, float]]:
    mb, mib = size * count / 1e6, size * count / (1 << 20)
    out: dict[str, dict[str, float]] = {}
    order = SYSTEMS[turn % len(SYSTEMS):] + SYSTEMS[:turn % len(SYSTEMS)]  # drift spreads over all
    for name in order:
        root = tempfile.mkdtemp(prefix=name.replace(" ", "-") + "-", dir=base)
        try:
            r: dict[str, float] = {}
            os.sync()
            if name.startswith("fio"):
                engine = name.split()[1]
                r["store"] = fio(root, "store", engine, size, count, args.threads)
                if engine == "psync":
                    read_once([os.path.join(root, f) for f in os.listdir(root)])
                    r["warm"] = statistics.median(fio(root, "warm", engine, size, count, args.threads)
                                                  for _ in range(WARM_PASSES))
                if args.drop_caches:
                    drop_caches(root)
                    r["cold"] = fio(root, "cold", engine, size, count, args.threads)
            else:
                sys_ = ours[name]
                cpu: list[float] = []
                t = timed(functools.partial(sys_.store, root), cpu)
                ts = timed(os.sync)
                r["store"], r["store+sync"], r["cpu store"] = mb / t, mb / (t + ts), cpu[-1] / mib * 1e6
                read_once(sys_.paths(root))
                r["warm"] = mb / statistics.median(timed(functools.partial(sys_.load, root), cpu)
                                                   for _ in range(WARM_PASSES))
                r["cpu warm"] = statistics.median(cpu[-WARM_PASSES:]) / mib * 1e6
                sys_.check()
                with Busy() as busy:
                    r["warm busy"] = mb / timed(functools.partial(sys_.load, root))
                r["spin"] = busy.rate / SPIN_IDLE[0]
                sys_.check()
                if name == "native":
                    r["xxh3"] = mb / timed(sys_.checksums)
                if args.drop_caches:
                    drop_caches(root)
                    r["cold"] = mb / timed(functools.partial(sys_.load, root), cpu)
                    r["cpu cold"] = cpu[-1] / mib * 1e6
                    sys_.check()
            out[name] = r
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=benchmain.positive_list, default=[256, 1024, 2048],
                    help="record sizes in KiB (default 256,1024,2048)")
    pos = benchmain.positive
    ap.add_argument("--mib", type=pos, default=256, help="MiB of records per size (default 256)")
    ap.add_argument("--threads", type=pos, default=4, help="threads of every system (default 4)")
    ap.add_argument("--batch", type=pos, default=32, help="records per batch call (default 32)")
    ap.add_argument("--repeats", type=benchmain.positive, default=3, help="rounds (default 3)")
    ap.add_argument("--dir", type=benchmain.directory, default=None,
                    help="where the files go (default: a new directory under /var/tmp, a disk)")
    ap.add_argument("--drop-caches", action=argparse.BooleanOptionalAction, default=True,
                    help="measure cold reads (default on)")
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = ap.parse_args(argv)
    if shutil.which("fio") is None:
        sys.exit("batchio: needs fio (the OS package: apt-get install fio)")
    if batchio.native_error() is not None:
        sys.exit(f"batchio: {batchio.native_error()}: build it with pip install -e . (or scripts/dev)")
    print(f"tierkv batchio bench: {os.cpu_count()} CPUs {platform.machine()}, Python "
          f"{platform.python_version()}, {args.threads} threads, batches of {args.batch}; MB/s, medians of "
          f"{args.repeats} rounds; load average {os.getloadavg()[0]:.1f} at the start")
    with Busy() as idle:
        time.sleep(0.5)
    SPIN_IDLE[0] = idle.rate
    base = benchmain.remove_at_exit(tempfile.mkdtemp(prefix="tierkv-batchio-", dir=args.dir or "/var/tmp"))
    results: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "json"}, "sizes": {}}
    try:
        for kib in args.sizes:
            size = kib << 10
            count = max(args.threads, (args.mib << 20) // size // args.threads * args.threads)
            ours = {n: Ours(n, size, count, args.threads, args.batch) for n in ("native", "python", "loop")}
            rounds = [one_round(base, size, count, args, ours, k) for k in range(args.repeats)]
            results["sizes"][kib] = rounds
            report(kib, rounds)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _med(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def report(kib: int, rounds: list[dict[str, dict[str, float]]]) -> None:
    cols = ("store", "store+sync", "warm", "cold", "cpu store", "cpu warm", "cpu cold", "warm busy", "spin")
    print(f"\n{kib} KiB records (MB/s; cpu: CPU us of this process per MiB)")
    print(f"  {'system':<11}" + "".join(f"{c:>11}" for c in cols) + "   x fio (store/warm/cold)   x loop")
    for name in SYSTEMS:
        row = [_med([r[name].get(c, float("nan")) for r in rounds]) for c in cols]
        cells = "".join(f"{v:>11.2f}" if c == "spin" and v == v else f"{v:>11.0f}" if v == v else f"{'-':>11}"
                        for c, v in zip(cols, row, strict=True))
        extra = ""
        if name == "native":
            nan = float("nan")
            fx = [_med([r["native"].get(p, nan) / r["fio psync"].get(p, nan) for r in rounds])
                  for p in PHASES]
            lx = [_med([r["native"][p] / r["loop"][p] for r in rounds if p in r["native"]]) for p in PHASES]
            extra = ("   " + " / ".join(f"{x:.2f}" for x in fx) + "        "
                     + " / ".join(f"{x:.2f}" for x in lx))
        print(f"  {name:<11}{cells}{extra}")
    xxh = _med([r["native"]["xxh3"] for r in rounds])
    print(f"  xxh3_64 over the rows just read: {xxh:.0f} MB/s ({1.048576e6 / xxh:.0f} us per MiB)")


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        benchmain.run(main)

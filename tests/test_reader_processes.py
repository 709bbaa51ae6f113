"""Reader processes: records read straight into a pool in shared memory by helper processes are
the stored bytes; anything a helper cannot verify (damage, a cold record, a helper that died) is
read in threads as before, never served wrong; helpers end with the tier, and with their parent."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from helpers import ctrl_c, evict

from tierkv import GroupSpec, Layout, Lookup, TieredStore
from tierkv.backends.base import TierContext
from tierkv.backends.fsspec import FsspecTier, FsspecTierConfig
from tierkv.backends.fsspec import _local as local_driver
from tierkv.backends.fsspec import _readproc as readproc
from tierkv.backends.fsspec._readproc import ReaderProcesses
from tierkv.blocks import sharedmem
from tierkv.blocks.pool import PoolPlan, plan_pools, shared_pool_tensors
from tierkv.errors import ConfigError
from tierkv.keys import make_key

pytestmark = [pytest.mark.anyio,
              pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="reader processes need Linux")]

BB = 64 * 1024
N = 24


def layout() -> Layout:
    return Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=BB)])


def ctx() -> TierContext:
    lay = layout()
    return TierContext(layout=lay, namespace="readers", fingerprint=lay.fingerprint("readers"))


def keys(n: int = N) -> list[bytes]:
    return [make_key(i.to_bytes(32, "big"), 0) for i in range(n)]


def blocks(n: int = N, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, BB), dtype=torch.uint8, generator=g)


def plan(n: int = N) -> PoolPlan:
    return plan_pools(None, layout(), 1, {0: n})


def tier(root: Path, **kw: Any) -> FsspecTier:
    return FsspecTier(FsspecTierConfig(url=f"file://{root}", **kw), ctx())


async def stored(root: Path, data: torch.Tensor) -> None:
    t = tier(root)
    await t.open()
    try:
        assert await t.put(0, keys(len(data)), data) == [True] * len(data)
    finally:
        await t.close()
    warm(root)


def warm(root: Path) -> None:
    """Read every record file, so the page cache holds them (direct writes leave them out)."""
    for p in root.rglob("*.tkv"):
        p.read_bytes()


def backend(t: FsspecTier) -> dict[str, int]:
    """The tier's counters with its driver's (as the store's stats report them)."""
    t.used_bytes()
    return t.counters


def readers_of(t: FsspecTier) -> ReaderProcesses:
    readers = t.driver._readers  # type: ignore[attr-defined]
    assert readers is not None, "no reader processes started"
    deadline = time.monotonic() + 20
    while len(readers.ready()) < len(readers.procs):
        assert time.monotonic() < deadline, "reader processes never became ready"
        time.sleep(0.01)
    return readers


HelperTier = tuple[FsspecTier, torch.Tensor, torch.Tensor]


@contextlib.asynccontextmanager
async def with_helpers(tmp_path: Path, count: int) -> AsyncIterator[HelperTier]:
    """A tier with ``count`` ready helpers, its stored blocks (in the page cache) and a zeroed pool
    in shared memory to read them into."""
    data = blocks()
    await stored(tmp_path / "t", data)
    pool = shared_pool_tensors(str(tmp_path / "pool"), plan())[0]
    t = tier(tmp_path / "t", read_processes=count)
    await t.open()
    try:
        readers_of(t)
        pool.zero_()
        yield t, data, pool
    finally:
        await t.close()


async def test_rows_in_shared_memory_are_read_by_helpers_and_hold_the_stored_bytes(tmp_path: Path) -> None:
    async with with_helpers(tmp_path, 2) as (t, data, pool):
        readers = readers_of(t)
        assert len(readers.procs) == 2
        seen: list[tuple[int, bytes]] = []  # rows reported verified, as they were then
        found = await t.get(0, keys(), pool, lambda i: seen.append((i, pool[i].numpy().tobytes())))
        assert found == [True] * N
        assert torch.equal(pool, data)
        assert backend(t).get("reader_reads") == N  # every record by a helper, none by a thread
        # each reported at once (a waiting get copies it out: tierkv.blocks.rowsink), with its bytes
        assert sorted(i for i, _ in seen) == list(range(N))
        assert all(row == data[i].numpy().tobytes() for i, row in seen)
        procs = [p.proc for p in readers.procs]
    assert all(p.returncode is not None for p in procs), "helpers outlived their tier"


async def test_a_helper_hands_rows_over_while_it_reads_the_rest(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(local_driver, "HELPER_REQUEST_BYTES", 3 * BB)  # requests of 3 records
    async with with_helpers(tmp_path, 1) as (t, data, pool):
        written_at_first: list[int] = []

        def landed(i: int) -> None:
            if not written_at_first:
                written_at_first.extend(j for j in range(N) if pool[j].any())

        assert await t.get(0, keys(), pool, landed) == [True] * N
        assert torch.equal(pool, data)
        assert backend(t).get("reader_reads") == N
        # the first rows were reported while the helper had at most two requests (six records)
        assert 3 <= len(written_at_first) <= 6, written_at_first


async def test_a_helper_that_dies_between_requests_keeps_what_it_verified(tmp_path: Path,
                                                                         monkeypatch: Any) -> None:
    monkeypatch.setattr(local_driver, "HELPER_REQUEST_BYTES", 3 * BB)
    async with with_helpers(tmp_path, 1) as (t, data, pool):
        helper = readers_of(t).procs[0]

        def landed(i: int) -> None:
            if helper.proc.poll() is None:
                helper.proc.kill()
                helper.proc.wait()

        assert await t.get(0, keys(), pool, landed) == [True] * N
        assert torch.equal(pool, data)  # what it had not answered was read in threads
        assert backend(t).get("reader_deaths") == 1
        assert backend(t).get("reader_reads") in (3, 6)  # its answers before it died


@pytest.mark.parametrize("bad", [2, N // 3])  # the second answer, the last
async def test_a_helper_that_answers_nonsense_is_ended_and_its_verified_answers_stand(
        tmp_path: Path, monkeypatch: Any, bad: int) -> None:
    monkeypatch.setattr(local_driver, "HELPER_REQUEST_BYTES", 3 * BB)

    class Garbled:
        """The helper's answers, answer ``bad`` cut to one size (a confused helper)."""

        def __init__(self, conn: Any) -> None:
            self.conn, self.answers = conn, 0

        def recv(self) -> Any:
            got = self.conn.recv()
            self.answers += 1
            return got[:1] if self.answers == bad else got

        def close(self) -> None:
            self.conn.close()

    async with with_helpers(tmp_path, 1) as (t, data, pool):
        helper = readers_of(t).procs[0]
        helper._recv = Garbled(helper._recv)  # type: ignore[assignment]
        assert await t.get(0, keys(), pool, lambda i: None) == [True] * N
        assert torch.equal(pool, data)  # the rest read in threads
        assert helper.state == "dead" and helper.proc.poll() is not None
        assert backend(t).get("reader_deaths") == 1
        assert backend(t).get("reader_reads") == 3 * (bad - 1)  # its answers before, verified


async def test_the_helpers_are_ready_once_the_tier_is_open(tmp_path: Path) -> None:
    """A helper's start is CPU work (an interpreter, its mappings): the tier's open waits for it,
    so it never competes with the first restore after a restart (a restore timed at once after
    the open ran at half speed on two cores while two helpers started)."""
    pool = shared_pool_tensors(str(tmp_path / "pool"), plan())  # a live region: helpers start
    t = tier(tmp_path / "t", read_processes=2)
    await t.open()
    try:
        readers = t.driver._readers  # type: ignore[attr-defined]
        assert readers is not None and len(readers.ready()) == 2
    finally:
        await t.close()
        del pool


def _mapped_kib(pid: int, inode: int) -> int:
    """Resident KiB of process ``pid``'s mappings of the file with ``inode``."""
    total, ours = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" in head[3]:
                ours = int(head[4]) == inode
            elif ours and head[0] == "Rss:":
                total += int(head[1])
    return total


@pytest.mark.parametrize("populate_max", [1 << 30, 0])
async def test_helpers_map_small_pools_populated_and_large_ones_lazily(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, populate_max: int) -> None:
    """A helper fills its page tables for a pool up to ``POPULATE_MAX_BYTES`` at start (no page
    faults in its first reads), and maps a larger one (a host's whole CPU region) lazily; either
    way it reads the stored bytes."""
    monkeypatch.setattr(readproc, "POPULATE_MAX_BYTES", populate_max)
    data = blocks()
    await stored(tmp_path / "t", data)
    pool = shared_pool_tensors(str(tmp_path / "pool"), plan())[0]
    inode = os.stat(tmp_path / "pool").st_ino
    t = tier(tmp_path / "t", read_processes=1)
    await t.open()
    try:
        (helper,) = readers_of(t).procs
        before = _mapped_kib(helper.proc.pid, inode)
        if populate_max:
            assert before >= N * BB // 1024
        else:
            assert before < N * BB // 1024 // 2
        warm(tmp_path / "t")
        assert await t.get(0, keys(), pool) == [True] * N
        assert torch.equal(pool, data)
        assert backend(t).get("reader_reads") == N
        assert _mapped_kib(helper.proc.pid, inode) >= N * BB // 1024
    finally:
        await t.close()


async def test_a_pool_mapped_after_the_helpers_started_is_read_by_new_helpers(tmp_path: Path) -> None:
    data = blocks()
    await stored(tmp_path / "t", data)
    early = shared_pool_tensors(str(tmp_path / "early"), plan())[0]
    t = tier(tmp_path / "t", read_processes=1)
    await t.open()
    try:
        first = readers_of(t)
        late = shared_pool_tensors(str(tmp_path / "late"), plan())[0]
        assert await t.get(0, keys(), late) == [True] * N  # in threads, while new helpers start
        assert torch.equal(late, data)
        assert readers_of(t) is not first
        late.zero_()
        warm(tmp_path / "t")  # helpers read what the page cache holds: have it hold the records now
        assert await t.get(0, keys(), late) == [True] * N
        assert torch.equal(late, data)
        counts = backend(t)
        assert counts.get("reader_reads") == N
        assert not counts.get("reader_deaths")
        assert first.procs[0].proc.returncode is not None, "the replaced helper still runs"
    finally:
        await t.close()
    del early


async def test_a_damaged_record_is_a_counted_miss_with_helpers_on(tmp_path: Path) -> None:
    data = blocks()
    root = tmp_path / "t"
    await stored(root, data)
    victim = next(p for p in sorted(root.rglob("*.tkv")))
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    victim.write_bytes(bytes(raw))
    pool = shared_pool_tensors(str(tmp_path / "pool"), plan())[0]
    t = tier(root, read_processes=1)
    await t.open()
    try:
        readers_of(t)
        warm(root)
        found = await t.get(0, keys(), pool)
        counts = backend(t)
    finally:
        await t.close()
    assert found.count(False) == 1
    bad = found.index(False)
    assert counts.get("corrupt") == 1
    assert counts.get("reader_reads") == N - 1
    good = [i for i in range(N) if i != bad]
    assert torch.equal(pool[good], data[good])
    assert not victim.exists(), "the damaged record was not removed"


async def test_records_out_of_the_page_cache_and_absent_ones_are_read_in_threads(tmp_path: Path) -> None:
    data = blocks()
    root = tmp_path / "t"
    await stored(root, data)
    files = sorted(root.rglob("*.tkv"))
    for p in files[: N // 2]:
        evict(p)
    pool = shared_pool_tensors(str(tmp_path / "pool"), plan(N + 1))[0]
    t = tier(root, read_processes=1)
    await t.open()
    try:
        readers_of(t)
        found = await t.get(0, [*keys(), make_key(b"\xff" * 32, 0)], pool)
    finally:
        await t.close()
    assert found == [True] * N + [False]
    assert torch.equal(pool[:N], data)


async def test_a_cold_batch_skips_the_helpers_and_a_warm_one_uses_them(tmp_path: Path) -> None:
    """After a restart nothing is in the page cache: a batch whose first record is not there goes
    straight to the threads that wait for the device, without a round trip through helpers that
    would turn every record away; once read, the same records are the helpers' again."""
    data = blocks()
    root = tmp_path / "t"
    await stored(root, data)
    for p in root.rglob("*.tkv"):
        evict(p)
    pool = shared_pool_tensors(str(tmp_path / "pool"), plan(N))[0]
    t = tier(root, read_processes=1)
    await t.open()
    try:
        readers_of(t)
        assert await t.get(0, keys(), pool) == [True] * N
        assert torch.equal(pool, data)
        cold = backend(t)
        assert cold.get("reader_batches_cold") == 1 and not cold.get("reader_reads")
        pool.zero_()
        warm(root)
        assert await t.get(0, keys(), pool) == [True] * N
        assert torch.equal(pool, data)
        after = backend(t)
        assert after.get("reader_batches_cold") == 1 and after.get("reader_reads") == N
    finally:
        await t.close()


async def test_a_helper_that_dies_is_counted_and_its_reads_go_to_threads(tmp_path: Path) -> None:
    data = blocks()
    await stored(tmp_path / "t", data)
    pool = shared_pool_tensors(str(tmp_path / "pool"), plan())[0]
    t = tier(tmp_path / "t", read_processes=1)
    await t.open()
    try:
        readers = readers_of(t)
        readers.procs[0].proc.kill()
        readers.procs[0].proc.wait()
        for _ in range(2):  # the death is found by the first call, which reads in threads
            pool.zero_()
            assert await t.get(0, keys(), pool) == [True] * N
            assert torch.equal(pool, data)
        assert backend(t).get("reader_deaths") == 1
        assert not backend(t).get("reader_reads")
    finally:
        await t.close()


async def test_private_rows_and_read_processes_0_use_threads_only(tmp_path: Path) -> None:
    data = blocks()
    await stored(tmp_path / "t", data)
    shared_pool = shared_pool_tensors(str(tmp_path / "pool"), plan())[0]
    t = tier(tmp_path / "t", read_processes=0)
    await t.open()
    try:
        assert t.driver._readers is None  # type: ignore[attr-defined]
        assert await t.get(0, keys(), shared_pool) == [True] * N
    finally:
        await t.close()
    t = tier(tmp_path / "t", read_processes=1)
    await t.open()
    try:
        readers_of(t)
        out = torch.zeros_like(data)  # private memory: the helpers cannot write there
        assert await t.get(0, keys(), out) == [True] * N
        assert torch.equal(out, data)
        assert not backend(t).get("reader_reads")
    finally:
        await t.close()


async def test_a_store_restores_a_prefix_into_its_shared_pool_through_helpers(tmp_path: Path) -> None:
    data = blocks()
    hashes = [k[:32] for k in keys()]
    file_tier = {"kind": "fsspec", "url": f"file://{tmp_path / 't'}"}
    base = {"layout": layout(), "namespace": "readers"}
    async with TieredStore({**base, "tiers": [{"kind": "cpu", "slots": {0: N}}, file_tier]}) as store:
        await store.put(0, hashes, data)
        await store.flush()
    for p in (tmp_path / "t").rglob("*.tkv"):  # helpers read what the page cache holds
        p.read_bytes()
    shared = {"kind": "cpu", "slots": {0: N}, "shm_path": str(tmp_path / "pool")}
    async with TieredStore({**base, "tiers": [shared, {**file_tier, "read_processes": 2}]}) as store:
        readers_of(store._tiers[1])  # type: ignore[arg-type]  # started with the tier, ready soon after
        deadline = time.monotonic() + 10
        while True:
            pl = store.lookup_prefix(hashes, request_id="r")
            if pl.state is not Lookup.PENDING:
                break
            assert time.monotonic() < deadline
            await anyio.sleep(0.002)
        assert (pl.state, pl.blocks) == (Lookup.HIT, N)
        out = torch.zeros_like(data)
        await store.get(0, hashes, out, request_id="r")
        assert torch.equal(out, data)
        counters = store.stats().tiers[1].backend
        store.release("r")
    assert counters.get("reader_reads", 0) > 0, counters


def test_read_processes_must_be_auto_or_a_count(tmp_path: Path) -> None:
    for bad in (-1, "many", 1.5):
        with pytest.raises(ConfigError, match="read_processes"):
            TieredStore({"layout": layout(), "namespace": "x",
                         "tiers": [{"kind": "cpu", "slots": {0: 2}},
                                   {"kind": "fsspec", "url": f"file://{tmp_path}", "read_processes": bad}]})


def test_a_region_is_forgotten_when_its_mapping_is_freed(tmp_path: Path) -> None:
    pool = shared_pool_tensors(str(tmp_path / "pool"), plan())[0]
    address = pool.data_ptr()
    found = sharedmem.region_of(address, pool.nbytes)
    assert found is not None and found[1] == 0
    fd = found[0].fd
    os.fstat(fd)
    del pool
    gc.collect()
    assert sharedmem.region_of(address, 1) is None
    with pytest.raises(OSError):
        os.fstat(fd)


def test_helpers_end_when_their_parent_is_killed(tmp_path: Path) -> None:
    data = blocks()
    anyio.run(stored, tmp_path / "t", data)
    script = textwrap.dedent(f"""
        import anyio, sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_reader_processes import plan, tier, readers_of
        from tierkv.blocks.pool import shared_pool_tensors
        from pathlib import Path
        pool = shared_pool_tensors({str(tmp_path / 'pool')!r}, plan())[0]
        async def main():
            t = tier(Path({str(tmp_path / 't')!r}), read_processes=2)
            await t.open()
            print(*[p.proc.pid for p in readers_of(t).procs], flush=True)
            time.sleep(60)
        anyio.run(main)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pids = [int(x) for x in parent.stdout.readline().split()]
    assert len(pids) == 2
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in pids if _alive(p)]
    assert not alive, f"helpers {alive} outlived their killed parent"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_the_busy_restore_benchmark_runs_and_its_helpers_read(tmp_path: Path) -> None:
    bench = Path(__file__).parent.parent / "bench" / "busy_restore.py"
    out = tmp_path / "busy.json"
    res = subprocess.run([sys.executable, str(bench), "--blocks", "16", "--block-kib", "64", "--repeats", "1",
                          "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    # the helpers read what the page cache holds: on a loaded machine the kernel may drop a record
    # between the bench's warm-up read and the restore, and the tier's threads then read it (with
    # 4 records, all four were once read so on a busy machine: 16 leave the helpers some)
    read = re.search(r"read by reader processes in the last round: (\d+) of 16", res.stdout)
    assert read is not None and int(read.group(1)) >= 1, res.stdout[-2000:]

    rows = json.loads(out.read_text())["results"]
    assert {(r["variant"], r["busy"]) for r in rows} == {
        (v, b) for v in ("raw readinto", "private", "shared, read_processes 0", "shared, read_processes auto")
        for b in (False, True)}


def test_a_mapping_freed_inside_a_lookup_does_not_deadlock(tmp_path: Path) -> None:
    # A signal handler (asyncio's SIGINT handler, an engine's) runs between any two bytecodes, so a
    # collection it starts can free a shared mapping while this thread is inside region_of. That
    # froze a restore on Ctrl-C; the mapping's finalizer must not wait on region_of's lock.
    script = textwrap.dedent(f"""
        import gc, mmap, os, signal
        from tierkv.blocks import sharedmem
        fd = os.open({str(tmp_path / "map")!r}, os.O_RDWR | os.O_CREAT)
        os.ftruncate(fd, 4096)
        live = [mmap.mmap(fd, 4096) for _ in range(300)]
        for m in live:
            sharedmem.register(m, fd)
        gc.disable()
        signal.signal(signal.SIGALRM, lambda *_: gc.collect())
        signal.setitimer(signal.ITIMER_REAL, 0.002, 0.002)
        for _ in range(3000):
            m = mmap.mmap(fd, 4096)
            sharedmem.register(m, fd)
            cycle = [m]
            cycle.append(cycle)
            del m, cycle
            for _ in range(10):
                sharedmem.region_of(1, 1)
        signal.setitimer(signal.ITIMER_REAL, 0)
        gc.collect()
        print(len(sharedmem.regions()), len(os.listdir("/proc/self/fd")))
    """)
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("region_of deadlocked on a mapping freed inside it")
    assert done.returncode == 0, done.stderr
    live, fds = map(int, done.stdout.split())
    # each live mapping holds two descriptors (its own, the region's); the 3,000 freed hold none
    assert live == 300 and fds < 700


def test_ctrl_c_ends_the_busy_restore_benchmark_and_its_helpers(tmp_path: Path) -> None:
    bench = Path(__file__).parent.parent / "bench" / "busy_restore.py"
    mark = f"tierkv-test-{os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, "TIERKV_TEST_MARK": mark}
    proc = subprocess.Popen([sys.executable, str(bench), "--blocks", "32", "--block-kib", "256",
                             "--repeats", "200"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    while not marked(mark, "tierkv.backends.fsspec._readchild") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marked(mark, "tierkv.backends.fsspec._readchild"), "no helper ever started"
    time.sleep(1.0)  # well into the restore rounds
    err = ctrl_c(proc)
    assert proc.returncode == 130
    assert "interrupted" in err and "Traceback" not in err
    deadline = time.monotonic() + 10
    while marked(mark, "tierkv.backends.fsspec._readchild") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not marked(mark, "tierkv.backends.fsspec._readchild"), "a helper outlived the benchmark"


def marked(mark: str, command: str) -> list[int]:
    """The live processes whose environment holds ``mark`` and whose command line holds ``command``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if mark.encode() in environ and command.encode() in cmdline:
            found.append(int(pid))
    return found


def test_a_mapping_another_library_made_is_adopted_even_once_its_file_is_unlinked(tmp_path: Path) -> None:
    """vLLM maps its CPU offload region from a file in /dev/shm that it may unlink: the region is
    found and reopened through the descriptor vLLM keeps; private memory is not a region; a
    released region is forgotten and its descriptor closed."""
    import mmap

    fd = os.open(tmp_path / "region", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 1 << 20)
    mapped = mmap.mmap(fd, 1 << 20, flags=mmap.MAP_SHARED)
    os.unlink(tmp_path / "region")
    rows = torch.frombuffer(memoryview(mapped), dtype=torch.uint8)
    try:
        region = sharedmem.adopt(rows.data_ptr() + 4096, 8192)
        assert region is not None and region.base == rows.data_ptr() and region.size == 1 << 20
        assert sharedmem.region_of(rows.data_ptr() + 4096, 100) == (region, 4096)
        os.pwrite(region.fd, b"seen", 8)  # the descriptor is the same file: what helpers map
        assert bytes(rows[8:12].numpy()) == b"seen"
        assert sharedmem.adopt(torch.zeros(1 << 16, dtype=torch.uint8).data_ptr(), 100) is None
        sharedmem.release(region)
        assert sharedmem.region_of(rows.data_ptr() + 4096, 100) is None
        with pytest.raises(OSError):
            os.fstat(region.fd)
    finally:
        del rows
        mapped.close()
        os.close(fd)

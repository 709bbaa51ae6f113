"""Batch record I/O (tierkv.records.batchio): every case runs against the C module and the
pure-Python fallback, which must give the same results."""

from __future__ import annotations

import errno
import os
import signal
import stat
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from shutil import which
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from helpers import evict, extents
from test_filesystems import full_tmpfs

from tierkv.backends.fsspec._local import probe_nowait
from tierkv.records import _batchio_py as batchio_py
from tierkv.records import batchio, directio
from tierkv.records.tempnames import TEMP_MARK

__all__ = ["full_tmpfs"]


@pytest.fixture(params=["native", "python"])
def io(request: pytest.FixtureRequest) -> ModuleType:
    """The implementation under test."""
    if request.param == "native" and batchio.native_error() is not None:
        pytest.skip(f"the C module did not build here: {batchio.native_error()}")
    return batchio.implementation(request.param)


def data(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def write(io: ModuleType, d: Path, records: list[np.ndarray], **kw: Any) -> tuple[list[int], int, int]:
    items = [(str(d / f"r{i}"), str(d / f".r{i}{TEMP_MARK}test"), [r[:100], r[100:]])
             for i, r in enumerate(records)]
    result: tuple[list[int], int, int] = io.write_batch(items, **kw)
    return result


def temps(d: Path) -> list[Path]:
    return [p for p in d.rglob("*") if TEMP_MARK in p.name]


# ---- what a caller gets back --------------------------------------------------------------------------
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_records_read_back_byte_for_byte(io: ModuleType, tmp_path: Path, direct: bool) -> None:
    sizes = [100, 4096, 4097, 256 * 1024 + 6, (2 << 20) + 136]
    recs = [data(n, seed=n) for n in sizes]
    got, written_direct, refused = write(io, tmp_path, recs, direct=direct, direct_min=4096)
    assert got == sizes
    assert (written_direct, refused) == ((4, 0) if direct else (0, 0))
    for p, n in zip(sorted(tmp_path.iterdir(), key=lambda p: int(p.name[1:])), sizes, strict=True):
        assert p.stat().st_size == n
    # scatter reads, as a tier reads header, row and trailer (with a spare byte)
    bufs = [[bytearray(100), bytearray(n - 100), bytearray(9)] for n in sizes]
    assert io.read_batch([str(tmp_path / f"r{i}") for i in range(len(sizes))], bufs, direct) == sizes
    for r, (head, row, tail) in zip(recs, bufs, strict=True):
        assert bytes(head) + bytes(row) == r.tobytes() and tail == bytearray(9)


def test_a_pool_row_is_read_in_place(io: ModuleType, tmp_path: Path) -> None:
    pool = torch.zeros(4, 8192, dtype=torch.bfloat16)
    rec = data(128 + pool[0].nbytes + 8, seed=3)
    write(io, tmp_path, [rec])
    head, tail = bytearray(128), bytearray(9)
    row = pool.view(torch.uint8)[2].numpy()
    assert io.read_batch([tmp_path / "r0"], [[head, row, tail]]) == [rec.size]
    assert pool.view(torch.uint8)[2].numpy().tobytes() == rec[128:-8].tobytes()
    assert not pool[[0, 1, 3]].view(torch.uint8).any()


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_a_short_file_reads_short_and_a_longer_one_fills_the_buffers(io: ModuleType, tmp_path: Path,
                                                                    direct: bool) -> None:
    rec = data(10_000)
    write(io, tmp_path, [rec])
    big, small = bytearray(20_000), bytearray(4096)
    assert io.read_batch([tmp_path / "r0", tmp_path / "r0"], [big, small], direct) == [10_000, 4096]
    assert bytes(big[:10_000]) == rec.tobytes() and bytes(small) == rec[:4096].tobytes()
    (tmp_path / "empty").touch()
    assert io.read_batch([tmp_path / "empty"], [bytearray(10)], direct) == [0]


def test_what_is_not_a_record_is_told_apart(io: ModuleType, tmp_path: Path) -> None:
    write(io, tmp_path, [data(5000)])
    (tmp_path / "dir").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "r0")
    os.mkfifo(tmp_path / "fifo")  # no writer: a read that blocked would hang the test
    paths = [tmp_path / n for n in ("missing", "dir", "link", "fifo", "r0")]
    got = io.read_batch(paths, [bytearray(5000) for _ in paths])
    assert got == [-errno.ENOENT, -errno.ESPIPE, -errno.ELOOP, -errno.ESPIPE, 5000]


def test_direct_reads_need_no_alignment_of_the_buffers(io: ModuleType, tmp_path: Path) -> None:
    rec = data(3 * 4096 + 77)
    write(io, tmp_path, [rec], direct=True, direct_min=0)
    backing = bytearray(rec.size + 1)
    odd = memoryview(backing)[1:]  # one byte past the allocation's alignment
    assert io.read_batch([tmp_path / "r0"], [odd], direct=True) == [rec.size]
    assert bytes(odd) == rec.tobytes()


def test_direct_writes_follow_the_file_system_and_the_threshold(io: ModuleType, tmp_path: Path) -> None:
    recs = [data(1000), data(70_000, 1)]
    assert write(io, tmp_path, recs, direct=True)[1:] == (1, 0)  # below direct_min: buffered
    shm = Path("/dev/shm") / f"tierkv-batchio-{os.getpid()}-{io.__name__}"
    shm.mkdir()
    try:
        sizes, used, refused = write(io, shm, recs, direct=True, direct_min=0)
        assert sizes == [1000, 70_000]
        assert (used, refused) == ((2, 0) if directio.probe(str(shm)) else (0, 2))
    finally:
        for p in shm.iterdir():
            p.unlink()
        shm.rmdir()


# ---- page-cache-only reads ---------------------------------------------------------------------------------
def test_nowait_reads_what_the_page_cache_holds_and_says_when_it_would_wait(io: ModuleType,
                                                                           tmp_path: Path) -> None:
    if probe_nowait(str(tmp_path)) is not True:
        pytest.skip(f"{tmp_path} does not do RWF_NOWAIT reads (not a disk file system)")
    recs = [data(1 << 20, seed=i) for i in range(2)]
    write(io, tmp_path, recs)
    evict(tmp_path / "r1")
    bufs = [bytearray(1 << 20) for _ in recs]
    got = io.read_batch([tmp_path / "r0", tmp_path / "r1"], bufs, nowait=True)
    assert got == [1 << 20, -errno.EAGAIN]
    assert bytes(bufs[0]) == recs[0].tobytes()
    assert io.read_batch([tmp_path / "r1"], [bufs[1]]) == [1 << 20]
    assert bytes(bufs[1]) == recs[1].tobytes()


def test_asking_the_page_cache_starts_no_read_of_a_record_it_does_not_hold(io: ModuleType,
                                                                           tmp_path: Path) -> None:
    """A page-cache-only read of a cold record says -EAGAIN without starting the kernel's readahead:
    the read that waits for the device then reads it once, not after a first pass did."""
    if probe_nowait(str(tmp_path)) is not True:
        pytest.fail(f"{tmp_path} does not do RWF_NOWAIT reads: this test needs a disk file system")
    write(io, tmp_path, [data(4 << 20)])
    evict(tmp_path / "r0")
    assert io.read_batch([tmp_path / "r0"], [bytearray(4 << 20)], nowait=True) == [-errno.EAGAIN]
    time.sleep(0.3)  # a started readahead of 4 MiB has landed by now
    fd = os.open(tmp_path / "r0", os.O_RDONLY)
    try:
        held = batchio_py.page_cached(fd, 4 << 20)
        assert held is not None, "this kernel has cachestat (Linux 6.5): the machines tierkv is tested on do"
        assert held is False, "the page cache holds the record: the non-blocking read started reading it"
    finally:
        os.close(fd)


def test_direct_writes_lie_in_one_piece_on_disk(io: ModuleType, tmp_path: Path) -> None:
    """A record of whole blocks written with O_DIRECT and a tail written buffered occupies one
    extent: the tail's block is allocated with the others, not later and elsewhere."""
    recs = [data((1 << 20) + 136, seed=i) for i in range(8)]
    sizes, used, _ = write(io, tmp_path, recs, direct=True)
    assert sizes == [(1 << 20) + 136] * 8 and used == 8
    assert [extents(tmp_path / f"r{i}") for i in range(8)] == [1] * 8


def test_nowait_on_tmpfs_is_refused_with_eopnotsupp(io: ModuleType) -> None:
    if probe_nowait("/dev/shm") is not False:
        pytest.skip("this kernel's tmpfs does RWF_NOWAIT reads")
    path = Path("/dev/shm") / f"tierkv-batchio-{os.getpid()}"
    path.write_bytes(b"x" * 5000)
    try:
        assert io.read_batch([path], [bytearray(5000)], nowait=True) == [-errno.EOPNOTSUPP]
        assert io.read_batch([path], [bytearray(5000)]) == [5000]
    finally:
        path.unlink()


# ---- publishing -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("mode", "file_mode", "dir_mode"), [(0o600, 0o600, 0o700), (0o660, 0o660, 0o770),
                                                             (0o644, 0o644, 0o755)])
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_modes_under_umask_022(io: ModuleType, tmp_path: Path, mode: int, file_mode: int, dir_mode: int,
                               direct: bool) -> None:
    d = tmp_path / "new" / "sub"
    old = os.umask(0o022)
    try:
        sizes, _, _ = write(io, d, [data(100_000)], mode=mode, direct=direct)
    finally:
        os.umask(old)
    assert sizes == [100_000]
    assert stat.S_IMODE((d / "r0").stat().st_mode) == file_mode
    assert stat.S_IMODE(d.stat().st_mode) == dir_mode
    assert stat.S_IMODE(d.parent.stat().st_mode) == dir_mode


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_a_full_file_system_leaves_the_old_record_and_no_temporary(io: ModuleType, full_tmpfs: Path,
                                                                  direct: bool) -> None:
    old = data(1 << 20, seed=1)
    assert write(io, full_tmpfs, [old])[0] == [1 << 20]
    new = [data(7 << 19, seed=2), data(200, seed=3)]  # the first cannot fit beside the old one
    sizes, _, _ = write(io, full_tmpfs, new, direct=direct, direct_min=0)
    assert sizes[0] == -errno.ENOSPC and sizes[1] == 200
    assert (full_tmpfs / "r0").read_bytes() == old.tobytes()
    assert temps(full_tmpfs) == []


def test_a_rename_that_fails_removes_the_temporary(io: ModuleType, tmp_path: Path) -> None:
    (tmp_path / "r0").mkdir()
    (tmp_path / "r0" / "keep").touch()  # a non-empty directory where the record goes
    sizes, _, _ = write(io, tmp_path, [data(5000), data(6000)])
    assert sizes[0] in (-errno.EISDIR, -errno.ENOTEMPTY) and sizes[1] == 6000
    assert temps(tmp_path) == [] and (tmp_path / "r0" / "keep").exists()


def test_the_front_door_names_temporaries_itself(tmp_path: Path) -> None:
    sizes, _, _ = batchio.write_batch([(str(tmp_path / "a" / "r"), None, data(10))])
    assert sizes == [10] and [p.name for p in (tmp_path / "a").iterdir()] == ["r"]


# ---- concurrency and interrupts ---------------------------------------------------------------------------
def test_many_threads_calling_at_once(io: ModuleType, tmp_path: Path) -> None:
    errors: list[str] = []

    def one(t: int) -> None:
        d = tmp_path / str(t)
        recs = [data(65_536 + 4096 * i + t, seed=t * 100 + i) for i in range(12)]
        sizes, _, _ = write(io, d, recs, direct=t % 2 == 1)
        bufs = [bytearray(r.size + 1) for r in recs]
        got = io.read_batch([d / f"r{i}" for i in range(12)], bufs)
        if sizes != [r.size for r in recs] or got != sizes:
            errors.append(f"thread {t}: {sizes} {got}")
        elif any(bytes(b[:-1]) != r.tobytes() for b, r in zip(bufs, recs, strict=True)):
            errors.append(f"thread {t}: wrong bytes")

    workers = [threading.Thread(target=one, args=(t,)) for t in range(8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert errors == []
    assert temps(tmp_path) == []


def test_a_forked_child_reads_batches(io: ModuleType, tmp_path: Path) -> None:
    recs = [data(70_000, seed=i) for i in range(8)]
    write(io, tmp_path, recs, direct=True)  # the parent's scratch buffers exist now
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            bufs = [bytearray(r.size) for r in recs]
            got = io.read_batch([tmp_path / f"r{i}" for i in range(8)], bufs, direct=True)
            same = all(b == r.tobytes() for b, r in zip(bufs, recs, strict=True))
            ok = got == [r.size for r in recs] and same
            code = 0 if ok else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's batch did not end")


def test_an_interrupt_during_a_batch_leaves_whole_records_or_none(io: ModuleType, tmp_path: Path) -> None:
    recs = [data(256 * 1024, seed=i) for i in range(200)]
    # Python's own Ctrl-C handler, whatever this process inherited (a job that a shell without job
    # control starts in the background begins with SIGINT ignored, and Python then leaves it so)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.005, os.kill, (os.getpid(), signal.SIGINT))
    interrupted = False
    timer.start()
    try:
        write(io, tmp_path, recs, fsync=True)
        time.sleep(5)  # a batch faster than the timer: the signal lands here
    except KeyboardInterrupt:
        interrupted = True
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert interrupted
    assert temps(tmp_path) == []
    for i, r in enumerate(recs):
        p = tmp_path / f"r{i}"
        assert not p.exists() or p.read_bytes() == r.tobytes()


# ---- bad input --------------------------------------------------------------------------------------------
def test_bad_input_is_an_error_before_any_io(io: ModuleType, tmp_path: Path) -> None:
    write(io, tmp_path, [data(10)])
    p = str(tmp_path / "r0")
    assert io.read_batch([], []) == [] and io.write_batch([]) == ([], 0, 0)
    with pytest.raises(TypeError, match="read-only"):
        io.read_batch([p, p], [bytearray(10), b"0123456789"])
    with pytest.raises(TypeError):
        io.read_batch([p], [object()])
    with pytest.raises(ValueError):
        io.read_batch([p], [])
    with pytest.raises(ValueError):
        io.read_batch([p + "\0x"], [bytearray(10)])
    with pytest.raises(TypeError):
        io.read_batch([p], [bytearray(10)], threads=2)  # one thread: the caller's
    with pytest.raises(TypeError, match="tuple"):
        io.write_batch([(p, p + ".tmp")])
    with pytest.raises(ValueError, match="C-contiguous"):
        io.read_batch([p], [np.zeros((4, 4), np.uint8)[:, 1]])  # not contiguous
    with pytest.raises(ValueError):
        io.write_batch([(p, p + ".tmp", b"x")], mode=-1)
    assert not Path(p + ".tmp").exists() and Path(p).read_bytes() == data(10).tobytes()


def test_python_code_run_while_the_arguments_are_read_cannot_break_the_batch(io: ModuleType,
                                                                            tmp_path: Path) -> None:
    write(io, tmp_path, [data(5000)])
    parts = [bytearray(2500), bytearray(2500)]
    lists: list[Any] = [parts]

    class Sneaky:
        def __fspath__(self) -> str:
            parts.clear()  # the buffers of the item, before they are exported
            lists.clear()
            return str(tmp_path / "r0")

    assert io.read_batch([Sneaky()], lists) == [0]


# ---- which one runs ---------------------------------------------------------------------------------------
def test_tierkv_native_0_forces_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERKV_NATIVE", "0")
    assert batchio.active().startswith("python (")
    assert batchio.implementation() is batchio_py
    monkeypatch.delenv("TIERKV_NATIVE")
    why = batchio.native_error()
    assert batchio.active() == ("native" if why is None else f"python ({why})")


def test_the_c_module_is_built_where_a_compiler_is() -> None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if which(cc) is None or not Path(sysconfig.get_paths()["include"], "Python.h").exists():
        pytest.skip(f"no C compiler ({cc}) or no Python.h for {sys.executable}: the fallback is expected")
    assert batchio.native_error() is None, \
        "pip install -e . (scripts/dev) should have built tierkv.records._batchio"


@pytest.fixture(autouse=True)
def _no_stray_umask() -> Iterator[None]:
    before = os.umask(0o022)
    os.umask(before)
    yield
    assert os.umask(before) == before


@pytest.mark.parametrize("impl", ["native", "python"])
def test_a_file_tier_restores_through_either_and_says_which(impl: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``file://`` tier reads its records through the C module or the Python path (the same
    blocks, every record checked), and its stats say which one read them."""
    import anyio

    from tierkv import GroupSpec, Layout, Lookup, TieredStore

    if impl == "native" and batchio.native_error() is not None:
        pytest.skip(f"the C module did not build here: {batchio.native_error()}")
    monkeypatch.setenv(batchio.ENV, "1" if impl == "native" else "0")
    layout = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=64 << 10)])
    cfg = {"layout": layout, "namespace": "io", "tiers": [
        {"kind": "cpu", "slots": {0: 8}},
        {"kind": "fsspec", "url": f"file://{tmp_path}", "read_processes": 0}]}
    hs = [f"b{i}".encode() for i in range(8)]
    data = torch.from_numpy(np.stack([data_row(i) for i in range(8)]))

    async def run() -> tuple[torch.Tensor, dict[str, int]]:
        async with TieredStore(cfg) as store:
            await store.put(0, hs, data)
        async with TieredStore(cfg) as store:
            while store.lookup_prefix(hs, request_id="r").state is Lookup.PENDING:
                await anyio.sleep(0.002)
            out = torch.zeros_like(data)
            await store.get(0, hs, out, request_id="r")
            return out, store.stats().tiers[1].backend

    out, counters = anyio.run(run)
    assert torch.equal(out, data)
    other = "io_native" if impl == "python" else "io_python"
    assert counters.get(f"io_{impl}") == 1 and other not in counters


def data_row(i: int) -> np.ndarray:
    return data(64 << 10, seed=100 + i)

"""TierKVSecondaryTier driven by vLLM's real TieringOffloadingSpec / TieringOffloadingManager.

No engine is needed: the scheduler-side manager runs standalone (CPU primary over a shared-memory
region, our tier created by vLLM's SecondaryTierFactory from a ``secondary_tiers`` entry).
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# a submodule, not "vllm": a directory named vllm on sys.path (e.g. tests/vllm/) would otherwise
# pass for vLLM as a namespace package where vLLM is not installed
pytest.importorskip("vllm.v1.kv_offload.tiering.base")

import torch
from test_fsspec_tier import logs
from vllm.v1.kv_offload.base import (
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from tierkv.adapters.vllm import TierKVSecondaryTier
from tierkv.adapters.vllm.secondary import METRICS, PROBE_BATCH
from tierkv.errors import ConfigError
from tierkv.records import read_header

WORKER_BYTES = 4096  # worker_kv_bytes_per_block; one chunk = one block = one page
HIT, MISS, RETRY, HIT_PENDING = (LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY,
                                 LookupResult.HIT_PENDING)

__all__ = ["logs"]  # a fixture, imported for this module


class Setup:
    """One standalone TieringOffloadingManager with a TierKVSecondaryTier below its CPU primary."""

    def __init__(self, spec: TieringOffloadingSpec) -> None:
        self.spec = spec
        mgr = spec.get_manager()
        assert isinstance(mgr, TieringOffloadingManager)
        self.mgr = mgr
        (tier,) = mgr.secondary_tiers
        assert isinstance(tier, TierKVSecondaryTier)
        self.tier = tier
        view = mgr.primary_tier.get_kv_memoryview()
        self.row = view.strides[0]
        self._n = 0

    def ctx(self, prefix: str = "r") -> ReqContext:
        self._n += 1
        c = ReqContext(req_id=f"{prefix}{self._n}")
        self.mgr.on_new_request(c)
        return c

    def step(self) -> None:
        self.mgr.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def _rows(self) -> np.ndarray:
        view = self.mgr.primary_tier.get_kv_memoryview()
        return np.frombuffer(view, dtype=np.uint8).reshape(-1, self.row)

    def store(self, data: dict[bytes, np.ndarray]) -> None:
        """GPU -> primary store of ``data`` (prepare, write rows, complete), cascaded and drained."""
        c = self.ctx("w")
        out = self.mgr.prepare_store(list(data), c)
        assert out is not None
        rows = self._rows()
        for k, cid in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
            rows[int(cid)] = data[k]
        del rows
        self.mgr.complete_store(out.keys_to_store, c)
        self.step()
        self.mgr.on_request_finished(c)
        self.tier.drain_jobs()
        self.step()  # on_schedule_end polls the tier's finished jobs
        assert not self.mgr.has_pending_work()

    def restore(self, keys: list[bytes], timeout: float = 20.0) -> tuple[
            dict[bytes, LookupResult], dict[bytes, list[LookupResult]], dict[bytes, np.ndarray]]:
        """Look ``keys`` up step by step until each is HIT or MISS; load the hits' primary rows."""
        c = self.ctx()
        seen: dict[bytes, list[LookupResult]] = {k: [] for k in keys}
        final: dict[bytes, LookupResult] = {}
        deadline = time.monotonic() + timeout
        while len(final) < len(keys):
            for k in keys:
                if k in final:
                    continue
                r = self.mgr.lookup(k, c)
                seen[k].append(r)
                if r in (HIT, MISS):
                    final[k] = r
            self.step()
            assert time.monotonic() < deadline, f"lookups never settled: {seen}"
            time.sleep(0.002)
        hits = [k for k in keys if final[k] is HIT]
        got: dict[bytes, np.ndarray] = {}
        if hits:
            spec = self.mgr.prepare_load(hits, c)
            rows = self._rows()
            for k, cid in zip(hits, spec.chunk_ids, strict=True):
                got[k] = rows[int(cid)].copy()
            del rows
            self.mgr.complete_load(hits, c)
        self.mgr.on_request_finished(c)
        self.step()
        return final, seen, got

    def shutdown(self) -> None:
        self.mgr.shutdown()


def reset(mgr: Any) -> None:
    """``reset_cache`` as vLLM's scheduler does it: 0.33 then reports, once the workers have no job
    of before the reset left (none here), ``on_reset_flushed``, which lifts its hold on promotions."""
    mgr.reset_cache()
    flushed = getattr(mgr, "on_reset_flushed", None)
    if flushed is not None:
        flushed()


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[..., Setup]]:
    made: list[Setup] = []

    def factory(*, model: str = "test/model-a", url: str | None = None, num_chunks: int = 32,
                groups: tuple[int, ...] = (0,), events: bool = False, **tier: Any) -> Setup:
        entry = {"type": "TierKVSecondaryTier", "module_path": "tierkv.adapters.vllm",
                 "url": url or f"file://{tmp_path}/kv", **tier}
        config = OffloadingConfig(
            groups=tuple(OffloadingGroupConfig(tokens_per_block=16, layer_names=(f"l{g}",), group_id=g)
                         for g in groups),
            worker_kv_bytes_per_block=WORKER_BYTES,
            enable_kv_cache_events=events,
            extra_config={"cpu_bytes_to_use": num_chunks * WORKER_BYTES, "secondary_tiers": [entry]},
            engine_id=f"tierkv-test-{uuid.uuid4().hex[:12]}",
            model=OffloadingModelConfig(name=model, dtype="bfloat16"),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(
                rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                is_parallelism_agnostic=True),
        )
        s = Setup(TieringOffloadingSpec(config))
        made.append(s)
        return s

    yield factory
    for s in made:
        s.shutdown()


def kv_rows(n: int, row: int, seed: int = 0) -> list[np.ndarray]:
    """``n`` rows of bf16 values, as bytes (what a KV cache chunk looks like)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(row // 2, generator=g).to(torch.bfloat16).view(torch.uint8).numpy().copy()
            for _ in range(n)]


def make_keys(n: int, group: int = 0, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [make_offload_key(rng.bytes(32), group) for _ in range(n)]


def records(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.tkv") if ".tkvtmp-" not in p.name)


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["store", "load", "probe"])
def test_the_schedulers_calls_return_at_once_while_the_loop_is_busy(
        make: Callable[..., Setup], kind: str) -> None:
    """submit_store, submit_load and the step that sends probes hand their work to tierkv's loop
    and go on: the scheduler thread never waits for the loop to take it (it waited about a
    millisecond a job in the peers bench, and as long as the loop's longest step)."""
    s = make()
    keys = make_keys(4, seed=5)
    data = dict(zip(keys, kv_rows(4, s.row, seed=5), strict=True))
    if kind == "load":
        s.store(data)
    tier = s.tier
    busy = threading.Event()

    async def hog() -> None:  # the loop's thread busy for a while, as with a long CPU step
        busy.set()
        time.sleep(0.8)

    c = s.ctx()
    job = TransferJob(job_id=20_100, keys=keys, chunk_ids=np.array([4, 9, 2, 7]), is_promotion=kind == "load",
                      req_context=c)
    tier._loop.submit(hog)
    assert busy.wait(5)
    t0 = time.monotonic()
    if kind == "store":
        tier.submit_store(job)
    elif kind == "load":
        tier.submit_load(job)
    else:
        assert tier.lookup(make_keys(1, seed=77)[0], c) is LookupResult.RETRY
        tier.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
    took = time.monotonic() - t0
    assert took < 0.3, f"the scheduler's call waited {took:.2f} s for the loop"
    tier.drain_jobs()
    if kind != "probe":
        (res,) = list(tier.get_finished_jobs())
        assert res.job_id == 20_100 and res.success
    s.mgr.on_request_finished(c)


@pytest.mark.parametrize("kind", ["store", "load", "probe"])
def test_handing_work_to_the_loop_never_deadlocks_with_a_task_that_takes_the_lock(
        make: Callable[..., Setup], kind: str) -> None:
    """The loop's tasks take the tier's lock (a finishing job updates presence): a scheduler call
    that still held it while waiting for the loop to accept new work hung forever (found by
    bench/peers.py, a store job finishing just as the next one was submitted)."""
    s = make()
    keys = make_keys(4)
    if kind == "load":
        s.store(dict(zip(keys, kv_rows(4, s.row), strict=True)))
    tier = s.tier
    original = tier._valid_job
    blocked = threading.Event()

    async def takes_the_lock() -> None:
        blocked.set()
        with tier._lock:
            pass

    def loop_task_waits_on_the_lock() -> None:
        # runs under the lock on the scheduler's thread: the loop now blocks on it
        tier._loop.submit(takes_the_lock)
        assert blocked.wait(5)
        time.sleep(0.05)

    def valid_job(*args: Any) -> bool:
        loop_task_waits_on_the_lock()
        return original(*args)

    tier._valid_job = valid_job  # type: ignore[method-assign]
    c = s.ctx()
    job = TransferJob(job_id=20_000, keys=keys, chunk_ids=np.array([0, 1, 2, 3]), is_promotion=kind == "load",
                      req_context=c)

    def call() -> None:
        if kind == "store":
            tier.submit_store(job)
        elif kind == "load":
            tier.submit_load(job)
        else:  # the lookup that fills a probe batch sends it
            presence, calls = tier._gw.presence, [0]

            def last_one_blocks(*args: Any) -> Any:
                calls[0] += 1
                if calls[0] == PROBE_BATCH:
                    loop_task_waits_on_the_lock()
                return presence(*args)

            tier._gw.presence = last_one_blocks  # type: ignore[method-assign]
            for k in make_keys(PROBE_BATCH, seed=9):
                tier.lookup(k, c)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "the scheduler thread deadlocked with the tier's event loop"
    tier.drain_jobs()
    s.mgr.on_request_finished(c)


@pytest.mark.parametrize("codec", ["none", "zstd-shuffle"])
def test_store_cascade_reset_and_promote(make: Callable[..., Setup], tmp_path: Path, codec: str) -> None:
    s = make(codec=codec)
    keys = make_keys(6)
    data = dict(zip(keys, kv_rows(6, s.row), strict=True))
    s.store(data)

    files = records(tmp_path / "kv")
    assert len(files) == 6
    hdr = read_header(files[0].read_bytes())
    assert hdr.codec == codec and hdr.fingerprint == s.tier.fingerprint
    if codec == "zstd-shuffle":
        assert all(f.stat().st_size < s.row for f in files), "bf16 high bytes should compress"

    reset(s.mgr)  # drains the tier, empties the primary
    c = s.ctx()
    assert s.mgr.primary_tier.lookup(keys[0], c) is MISS
    s.mgr.on_request_finished(c)

    final, seen, got = s.restore(keys)
    assert all(r is HIT for r in final.values())
    # known present (this process wrote them): the promotion starts at once
    assert all(seen[k][0] is HIT_PENDING for k in keys)
    for k in keys:
        np.testing.assert_array_equal(got[k], data[k])

    stats = s.mgr.get_stats()
    assert stats is not None
    reduced = stats.reduce()
    assert any(name.startswith("vllm:kv_offload_tiering_read_bytes") for name in reduced)
    defs = TieringOffloadingSpec.build_metric_definitions(dict(s.spec.extra_config))
    for name in stats.data["data"]:
        assert name in defs, name
    assert set(METRICS) <= set(defs)


def test_store_skips_keys_already_held(make: Callable[..., Setup]) -> None:
    s = make()
    keys = make_keys(3)
    data = dict(zip(keys, kv_rows(3, s.row), strict=True))
    s.store(data)
    s.tier.get_stats()  # reset counters
    # the same keys cascade again (e.g. after the primary evicted them): nothing is written
    c = s.ctx()
    job = TransferJob(job_id=10_000, keys=keys, chunk_ids=np.array([0, 1, 2]), is_promotion=False,
                      req_context=c)
    s.tier.submit_store(job)
    s.tier.drain_jobs()
    (res,) = list(s.tier.get_finished_jobs())
    assert res.job_id == 10_000 and res.success and res.transfer_bytes == 0
    stats = s.tier.get_stats()
    assert stats is not None
    assert stats.reduce()["tierkv_tier_stores_skipped_total:('TierKVSecondaryTier', 'fsspec')"] == 3
    s.mgr.on_request_finished(c)


@pytest.mark.parametrize("codec", ["none", "zstd-shuffle"])
def test_scattered_rows_and_a_corrupt_record_leave_other_rows_alone(
        make: Callable[..., Setup], tmp_path: Path, codec: str) -> None:
    """Jobs on the tier itself (ids vLLM's manager never issues), with non-consecutive chunk ids."""
    s = make(codec=codec)
    keys = make_keys(6, seed=11)
    rows = kv_rows(6, s.row, seed=11)
    prim = s._rows()
    src_ids = np.array([7, 2, 5, 3, 11, 9])
    for cid, r in zip(src_ids, rows, strict=True):
        prim[cid] = r
    c = s.ctx()
    s.tier.submit_store(TransferJob(job_id=20_000, keys=keys, chunk_ids=src_ids, is_promotion=False,
                                    req_context=c))
    s.tier.drain_jobs()
    (res,) = list(s.tier.get_finished_jobs())
    assert res.success and res.transfer_bytes == 6 * s.row

    bad = next(p for p in records(tmp_path / "kv") if p.name.startswith(keys[4].hex()))
    data = bytearray(bad.read_bytes())
    data[-20] ^= 0xFF
    bad.write_bytes(bytes(data))
    dst_ids = np.array([20, 18, 16, 14, 12, 10])
    prim[dst_ids] = 0xA5
    s.tier.submit_load(TransferJob(job_id=20_001, keys=keys, chunk_ids=dst_ids, is_promotion=True,
                                   req_context=c))
    assert s.tier.has_pending_work()
    s.tier.drain_jobs()
    (res,) = list(s.tier.get_finished_jobs())
    assert res.job_id == 20_001 and not res.success
    assert res.successful_keys is not None and set(res.successful_keys) == set(keys) - {keys[4]}
    assert res.transfer_bytes == 5 * s.row
    for i, cid in enumerate(dst_ids):
        if i != 4:  # the failed key's row holds unspecified bytes: vLLM frees it unused
            np.testing.assert_array_equal(prim[cid], rows[i])
    del prim
    assert s.tier.lookup(keys[4], c) is MISS
    assert s.tier.lookup(keys[0], c) is HIT
    s.mgr.on_request_finished(c)


def test_restart_serves_from_disk(make: Callable[..., Setup]) -> None:
    a = make(codec="zstd-shuffle")
    keys = make_keys(5, seed=1)
    data = dict(zip(keys, kv_rows(5, a.row, seed=1), strict=True))
    a.store(data)
    a.shutdown()

    # a new process's tier on the same URL (no start-up listing: it knows nothing of them)
    b = make(codec="zstd-shuffle", scan_on_open=False)
    assert b.tier.fingerprint == a.tier.fingerprint
    final, seen, got = b.restore(keys)
    assert all(r is HIT for r in final.values())
    assert all(seen[k][0] is RETRY for k in keys), "unknown keys are probed first"
    for k in keys:
        np.testing.assert_array_equal(got[k], data[k])
    # the codec is per record: a reader configured with another codec still reads them
    c = make(codec="none")
    final, _, got = c.restore(keys)
    assert all(r is HIT for r in final.values())
    np.testing.assert_array_equal(got[keys[0]], data[keys[0]])


def test_a_new_process_reads_warm_records_into_vllm_s_primary_with_reader_processes(
        make: Callable[..., Setup], tmp_path: Path) -> None:
    """vLLM's primary is a shared mapping in /dev/shm: a restarted tier's reader processes (own
    GIL, beside the scheduler's loop) read warm records straight into its rows, the bytes exact;
    its start-up listing made every key a HIT_PENDING at the first lookup (no probe)."""
    a = make()
    keys = make_keys(6, seed=5)
    data = dict(zip(keys, kv_rows(6, a.row, seed=5), strict=True))
    a.store(data)
    a.shutdown()
    for f in records(tmp_path / "kv"):
        f.read_bytes()  # direct writes bypass the page cache: warm it, as a recent restore would
    b = make()
    deadline = time.monotonic() + 20
    readers = b.tier._tier.driver._readers
    assert readers is not None, "the tier started no reader processes for vLLM's primary"
    while "scanned" not in b.tier._tier.counters or len(readers.ready()) < len(readers.procs):
        assert time.monotonic() < deadline, "the listing never ended, or the helpers never started"
        time.sleep(0.01)
        b.tier._tier.used_bytes()  # refreshes the counters
    final, seen, got = b.restore(keys)
    assert all(r is HIT for r in final.values())
    assert all(seen[k][0] is HIT_PENDING for k in keys), "listed keys need no probe"
    for k in keys:
        np.testing.assert_array_equal(got[k], data[k])
    b.tier._tier.used_bytes()  # refreshes the driver's counters
    assert b.tier._tier.counters.get("reader_reads", 0) == len(keys)


def test_unknown_keys_are_a_miss_after_the_probe(make: Callable[..., Setup]) -> None:
    s = make(negative_ttl_s=30)
    keys = make_keys(3, seed=7)
    final, seen, _ = s.restore(keys)
    assert all(r is MISS for r in final.values())
    assert all(seen[k][0] is RETRY for k in keys)
    assert not s.tier.has_pending_work()
    # negative answers are cached: no second probe
    c = s.ctx()
    assert all(s.mgr.lookup(k, c) is MISS for k in keys)
    s.mgr.on_request_finished(c)


def test_negative_answers_expire(make: Callable[..., Setup]) -> None:
    reader = make(negative_ttl_s=1.0)
    keys = make_keys(2, seed=9)
    final, _, _ = reader.restore(keys)
    assert all(r is MISS for r in final.values())
    writer = make()  # another engine on the same URL writes the records meanwhile
    data = dict(zip(keys, kv_rows(2, writer.row, seed=9), strict=True))
    writer.store(data)
    c = reader.ctx()
    assert reader.mgr.lookup(keys[0], c) is MISS  # still cached as absent
    reader.mgr.on_request_finished(c)
    time.sleep(1.05)
    final, seen, got = reader.restore(keys)
    assert all(r is HIT for r in final.values())
    assert all(seen[k][0] is RETRY for k in keys), "an expired negative answer is probed again"
    np.testing.assert_array_equal(got[keys[1]], data[keys[1]])


def test_corrupt_or_truncated_record_is_a_miss_never_wrong_bytes(
        make: Callable[..., Setup], tmp_path: Path) -> None:
    a = make()
    keys = make_keys(4, seed=2)
    data = dict(zip(keys, kv_rows(4, a.row, seed=2), strict=True))
    a.store(data)
    a.shutdown()

    path = {k: next(p for p in records(tmp_path / "kv") if p.name.startswith(k.hex())) for k in keys}
    flipped = bytearray(path[keys[1]].read_bytes())
    flipped[len(flipped) // 2] ^= 0x40
    path[keys[1]].write_bytes(bytes(flipped))
    path[keys[2]].write_bytes(path[keys[2]].read_bytes()[: a.row // 2])

    b = make()
    final, _, got = b.restore(keys)
    assert final == {keys[0]: HIT, keys[1]: MISS, keys[2]: MISS, keys[3]: HIT}
    for k in (keys[0], keys[3]):
        np.testing.assert_array_equal(got[k], data[k])
    assert not path[keys[1]].exists() and not path[keys[2]].exists(), "damaged records are removed"
    # the failed keys stay a miss (no promotion livelock) and the primary never holds them
    c = b.ctx()
    for k in (keys[1], keys[2]):
        assert b.mgr.lookup(k, c) is MISS
        assert b.mgr.primary_tier.lookup(k, c) is MISS
    b.mgr.on_request_finished(c)
    stats = b.tier.get_stats()
    assert stats is not None
    red = stats.reduce()
    assert red["tierkv_tier_corrupt_records_total:('TierKVSecondaryTier', 'fsspec')"] == 2
    assert red["tierkv_tier_promotions_failed_total:('TierKVSecondaryTier', 'fsspec')"] == 2


def test_capacity_bound_evicts(make: Callable[..., Setup], tmp_path: Path) -> None:
    probe = make(url=f"file://{tmp_path}/probe")
    k0 = make_keys(1, seed=99)
    probe.store(dict(zip(k0, kv_rows(1, probe.row), strict=True)))
    record_size = records(tmp_path / "probe")[0].stat().st_size

    s = make(capacity_bytes=4 * record_size)
    keys = make_keys(10, seed=3)
    rows = kv_rows(10, s.row, seed=3)
    for k, r in zip(keys, rows, strict=True):  # one job each: LRU order is the store order
        s.store({k: r})
    held = records(tmp_path / "kv")
    assert len(held) == 4
    assert {p.name[: -len(".tkv")] for p in held} == {k.hex() for k in keys[-4:]}

    reset(s.mgr)
    # an evicted key this process still believed present: its promotion fails, it becomes a miss
    final, _, got = s.restore([keys[0], keys[9]])
    assert final == {keys[0]: MISS, keys[9]: HIT}
    np.testing.assert_array_equal(got[keys[9]], rows[9])

    t = make(capacity_bytes=4 * record_size)  # restart: only what is on disk is served
    final, _, _ = t.restore(keys)
    assert [final[k] for k in keys] == [MISS] * 6 + [HIT] * 4


def test_other_model_never_sees_records(make: Callable[..., Setup], tmp_path: Path) -> None:
    a = make(model="org/model-a")
    keys = make_keys(3, seed=4)
    data = dict(zip(keys, kv_rows(3, a.row, seed=4), strict=True))
    a.store(data)

    b = make(model="org/model-b")
    assert b.tier.fingerprint != a.tier.fingerprint
    final, _, _ = b.restore(keys)
    assert all(r is MISS for r in final.values())
    c = make(model="org/model-a", namespace="deployment-2")  # a user namespace separates too
    final, _, _ = c.restore(keys)
    assert all(r is MISS for r in final.values())

    d = make(model="org/model-a")
    final, _, got = d.restore(keys)
    assert all(r is HIT for r in final.values())
    np.testing.assert_array_equal(got[keys[2]], data[keys[2]])
    manifests = sorted(p.parent.name for p in (tmp_path / "kv").glob("*/layout.json"))
    assert len(manifests) == 3


def test_group_mapping_keeps_indices_and_scratch_gets_nothing(
        make: Callable[..., Setup], tmp_path: Path) -> None:
    s = make(groups=(0, 2))  # group 1 (e.g. a circular-buffer scratch group) is not offloaded
    assert [g.kind for g in s.tier.layout.groups] == ["full", "scratch", "full"]
    assert all(g.block_bytes == s.row for g in s.tier.layout.groups)
    hashes = make_keys(2, seed=5)
    k0 = make_offload_key(hashes[0][:-4], 0)
    k2 = make_offload_key(hashes[0][:-4], 2)
    data = dict(zip([k0, k2], kv_rows(2, s.row, seed=5), strict=True))
    s.store(data)
    dirs = sorted(p.name for p in (tmp_path / "kv" / s.tier.fingerprint).iterdir() if p.is_dir())
    assert dirs == ["g00000000", "g00000002"]
    c = s.ctx()
    assert s.tier.lookup(make_offload_key(hashes[1][:-4], 1), c) is MISS
    s.mgr.on_request_finished(c)
    reset(s.mgr)
    final, _, got = s.restore([k0, k2])
    assert final == {k0: HIT, k2: HIT}
    np.testing.assert_array_equal(got[k2], data[k2])


def test_any_fsspec_url(make: Callable[..., Setup]) -> None:
    url = f"memory://tierkv-test-{uuid.uuid4().hex[:8]}/kv"
    a = make(url=url, codec="zstd")
    keys = make_keys(3, seed=6)
    data = dict(zip(keys, kv_rows(3, a.row, seed=6), strict=True))
    a.store(data)
    a.shutdown()
    b = make(url=url, codec="zstd")
    final, _, got = b.restore(keys)
    assert all(r is HIT for r in final.values())
    for k in keys:
        np.testing.assert_array_equal(got[k], data[k])


def test_the_tier_lowers_the_gil_switch_interval_in_the_schedulers_process(
        make: Callable[..., Setup]) -> None:
    """vLLM's step loop spins while loads are in flight: the tier caps the switch interval (default
    0.1 ms) so its I/O threads get the GIL; ``gil_switch_interval_s: None`` leaves it alone."""
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        make()
        assert sys.getswitchinterval() == pytest.approx(0.0001)
        sys.setswitchinterval(0.005)
        make(gil_switch_interval_s=None)
        assert sys.getswitchinterval() == pytest.approx(0.005)
    finally:
        sys.setswitchinterval(before)


def test_kv_events_for_stored_keys(make: Callable[..., Setup]) -> None:
    s = make(events=True, enable_kv_events=True, locality="LOCAL")
    keys = make_keys(2, seed=8)
    s.store(dict(zip(keys, kv_rows(2, s.row, seed=8), strict=True)))
    ours = [e for e in s.mgr.take_events() if e.medium.name == "STORAGE"]
    assert [sorted(e.keys) for e in ours] == [sorted(keys)]
    assert not ours[0].removed and ours[0].locality is not None and ours[0].locality.value == "LOCAL"


@pytest.mark.parametrize(("entry", "bad"), [
    ({"codec": "lz4"}, "codec"),
    ({"bogus_key": 1}, "bogus_key"),
    ({"capacity_bytes": 0}, "capacity_bytes"),
    ({"kind": "memory"}, "kind"),
])
def test_config_errors_name_the_key(make: Callable[..., Setup], entry: dict[str, Any], bad: str) -> None:
    before = {f for f in os.listdir("/dev/shm") if "tierkv-test-" in f}
    with pytest.raises(ConfigError, match=bad) as info:
        make(storage_options={"key": "AKIA-SECRET", "secret": "hunter2"}, **entry)
    assert "hunter2" not in str(info.value) and "AKIA-SECRET" not in str(info.value)
    after = {f for f in os.listdir("/dev/shm") if "tierkv-test-" in f}
    assert after <= before, "vLLM removed the primary's shared-memory region"


def test_vllm_unmaps_its_primary_after_cold_and_corrupt_reads_without_a_collection(
        make: Callable[..., Setup], tmp_path: Path, logs: Any) -> None:
    """vLLM closes its shared region right after the tier's shutdown: nothing of tierkv's may still
    hold a view of it then, also when no garbage collection ran (an engine freezes its heap; a read
    that failed or had to wait kept its buffers in a traceback's reference cycle)."""
    a = make(read_processes=0)
    keys = make_keys(6, seed=11)
    data = dict(zip(keys, kv_rows(6, a.row, seed=11), strict=True))
    a.store(data)
    a.shutdown()
    files = records(tmp_path / "kv")
    for f in files:  # cold: the reads must wait for the device (or be refused a page-cache-only read)
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    damaged = bytearray(files[0].read_bytes())
    damaged[len(damaged) // 2] ^= 0x40
    files[0].write_bytes(bytes(damaged))
    gc.collect()
    gc.disable()
    try:
        b = make(read_processes=0)
        final, _, _ = b.restore(keys)
        b.shutdown()
    finally:
        gc.enable()
    assert sum(r is HIT for r in final.values()) == 5
    text = "\n".join(logs.lines)
    assert "Failed to close" not in text and "BufferError" not in text, text[-2000:]

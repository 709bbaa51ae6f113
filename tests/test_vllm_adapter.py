"""TierKVOffloadingSpec against vLLM's own types, without an engine: manager and worker contract."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

base = pytest.importorskip("vllm.v1.kv_offload.base")  # installed by `scripts/dev test` where there is no GPU
vcfg = pytest.importorskip("vllm.v1.kv_offload.config")

from tierkv.adapters.vllm import TierKVOffloadingSpec  # noqa: E402
from tierkv.errors import ConfigError  # noqa: E402

LookupResult = base.LookupResult
PAGE = 4096
NUM_BLOCKS = 64


def offloading_config(tmp_path: Path, groups: list[tuple[int, int]], extra: dict[str, Any],
                      engine: str, blocks_per_chunk: int = 1) -> Any:
    """An OffloadingConfig as vLLM builds it: only offloaded groups, original group ids."""
    return vcfg.OffloadingConfig(
        groups=tuple(vcfg.OffloadingGroupConfig(tokens_per_block=tpb,
                                                layer_names=(f"model.layers.{gid}.attn",), group_id=gid)
                     for gid, tpb in groups),
        worker_kv_bytes_per_block=PAGE, enable_kv_cache_events=True,
        extra_config={"cpu_bytes_to_use": 1 << 20, "shm_dir": str(tmp_path / "shm"),
                      "tiers": [{"kind": "fsspec", "url": f"file://{tmp_path / 'tier'}"}],
                      "manifest_timeout_s": 0.0, **extra},
        engine_id=engine, model=vcfg.OffloadingModelConfig(name="tiny", dtype="bfloat16"),
        cache=vcfg.OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
        parallel=vcfg.OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1,
                                               dcp_size=1, data_parallel_index=0, data_parallel_size=1,
                                               data_parallel_rank_local=None, is_parallelism_agnostic=True))


def kv_caches(n_groups: int, device: str = "cpu") -> tuple[Any, torch.Tensor]:
    """One shared int8 [blocks, page] tensor, one layer per offloaded group (like Gemma3)."""
    t = torch.randint(-128, 127, (NUM_BLOCKS, PAGE), dtype=torch.int8, device=device)
    caches = base.CanonicalKVCaches(tensors=[base.CanonicalKVCacheTensor(tensor=t, page_size_bytes=PAGE)],
                                    group_data_refs=[[base.CanonicalKVCacheRef(tensor_idx=0,
                                                                               page_size_bytes=PAGE)]
                                                     for _ in range(n_groups)])
    return caches, t


class Engine:
    """Spec, worker and manager wired as vLLM wires them (worker first)."""

    def __init__(self, tmp_path: Path, groups: list[tuple[int, int]], extra: dict[str, Any] | None = None,
                 engine: str = "engine-a", device: str = "cpu", blocks_per_chunk: int = 1) -> None:
        os.makedirs(tmp_path / "shm", exist_ok=True)
        self.cfg = offloading_config(tmp_path, groups, extra or {}, engine, blocks_per_chunk)
        self.caches, self.gpu = kv_caches(len(groups), device)
        self.worker = TierKVOffloadingSpec(self.cfg).get_worker(self.caches)
        self.spec = TierKVOffloadingSpec(self.cfg)
        self.manager = self.spec.get_manager()
        self.job = 0

    def store(self, keys: list[bytes], blocks: list[int], group_sizes: list[int], ctx: Any) -> Any:
        out = self.manager.prepare_store(keys, ctx)
        if out is None or not out.keys_to_store:
            return out
        self.job += 1
        src = base.GPULoadStoreSpec(blocks, group_sizes, [0] * len(group_sizes))
        assert self.worker.submit_store(self.job, src, out.store_spec)
        self.worker.wait({self.job})
        assert [r.job_id for r in self.worker.get_finished()] == [self.job]
        self.manager.complete_store(out.keys_to_store, ctx)
        return out

    def load(self, keys: list[bytes], blocks: list[int], group_sizes: list[int], ctx: Any,
             **kw: Any) -> None:
        spec = self.manager.prepare_load(keys, ctx)
        self.job += 1
        dst = base.GPULoadStoreSpec(blocks, group_sizes, [0] * len(group_sizes))
        assert self.worker.submit_load(self.job, spec, dst, **kw)
        self.worker.wait({self.job})
        res = self.worker.get_finished()
        assert len(res) == 1 and res[0].success
        self.manager.complete_load(keys, ctx)

    def close(self) -> None:
        self.manager.shutdown()


def settle(manager: Any) -> None:
    import time

    deadline = time.monotonic() + 10
    while manager.has_pending_work() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not manager.has_pending_work()


def key(i: int, group: int) -> bytes:
    return base.make_offload_key(i.to_bytes(32, "big"), group)


def ctx(rid: str) -> Any:
    return base.ReqContext(req_id=rid)


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    e = Engine(tmp_path, [(0, 16), (1, 16)])
    yield e
    e.close()


def test_store_then_load_round_trips_the_bytes(engine: Engine) -> None:
    keys = [key(i, 0) for i in range(3)] + [key(i, 1) for i in range(3)]
    c = ctx("r1")
    # the disk tier may hold them: RETRY while its presence is probed, then MISS
    assert [engine.manager.lookup(k, c) for k in keys] == [LookupResult.RETRY] * 6
    settle(engine.manager)
    assert [engine.manager.lookup(k, c) for k in keys] == [LookupResult.MISS] * 6
    src = [1, 2, 3, 4, 5, 6]
    want = engine.gpu[src].clone()
    out = engine.store(keys, src, [3, 3], c)
    assert out.keys_to_store == keys and out.evicted_keys == []
    assert [engine.manager.lookup(k, ctx("r2")) for k in keys] == [LookupResult.HIT] * 6
    dst = [40, 41, 42, 43, 44, 45]
    engine.load(keys, dst, [3, 3], ctx("r2"))
    assert torch.equal(engine.gpu[dst], want)


def test_an_offloaded_block_of_two_engine_blocks_round_trips_and_loads_from_inside_a_chunk(
        tmp_path: Path) -> None:
    e = Engine(tmp_path, [(0, 16)], blocks_per_chunk=2)
    try:
        keys = [key(0, 0), key(1, 0)]  # two offloaded blocks: engine blocks 1, 2 and 3, 4
        want = e.gpu[[1, 2, 3, 4]].clone()
        out = e.store(keys, [1, 2, 3, 4], [4], ctx("r1"))
        assert out.keys_to_store == keys
        assert [e.manager.lookup(k, ctx("r2")) for k in keys] == [LookupResult.HIT] * 2
        # a load that starts at the chunk's second engine block (vLLM's block_indices)
        spec = e.manager.prepare_load(keys, ctx("r2"))
        assert e.worker.submit_load(99, spec, base.GPULoadStoreSpec([41, 42, 43], [3], [1]))
        e.worker.wait({99})
        assert torch.equal(e.gpu[[41, 42, 43]], want[1:])
        e.manager.complete_load(keys, ctx("r2"))
        # a store must cover whole offloaded blocks: half of one would keep another block's bytes
        half = e.manager.prepare_store([key(5, 0)], ctx("r3"))
        with pytest.raises(RuntimeError, match="whole chunks"):
            e.worker.submit_store(100, base.GPULoadStoreSpec([7], [1], [0]), half.store_spec)
    finally:
        e.close()


def test_an_offloaded_block_of_two_engine_blocks_is_refused_with_a_recurrent_group(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="full attention"):
        Engine(tmp_path, [(0, 16), (2, 16)], {"group_kinds": {"2": "recurrent"}}, engine="chunked",
               blocks_per_chunk=2)


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                     reason="needs a CUDA GPU"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_worker_jobs_follow_the_compute_stream_and_end_in_order(tmp_path: Path, device: str) -> None:
    """KV written just before a store is what gets stored; results come once, in submission order,
    with sizes and times; loads put the bytes back. On CUDA this is the worker's stream path."""
    e = Engine(tmp_path, [(0, 16)], engine=f"order-{device}", device=device)
    try:
        keys = [key(i, 0) for i in range(8)]
        stored = e.manager.prepare_store(keys, ctx("w"))
        assert stored is not None
        fresh = torch.randint(-128, 127, (8, PAGE), dtype=torch.int8, device=device)
        e.gpu[:8] = fresh  # on CUDA: queued on the compute stream right before the store
        jobs = []
        for j in range(4):  # four jobs of two blocks each
            spec = type(stored.store_spec)(stored.store_spec.groups[2 * j:2 * j + 2],
                                           stored.store_spec.slots[2 * j:2 * j + 2])
            assert e.worker.submit_store(100 + j, base.GPULoadStoreSpec([2 * j, 2 * j + 1], [2], [0]), spec)
            jobs.append(100 + j)
        e.worker.wait({jobs[-1]})
        done = e.worker.get_finished()
        assert [r.job_id for r in done] == jobs and all(r.success for r in done)
        assert all(r.transfer_size == 2 * PAGE and r.transfer_time >= 0 for r in done)
        assert e.worker.get_finished() == []  # reported once
        e.manager.complete_store(keys, ctx("w"))
        c = ctx("r")
        assert [e.manager.lookup(k, c) for k in keys] == [LookupResult.HIT] * 8
        e.load(keys, list(range(40, 48)), [8], c, expedited=True)  # vLLM 0.33's synchronous load
        assert torch.equal(e.gpu[40:48].cpu(), fresh.cpu())
    finally:
        e.close()


def test_keys_already_held_are_not_stored_again(engine: Engine) -> None:
    keys = [key(i, 0) for i in range(2)]
    engine.store(keys, [1, 2], [2, 0], ctx("a"))
    again = engine.manager.prepare_store([*keys, key(9, 0)], ctx("b"))
    assert again is not None and again.keys_to_store == [key(9, 0)]
    engine.manager.complete_store(again.keys_to_store, ctx("b"), success=False)


def test_a_failed_store_never_becomes_visible(engine: Engine) -> None:
    c = ctx("r")
    out = engine.manager.prepare_store([key(7, 0)], c)
    assert engine.manager.lookup(key(7, 0), ctx("x")) is LookupResult.HIT_PENDING
    engine.manager.complete_store(out.keys_to_store, c, success=False)
    assert engine.manager.lookup(key(7, 0), ctx("y")) is LookupResult.RETRY  # only the disk may have it
    settle(engine.manager)
    assert engine.manager.lookup(key(7, 0), ctx("y")) is LookupResult.MISS


def test_prepare_store_is_none_only_when_nothing_can_be_evicted(tmp_path: Path) -> None:
    e = Engine(tmp_path, [(0, 16)], {"slots": {"0": 2}}, engine="small")
    try:
        first = e.manager.prepare_store([key(1, 0), key(2, 0)], ctx("a"))
        assert first is not None
        assert e.manager.prepare_store([key(3, 0)], ctx("b")) is None  # both slots being written
        e.manager.complete_store(first.keys_to_store, ctx("a"))
        settle(e.manager)  # the cascades to disk, which read the slots, are done
        later = e.manager.prepare_store([key(3, 0)], ctx("b"))
        assert later is not None and len(later.evicted_keys) == 1
        events = list(e.manager.take_events())
        assert any(ev.removed for ev in events) and any(not ev.removed for ev in events)
    finally:
        e.close()


def test_a_looked_up_hit_is_pinned_until_the_request_loads_it(tmp_path: Path) -> None:
    e = Engine(tmp_path, [(0, 16)], {"slots": {"0": 2}}, engine="pins")
    try:
        e.store([key(1, 0), key(2, 0)], [1, 2], [2], ctx("w"))
        settle(e.manager)
        c = ctx("reader")
        assert e.manager.lookup(key(1, 0), c) is LookupResult.HIT
        # another request's stores need room: only the unpinned block may go
        out = e.manager.prepare_store([key(3, 0)], ctx("other"))
        assert out is not None and out.evicted_keys == [key(2, 0)]
        e.load([key(1, 0)], [50], [1], c)
        assert torch.equal(e.gpu[50], e.gpu[1])
    finally:
        e.close()


def test_blocks_come_back_from_disk_in_a_new_engine(tmp_path: Path) -> None:
    first = Engine(tmp_path, [(0, 16), (1, 16)], engine="one")
    keys = [key(i, 0) for i in range(4)]
    first.store(keys, [1, 2, 3, 4], [4, 0], ctx("w"))
    want = first.gpu[[1, 2, 3, 4]].clone()
    first.close()  # flushes the cascade to the file tier
    # no start-up listing: it would race the first lookups and tell the store what is present
    # (test_restore_stream covers that path); this is the path of a store that knows nothing
    unlisted = {"tiers": [{"kind": "fsspec", "url": f"file://{tmp_path / 'tier'}", "scan_on_open": False}]}
    second = Engine(tmp_path, [(0, 16), (1, 16)], unlisted, engine="two")
    try:
        c = ctx("r")
        assert [second.manager.lookup(k, c) for k in keys] == [LookupResult.RETRY] * 4  # probing
        settle(second.manager)
        assert [second.manager.lookup(k, c) for k in keys] == [LookupResult.HIT_PENDING] * 4  # promoting
        settle(second.manager)
        assert [second.manager.lookup(k, c) for k in keys] == [LookupResult.HIT] * 4
        second.load(keys, [20, 21, 22, 23], [4, 0], c)
        assert torch.equal(second.gpu[[20, 21, 22, 23]], want)
        stats = second.manager.get_stats()
        assert stats is not None and not stats.is_empty()
    finally:
        second.close()


def test_scratch_group_from_the_report_gets_no_keys_slots_or_files(tmp_path: Path) -> None:
    """Full attention (block 16) + circular-buffer scratch (block 4, not offloaded) + Mamba in align
    mode (block 16) at indices 0, 1, 2: vLLM hands over groups 0 and 2 only."""
    e = Engine(tmp_path, [(0, 16), (2, 16)], {"group_kinds": {"2": "recurrent"}}, engine="report")
    try:
        layout = e.manager.layout
        assert [g.kind for g in layout.groups] == ["full", "scratch", "recurrent"]
        assert sorted(g.group for g in e.manager.store.stats().groups) == [0, 2]
        assert e.manager.lookup(key(1, 1), ctx("r")) is LookupResult.MISS
        e.store([key(1, 0), key(1, 2)], [3, 4], [1, 1], ctx("w"))
        e.manager.store.stats()
    finally:
        e.close()
    files = [p for p in (tmp_path / "tier").rglob("*.tkv")]
    assert len(files) == 2
    assert {p.parts[-4] for p in files} == {"g00000000", "g00000002"}


def test_config_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.cpu_bytes_to_use"):
        TierKVOffloadingSpec(offloading_config(tmp_path, [(0, 16)], {"cpu_bytes_to_use": 0}, "bad"))
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.tiers\.0\.url"):
        TierKVOffloadingSpec(offloading_config(tmp_path, [(0, 16)], {"tiers": [{"kind": "fsspec"}]}, "bad"))
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.bogus"):
        TierKVOffloadingSpec(offloading_config(tmp_path, [(0, 16)], {"bogus": 1}, "bad"))


def test_shutdown_removes_the_shared_segment_and_a_stale_one_does_not_break_a_start(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "tierkv-stale.pool").write_bytes(b"\0" * 123)  # a crashed engine's segment, wrong size
    (shm / "tierkv-stale.json").write_text("{not json")
    e = Engine(tmp_path, [(0, 16)], engine="stale")
    e.store([key(1, 0)], [1], [1], ctx("w"))
    assert e.manager.lookup(key(1, 0), ctx("r")) is LookupResult.HIT
    e.close()
    assert not list(shm.iterdir())


def test_a_killed_engine_leaves_nothing_in_shm_dir(tmp_path: Path) -> None:
    """Once the scheduler has mapped the pool the worker published, both files are unlinked: vLLM
    kills an engine core that is slow to exit before its scheduler shuts down."""
    e = Engine(tmp_path, [(0, 16)], engine="killed")
    try:
        assert not list((tmp_path / "shm").iterdir())
        keys = [key(i, 0) for i in range(3)]
        e.store(keys, [1, 2, 3], [3], ctx("w"))  # worker and scheduler still share the same slots
        settle(e.manager)
        before = e.gpu[[1, 2, 3]].clone()
        e.gpu[[5, 6, 7]] = 0
        e.load(keys, [5, 6, 7], [3], ctx("r"))
        assert torch.equal(e.gpu[[5, 6, 7]], before)
    finally:
        e.close()


def test_the_scheduler_process_hands_the_gil_over_often(tmp_path: Path) -> None:
    """vLLM's step loop spins while a restore is pending; the I/O threads must not wait 5 ms for
    each hand-over of the GIL (gil_switch_interval_s, default 0.1 ms; unset leaves it alone)."""
    import sys

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        e = Engine(tmp_path / "a", [(0, 16)], engine="gil")
        e.close()
        assert sys.getswitchinterval() == pytest.approx(0.0001)
        sys.setswitchinterval(0.005)
        e = Engine(tmp_path / "b", [(0, 16)], {"gil_switch_interval_s": None}, engine="gil-off")
        e.close()
        assert sys.getswitchinterval() == pytest.approx(0.005)
    finally:
        sys.setswitchinterval(before)


def test_a_stalled_tier_turns_hit_pending_into_miss_at_the_deadline(tmp_path: Path) -> None:
    """A lower tier that never answers: vLLM sees HIT_PENDING, then MISS once max_pending_s has
    passed (the request recomputes), and nothing stays pinned."""
    import time

    stall = {"kind": "faulty", "inner": {"kind": "memory"}, "delay_s": 3600.0, "ops": ["get"]}
    e = Engine(tmp_path, [(0, 16)], {"tiers": [stall], "max_pending_s": 0.3}, engine="stall")
    try:
        keys = [key(i, 0) for i in range(4)]
        e.store(keys, [1, 2, 3, 4], [4], ctx("w"))
        settle(e.manager)
        e.manager.reset_cache()
        c = ctx("r")
        assert e.manager.lookup(keys[0], c) is LookupResult.HIT_PENDING
        t0 = time.monotonic()
        while (res := e.manager.lookup(keys[0], c)) is LookupResult.HIT_PENDING:
            assert time.monotonic() - t0 < 5, "held past the deadline"
            time.sleep(0.02)
        assert res is LookupResult.MISS and time.monotonic() - t0 >= 0.25
        e.manager.on_request_finished(c)
        st = e.manager.store.stats()
        assert st.pending_deadline_miss == 1 and all(g.pinned == 0 for g in st.groups)
    finally:
        e.close()


def test_kv_events_report_every_record_of_the_persistent_tier_once(tmp_path: Path) -> None:
    """Routers that place requests by cache locality see the persistent tier too: every record
    written is one STORAGE 'stored' event, and every one that leaves it (evicted for capacity,
    found corrupt, removed by someone else, e.g. `tierkv verify --repair`) one 'removed' event."""
    import time

    record = PAGE + 200  # a record of one block: the block, its header (128 bytes) and trailer
    tier = {"kind": "fsspec", "url": f"file://{tmp_path / 'tier'}", "capacity_bytes": 8 * record,
            "rescan_s": 0.2}
    e = Engine(tmp_path, [(0, 16)], {"tiers": [tier], "slots": {"0": 4}}, engine="events")
    medium = base.Medium.STORAGE

    def storage_events() -> tuple[list[bytes], list[bytes]]:
        stored, removed = [], []
        for ev in e.manager.take_events():
            if ev.medium is medium:
                assert ev.locality is base.Locality.LOCAL
                (removed if ev.removed else stored).extend(bytes(k) for k in ev.keys)
        return stored, removed

    try:
        keys = [key(i, 0) for i in range(12)]
        for i in range(0, 12, 4):
            e.store(keys[i:i + 4], [1, 2, 3, 4], [4], ctx(f"w{i}"))
            settle(e.manager)
        stored, removed = storage_events()
        assert sorted(stored) == sorted(keys), "each record written is reported once"
        on_disk = {p.name for p in (tmp_path / "tier").rglob("*.tkv")}
        gone = [k for k in keys if f"{k.hex()}.tkv" not in on_disk]
        assert len(gone) >= 4 and sorted(removed) == sorted(gone), "each eviction is reported once"
        # a corrupt record is removed when read
        victim = next(k for k in keys if k not in gone)
        (path,) = (tmp_path / "tier").rglob(f"{victim.hex()}.tkv")
        path.write_bytes(path.read_bytes()[:-8] + b"\0" * 8)
        e.manager.reset_cache()
        c = ctx("reader")
        while e.manager.lookup(victim, c) in (LookupResult.RETRY, LookupResult.HIT_PENDING):
            time.sleep(0.01)
        e.manager.on_request_finished(c)
        settle(e.manager)
        # a record removed by another process shows at the next listing
        other = next(k for k in keys if k not in gone and k != victim)
        next((tmp_path / "tier").rglob(f"{other.hex()}.tkv")).unlink()
        time.sleep(1.0)
        _, removed = storage_events()
        assert sorted(removed) == sorted([victim, other]), "corruption and outside removals, once each"
    finally:
        e.close()


# ---- CPUs that pick instructions by flags (tierkv/adapters/vllm/cpu.py) -------------------------------
def test_building_the_spec_asks_for_amx_tiles_in_that_process(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM builds the spec in its worker process before the first step: that is where AMX tile
    permission must be asked for (an engine whose first step is one token over a restored prefix
    otherwise ran vLLM's AMX attention kernel unpermitted: SIGILL on CPUs with AMX)."""
    import tierkv.adapters.vllm.spec as spec_module

    asked: list[int] = []
    monkeypatch.setattr(spec_module, "ensure_amx_permission", lambda: asked.append(os.getpid()) or "granted")
    spec = TierKVOffloadingSpec(offloading_config(tmp_path, [(0, 16)], {"cpu_bytes_to_use": 1 << 20}, "amx"))
    assert asked == [os.getpid()] and spec.amx == "granted"


def test_amx_permission_is_asked_of_the_kernel_only_where_the_cpu_has_amx(monkeypatch: pytest.MonkeyPatch
                                                                         ) -> None:
    import tierkv.adapters.vllm.cpu as cpu

    permitted = {"now": False}
    monkeypatch.setattr(cpu, "amx_supported", lambda: True)
    monkeypatch.setattr(cpu, "amx_permitted", lambda: permitted["now"])
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: permitted.update(now=True) or True, raising=False)
    assert cpu.ensure_amx_permission() == "granted" and permitted["now"]
    permitted["now"] = False
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: False, raising=False)
    assert cpu.ensure_amx_permission().startswith("refused")
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: 1 / 0, raising=False)
    assert cpu.ensure_amx_permission().startswith("refused: ZeroDivisionError")  # never raises
    monkeypatch.setattr(cpu, "amx_supported", lambda: False)
    assert cpu.ensure_amx_permission() == "not needed (no AMX on this CPU)"


def test_this_process_holds_amx_permission_after_asking_where_the_cpu_has_amx() -> None:
    """The real system call, on whatever CPU runs the suite: granted with AMX, not needed without."""
    from tierkv.adapters.vllm.cpu import amx_permitted, amx_supported, ensure_amx_permission

    answer = ensure_amx_permission()
    if amx_supported():
        assert answer == "granted" and amx_permitted()
    else:
        assert answer == "not needed (no AMX on this CPU)"


def test_engines_on_cpus_that_lay_out_kv_differently_never_share_a_namespace(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tierkv.adapters.vllm.cpu as cpu

    def namespace(amx: bool, conv: str | None) -> str:
        monkeypatch.setattr(cpu, "amx_supported", lambda: amx)
        if conv is None:
            monkeypatch.delenv("VLLM_SSM_CONV_STATE_LAYOUT", raising=False)
        else:
            monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", conv)
        cfg = offloading_config(tmp_path, [(0, 16)], {"cpu_bytes_to_use": 1 << 20}, "ns")
        return str(TierKVOffloadingSpec(cfg).namespace)

    names = {namespace(True, None), namespace(False, None), namespace(False, "SD"), namespace(False, "DS")}
    assert len(names) == 4  # the AMX and vector attention layouts, two conv state layouts
    assert namespace(False, None) == namespace(False, None)


@pytest.mark.parametrize(("extra", "named"), [
    ({"manifest_timeout_s": float("nan")}, "manifest_timeout_s"),
    ({"cpu_bytes_to_use": True}, "cpu_bytes_to_use"),
    ({"slots": {0: -1}}, "slots.0"),
    ({"shm_dir": ""}, "shm_dir"),
    ({"recompute_tokens_per_s": float("inf")}, "recompute_tokens_per_s"),
    ({"max_pending_s": 1e308}, "max_pending_s"),
])
def test_extra_config_values_that_switch_the_cache_off_are_refused(tmp_path: Path, extra: dict[str, Any],
                                                                   named: str) -> None:
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\." + named.replace(".", r"\.")):
        TierKVOffloadingSpec(offloading_config(tmp_path, [(0, 16)], extra, "bad"))


def test_an_extra_config_that_is_not_a_mapping_is_one_config_error() -> None:
    from tierkv.adapters.vllm.config import AdapterConfig

    with pytest.raises(ConfigError, match="must be a JSON object"):
        AdapterConfig.from_extra([("cpu_bytes_to_use", 1)])  # type: ignore[arg-type]


def test_the_measured_prefill_rate_is_the_engines_not_the_offered_load() -> None:
    """An engine that prefills 5,120 tokens/s, offered 1,024 tokens/s (a 10-block request of 16
    tokens a block every 156 ms, each computed in 31 ms, the engine idle in between): the meter
    reads the engine's rate, not the offered load (blocks stored per busy second read the latter:
    docs/performance.md, "Serving a Mooncake trace"). vLLM prepares a store in the pass that
    schedules its tokens and completes it after the step; a decode block's store (no lookup
    before it) is not timed. Two requests computed side by side in one step count their blocks
    over the step's time once."""
    from tierkv.adapters.vllm.manager import RateMeter

    meter = RateMeter(tokens_per_block=16)
    t, rate = 100.0, None
    for n in range(60):
        for _ in range(3):  # looked up in several passes; the last one schedules it
            meter.looked_up(f"r{n}")
            t += 0.001
        meter.preparing(f"r{n}", t)
        t += 160 / 5120
        rate = meter.stored(f"r{n}", 10, now=t)
        meter.preparing(f"r{n}", t + 0.01)  # a decode block, one step of 10 ms
        assert meter.stored(f"r{n}", 1, now=t + 0.02) == rate
        t += 0.125
    assert rate is not None and 5120 / 1.2 <= rate <= 5120 * 1.2, rate
    for n in range(60):  # two requests in one step of 62.5 ms: 20 blocks over 62.5 ms
        meter.looked_up(f"a{n}")
        meter.looked_up(f"b{n}")
        meter.preparing(f"a{n}", t)
        meter.preparing(f"b{n}", t)
        t += 320 / 5120
        meter.stored(f"a{n}", 10, now=t)
        rate = meter.stored(f"b{n}", 10, now=t + 1e-5)
        t += 0.2
    assert rate is not None and 5120 / 1.2 <= rate <= 5120 * 1.2, rate
    meter.looked_up("gone")
    meter.preparing("gone", t)
    meter.failed("gone")
    assert meter.stored("gone", 10, now=t + 5) == rate  # its store failed: no interval of 5 s
    for n in range(80):  # one output token: the request ends before its blocks are stored
        meter.looked_up(f"c{n}")
        meter.preparing(f"c{n}", t)
        meter.finished(f"c{n}")
        t += 160 / 2560  # a slower engine now: the meter follows it
        rate = meter.stored(f"c{n}", 10, now=t)
        t += 0.2
    assert rate is not None and 2560 / 1.2 <= rate <= 2560 * 1.2, rate

"""Hostile inputs and odd failures, through the public API: a clear error or a counted miss,
never a crash, a hang, wrong bytes or a broken store.

One test (or a few) per defect an adversarial run found (the numbers follow its list), then a
Hypothesis suite over tensor kinds and over every numeric setting, and ``close()`` cancelled at
random points.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from helpers import FULL, REC, SW, blocks, config, group_stats, hashes, hybrid_layout
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from s3util import boto_client, new_bucket, s3_endpoint, storage_options

from tierkv import (
    CapacityError,
    ConfigError,
    GroupSpec,
    InvalidArgument,
    Layout,
    LayoutError,
    Lookup,
    StoreConfig,
    TieredStore,
    TierKVError,
    make_key,
)
from tierkv.backends.namespace import record_path
from tierkv.tools.audit import verify_tier

pytestmark = pytest.mark.anyio
__all__ = ["s3_endpoint"]  # the fixture

LAYOUT = hybrid_layout()
BB = LAYOUT.groups[FULL].block_bytes
SLOTS = {FULL: 16, SW: 16, REC: 4}


def io_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("tierkv-io"))


def file_cfg(root: Path, **tier: Any) -> dict[str, Any]:
    return config(LAYOUT, {"kind": "fsspec", "url": f"file://{root}", **tier}, slots=SLOTS)


# ---- 1. tensors that pass the shape checks but are not plain bytes -----------------------------
def _quantized(n: int) -> torch.Tensor:
    return torch.quantize_per_tensor(torch.rand(n, BB), 0.1, 0, torch.quint8)


def _conj(n: int) -> torch.Tensor:
    return torch.complex(torch.rand(n, BB // 8), torch.rand(n, BB // 8)).conj()


def _neg(n: int) -> torch.Tensor:
    return torch._neg_view(torch.rand(n, BB // 4))


def _sparse(n: int) -> torch.Tensor:
    return torch.zeros(n, BB, dtype=torch.uint8).to_sparse()


BAD_TENSORS: dict[str, Callable[[int], torch.Tensor]] = {
    "quantized": _quantized,
    "conjugate view": _conj,
    "negative view": _neg,
    "sparse": _sparse,
    "meta": lambda n: torch.empty(n, BB, dtype=torch.uint8, device="meta"),
    "not contiguous": lambda n: torch.zeros(BB, n, dtype=torch.uint8).t(),
}


@pytest.mark.parametrize("kind", list(BAD_TENSORS))
async def test_put_of_a_tensor_that_is_not_plain_bytes_is_refused_before_any_state_change(
        kind: str) -> None:
    async with TieredStore(config(LAYOUT, {"kind": "memory"}, slots=SLOTS)) as store:
        hs = hashes(3)
        before = store.stats().model_dump()
        with pytest.raises(InvalidArgument):
            await store.put(FULL, hs, BAD_TENSORS[kind](3))
        assert store.stats().model_dump() == before
        assert store.lookup(FULL, hs) == [Lookup.MISS] * 3, "no slot was taken"
        good = blocks(3, BB)
        await store.put(FULL, hs, good)  # a correct put of the same hashes is not ignored
        out = torch.zeros_like(good)
        await store.get(FULL, hs, out)
        assert torch.equal(out, good)
        assert store.check() == []


@pytest.mark.parametrize("kind", [k for k in BAD_TENSORS if k != "meta"])
async def test_get_into_a_tensor_that_is_not_plain_bytes_is_refused(kind: str) -> None:
    async with TieredStore(config(LAYOUT, slots=SLOTS)) as store:
        hs = hashes(3)
        await store.put(FULL, hs, blocks(3, BB))
        with pytest.raises(InvalidArgument):
            await store.get(FULL, hs, BAD_TENSORS[kind](3))
        out = torch.zeros(3, BB // 4, requires_grad=True)
        with pytest.raises(InvalidArgument, match="grad"):
            await store.get(FULL, hs, out)
        assert store.check() == []


# ---- 2. close() from another task, inside a timeout ---------------------------------------------
async def test_close_from_another_task_and_inside_a_timeout(tmp_path: Path) -> None:
    base = io_threads()
    store = TieredStore(file_cfg(tmp_path))
    await store.open()
    await store.put(FULL, hashes(4), blocks(4, BB))
    async with anyio.create_task_group() as tg:
        async def closer() -> None:
            with anyio.fail_after(30):
                await store.close()

        tg.start_soon(closer)
    assert io_threads() == base, "the tier's I/O threads stopped"
    await store.close()  # a second close is a no-op


async def test_close_interrupted_by_its_timeout_still_closes_everything(tmp_path: Path) -> None:
    base = io_threads()
    slow = {"kind": "faulty", "inner": {"kind": "fsspec", "url": f"file://{tmp_path}"}, "delay_s": 2.0,
            "ops": ["put"]}
    store = TieredStore(config(LAYOUT, slow, slots=SLOTS))
    await store.open()
    await store.put(FULL, hashes(2), blocks(2, BB))  # its cascade takes 2 s
    with pytest.raises(TimeoutError):
        with anyio.fail_after(0.2):
            await store.close()
    assert io_threads() == base, "an interrupted close still stops the I/O threads"
    await store.close()
    with pytest.raises(TierKVError):
        store.lookup(FULL, hashes(1))


async def test_close_under_asyncio_wait_for(tmp_path: Path) -> None:
    base = io_threads()
    store = TieredStore(file_cfg(tmp_path))
    await store.open()
    await store.put(FULL, hashes(2), blocks(2, BB))
    await asyncio.wait_for(store.close(), timeout=30)
    assert io_threads() == base


# ---- 3. special files at a record's path ---------------------------------------------------------
async def test_a_fifo_at_a_record_path_is_a_miss_not_a_hang(tmp_path: Path) -> None:
    hs = hashes(2)
    data = blocks(2, BB)
    async with TieredStore(file_cfg(tmp_path)) as store:
        await store.put(FULL, hs, data)
        await store.flush()
        root = str(tmp_path)
        path = Path(record_path(root, store.fingerprint, make_key(hs[0], FULL)))
    path.unlink()
    os.mkfifo(path)
    with anyio.fail_after(20):
        async with TieredStore(file_cfg(tmp_path)) as store:
            out = torch.zeros_like(data)
            with pytest.raises(TierKVError) as exc:
                await store.get(FULL, hs, out)
            assert getattr(exc.value, "missing", None) == [0]
            assert torch.equal(out[1], data[1])
            backend = store.stats().tiers[1].backend
            assert backend.get("corrupt_special", 0) + backend.get("corrupt_empty", 0) == 1
        report = await verify_tier(f"file://{tmp_path}")
    assert report.clean, "the special file was counted as a corrupt record and removed"
    assert not path.exists()


async def test_verify_reports_and_repairs_a_fifo(tmp_path: Path) -> None:
    async with TieredStore(file_cfg(tmp_path)) as store:
        await store.put(FULL, hashes(2), blocks(2, BB))
        await store.flush()
        path = Path(record_path(str(tmp_path), store.fingerprint, make_key(hashes(2)[1], FULL)))
    path.unlink()
    os.mkfifo(path)
    with anyio.fail_after(20):
        report = await verify_tier(f"file://{tmp_path}")
        assert [p.reason for p in report.corrupt] == ["special"]
        assert not report.clean
        repaired = await verify_tier(f"file://{tmp_path}", repair=True)
    assert repaired.clean and not path.exists()


# ---- 4 and 12. settings that would break the store -----------------------------------------------
BAD_TIER_SETTINGS = [
    ("presence_ttl_s", 0), ("presence_ttl_s", -1.0), ("presence_ttl_s", math.nan),
    ("presence_ttl_s", math.inf),
    ("negative_ttl_s", 0), ("negative_ttl_s", -5), ("negative_ttl_s", math.nan),
    ("shed_after_s", 0), ("shed_after_s", math.nan), ("elem_size", 0), ("elem_size", 256),
    ("zstd_level", 1000), ("zstd_level", -(1 << 20)), ("url", ""), ("url", "file://"), ("url", "   "),
    ("url", "s3://"), ("url", "s3:///prefix"),
    ("stale_temp_s", -1), ("max_inflight_bytes", 0), ("max_queued_bytes", -1), ("read_bytes_per_s", 0),
    ("io_depth", 0),
]


@pytest.mark.parametrize(("key", "value"), BAD_TIER_SETTINGS)
def test_bad_tier_settings_are_refused_naming_the_key(key: str, value: Any, tmp_path: Path) -> None:
    tier = {"kind": "fsspec", "url": f"file://{tmp_path}", key: value}
    with pytest.raises(ConfigError, match=rf"tiers\.1\.{key}"):
        StoreConfig.from_dict(config(LAYOUT, tier, slots=SLOTS))


@pytest.mark.parametrize(("inner", "expect"), [
    ({"kind": "bogus"}, r"tiers\.1.*bogus"),
    ({"kind": "memory", "capacity_bytes": -1}, r"tiers\.1.*inner\.capacity_bytes"),
    ({"url": "file:///x"}, r"tiers\.1\.inner.*kind"),
])
def test_a_faulty_tier_with_a_bad_inner_config_is_a_config_error(inner: dict[str, Any], expect: str) -> None:
    with pytest.raises(ConfigError, match=expect):
        StoreConfig.from_dict(config(LAYOUT, {"kind": "faulty", "inner": inner}, slots=SLOTS))


def test_a_namespace_with_a_lone_surrogate_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="namespace"):
        StoreConfig.from_dict({**config(LAYOUT, slots=SLOTS), "namespace": "model-\udcff"})


async def test_an_allocation_the_machine_cannot_make_is_a_capacity_error() -> None:
    with pytest.raises(CapacityError, match="group 0"):
        async with TieredStore(config(LAYOUT, slots={FULL: 2 ** 40, SW: 2, REC: 2})):
            pass


def test_layout_errors_are_one_line_without_input_values() -> None:
    with pytest.raises(LayoutError) as exc:
        Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=64)], extra="secret-value")
    assert "\n" not in str(exc.value) and "secret-value" not in str(exc.value)
    with pytest.raises(LayoutError) as exc2:
        GroupSpec(kind="full", block_bytes="many")  # type: ignore[arg-type]
    assert "\n" not in str(exc2.value) and "input_value" not in str(exc2.value)


@pytest.mark.parametrize("bad", [None, (h for h in hashes(2)), 3, b"abc", [b"a", "b"]])
async def test_hashes_that_are_not_a_sequence_of_bytes_are_invalid_arguments(bad: Any) -> None:
    async with TieredStore(config(LAYOUT, slots=SLOTS)) as store:
        with pytest.raises(InvalidArgument):
            store.lookup(FULL, bad)
        with pytest.raises(InvalidArgument):
            store.lookup_prefix(bad)
        with pytest.raises(InvalidArgument):
            await store.put(FULL, bad, blocks(2, BB))


# ---- 5. long hashes --------------------------------------------------------------------------------
async def test_hashes_of_every_allowed_length_are_stored_and_restored(tmp_path: Path) -> None:
    hs = [bytes([i]) * n for i, n in enumerate((1, 32, 108, 200, 1024))]
    data = blocks(len(hs), BB)
    async with TieredStore(file_cfg(tmp_path)) as store:
        await store.put(FULL, hs, data)
        await store.flush()
        assert store.stats().tiers[1].stores == len(hs)
    assert all(len(p.name) <= 255 for p in tmp_path.rglob("*"))
    async with TieredStore(file_cfg(tmp_path)) as store:
        out = torch.zeros_like(data)
        await store.get(FULL, hs, out)
        assert torch.equal(out, data)
    report = await verify_tier(f"file://{tmp_path}")
    assert report.clean and report.ok == len(hs)


async def test_a_hash_over_the_limit_is_refused() -> None:
    async with TieredStore(config(LAYOUT, slots=SLOTS)) as store:
        with pytest.raises(InvalidArgument, match="1024"):
            await store.put(FULL, [b"x" * 1025], blocks(1, BB))


# ---- 6. start-up on a full disk, unreadable entries ----------------------------------------------
async def test_open_does_not_rewrite_the_manifest(tmp_path: Path) -> None:
    async with TieredStore(file_cfg(tmp_path)):
        pass
    (manifest,) = tmp_path.glob("*/layout.json")
    stamp = manifest.stat().st_mtime_ns
    async with TieredStore(file_cfg(tmp_path)):
        pass
    assert manifest.stat().st_mtime_ns == stamp


async def test_a_full_disk_at_open_still_serves_the_records_there(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    data = blocks(2, BB)
    async with TieredStore(file_cfg(tmp_path)) as store:
        await store.put(FULL, hashes(2), data)
        await store.flush()
    for m in tmp_path.glob("*/layout.json"):
        m.unlink()
    from tierkv.backends.fsspec._driver import Driver

    async def full(self: Any, path: str, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Driver, "write_file", full)
    async with TieredStore(file_cfg(tmp_path)) as store:
        out = torch.zeros_like(data)
        await store.get(FULL, hashes(2), out)
        assert torch.equal(out, data)
        assert store.stats().tiers[1].backend.get("manifest_errors") == 1


async def test_an_unstatable_entry_does_not_stop_the_startup_scan(tmp_path: Path) -> None:
    cap = 6 * (BB + 4096)
    async with TieredStore(file_cfg(tmp_path, capacity_bytes=cap)) as store:
        await store.put(FULL, hashes(4), blocks(4, BB))
        await store.flush()
        ns = tmp_path / store.fingerprint
    loop = ns / "g00000000" / "loop"
    os.symlink(loop, loop)  # a symlink loop inside the namespace
    (ns / "stale.tkvtmp-otherhost-1-abc").write_bytes(b"x")
    async with TieredStore(file_cfg(tmp_path, capacity_bytes=cap)) as store:
        tier = store.tiers[1]
        await tier.wait_scanned()  # type: ignore[attr-defined]
        assert tier.counters.get("scanned") == 4 and "scan_errors" not in tier.counters
        await store.put(FULL, hashes(4, doc=1), blocks(4, BB, seed=1))
        await store.flush()
        assert store.stats().tiers[1].used_bytes <= cap, "capacity is enforced across the restart"


# ---- 7. two stores on one shared-memory pool -----------------------------------------------------
async def test_a_shared_memory_path_serves_one_store_only(tmp_path: Path) -> None:
    shm = str(tmp_path / "pool")
    cfg = config(LAYOUT, slots=SLOTS)
    cfg["tiers"][0]["shm_path"] = shm
    data = blocks(2, BB)
    async with TieredStore(cfg) as first:
        await first.put(FULL, hashes(2), data)
        with pytest.raises(ConfigError, match="in use"):
            async with TieredStore(cfg):
                pass
        assert os.path.exists(shm), "the refused store did not delete the first one's file"
        out = torch.zeros_like(data)
        await first.get(FULL, hashes(2), out)
        assert torch.equal(out, data)
    assert not os.path.exists(shm)


# ---- 8. request_id "" ------------------------------------------------------------------------------
async def test_request_id_empty_is_a_request_like_any_other() -> None:
    async with TieredStore(config(LAYOUT, slots=SLOTS)) as store:
        hs = hashes(3)
        await store.put(FULL, hs, blocks(3, BB))
        await store.flush()
        assert store.lookup(FULL, hs, request_id="") == [Lookup.HIT] * 3
        assert group_stats(store, FULL).pinned == 3
        store.lookup(FULL, hs)  # anonymous lookups pin for their own call only
        store.lookup_prefix(hs)
        assert group_stats(store, FULL).pinned == 3, "anonymous calls never drop another's pins"
        store.release("")
        assert group_stats(store, FULL).pinned == 0


# ---- 9. secrets ----------------------------------------------------------------------------------
SECRET = "s3cr3t-VALUE-xyz"


def test_a_yaml_syntax_error_never_quotes_the_offending_line(tmp_path: Path) -> None:
    p = tmp_path / "cfg.yaml"
    p.write_text("layout: {}\ntiers:\n  - kind: fsspec\n"
                 "    storage_options: {secret: " + SECRET + "\n  oops: [\n")
    with pytest.raises(ConfigError) as exc:
        StoreConfig.from_file(p)
    assert SECRET not in str(exc.value) and "line" in str(exc.value)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize("client", ["s3fs", "obstore"])
async def test_debug_logs_of_the_storage_libraries_hold_no_credentials(s3_endpoint: str, client: str) -> None:
    bucket = new_bucket(s3_endpoint)
    opts = {**storage_options(s3_endpoint), "client_kwargs": {"region_name": "us-east-1"}}
    # the session token below is what botocore logs in its request headers at DEBUG
    opts["token"] = SECRET
    cfg = config(LAYOUT, {"kind": "fsspec", "url": f"s3://{bucket}/kv", "storage_options": opts,
                          "s3_client": client}, slots=SLOTS)
    root = logging.getLogger()
    handler, level = _Collect(), root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        async with TieredStore(cfg) as store:
            await store.put(FULL, hashes(2), blocks(2, BB))
            await store.flush()
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    text = "\n".join(r.getMessage() + (r.exc_text or "") for r in handler.records)
    if client == "s3fs":
        assert any(r.name.startswith("botocore") for r in handler.records), "botocore logged at DEBUG"
    assert SECRET not in text


# ---- 10. an empty object on S3 -------------------------------------------------------------------
async def test_an_empty_s3_object_at_a_record_path_is_a_counted_miss_and_removed(
        s3_endpoint: str) -> None:
    bucket = new_bucket(s3_endpoint)
    cfg = config(LAYOUT, {"kind": "fsspec", "url": f"s3://{bucket}/kv",
                          "storage_options": storage_options(s3_endpoint)}, slots=SLOTS)
    hs = hashes(2)
    async with TieredStore(cfg) as store:
        await store.put(FULL, hs, blocks(2, BB))
        await store.flush()
        key = record_path(f"{bucket}/kv", store.fingerprint, make_key(hs[0], FULL)).partition("/")[2]
    client = boto_client(s3_endpoint)
    client.put_object(Bucket=bucket, Key=key, Body=b"")
    async with TieredStore(cfg) as store:
        out = torch.zeros(2, BB, dtype=torch.uint8)
        with pytest.raises(TierKVError):
            await store.get(FULL, hs, out)
        backend = store.stats().tiers[1].backend
        assert backend.get("corrupt_empty") == 1 and backend.get("corrupt_removed") == 1
        assert "read_errors" not in backend
    assert "Contents" not in client.list_objects_v2(Bucket=bucket, Prefix=key)


# ---- 11. a burst of puts while every cascade fails ------------------------------------------------
async def test_blocks_lost_to_a_failing_tier_are_counted() -> None:
    failing = {"kind": "faulty", "inner": {"kind": "memory"}, "fail_every": 1, "ops": ["put"]}
    async with TieredStore(config(LAYOUT, failing, slots={FULL: 16, SW: 2, REC: 2})) as store:
        for i in range(64):
            await store.put(FULL, hashes(1, doc=i), blocks(1, BB, seed=i))
        await store.flush()
        st = store.stats()
        assert st.tiers[1].stores_failed == 64 and st.tiers[1].stores == 0
        # 16 blocks stay in the primary; the 48 others are held by no tier, and stats say so: evicted
        # from the primary with no lower tier holding them, or put past a full primary and then
        # refused by every tier
        assert group_stats(store, FULL).ready == 16
        assert st.evictions_unbacked + st.put_blocks_dropped == 48


# ---- Hypothesis: tensor kinds and numeric settings ----------------------------------------------
DTYPES = [torch.uint8, torch.int8, torch.int16, torch.float16, torch.bfloat16, torch.float32, torch.int32,
          torch.float64, torch.int64, torch.complex64, torch.bool]


@st.composite
def tensors(draw: st.DrawFn, n: int) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    size = torch.empty((), dtype=dtype).element_size()
    rows = draw(st.sampled_from([n, n - 1, n + 1])) if draw(st.booleans()) else n
    cols = max(1, BB // size + draw(st.sampled_from([0, 0, 0, 1, -1])))
    base = torch.zeros((max(rows, 0), cols), dtype=dtype)
    view = draw(st.sampled_from(["plain", "transposed", "strided", "conj", "neg", "expanded", "3d",
                                 "quantized", "sparse", "grad"]))
    if view == "transposed":
        return torch.zeros((cols, max(rows, 0)), dtype=dtype).t()
    if view == "strided":
        return torch.zeros((max(rows, 0), 2 * cols), dtype=dtype)[:, ::2]
    if view == "conj" and dtype.is_complex:
        return base.conj()
    if view == "neg" and dtype.is_floating_point:
        return torch._neg_view(base)
    if view == "expanded":
        return torch.zeros((1, cols), dtype=dtype).expand(max(rows, 0), cols)
    if view == "3d":
        return base.reshape(max(rows, 0), 1, cols)
    if view == "quantized":
        return _quantized(max(rows, 1))
    if view == "sparse":
        return base.to_sparse()
    if view == "grad" and dtype.is_floating_point:
        return base.requires_grad_()
    return base


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_tensor_is_stored_exactly_or_refused_cleanly(data: st.DataObject) -> None:
    async def run() -> None:
        async with TieredStore(config(LAYOUT, {"kind": "memory"}, slots=SLOTS)) as store:
            hs = hashes(3)
            t = data.draw(tensors(3))
            before = store.stats().model_dump()
            try:
                await store.put(FULL, hs, t)
            except InvalidArgument:
                assert store.stats().model_dump() == before
                assert store.lookup(FULL, hs) == [Lookup.MISS] * 3
            else:
                out = torch.zeros(3, BB, dtype=torch.uint8)
                await store.get(FULL, hs, out)
                assert torch.equal(out, t.detach().reshape(3, -1).view(torch.uint8))
            o = data.draw(tensors(3))
            try:
                await store.get(FULL, hashes(3, doc=9), o)
            except TierKVError:
                pass  # InvalidArgument, or BlockMissing for a well-formed out
            assert store.check() == []

    anyio.run(run)


NUMERIC = {
    "presence_ttl_s": "float", "negative_ttl_s": "float", "shed_after_s": "float", "stale_temp_s": "float",
    "read_bytes_per_s": "float", "max_inflight_bytes": "int", "max_inflight_ops": "int",
    "max_queued_bytes": "int", "read_concurrency": "int", "io_threads": "int", "io_depth": "int",
    "elem_size": "int", "zstd_level": "int", "capacity_bytes": "int",
}
values = st.one_of(st.integers(-(1 << 41), 1 << 41), st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0, -1, 1, 2, 255, 256, 1 << 20]))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(sorted(NUMERIC)), value=values)
def test_every_numeric_setting_is_refused_by_name_or_works(key: str, value: Any, tmp_path: Path) -> None:
    tier = {"kind": "fsspec", "url": f"file://{tmp_path}/t", key: value}
    try:
        cfg = StoreConfig.from_dict(config(LAYOUT, tier, slots=SLOTS))
    except ConfigError as exc:
        assert f"tiers.1.{key}" in str(exc)
        return

    async def run() -> None:
        async with TieredStore(cfg) as store:
            data = blocks(2, BB)
            hs = hashes(2, doc=abs(hash((key, str(value)))) % 1000)
            await store.put(FULL, hs, data)
            await store.flush()
            out = torch.zeros_like(data)
            await store.get(FULL, hs, out)
            assert torch.equal(out, data)

    anyio.run(run)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(delay=st.floats(0, 0.3), cascade_s=st.sampled_from([0.0, 0.05, 0.5]))
def test_close_cancelled_at_any_point_leaves_nothing_running(delay: float, cascade_s: float,
                                                             tmp_path: Path) -> None:
    base = io_threads()

    async def run() -> None:
        tier = {"kind": "faulty", "inner": {"kind": "fsspec", "url": f"file://{tmp_path}/c"},
                "delay_s": cascade_s, "ops": ["put"]}
        store = TieredStore(config(LAYOUT, tier, slots=SLOTS))
        await store.open()
        await store.put(FULL, hashes(2), blocks(2, BB))
        with anyio.move_on_after(delay):
            await store.close()
        await store.close()
        with pytest.raises(TierKVError):
            store.lookup(FULL, hashes(1))

    anyio.run(run)
    assert io_threads() == base

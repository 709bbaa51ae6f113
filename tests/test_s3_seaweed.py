"""The S3 tier against a real S3 server (SeaweedFS, ``tests/seaweed.py``), not only moto.

Three parts:

1. the tier conformance suite over SeaweedFS (oracle hooks through s3fs);
2. the moto-era S3 tests (concurrent restores, faults, credentials, ``inspect``/``verify`` of a
   damaged record) run unchanged against SeaweedFS: their bodies are imported and called with this
   module's ``s3_endpoint`` fixture, which is SeaweedFS here (the server also accepts the
   credentials those tests hard-code, ``seaweed.COMPAT_CREDENTIALS``);
3. what a mock hides, through tierkv's public API: listings of more than one page, a record above
   s3fs's multipart threshold, a server killed and restarted under a running store, and a missing
   bucket or wrong credentials at ``open()``.

Every test runs once per S3 client (``s3clients``: obstore and s3fs).
"""

from __future__ import annotations

import json
import secrets
import time
import traceback
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import s3fs
import test_admission as admission_tests
import test_fsspec_cli as cli_tests
import test_fsspec_conformance as conformance_tests
import test_fsspec_tier as tier_tests
import torch
from s3clients import s3_client
from seaweed import COMPAT_CREDENTIALS, SeaweedServer, seaweed
from test_fsspec_tier import logs

from tierkv import BackendError, BlockMissing, GroupSpec, Layout, Lookup, TieredStore
from tierkv.backends.base import Tier
from tierkv.backends.fsspec._tier import FsspecTier, record_path
from tierkv.cli import main as cli_main
from tierkv.keys import make_key
from tierkv.testing import TierTests, conformance_layout
from tierkv.tools.audit import inspect_tier

__all__ = ["logs", "s3_client", "seaweed"]  # fixtures, imported for this module

#: every test here runs on both S3 clients (obstore and s3fs)
pytestmark = pytest.mark.usefixtures("s3_client")

LAYOUT = conformance_layout()
FULL, REC = 0, 2
BB = LAYOUT.groups[FULL].block_bytes
#: the longest any single store call may take while the server is down or coming back (s3fs and
#: botocore defaults: 5 attempts with a random exponential backoff, 2-11 s per request measured)
OUTAGE_BOUND_S = 30.0


@asynccontextmanager
async def open_s3fs(opts: dict[str, Any]) -> AsyncIterator[Any]:
    """An async s3fs file system whose client session is closed on exit."""
    fs = s3fs.S3FileSystem(asynchronous=True, skip_instance_cache=True, **opts)
    session = await fs.set_session()
    try:
        yield fs
    finally:
        await session.close()


@pytest.fixture
def s3_endpoint(seaweed: SeaweedServer) -> str:
    """The endpoint the reused moto-era test bodies talk to: SeaweedFS in this module."""
    return seaweed.endpoint_url


def store_config(url: str, opts: dict[str, Any], slots: dict[int, int] | None = None,
                 layout: Layout = LAYOUT, namespace: str = "seaweed", **tier: Any) -> dict[str, Any]:
    """A cpu primary and an fsspec tier at ``url``."""
    return {"layout": layout, "namespace": namespace, "max_concurrent_requests": 2,
            "tiers": [{"kind": "cpu", "slots": slots or {FULL: 16, REC: 2}},
                      {"kind": "fsspec", "url": url, "storage_options": opts, **tier}]}


async def settle(store: TieredStore, hashes: list[bytes], request_id: str, rounds: int = 40) -> list[Lookup]:
    """Look ``hashes`` up until no answer is PENDING (background probes and promotions done)."""
    res = store.lookup(FULL, hashes, request_id=request_id)
    for _ in range(rounds):
        if Lookup.PENDING not in res:
            break
        await store.idle()
        await anyio.sleep(0.05)
        res = store.lookup(FULL, hashes, request_id=request_id)
    return res


def record_objects(objects: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in objects.items() if k.endswith(".tkv")}


# ---- 1. conformance ------------------------------------------------------------------------------
class TestFsspecSeaweed(TierTests):
    """``s3://`` URLs through async s3fs against SeaweedFS; the oracle reads and writes with s3fs."""

    kind = "fsspec"
    reports_rows = True

    @pytest.fixture(autouse=True)
    def _bucket(self, seaweed: SeaweedServer) -> None:
        self.server = seaweed
        self.bucket = seaweed.new_bucket()

    def tier_config(self) -> dict[str, Any]:
        return {"kind": "fsspec", "url": f"s3://{self.bucket}/kv", "codec": "none",
                "storage_options": self.server.storage_options()}

    def _object(self, tier: Tier, key: bytes) -> str:
        assert isinstance(tier, FsspecTier)
        return record_path(f"{self.bucket}/kv", tier.context.fingerprint, key)

    async def oracle_set(self, tier: Tier, group: int, key: bytes, data: bytes) -> None:
        async with open_s3fs(self.server.storage_options()) as fs:
            await fs._pipe_file(self._object(tier, key), conformance_tests._record(tier, key, data))

    async def oracle_get(self, tier: Tier, group: int, key: bytes) -> bytes | None:
        async with open_s3fs(self.server.storage_options()) as fs:
            try:
                blob = await fs._cat_file(self._object(tier, key))
            except FileNotFoundError:
                return None
        return conformance_tests._decode(tier, key, blob)


# ---- 2. the moto-era S3 tests, against SeaweedFS ---------------------------------------------------
@pytest.mark.anyio
async def test_concurrent_restores_reported_scenario(s3_endpoint: str) -> None:
    """4 documents written by another process, restored by 4 requests through a 3-slot recurrent pool."""
    await admission_tests.test_reported_scenario_through_s3(s3_endpoint)


@pytest.mark.anyio
async def test_faulty_tier_store_keeps_serving_and_leaks_nothing(
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Injected SlowDown errors over a real S3 tier: served bytes right, nothing leaked, all back after."""
    await tier_tests.test_faulty_tier_store_keeps_serving_and_leaks_nothing(
        tmp_path, request, "s3", "SlowDown")


@pytest.mark.anyio
async def test_credentials_in_the_url_reach_s3_and_never_show(
        tmp_path: Path, s3_endpoint: str, logs: Any) -> None:
    """The moto test accepts any credentials; here the URL's user info must really authenticate."""
    assert ("AKIAUSER", tier_tests.SECRET) in COMPAT_CREDENTIALS, "the server must accept the URL's secret"
    await tier_tests.test_credentials_never_appear_in_reprs_stats_or_logs(tmp_path, s3_endpoint, logs)


def test_inspect_and_verify_find_and_repair_a_damaged_object(
        s3_endpoint: str, capsys: pytest.CaptureFixture[str]) -> None:
    cli_tests.test_inspect_and_verify_on_s3(s3_endpoint, capsys)


@pytest.mark.anyio
async def test_corrupt_objects_are_misses_through_the_store_and_removed(seaweed: SeaweedServer) -> None:
    """Damaged objects (``test_fsspec_tier._damage_kinds``) are counted misses, deleted from the bucket."""
    bucket = seaweed.new_bucket()
    opts = seaweed.storage_options()
    hs = tier_tests.hashes(10, salt=3)
    data = tier_tests.kv_like(10, BB, seed=3)
    async with TieredStore(store_config(f"s3://{bucket}/kv", opts, codec="zstd")) as store, \
            open_s3fs(opts) as fs:
        await store.put(FULL, hs, data)
        await store.flush()
        tier = store.tiers[1]
        assert isinstance(tier, FsspecTier)
        ks = [make_key(h, FULL) for h in hs]
        good = await fs._cat_file(tier.path(ks[0]))
        damaged = tier_tests._damage_kinds(good, ks[0], data[0].numpy().tobytes())
        for k, blob in zip(ks, damaged, strict=False):  # objects 0..7 damaged, 8 and 9 sound
            await fs._pipe_file(tier.path(k), bytes(blob))
        store.engine.clear()  # forget the primary's copies
        with anyio.fail_after(60):
            res = await settle(store, hs, "r")
        assert res == [Lookup.MISS] * 8 + [Lookup.HIT] * 2
        out = torch.zeros_like(data)
        with pytest.raises(BlockMissing) as exc:
            await store.get(FULL, hs, out, request_id="r")
        assert exc.value.missing == list(range(8))
        assert torch.equal(out[8:], data[8:])
        store.release("r")
        backend = store.stats().tiers[1].backend
        # the empty object among them: a ranged GET of a 0-byte object is 416 on a real S3 (moto
        # serves b""), and must still be classified "empty" and removed, not retried forever
        assert backend.get("read_errors", 0) == 0, backend
        assert backend["corrupt"] == 8 and backend["corrupt_removed"] == 8, backend
        left = record_objects(seaweed.objects(bucket))
        assert sorted(left) == sorted(tier.path(k).partition("/")[2] for k in ks[8:]), \
            "corrupt objects must be deleted from the bucket, sound ones kept"


# ---- 3. what a mock hides ------------------------------------------------------------------------------
LISTED = 1200  # > 1000: ListObjectsV2 pages hold at most 1000 keys


@pytest.mark.slow
@pytest.mark.anyio
async def test_more_records_than_one_listing_page_are_all_accounted_for(
        seaweed: SeaweedServer, capsys: pytest.CaptureFixture[str]) -> None:
    """1,200 records: a new store's background scan, ``inspect_tier`` and ``tierkv inspect`` see all."""
    bucket = seaweed.new_bucket()
    opts = seaweed.storage_options()
    url = f"s3://{bucket}/kv"
    cfg = store_config(url, opts, slots={FULL: 64, REC: 2}, io_threads=16)  # 16 requests at once
    hs = tier_tests.hashes(LISTED, salt=21)
    data = tier_tests.rand_blocks(LISTED, BB, seed=21)
    async with TieredStore(cfg) as store:
        for i in range(0, LISTED, 48):
            await store.put(FULL, hs[i:i + 48], data[i:i + 48])
            await store.flush()
        st = store.stats().tiers[1]
        assert st.stores == LISTED and st.stores_failed == 0 and st.stores_shed == 0
    records = record_objects(seaweed.objects(bucket, "kv/"))
    assert len(records) == LISTED

    async with TieredStore(cfg) as store:  # a new store accounts for every record by listing them
        tier = store.tiers[1]
        assert isinstance(tier, FsspecTier)
        with anyio.fail_after(120):
            await tier.wait_scanned()
        st = store.stats().tiers[1]
        assert st.backend.get("scanned") == LISTED, st.backend
        assert st.backend.get("scan_errors", 0) == 0
        assert st.used_bytes == sum(records.values())
        # and serves a record from the last listing page it never wrote itself
        out = torch.zeros((2, BB), dtype=torch.uint8)
        await store.get(FULL, [hs[0], hs[-1]], out)
        assert torch.equal(out[0], data[0]) and torch.equal(out[1], data[-1])

    report = await inspect_tier(url, opts)
    assert [ns.records for ns in report.namespaces] == [LISTED]
    assert report.namespaces[0].bytes_on_disk == sum(records.values())

    flags = ["-o", f"endpoint_url={seaweed.endpoint_url}", "-o", f"key={seaweed.key}",
             "-o", f"secret={seaweed.secret}"]
    capsys.readouterr()
    rc = await anyio.to_thread.run_sync(cli_main, ["inspect", url, *flags, "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0 and rep["namespaces"][0]["records"] == LISTED


BIG = 110 << 20  # above s3fs's multipart threshold (2 x 50 MiB chunks)


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_record_above_the_multipart_threshold_round_trips(seaweed: SeaweedServer) -> None:
    """One 110 MiB block through put / flush, then a fresh store reads back identical bytes."""
    bucket = seaweed.new_bucket()
    opts = seaweed.storage_options()
    layout = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=BIG)])
    cfg = store_config(f"s3://{bucket}/kv", opts, slots={FULL: 1}, layout=layout)
    h = tier_tests.hashes(1, salt=30)
    data = torch.randint(0, 256, (1, BIG), dtype=torch.uint8, generator=torch.Generator().manual_seed(30))
    async with TieredStore(cfg) as store:
        await store.put(FULL, h, data)
        with anyio.fail_after(120):
            await store.flush()
        st = store.stats().tiers[1]
        assert st.stores == 1 and st.stores_failed == 0, st
    (name, size), = record_objects(seaweed.objects(bucket)).items()
    assert size > BIG
    etag = seaweed.client.head_object(Bucket=bucket, Key=name)["ETag"].strip('"')
    assert etag.endswith("-3"), f"expected a 3-part multipart upload, got ETag {etag}"
    async with TieredStore(cfg) as store:
        out = torch.zeros_like(data)
        with anyio.fail_after(120):
            await store.get(FULL, h, out)
        assert torch.equal(out, data)


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_store_rides_out_a_killed_server_and_recovers_by_itself(seaweed: SeaweedServer) -> None:
    """SIGKILL the server under a running store, then restart it on the same port and data.

    While it is down: resident blocks are served, puts return (their cascades fail, counted),
    blocks only on S3 are misses / BlockMissing, and no call takes longer than ``OUTAGE_BOUND_S``.
    Once it is back: new puts cascade and S3-only blocks restore, with nothing done by the caller.
    """
    bucket = seaweed.new_bucket()
    hs = tier_tests.hashes(24, salt=40)
    data = tier_tests.rand_blocks(24, BB, seed=40)
    async with TieredStore(store_config(f"s3://{bucket}/kv", seaweed.storage_options())) as store:
        for i in range(0, 24, 8):  # 16 primary slots: blocks 0..7 end up only on S3
            await store.put(FULL, hs[i:i + 8], data[i:i + 8])
            await store.flush()
        assert store.stats().tiers[1].stores == 24
        assert store.lookup(FULL, hs[8:]) == [Lookup.HIT] * 16
        s3_only, resident = hs[:8], hs[8:]

        seaweed.kill()
        try:
            with anyio.fail_after(OUTAGE_BOUND_S):
                out = torch.zeros((16, BB), dtype=torch.uint8)
                await store.get(FULL, resident, out)
                assert torch.equal(out, data[8:]), "resident blocks must be served while S3 is down"
            new = tier_tests.hashes(4, salt=41)
            new_data = tier_tests.rand_blocks(4, BB, seed=41)
            t0 = time.monotonic()
            await store.put(FULL, new, new_data)
            assert time.monotonic() - t0 < 5, "put must not wait for the dead server"
            with anyio.fail_after(OUTAGE_BOUND_S):
                await store.flush()
            st = store.stats().tiers[1]
            assert st.stores == 24 and st.stores_failed == 4, st
            with anyio.fail_after(OUTAGE_BOUND_S):
                res = await settle(store, s3_only[:4], "down")
            assert res == [Lookup.MISS] * 4, res
            with anyio.fail_after(OUTAGE_BOUND_S), pytest.raises(BlockMissing):
                await store.get(FULL, s3_only[:4], out[:4], request_id="down")
            store.release("down")
            with anyio.fail_after(OUTAGE_BOUND_S), pytest.raises(BlockMissing):
                await store.get(FULL, s3_only[4:], out[4:8])  # no lookup first: read straight through
            out4 = torch.zeros((4, BB), dtype=torch.uint8)
            with anyio.fail_after(OUTAGE_BOUND_S):
                await store.get(FULL, new, out4)  # put during the outage: resident
            assert torch.equal(out4, new_data)
        finally:
            restart_s = await seaweed.arestart()  # same ports, same data; the loop keeps running

        # back: nothing done to the store, it recovers by itself
        later = tier_tests.hashes(4, salt=42)
        await store.put(FULL, later, tier_tests.rand_blocks(4, BB, seed=42))
        with anyio.fail_after(OUTAGE_BOUND_S):
            await store.flush()
        st = store.stats().tiers[1]
        assert st.stores >= 28 and st.stores_failed == 4, st
        with anyio.fail_after(OUTAGE_BOUND_S):
            res = await settle(store, s3_only, "back")
            while res != [Lookup.HIT] * 8:  # failed probes are remembered for negative_ttl_s (1 s)
                store.release("back")
                await anyio.sleep(0.2)
                res = await settle(store, s3_only, "back")
        out = torch.zeros((8, BB), dtype=torch.uint8)
        await store.get(FULL, s3_only, out, request_id="back")
        store.release("back")
        assert torch.equal(out, data[:8]), "blocks written before the kill must come back identical"
    assert len(record_objects(seaweed.objects(bucket))) >= 28, f"restart took {restart_s:.1f}s"


def _open_error_text(exc: BaseException) -> str:
    return "\n".join([str(exc), repr(exc), "".join(traceback.format_exception(exc))])


@pytest.mark.anyio
@pytest.mark.parametrize("case", ["missing-bucket", "wrong-secret", "unknown-key", "wrong-secret-in-url"])
async def test_missing_bucket_or_wrong_credentials_fail_at_open_with_a_clear_error(
        seaweed: SeaweedServer, case: str) -> None:
    """Moto accepts any bucket name a test forgot to create and any credentials; a real S3 does not."""
    wrong = "WRONG" + secrets.token_hex(12)
    bucket = seaweed.new_bucket() if case != "missing-bucket" else f"tkv-missing-{uuid.uuid4().hex[:8]}"
    url, opts = f"s3://{bucket}/kv", seaweed.storage_options()
    if case == "wrong-secret":
        opts["secret"] = wrong
    elif case == "unknown-key":
        opts["key"] = "NOSUCHKEY" + secrets.token_hex(4)
    elif case == "wrong-secret-in-url":
        url = f"s3://{seaweed.key}:{wrong}@{bucket}/kv"
        del opts["key"], opts["secret"]
    t0 = time.monotonic()
    with pytest.raises(BackendError) as exc:
        async with TieredStore(store_config(url, opts)):
            pass
    elapsed = time.monotonic() - t0
    text = _open_error_text(exc.value)
    message = str(exc.value)
    assert f"s3://{bucket}/kv" in message, message  # which tier, without user info
    assert "opening the tier" in message, message
    assert seaweed.endpoint_url in message, message  # which server
    if case == "missing-bucket":
        assert "bucket" in message.lower() and ("not exist" in message or "NoSuchBucket" in message), message
    else:
        assert any(w in message for w in ("PermissionError", "Forbidden", "AccessDenied",
                                          "SignatureDoesNotMatch", "InvalidAccessKeyId")), message
    assert wrong not in text and seaweed.secret not in text, text
    assert elapsed < OUTAGE_BOUND_S, f"open took {elapsed:.1f}s to fail"


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_hung_server_costs_a_bounded_wait_and_the_store_recovers(seaweed: SeaweedServer) -> None:
    """SIGSTOP the server (it accepts connections and never answers; an S3 PUT would wait forever
    on ``Expect: 100-continue``): a flush ends within the tier's request deadline, the cascades
    are counted as failed, and once the server answers again they are written, and new ones too."""
    bucket = seaweed.new_bucket()
    cfg = store_config(f"s3://{bucket}/kv", seaweed.storage_options())
    cfg["tiers"][1].update(request_timeout_s=2.0, retry_budget_s=1.0)
    async with TieredStore(cfg) as store:
        hs = tier_tests.hashes(4, salt=50)
        data = tier_tests.rand_blocks(4, BB, seed=50)
        seaweed.freeze()
        try:
            await store.put(FULL, hs, data)
            t0 = time.monotonic()
            with anyio.fail_after(OUTAGE_BOUND_S):
                await store.flush()
            assert time.monotonic() - t0 < 10, "one request deadline (2 s), not the server's whim"
            assert store.stats().tiers[1].stores_failed == 4
        finally:
            seaweed.thaw()
        later = tier_tests.hashes(4, salt=51)
        await store.put(FULL, later, data)
        with anyio.fail_after(OUTAGE_BOUND_S):
            await store.flush()
        # the 4 that failed while it hung waited in the retry queue: written now it answers
        assert store.stats().tiers[1].stores == 8


@pytest.mark.slow
@pytest.mark.anyio
async def test_one_slow_restore_never_switches_restores_off(seaweed: SeaweedServer) -> None:
    """The server paused 3 s during a fresh store's first restore (its read rate sample is that of
    a stall): once it answers again, prefixes are restored within 10 s, not recomputed for ever."""
    bucket = seaweed.new_bucket()
    cfg = store_config(f"s3://{bucket}/kv", seaweed.storage_options(), slots={FULL: 64, REC: 2},
                       request_timeout_s=10.0)
    cfg["recompute_tokens_per_s"] = 2000.0
    docs = [tier_tests.hashes(4, salt=70 + d) for d in range(6)]
    async with TieredStore(cfg) as writer:
        for d, hs in enumerate(docs):
            await writer.put(FULL, hs, tier_tests.rand_blocks(4, BB, seed=70 + d))
        await writer.flush()
    async with TieredStore(cfg) as store:
        store.lookup(FULL, docs[0], request_id="first")  # probes, then promotes: the server stalls
        seaweed.freeze()
        await anyio.sleep(3)
        seaweed.thaw()
        with anyio.fail_after(30):
            await settle(store, docs[0], "first")
        back = time.monotonic()
        restored = 0
        for d, hs in enumerate(docs[1:], start=1):
            res = await settle(store, hs, f"r{d}")
            if all(r is Lookup.HIT for r in res):
                restored += 1
                out = torch.zeros((4, BB), dtype=torch.uint8)
                await store.get(FULL, hs, out, request_id=f"r{d}")
                assert torch.equal(out, tier_tests.rand_blocks(4, BB, seed=70 + d))
            store.release(f"r{d}")
            if restored and time.monotonic() - back < 10:
                break
        assert restored and time.monotonic() - back < 10, store.stats().cost

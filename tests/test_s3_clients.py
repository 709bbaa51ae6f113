"""The two S3 clients behind ``s3://`` tiers (obstore and s3fs): which one serves a tier, how the
storage options map, and the same answers from both to a misbehaving server (503 SlowDown, a
dropped connection, a server that stops answering, a refused connection), on real HTTP."""

from __future__ import annotations

import errno
import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import anyio
import pytest
from faultproxy import FaultProxy
from s3clients import CLIENTS
from seaweed import SeaweedServer, seaweed
from test_fsspec_tier import logs

from tierkv import TieredStore
from tierkv.backends.fsspec._obstore import ENV_CLIENT, s3_store_config
from tierkv.backends.fsspec._open import open_driver
from tierkv.backends.fsspec._remote import AsyncDriver, RequestDriver, RetryPolicy, transient
from tierkv.cli import main as cli_main
from tierkv.errors import ConfigError, unavailable
from tierkv.records.outcomes import Failed, Written

__all__ = ["logs", "seaweed"]  # fixtures, imported for this module

FAST = RetryPolicy(attempts=4, base_s=0.01, cap_s=0.05, budget_s=5.0, timeout_s=5.0)


@asynccontextmanager
async def opened(url: str, opts: dict[str, Any], client: str,
                 retry: RetryPolicy = FAST) -> AsyncIterator[RequestDriver]:
    """The driver an ``s3://`` tier would open with ``s3_client: client``."""
    driver, _ = open_driver(url, opts, anyio.CapacityLimiter(4), None, False, retry=retry, s3_client=client)
    assert isinstance(driver, RequestDriver) and driver.client == client
    if isinstance(driver, AsyncDriver):
        await driver.fs.set_session()
    try:
        yield driver
    finally:
        await driver.close()


@pytest.fixture
def proxy(seaweed: SeaweedServer) -> Iterator[FaultProxy]:
    with FaultProxy(seaweed.ports["s3"]) as p:
        yield p


def _object(server: SeaweedServer, data: bytes = b"a record") -> tuple[str, str]:
    bucket = server.new_bucket()
    server.client.put_object(Bucket=bucket, Key="kv/x.tkv", Body=data)
    return bucket, f"{bucket}/kv/x.tkv"


# ---- faults: the same answer from both clients ----------------------------------------------------
@pytest.mark.anyio
@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("mode", ["slowdown", "drop"])
async def test_slowdown_or_a_dropped_connection_is_retried_then_served(
        seaweed: SeaweedServer, proxy: FaultProxy, client: str, mode: Any) -> None:
    bucket, path = _object(seaweed)
    async with opened(f"s3://{bucket}/kv", seaweed.storage_options(endpoint_url=proxy.endpoint_url),
                      client) as d:
        proxy.fail(mode, 2)
        assert await d.read_files([path], 100) == [b"a record"]
        # aiohttp (s3fs) tries a request on a dropped connection once more by itself
        assert proxy.failed == 2 and (d.retries == 2 if mode == "slowdown" else 1 <= d.retries <= 2)
        proxy.fail(mode, 1)
        assert await d.write_records([f"{bucket}/kv/y.tkv"], lambda _: [b"written"], 7) == [Written(7)]
        assert proxy.failed == 3
    assert seaweed.objects(bucket)["kv/y.tkv"] == len(b"written")


@pytest.mark.anyio
@pytest.mark.parametrize("client", CLIENTS)
async def test_slowdown_past_the_attempts_is_a_busy_error_not_a_down_server(
        seaweed: SeaweedServer, proxy: FaultProxy, client: str) -> None:
    bucket, path = _object(seaweed)
    async with opened(f"s3://{bucket}/kv", seaweed.storage_options(endpoint_url=proxy.endpoint_url),
                      client) as d:
        proxy.fail("slowdown", 100)
        (failed,) = await d.read_files([path], 100)
    assert isinstance(failed, Failed), repr(failed)
    got = failed.error
    assert isinstance(got, OSError) and got.errno == errno.EBUSY, repr(got)
    assert transient(got) and not unavailable(got)
    assert proxy.failed == FAST.attempts and d.retries == FAST.attempts - 1


@pytest.mark.anyio
@pytest.mark.parametrize("client", CLIENTS)
async def test_a_server_that_stops_answering_costs_the_request_deadline_and_reads_as_down(
        seaweed: SeaweedServer, proxy: FaultProxy, client: str) -> None:
    bucket, path = _object(seaweed)
    policy = RetryPolicy(attempts=2, base_s=0.01, budget_s=2.0, timeout_s=0.5)
    async with opened(f"s3://{bucket}/kv", seaweed.storage_options(endpoint_url=proxy.endpoint_url),
                      client, policy) as d:
        proxy.fail("hang", 100)
        t0 = time.monotonic()
        (failed,) = await d.read_files([path], 100)
        elapsed = time.monotonic() - t0
    assert isinstance(failed, Failed), repr(failed)
    got = failed.error
    assert isinstance(got, TimeoutError), repr(got)
    assert unavailable(got) and elapsed < 3.0 and proxy.failed == 2


@pytest.mark.anyio
@pytest.mark.parametrize("client", CLIENTS)
async def test_a_refused_connection_reads_as_down(seaweed: SeaweedServer, client: str) -> None:
    with FaultProxy(seaweed.ports["s3"]) as gone:
        endpoint = gone.endpoint_url  # a port nobody listens on once the proxy stops
    async with opened("s3://bucket/kv", seaweed.storage_options(endpoint_url=endpoint), client) as d:
        (got,) = await d.read_files(["bucket/kv/x.tkv"], 100)
        assert isinstance(got, Failed) and unavailable(got.error) and transient(got.error), repr(got)
        assert d.retries == FAST.attempts - 1


@pytest.mark.anyio
@pytest.mark.parametrize("client", CLIENTS)
async def test_missing_objects_listings_and_deletes_match(seaweed: SeaweedServer, client: str) -> None:
    """A missing object is a miss (None, not an error); listings give ``bucket/key`` paths with sizes
    and times; deletes ignore absent objects; an empty object reads as b''."""
    bucket = seaweed.new_bucket()
    async with opened(f"s3://{bucket}/kv", seaweed.storage_options(), client) as d:
        pieces = [[b"one"], [b""], [b"th", b"ree"]]
        assert await d.write_records([f"{bucket}/kv/a/1.tkv", f"{bucket}/kv/a/2.tkv", f"{bucket}/kv/b/3.tkv"],
                                     lambda i: pieces[i], 6) == [Written(3), Written(0), Written(5)]
        got = await d.read_files([f"{bucket}/kv/{n}.tkv" for n in ("a/1", "a/2", "none")], 10)
        assert got == [b"one", b"", None]
        (long,) = await d.read_files([f"{bucket}/kv/b/3.tkv"], 1)  # at most limit + 1 bytes
        assert long == b"th"
        assert await d.exists_many([f"{bucket}/kv/a/1.tkv", f"{bucket}/kv/none.tkv"]) == [True, False]
        listed = {e.path: e.size for e in await d.listdir(f"{bucket}/kv/a")}
        assert listed == {f"{bucket}/kv/a/1.tkv": 3, f"{bucket}/kv/a/2.tkv": 0}
        before = {e.path: e.mtime for e in await d.listdir(f"{bucket}/kv")}
        await anyio.sleep(1.1)
        await d.touch_many([f"{bucket}/kv/a/1.tkv", f"{bucket}/kv/none.tkv"])
        after = {e.path: e.mtime for e in await d.listdir(f"{bucket}/kv")}
        assert set(after) == set(before), "a touch leaves no temporary object behind"
        assert after[f"{bucket}/kv/a/1.tkv"] > before[f"{bucket}/kv/a/1.tkv"]
        assert await d.read_files([f"{bucket}/kv/a/1.tkv"], 10) == [b"one"]
        await d.delete_many([f"{bucket}/kv/a/1.tkv", f"{bucket}/kv/none.tkv"])
        assert [e.path for e in await d.listdir(f"{bucket}/kv/a")] == [f"{bucket}/kv/a/2.tkv"]
        assert await d.listdir(f"{bucket}/nothing") == []


# ---- which client serves a tier ---------------------------------------------------------------------
def test_storage_options_map_to_obstore() -> None:
    opts = {"endpoint_url": "http://127.0.0.1:9000", "key": "K", "secret": "S", "token": "T",
            "client_kwargs": {"region_name": "eu-west-1"}, "retries": 3,
            "config_kwargs": {"connect_timeout": 2, "read_timeout": 7, "s3": {"addressing_style": "virtual"}}}
    config, client, why_not = s3_store_config(opts, FAST, environ={})
    assert why_not == ""
    assert config == {"access_key_id": "K", "secret_access_key": "S", "session_token": "T",
                      "region": "eu-west-1", "endpoint": "http://127.0.0.1:9000",
                      "virtual_hosted_style_request": True}
    assert client["allow_http"] and client["connect_timeout"] == timedelta(seconds=2)
    assert client["read_timeout"] == timedelta(seconds=7) and client["timeout"] == timedelta(seconds=5)
    config, _, why_not = s3_store_config({"anon": True, "client_kwargs": {"region_name": "us-east-1"}},
                                         FAST, environ={})
    assert why_not == "" and config == {"skip_signature": True, "region": "us-east-1"}


@pytest.mark.parametrize(("opts", "environ", "named"), [
    ({"s3_additional_kwargs": {"ServerSideEncryption": "AES256"}, "endpoint_url": "http://h"}, {},
     "s3_additional_kwargs"),
    ({"endpoint_url": "http://h", "client_kwargs": {"proxies": {}}}, {}, "proxies"),
    ({"key": "K", "secret": "S"}, {}, "region"),
    ({"client_kwargs": {"region_name": "us-east-1"}}, {"AWS_PROFILE": "dev"}, "profile"),
])
def test_options_obstore_cannot_take_are_named(opts: dict[str, Any], environ: dict[str, str],
                                               named: str) -> None:
    _, _, why_not = s3_store_config(opts, FAST, environ=environ)
    assert named in why_not


def test_auto_is_obstore_and_falls_back_to_s3fs_saying_why_once(monkeypatch: pytest.MonkeyPatch,
                                                                logs: Any) -> None:
    """``s3_client: auto`` picks obstore where it takes every storage option, else s3fs (one log
    line says why); ``s3_client: s3fs`` or ``TIERKV_S3_CLIENT=s3fs`` picks s3fs."""
    monkeypatch.delenv(ENV_CLIENT, raising=False)
    opts = {"endpoint_url": "http://127.0.0.1:1", "key": "K", "secret": "S"}
    limiter = anyio.CapacityLimiter(1)
    driver, root = open_driver("s3://b/kv", opts, limiter, None, False)
    assert driver.client == "obstore" and root == "b/kv"
    unmapped = {**opts, "s3_additional_kwargs": {"ServerSideEncryption": "AES256"}}
    for _ in range(2):
        driver, root = open_driver("s3://fallback-bucket/kv", unmapped, limiter, None, False)
        assert driver.client == "s3fs" and root == "fallback-bucket/kv"
    said = [line for line in logs.lines if "s3_additional_kwargs" in line]
    assert len(said) == 1 and "uses s3fs" in said[0] and "K" not in said[0].split("tierkv.fsspec")[1].split()
    driver, _ = open_driver("s3://b/kv", opts, limiter, None, False, s3_client="s3fs")
    assert driver.client == "s3fs"
    monkeypatch.setenv(ENV_CLIENT, "s3fs")
    driver, _ = open_driver("s3://b/kv", opts, limiter, None, False)
    assert driver.client == "s3fs"


def test_asking_for_obstore_where_it_cannot_serve_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    opts = {"endpoint_url": "http://127.0.0.1:1", "s3_additional_kwargs": {"ACL": "private"}}
    limiter = anyio.CapacityLimiter(1)
    with pytest.raises(ConfigError, match="s3_additional_kwargs"):
        open_driver("s3://b/kv", opts, limiter, None, False, s3_client="obstore")
    monkeypatch.setenv(ENV_CLIENT, "obstore")
    with pytest.raises(ConfigError, match="s3_additional_kwargs"):
        open_driver("s3://b/kv", opts, limiter, None, False)
    monkeypatch.setenv(ENV_CLIENT, "boto")
    with pytest.raises(ConfigError, match=ENV_CLIENT):
        open_driver("s3://b/kv", opts, limiter, None, False)
    driver, _ = open_driver("s3://b/kv", opts, limiter, None, False, s3_client="s3fs")  # the setting wins
    assert driver.client == "s3fs"


@pytest.mark.anyio
@pytest.mark.parametrize("client", CLIENTS)
async def test_stats_and_inspect_say_which_client_serves_the_tier(
        seaweed: SeaweedServer, client: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from tierkv import GroupSpec, Layout

    monkeypatch.delenv(ENV_CLIENT, raising=False)
    bucket = seaweed.new_bucket()
    url, opts = f"s3://{bucket}/kv", seaweed.storage_options()
    layout = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=4096)])
    cfg = {"layout": layout, "namespace": "clients",
           "tiers": [{"kind": "cpu", "slots": {0: 4}},
                     {"kind": "fsspec", "url": url, "storage_options": opts, "s3_client": client}]}
    async with TieredStore(cfg) as store:
        await store.put(0, [b"h" * 16], torch.ones((1, 4096), dtype=torch.uint8))
        await store.flush()
        backend = store.stats().tiers[1].backend
        assert backend.get(f"client_{client}") == 1, backend
        assert not any(k.startswith("client_") and k != f"client_{client}" for k in backend), backend
    monkeypatch.setenv(ENV_CLIENT, client)
    capsys.readouterr()
    flags = ["-o", f"endpoint_url={seaweed.endpoint_url}", "-o", f"key={seaweed.key}",
             "-o", f"secret={seaweed.secret}"]
    rc = await anyio.to_thread.run_sync(cli_main, ["inspect", url, *flags, "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["client"] == client and report["namespaces"][0]["records"] == 1


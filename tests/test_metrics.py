"""Metrics for operators: one naming scheme, served over HTTP while the store is open."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from helpers import blocks, hashes
from test_fsspec_tier import logs

from tierkv import ConfigError, GroupSpec, Layout, Lookup, TieredStore, to_prometheus

__all__ = ["logs"]  # a fixture, imported for this module

pytestmark = pytest.mark.anyio

BB = 16 << 10
LAYOUT = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=BB)])


def cfg(root: Path, **kw: object) -> dict[str, object]:
    return {"layout": LAYOUT, "namespace": "metrics", "metrics_port": 0,
            "tiers": [{"kind": "cpu", "slots": {0: 8}}, {"kind": "fsspec", "url": f"file://{root}"}], **kw}


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def series(values: dict[str, float], name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels`` (in any order)."""
    total = 0.0
    for key, v in values.items():
        base, _, rest = key.partition("{")
        found = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        if base == name and all(found.get(k) == w for k, w in labels.items()):
            total += v
    return total


async def test_the_endpoint_serves_series_that_move_with_the_workload(tmp_path: Path) -> None:
    async with TieredStore(cfg(tmp_path)) as store:
        url = store.metrics_url
        assert url is not None and url.startswith("http://127.0.0.1:")
        before = await anyio.to_thread.run_sync(scrape, url)
        assert series(before, "tierkv_tier_stores_total", tier="1") == 0
        hs, data = hashes(16), blocks(16, BB)
        for i in range(0, 16, 4):
            await store.put(0, hs[i:i + 4], data[i:i + 4])
            await store.flush()
        store.engine.clear()
        while store.lookup_prefix(hs[:8], request_id="r").state is Lookup.PENDING:
            await anyio.sleep(0.01)
        out = torch.zeros((8, BB), dtype=torch.uint8)
        await store.get(0, hs[:8], out, request_id="r")
        after = await anyio.to_thread.run_sync(scrape, url)
    # counters moved by what the workload did
    assert series(after, "tierkv_tier_stores_total", tier="1", kind="fsspec") == 16
    assert series(after, "tierkv_tier_promotions_total", tier="1", kind="fsspec") == 8
    assert series(after, "tierkv_lookups_total", state="hit") >= 1
    # gauges of the pool, and latency histograms of loads, stores and PENDING age
    assert series(after, "tierkv_pool_slots", group="0", kind="full") == 8
    assert series(after, "tierkv_tier_store_seconds_count", tier="1") >= 4
    assert series(after, "tierkv_tier_load_seconds_count", tier="1") >= 1
    assert series(after, "tierkv_pending_seconds_count") == 1
    assert series(after, "tierkv_tier_load_seconds_bucket", tier="1", le="+Inf") >= 1
    # the endpoint is gone with the store
    with pytest.raises(OSError):
        await anyio.to_thread.run_sync(scrape, url)


async def test_the_text_exposition_and_the_endpoint_use_the_same_names(tmp_path: Path) -> None:
    async with TieredStore(cfg(tmp_path)) as store:
        await store.put(0, hashes(2), blocks(2, BB))
        await store.flush()
        served = await anyio.to_thread.run_sync(scrape, store.metrics_url)
        text = to_prometheus(store.stats())
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if not line.startswith("#")}
    served_names = {k.split("{")[0] for k in served}
    assert names <= served_names | {n + "_created" for n in names}


async def test_a_port_in_use_is_a_config_error(tmp_path: Path) -> None:
    async with TieredStore(cfg(tmp_path)) as first:
        port = int(str(first.metrics_url).rsplit(":", 1)[1].split("/")[0])
        with pytest.raises(ConfigError, match="metrics_port"):
            async with TieredStore(cfg(tmp_path / "b", metrics_port=port)):
                pass


async def test_the_environment_turns_the_endpoint_on_for_a_config_built_in_code(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logs: Any) -> None:
    monkeypatch.setenv("TIERKV_METRICS_PORT", "0")
    plain = {k: v for k, v in cfg(tmp_path).items() if k != "metrics_port"}
    async with TieredStore(plain) as store:
        assert store.metrics_url is not None
        values = await anyio.to_thread.run_sync(scrape, store.metrics_url)
        assert any(k.startswith("tierkv_tier_") for k in values)
        port = int(str(store.metrics_url).rsplit(":", 1)[1].split("/")[0])
        # a second store of the process cannot have the same port: it opens without an endpoint
        monkeypatch.setenv("TIERKV_METRICS_PORT", str(port))
        async with TieredStore({**plain, "tiers": [{"kind": "cpu", "slots": {0: 8}}]}) as second:
            assert second.metrics_url is None
        assert any("TIERKV_METRICS_PORT" in line for line in logs.lines)
    # a port in the config wins over the variable
    monkeypatch.setenv("TIERKV_METRICS_PORT", "1")
    async with TieredStore(cfg(tmp_path)) as store:
        assert store.metrics_url is not None and not str(store.metrics_url).endswith(":1/metrics")


async def test_a_bad_metrics_port_variable_is_a_config_error(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERKV_METRICS_PORT", "nine")
    plain = {k: v for k, v in cfg(tmp_path).items() if k != "metrics_port"}
    with pytest.raises(ConfigError, match="TIERKV_METRICS_PORT"):
        async with TieredStore(plain):
            pass


async def test_slow_clients_hold_a_bounded_number_of_threads_and_none_outlive_the_store(
        tmp_path: Path) -> None:
    import contextlib
    import socket
    import threading

    from tierkv.observing.exporter import MAX_CONNECTIONS, READ_TIMEOUT_S

    def serving() -> int:
        return sum(1 for t in threading.enumerate()
                   if "process_request" in t.name or t.name == "tierkv-metrics")

    clients: list[socket.socket] = []
    async with TieredStore(cfg(tmp_path)) as store:
        port = int(str(store.metrics_url).rsplit(":", 1)[1].split("/")[0])
        for _ in range(100):  # half-open: connect, send half a request, never finish it
            c = socket.create_connection(("127.0.0.1", port), timeout=5)
            c.sendall(b"GET /metr")
            clients.append(c)
        await anyio.sleep(0.5)
        assert 1 < serving() <= MAX_CONNECTIONS + 1  # the connection threads and the server's
        values: dict[str, float] = {}
        with anyio.fail_after(10 * READ_TIMEOUT_S):  # the half-open ones are cut: a scraper is served
            while not values:
                await anyio.sleep(READ_TIMEOUT_S / 2)
                with contextlib.suppress(OSError):
                    values = await anyio.to_thread.run_sync(scrape, store.metrics_url)
    assert serving() == 0, [t.name for t in threading.enumerate()]
    for c in clients:
        c.close()


async def test_an_ipv6_host_is_served_and_named_in_brackets(tmp_path: Path) -> None:
    import socket

    if not socket.has_ipv6:
        pytest.skip("no IPv6 in this kernel")
    try:
        probe = socket.socket(socket.AF_INET6)
        probe.bind(("::1", 0))
        probe.close()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    async with TieredStore(cfg(tmp_path, metrics_host="::1")) as store:
        assert str(store.metrics_url).startswith("http://[::1]:")
        assert await anyio.to_thread.run_sync(scrape, store.metrics_url)

"""tierkv driven by SGLang's own HiCache code: the dynamic factory, real host pools, and the real
HybridCacheController's backup / prefetch / I/O threads issuing the v1, v2 and old calls."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from sgl_pools import (
    PAGE,
    TIERKV,
    controller,
    entry,
    fill,
    fill_mamba,
    hybrid_group,
    keys_of,
    logical_mha,
    make_mha,
    pages,
    prefetch,
    scattered,
    sidecar_backup,
    sidecar_prefetch,
    tokens,
    write_through,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo, PoolName, PoolTransfer
from sglang.srt.mem_cache.pool_host import HostPoolGroup
from sglang.srt.observability.metrics_collector import StorageMetrics, StorageMetricsCollector

from tierkv.adapters.sglang import TierKVHiCacheStorage


def _extra(tier: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {**TIERKV, "cpu_bytes_to_use": 8 << 20, "tiers": [tier], **kw}


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
@pytest.mark.parametrize("v1", [1, 0], ids=["interface_v1", "generic"])
def test_round_trip_through_the_controller(layout: str, v1: int, file_tier: dict[str, Any],
                                           closing: list[Any]) -> None:
    dev, host = make_mha(layout)
    ctl = controller(HostPoolGroup([entry(PoolName.KV, host, dev, anchor=True)]), dev,
                     _extra(file_tier, interface_v1=v1))
    closing.append(ctl)
    backend = ctl.storage_backend
    assert isinstance(backend, TierKVHiCacheStorage)
    assert ctl.page_set_func.__name__ == ("_page_set_zero_copy" if v1 else "_generic_page_set")

    toks = tokens(4, seed=1)
    keys = keys_of(toks)
    src = scattered(host, 4)
    fill(host, src, seed=10)
    want = logical_mha(host, src)
    op = write_through(ctl, src, toks, keys)
    assert op.completed_tokens == 4 * PAGE

    unknown = list(range(900_000, 900_000 + PAGE))
    backend.flush()
    backend.clear()  # the pages come back from disk, not from tierkv's CPU pool
    op, done = prefetch(ctl, host, toks + unknown)
    assert done == 4 * PAGE, "the four stored pages load, the unknown fifth does not"
    assert not set(op.host_indices.tolist()) & set(src.tolist()), "read into other host slots"
    assert all(torch.equal(a, b) for a, b in zip(want, logical_mha(host, op.host_indices), strict=True))
    gap = [*keys[:2], "0" * 64, *keys[2:]]
    assert backend.batch_exists(gap, HiCacheStorageExtraInfo()) == 2


def test_pages_are_stored_in_one_order_for_every_layout(file_tier: dict[str, Any],
                                                        closing: list[Any]) -> None:
    """Writers of every host layout and a layer_first reader share records, and the reader gets the
    same K/V per (layer, token), never a writer's bytes scrambled."""
    written = []
    for seed, layout in enumerate(("page_first", "page_first_direct", "page_head"), start=20):
        toks = tokens(3, seed=seed)
        dev, host = make_mha(layout)
        writer = controller(HostPoolGroup([entry(PoolName.KV, host, dev, anchor=True)]), dev,
                            _extra(file_tier, interface_v1=1))
        src = scattered(host, 3)
        fill(host, src, seed=seed)
        written.append((toks, logical_mha(host, src)))
        write_through(writer, src, toks, keys_of(toks))
        writer.detach_storage_backend()

    dev, lf = make_mha("layer_first")
    reader = controller(HostPoolGroup([entry(PoolName.KV, lf, dev, anchor=True)]), dev,
                        _extra(file_tier, interface_v1=1))
    closing.append(reader)
    for toks, want in written:
        op, done = prefetch(reader, lf, toks)
        assert done == 3 * PAGE
        assert all(torch.equal(a, b) for a, b in zip(want, logical_mha(lf, op.host_indices), strict=True))


def test_hybrid_kv_swa_mamba_through_v2(file_tier: dict[str, Any], closing: list[Any]) -> None:
    group, kv_dev, hosts = hybrid_group()
    window = 2
    ctl = controller(group, kv_dev, _extra(file_tier, interface_v1=1, window_pages={"swa": window}))
    closing.append(ctl)
    backend = ctl.storage_backend
    plan = backend.plan
    assert {n: p.kind for n, p in plan.pools.items()} == {"kv": "full", "swa": "sliding_window",
                                                           "mamba": "recurrent"}
    assert plan.layout.groups[plan.pools["swa"].group].window_blocks == window

    kv, swa, mamba = hosts["kv"], hosts["swa"], hosts["mamba"]
    toks = tokens(4, seed=3)
    keys = keys_of(toks)
    kv_src = scattered(kv, 4)
    fill(kv, kv_src, seed=30)
    swa_src = swa.alloc(window * PAGE)
    fill(swa, swa_src, seed=31)
    m_src = mamba.alloc(1)
    fill_mamba(mamba, int(m_src.item()), seed=32)
    want = (pages(kv, kv_src), pages(swa, swa_src), pages(mamba, m_src))

    op = write_through(ctl, kv_src, toks, keys, extra_pools=sidecar_backup(m_src, swa_src, keys, window))
    assert op.completed_tokens == 4 * PAGE
    assert op.pool_storage_result.extra_pool_hit_pages == {PoolName.MAMBA: 1, PoolName.SWA: window}

    r = backend.batch_exists_v2(keys, sidecar_prefetch(window), HiCacheStorageExtraInfo())
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (4, [4])
    r = backend.batch_exists_v2(keys[:3], sidecar_prefetch(window), HiCacheStorageExtraInfo())
    assert r.kv_hit_pages == 0, "KV of three pages is there, but no Mamba state ends at page 3"
    r = backend.batch_exists_v2([*keys, "f" * 64], sidecar_prefetch(window), HiCacheStorageExtraInfo())
    assert r.kv_hit_pages == 4

    backend.flush()
    backend.clear()
    staged: dict[Any, Any] = {}

    def alloc_sidecars(op: Any) -> None:  # what UnifiedRadixCache does once the hit is known
        for t in op.pool_transfers:
            pool = group.get_pool(t.name)
            t.host_indices = staged[t.name] = pool.alloc(len(t.keys) * pool.page_size)

    op, done = prefetch(ctl, kv, toks, extra_pools=sidecar_prefetch(window), alloc_sidecars=alloc_sidecars)
    assert done == 4 * PAGE
    got = (pages(kv, op.host_indices), pages(swa, staged[PoolName.SWA]), pages(mamba, staged[PoolName.MAMBA]))
    for w, g in zip(want, got, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(w, g, strict=True))


def test_a_transfer_with_the_wrong_number_of_slots_is_false(file_tier: dict[str, Any],
                                                            closing: list[Any]) -> None:
    group, kv_dev, hosts = hybrid_group()
    ctl = controller(group, kv_dev, _extra(file_tier, interface_v1=1, window_pages={"swa": 2}))
    closing.append(ctl)
    keys = keys_of(tokens(2, seed=4))
    swa_src = hosts["swa"].alloc(2 * PAGE)
    bad = PoolTransfer(name=PoolName.SWA, host_indices=swa_src[:PAGE], keys=keys)
    assert ctl.storage_backend.batch_set_v2([bad]) == {PoolName.SWA: [False, False]}


def test_get_stats_feeds_sglangs_storage_metrics(file_tier: dict[str, Any], closing: list[Any]) -> None:
    dev, host = make_mha("page_first")
    ctl = controller(HostPoolGroup([entry(PoolName.KV, host, dev, anchor=True)]), dev,
                     _extra(file_tier, interface_v1=1))
    closing.append(ctl)
    toks = tokens(3, seed=5)
    src = scattered(host, 3)
    fill(host, src, seed=50)
    write_through(ctl, src, toks, keys_of(toks))
    prefetch(ctl, host, toks)
    m = ctl.storage_backend.get_stats()
    assert isinstance(m, StorageMetrics)
    assert m.backup_pgs == [3] and m.prefetch_pgs == [3]
    assert all(bw > 0 for bw in m.backup_bandwidth + m.prefetch_bandwidth)
    StorageMetricsCollector(labels={"tp_rank": "0"}).log_storage_metrics(m)  # SGLang's own consumer
    assert ctl.storage_backend.get_stats() == StorageMetrics(), "observations are handed over once"


def test_a_cpu_pool_smaller_than_a_call_still_stores_every_page(file_tier: dict[str, Any],
                                                                closing: list[Any]) -> None:
    dev, host = make_mha("page_first")
    ctl = controller(HostPoolGroup([entry(PoolName.KV, host, dev, anchor=True)]), dev,
                     _extra(file_tier, interface_v1=1, slots={"kv": 2}))
    closing.append(ctl)
    toks = tokens(6, seed=6)
    src = scattered(host, 6)
    fill(host, src, seed=60)
    want = pages(host, src)
    assert write_through(ctl, src, toks, keys_of(toks)).completed_tokens == 6 * PAGE
    backend = ctl.storage_backend
    backend.flush()
    assert backend.stats().tiers[1].stores == 6
    op, done = prefetch(ctl, host, toks)
    assert done == 6 * PAGE
    assert all(torch.equal(a, b) for a, b in zip(want, pages(host, op.host_indices), strict=True))

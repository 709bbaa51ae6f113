"""What survives a restart, what is verified on the way back, and who sees whose pages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from sgl_pools import (
    TIERKV,
    create_backend,
    fill,
    fill_mamba,
    keys_of,
    make_mamba,
    make_mha,
    make_mla,
    pages,
    restored_from_another_process,
    scattered,
    storage_config,
    tokens,
)
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.storage import StorageBackendFactory

HERE = Path(__file__).parent


def _extra(tier: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {**TIERKV, "interface_v1": 1, "cpu_bytes_to_use": 8 << 20, "tiers": [tier], **kw}


def _records(tier: dict[str, Any]) -> list[Path]:
    return sorted(Path(tier["url"].removeprefix("file://")).rglob("*.tkv"))


def test_a_new_process_restores_from_disk(tmp_path: Path, file_tier: dict[str, Any],
                                          closing: list[Any]) -> None:
    ctl = restored_from_another_process(_extra(file_tier), tmp_path, closing)
    assert len(_records(file_tier)) == 5
    assert ctl.storage_backend.stats().tiers[1].hits == 5


def test_a_corrupt_record_is_false_and_counted(file_tier: dict[str, Any], closing: list[Any]) -> None:
    extra = _extra(file_tier)
    _, host = make_mha("page_first")
    writer = create_backend(extra, host)
    toks = tokens(4, seed=8)
    keys = keys_of(toks)
    src = scattered(host, 4)
    fill(host, src, seed=80)
    want = pages(host, src)
    assert writer.batch_set_v1(keys, src) == [True] * 4
    writer.close()
    (bad,) = [p for p in _records(file_tier) if p.name.startswith(keys[2])]
    raw = bytearray(bad.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    bad.write_bytes(bytes(raw))

    reader = create_backend(extra, host)
    closing.append(reader)
    dst = scattered(host, 4)
    before = pages(host, dst)
    assert reader.batch_exists(keys) == 4, "presence is a path check: the damage shows on reading"
    assert reader.batch_get_v1(keys, dst) == [True, True, False, True]
    got = pages(host, dst)
    assert [torch.equal(a, b) for a, b in zip(want, got, strict=True)] == [True, True, False, True]
    assert torch.equal(got[2], before[2]), "a page that failed verification is not copied in"
    assert reader.stats().tiers[1].backend["corrupt"] == 1
    assert reader.counters["prefetch_pages_failed"] == 1
    assert not bad.exists(), "the damaged record is removed"
    assert reader.batch_exists(keys) == 2


def test_namespaces_keep_deployments_apart(file_tier: dict[str, Any], closing: list[Any]) -> None:
    extra = _extra(file_tier)
    _, host = make_mha("page_first")
    keys = keys_of(tokens(2, seed=9))
    src = scattered(host, 2)
    fill(host, src, seed=90)
    rank0 = create_backend(extra, host, tp_rank=0, tp_size=2)
    assert rank0.batch_set_v1(keys, src) == [True, True]
    rank0.close()
    for kw in ({"tp_rank": 0, "tp_size": 2}, {"tp_rank": 1, "tp_size": 2}, {"tp_rank": 0, "tp_size": 1},
               {"tp_rank": 0, "tp_size": 2, "model": "other/model"}):
        b = create_backend(extra, host, **kw)
        closing.append(b)
        assert b.batch_exists(keys) == (2 if kw == {"tp_rank": 0, "tp_size": 2} else 0), kw
    _, bigger = make_mha("page_first", heads=4)
    b = create_backend(extra, bigger, tp_rank=0, tp_size=2)
    closing.append(b)
    assert b.batch_exists(keys) == 0, "another page geometry is another namespace"


def test_mla_pages_are_written_once_per_rank_group(file_tier: dict[str, Any], closing: list[Any]) -> None:
    extra = _extra(file_tier)
    _, host = make_mla("page_first")
    keys = keys_of(tokens(3, seed=11))
    src = scattered(host, 3)
    fill(host, src, seed=110)
    want = pages(host, src)
    rank1 = create_backend(extra, host, tp_rank=1, tp_size=2, mla=True)
    closing.append(rank1)
    assert rank1.batch_set_v1(keys, src) == [True] * 3
    rank1.flush()
    assert _records(file_tier) == [], "only the storage writer rank writes replicated pages"
    rank0 = create_backend(extra, host, tp_rank=0, tp_size=2, mla=True)
    assert rank0.batch_set_v1(keys, src) == [True] * 3
    rank0.close()
    assert len(_records(file_tier)) == 3
    dst = scattered(host, 3)
    assert rank1.batch_exists(keys) == 3
    assert rank1.batch_get_v1(keys, dst) == [True] * 3
    assert all(torch.equal(a, b) for a, b in zip(want, pages(host, dst), strict=True))


def test_mamba_state_beside_mla_kv_stays_per_rank(file_tier: dict[str, Any], closing: list[Any]) -> None:
    """MLA KV is shared by the TP ranks, the Mamba state next to it is each rank's own."""
    extra = _extra(file_tier)
    _, kv = make_mla("page_first")
    _, mamba = make_mamba()
    keys = keys_of(tokens(2, seed=12))
    kv_src = scattered(kv, 2)
    fill(kv, kv_src, seed=120)
    ranks = []
    for rank in (0, 1):
        b = StorageBackendFactory.create_backend("dynamic", storage_config(extra, tp_rank=rank, tp_size=2,
                                                                          mla=True), kv)
        closing.append(b)
        b.register_mem_pool_host(kv)
        b.register_mem_host_pool_v2(kv, PoolName.KV)
        b.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
        b.on_host_pools_registered()
        slot = mamba.alloc(1)
        fill_mamba(mamba, int(slot.item()), seed=121 + rank)
        t = PoolTransfer(name=PoolName.MAMBA, host_indices=slot, keys=[keys[-1]])
        assert b.batch_set_v2([t]) == {PoolName.MAMBA: [True]}
        assert b.batch_set_v1(keys, kv_src) == [True, True]
        b.flush()
        ranks.append((b, pages(mamba, slot)[0]))
    assert len(_records(file_tier)) == 2 + 2, "KV once (rank 0), one Mamba state per rank"
    for b, state in ranks:
        b.clear()
        slot = mamba.alloc(1)
        got = b.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=slot, keys=[keys[-1]])])
        assert got == {PoolName.MAMBA: [True]} and torch.equal(pages(mamba, slot)[0], state)
        assert b.batch_get_v1(keys, scattered(kv, 2)) == [True, True]

"""SGLang's real host pools and HiCache controller on CPU, and the calls its threads make.

Builds what SGLang's kv_cache_builder / hybrid_pool_assembler build (device pools on ``cpu``, host
pools with ``pin_memory=False``), wraps them in the real ``HybridCacheController`` (the controller
every model uses in 0.5.23) and drives its own prefetch / backup threads through their queues.
"""

from __future__ import annotations

import threading
import types
import uuid
from typing import Any

import torch
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.mem_cache.memory_pool import MambaPool, MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host import HostPoolGroup, PoolEntry
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str

PAGE = 16
MODEL = "test-org/tiny-model"

TIERKV = {"backend_name": "tierkv", "module_path": "tierkv.adapters.sglang",
          "class_name": "TierKVHiCacheStorage"}


def make_mha(layout: str, layers: int = 4, heads: int = 2, head_dim: int = 64, size: int = 1024,
             page: int = PAGE, label: str = "kv", dtype: torch.dtype = torch.bfloat16) -> tuple[Any, Any]:
    """A device MHA pool on CPU and its host pool (``size`` device tokens, host ratio 2)."""
    dev = MHATokenToKVPool(size=size, page_size=page, dtype=dtype, head_num=heads, head_dim=head_dim,
                           layer_num=layers, device="cpu", enable_memory_saver=False)
    info = dev.get_device_pool_infos()[0].buffer_info
    host = get_mha_host_pool_cls(info)(
        info, 2.0, 0, page, layout, pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
        start_layer=dev.start_layer, end_layer=dev.end_layer, pool_label=label)
    return dev, host


def make_mla(layout: str, layers: int = 2, size: int = 256) -> tuple[Any, Any]:
    """A device MLA pool on CPU and its host pool."""
    dev = MLATokenToKVPool(size=size, page_size=PAGE, dtype=torch.bfloat16, kv_lora_rank=64,
                           qk_rope_head_dim=16, layer_num=layers, device="cpu", enable_memory_saver=False)
    info = dev.get_device_pool_infos()[0].buffer_info
    host = MLATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=dev.size, start_layer=dev.start_layer,
                                end_layer=dev.end_layer, target_layer_num=dev.layer_num)
    return dev, host


def make_mamba(layout: str = "page_first") -> tuple[Any, Any]:
    """A device Mamba2 state pool on CPU (two Mamba layers) and its host pool (page size 1)."""
    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=64, n_groups=1, num_heads=2,
                                    head_dim=32, state_size=16, conv_kernel=4)
    dev = MambaPool(size=8, spec_state_size=0, cache_params=Mamba2CacheParams(shape=shape, layers=[1, 3]),
                    mamba_layer_ids=[1, 3], device="cpu")
    (info,) = dev.get_device_pool_infos()
    host = MambaPoolHost(info.buffer_info, 2.0, 0, device_capacity=dev.size, pin_memory=False,
                         device="cpu", layout=layout)
    return dev, host


def entry(name: PoolName, host: Any, dev: Any, anchor: bool = False) -> Any:
    """A host pool group entry, as the pool assembler makes it."""
    return PoolEntry(name=name, host_pool=host, device_pool=dev, layer_mapper=lambda i: i,
                     is_primary_index_anchor=anchor)


def controller(group: Any, dev: Any, extra: dict[str, Any], model: str = MODEL,
               backend: str = "dynamic") -> Any:
    """The real HybridCacheController, attaching ``backend`` with the extra config (its own attach:
    factory, then register_mem_pool_host, register_mem_host_pool_v2 per pool, on_host_pools_registered)."""
    allocator = types.SimpleNamespace(get_kvcache=lambda: dev)
    return HybridCacheController(allocator, group, PAGE, None, threading.Event(), io_backend="direct",
                                 storage_backend=backend, model_name=model,
                                 storage_backend_extra_config=dict(extra), enable_storage_metrics=True)


def storage_config(extra: dict[str, Any], *, tp_rank: int = 0, tp_size: int = 1, mla: bool = False,
                   model: str = MODEL, page_first: bool = True) -> Any:
    """A HiCacheStorageConfig like the controller's ``_generate_storage_config`` makes."""
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=True,
                                is_page_first_layout=page_first, model_name=model, extra_config=dict(extra))


def create_backend(extra: dict[str, Any], host: Any, **kw: Any) -> Any:
    """Build a backend through SGLang's factory ("dynamic") and register ``host`` as the controller
    does for a KV-only model."""
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra, **kw), host)
    b.register_mem_pool_host(host)
    b.register_mem_host_pool_v2(host, PoolName.KV)
    b.on_host_pools_registered()
    return b


def tokens(n_pages: int, seed: int) -> list[int]:
    """Token ids of ``n_pages`` pages, different per seed."""
    return [seed * 100_000 + i for i in range(n_pages * PAGE)]


def keys_of(toks: list[int]) -> list[str]:
    """SGLang's storage keys of the pages (its native chained SHA-256)."""
    out = get_storage_hash_str(toks, None, page_size=PAGE)
    assert isinstance(out, list)
    return out


def scattered(host: Any, n_pages: int) -> torch.Tensor:
    """Host slots of ``n_pages`` pages as a long-running server has them: page-aligned, every other
    page of a fresh allocation, in reverse order."""
    idx = host.alloc(2 * n_pages * host.page_size)
    assert idx is not None, "host pool full"
    pages = idx.view(-1, host.page_size)
    return torch.cat([pages[i] for i in range(0, 2 * n_pages, 2)][::-1])


def fill(host: Any, indices: torch.Tensor, seed: int) -> None:
    """Random contents in the pages starting at ``indices[::page_size]``."""
    g = torch.Generator().manual_seed(seed)
    for start in indices[::host.page_size].tolist():
        page = host.get_dummy_flat_data_page()
        if page.dtype == torch.uint8:
            page.copy_(torch.randint(0, 256, page.shape, dtype=torch.uint8, generator=g))
        else:
            page.copy_(torch.randn(page.shape, generator=g).to(page.dtype))
        host.set_from_flat_data_page(start, page)


def fill_mamba(host: Any, slot: int, seed: int) -> None:
    """Random values in every state tensor of one Mamba slot."""
    g = torch.Generator().manual_seed(seed)
    for t in host._iter_page_tensors(slot):
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


def pages(host: Any, indices: torch.Tensor) -> list[torch.Tensor]:
    """Copies of the pages starting at ``indices[::page_size]``, in the pool's flat form."""
    return [host.get_data_page(i, flat=True).clone() for i in indices[::host.page_size].tolist()]


def logical_mha(host: Any, indices: torch.Tensor) -> list[torch.Tensor]:
    """MHA pages as ``[k/v, layer, token, head, dim]`` whatever the host layout."""
    kv, ps, out = host.kv_buffer, host.page_size, []
    for s in indices[::ps].tolist():
        if host.layout == "layer_first":
            out.append(kv[:, :, s:s + ps].clone())
        elif host.layout == "page_first":
            out.append(kv[:, s:s + ps].transpose(1, 2).clone())
        elif host.layout == "page_head":
            out.append(kv[:, s // ps].permute(0, 3, 2, 1, 4).clone())
        else:
            out.append(kv[:, s // ps].clone())
    return out


def write_through(ctl: Any, host_indices: torch.Tensor, toks: list[int], keys: list[str],
                  extra_pools: list[Any] | None = None) -> Any:
    """What the radix cache does on write-through: the backup thread runs ``_page_backup``."""
    ctl.write_storage(host_indices, toks, hash_value=keys, prefix_keys=None, extra_pools=extra_pools)
    return ctl.ack_backup_queue.get(timeout=60)


def prefetch(ctl: Any, host: Any, toks: list[int], n_alloc: Any = None, extra_pools: list[Any] | None = None,
             alloc_sidecars: Any = None) -> tuple[Any, int]:
    """A prefetch as the radix cache runs it: the prefetch thread's hit query, then host slots for
    the hit, then the I/O thread's transfer; returns the operation and the tokens the acks report."""
    handle = types.SimpleNamespace(rid=f"req-{uuid.uuid4().hex[:8]}")
    ctl.prefetch(handle, toks, last_hash=None, prefix_keys=None, extra_pools=extra_pools)
    op = ctl.prefetch_hit_queue.get(timeout=60)
    if op.storage_hit_count == 0:
        return op, 0
    op.host_indices = scattered(host, op.storage_hit_count // PAGE)
    if alloc_sidecars is not None:
        alloc_sidecars(op)
    ctl.prefetch_buffer.put(op)
    done = 0
    while True:
        ack = ctl.ack_prefetch_queue.get(timeout=60)
        done = max(done, ack.completed_tokens or 0)
        if ack.completed_req:
            return op, done


def sidecar_backup(mamba_slot: torch.Tensor, swa_slots: torch.Tensor, keys: list[str],
                   window: int) -> list[Any]:
    """The PoolTransfers MambaComponent / SWAComponent build for BACKUP_STORAGE."""
    return [PoolTransfer(name=PoolName.MAMBA, host_indices=mamba_slot, keys=[keys[-1]],
                         hit_policy=PoolHitPolicy.TRAILING_PAGES),
            PoolTransfer(name=PoolName.SWA, host_indices=swa_slots, keys=keys[-window:],
                         hit_policy=PoolHitPolicy.TRAILING_PAGES)]


def sidecar_prefetch(window: int) -> list[Any]:
    """The placeholder PoolTransfers MambaComponent / SWAComponent build for PREFETCH."""
    return [PoolTransfer(name=PoolName.MAMBA, keys=["__placeholder__"],
                         hit_policy=PoolHitPolicy.TRAILING_PAGES),
            PoolTransfer(name=PoolName.SWA, keys=["__placeholder__"] * window,
                         hit_policy=PoolHitPolicy.TRAILING_PAGES)]


def hybrid_group() -> tuple[Any, Any, dict[str, Any]]:
    """KV (page_first) + SWA (2 layers) + Mamba host pools in one HostPoolGroup."""
    kv_dev, kv_host = make_mha("page_first", label="full")
    swa_dev, swa_host = make_mha("page_first", layers=2, label="swa")
    m_dev, m_host = make_mamba()
    group = HostPoolGroup([entry(PoolName.KV, kv_host, kv_dev, anchor=True),
                           entry(PoolName.SWA, swa_host, swa_dev),
                           entry(PoolName.MAMBA, m_host, m_dev)])
    return group, kv_dev, {"kv": kv_host, "swa": swa_host, "mamba": m_host}


def restored_from_another_process(extra: dict[str, Any], tmp: Any, closing: list[Any]) -> Any:
    """Five pages backed up by ``write_pages.py`` in a process of its own, then prefetched through
    a controller of this process into other host slots: checked equal; the controller (closed
    after the test)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    want_file = Path(tmp) / "want.pt"
    subprocess.run([sys.executable, str(Path(__file__).parent / "write_pages.py"), json.dumps(extra),
                    "page_first", "7", "5", str(want_file)], check=True, timeout=300)
    want = torch.load(want_file)
    dev, host = make_mha("page_first_direct")
    ctl = controller(HostPoolGroup([entry(PoolName.KV, host, dev, anchor=True)]), dev, extra)
    closing.append(ctl)
    op, done = prefetch(ctl, host, tokens(5, seed=7))
    assert done == 5 * PAGE
    assert all(torch.equal(a, b) for a, b in zip(want, logical_mha(host, op.host_indices), strict=True))
    return ctl

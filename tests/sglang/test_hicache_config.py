"""The extra config: tierkv's keys validated at attach with errors that name the key, SGLang's own
keys passed over, and SGLang never imported by ``import tierkv.adapters.sglang``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sgl_pools import TIERKV, controller, create_backend, hybrid_group, make_mha

from tierkv.errors import ConfigError


def _base(tier: dict[str, Any]) -> dict[str, Any]:
    return {**TIERKV, "cpu_bytes_to_use": 8 << 20, "tiers": [tier]}


@pytest.mark.parametrize(("change", "named"), [
    ({"bogus": 1}, "hicache_storage_backend_extra_config.bogus"),
    ({"cpu_bytes_to_use": 0}, "hicache_storage_backend_extra_config.cpu_bytes_to_use"),
    ({"tiers": [{"kind": "fsspec"}]}, "hicache_storage_backend_extra_config.tiers.0.url"),
    ({"eviction_policy": "mru"}, "hicache_storage_backend_extra_config.eviction_policy"),
    ({"slots": {"nope": 4}}, "hicache_storage_backend_extra_config.slots.nope"),
])
def test_a_bad_setting_fails_the_attach_naming_the_key(change: dict[str, Any], named: str,
                                                       file_tier: dict[str, Any]) -> None:
    extra = {k: v for k, v in {**_base(file_tier), **change}.items() if v is not None}
    _, host = make_mha("page_first")
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        create_backend(extra, host)


def test_sglangs_own_keys_are_passed_over(file_tier: dict[str, Any], closing: list[Any]) -> None:
    extra = {**_base(file_tier), "interface_v1": 1, "prefetch_threshold": 64,
             "hicache_storage_pass_prefix_keys": True, "tp_lcm_size": 2}
    _, host = make_mha("page_first")
    b = create_backend(extra, host)
    closing.append(b)
    assert b.settings.cpu_bytes_to_use == 8 << 20


def test_only_tiers_is_enough_the_cpu_pool_is_sized_from_the_host_pool(file_tier: dict[str, Any],
                                                                      closing: list[Any]) -> None:
    from tierkv.adapters.sglang.config import DEFAULT_CPU_MAX, DEFAULT_CPU_MIN

    extra = {**TIERKV, "interface_v1": 1, "tiers": [file_tier]}  # as SGLang's file backend is set up
    _, host = make_mha("page_first", size=1 << 16)
    b = create_backend(extra, host)
    closing.append(b)
    assert b.settings.cpu_bytes_to_use is None
    chosen = b.plan.store_config["tiers"][0]["capacity_bytes"]
    host_bytes = (host.size // host.page_size) * b.plan.pools["kv"].codec.block_bytes
    assert chosen == min(DEFAULT_CPU_MAX, max(DEFAULT_CPU_MIN, host_bytes // 4))
    slots = b.stats().groups[0].slots
    assert slots * b.plan.pools["kv"].codec.block_bytes <= chosen and slots >= 8 + 16


def test_a_sliding_window_pool_needs_its_window(file_tier: dict[str, Any]) -> None:
    group, kv_dev, _ = hybrid_group()
    with pytest.raises(ConfigError, match=r"hicache_storage_backend_extra_config\.window_pages\.swa"):
        controller(group, kv_dev, _base(file_tier))


def test_importing_the_adapter_does_not_import_sglang() -> None:
    code = ("import sys, tierkv, tierkv.adapters.sglang as a; assert 'sglang' not in sys.modules; "
            "from tierkv.adapters.sglang import config, groups, hits, keys, pages; "
            "assert 'sglang' not in sys.modules; import cpu_shim; a.TierKVHiCacheStorage; "
            "assert 'sglang' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300, cwd=Path(__file__).parent)

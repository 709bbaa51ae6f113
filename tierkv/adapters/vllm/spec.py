"""``TierKVOffloadingSpec``: tierkv as vLLM's offloading spec (``spec_name: TierKVOffloadingSpec``).

vLLM builds the spec twice: in its worker (``get_worker``; first) and in its scheduler
(``get_manager``). The worker measures each group's block bytes from the KV cache tensors, plans the
pools and publishes the plan in a manifest beside the shared pool file; the scheduler adopts that
plan, so both sides agree on every slot by construction.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)

from tierkv import ConfigError, Layout, plan_pools
from tierkv.adapter import DaemonLink, all_metrics, cap_switch_interval, shared_pool_tensors
from tierkv.adapters.fingerprint import engine_namespace, persistent_tiers
from tierkv.adapters.vllm.config import AdapterConfig
from tierkv.adapters.vllm.cpu import cpu_kv_format, ensure_amx_permission
from tierkv.adapters.vllm.fingerprint import (
    attention_backends,
    check_hashes,
    engine_configs,
    fingerprint_fields,
    hash_algo,
)
from tierkv.adapters.vllm.groups import build_layout, infer_group_info
from tierkv.adapters.vllm.manager import TierKVOffloadingManager, vllm_metric_definitions
from tierkv.adapters.vllm.worker import PoolRows, TierKVWorker, group_copies

__all__ = ["TierKVOffloadingSpec"]

log = logging.getLogger("tierkv.vllm")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
#: how long the worker waits for the daemon when it asks which pool a transfer names
DAEMON_CALL_S = 5.0


class TierKVOffloadingSpec(OffloadingSpec):  # type: ignore[misc,unused-ignore]
    """tierkv's per-group pools and lower tiers behind vLLM's ``OffloadingConnector``."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        """The counters and gauges ``get_stats`` reports: tierkv's metrics, named as everywhere."""
        return vllm_metric_definitions(all_metrics())

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.settings = AdapterConfig.from_extra(config.extra_config)
        # vLLM builds the spec in its worker process before the first step: AMX attention on a
        # restored prefix may be that process's first AMX instruction (tierkv/adapters/vllm/cpu.py)
        self.amx = ensure_amx_permission()
        log.info("tierkv: AMX tile permission in process %d: %s", os.getpid(), self.amx)
        tpbs = {int(g.tokens_per_block) for g in config.groups}
        if len(tpbs) != 1:
            raise ConfigError(f"offloaded groups have different block sizes {sorted(tpbs)}: tierkv needs one")
        self.chunk_tokens = tpbs.pop() * self.blocks_per_chunk
        self.group_ids = [int(g.group_id) for g in config.groups]
        self.rank = int(config.parallel.rank)
        self.world_size = int(config.parallel.world_size)
        engine = _UNSAFE.sub("_", str(config.engine_id))[:96]
        self.shm_path = os.path.join(self.settings.shm_dir, f"tierkv-{engine}.pool")
        self.manifest_path = os.path.join(self.settings.shm_dir, f"tierkv-{engine}.json")
        from vllm.platforms import current_platform

        self.kv_format = cpu_kv_format(bool(current_platform.is_cpu()))
        #: the engine's config objects, for the fingerprint (tierkv/adapters/vllm/fingerprint.py)
        self._vllm_config, self._kv_cache_config = engine_configs()
        shared = [f"the tierkv daemon at {self.settings.daemon}"] if self.settings.daemon else []
        #: vLLM seeds its block hashes per process and no tier outlives it (refused otherwise)
        self.volatile_hashes = check_hashes(hash_algo(self._vllm_config),
                                            persistent_tiers(self.settings.tiers) + shared,
                                            "kv_connector_extra_config.tiers")
        #: the attention backends the worker's model uses, from its manifest (scheduler side)
        self._backends: str | None = None
        self._namespace: str | None = None
        self._manager: TierKVOffloadingManager | None = None

    @property
    def namespace(self) -> str:
        """The namespace of the store: the engine fingerprint plus the ``namespace`` setting
        (docs/design.md, "What a key means"); built on first use."""
        if self._namespace is None:
            fields = fingerprint_fields(self.config, self._vllm_config, self._kv_cache_config,
                                        self.group_ids, self.kv_format, self._backends)
            self._namespace = engine_namespace(fields, self.settings.namespace)
        return self._namespace

    def _layout(self, block_bytes: dict[int, int]) -> Layout:
        s = self.settings
        infos = infer_group_info(self.config, self.chunk_tokens, s.group_kinds, s.window_blocks)
        layout = build_layout(infos, self.chunk_tokens, block_bytes)
        if self.blocks_per_chunk > 1 and any(g.kind != "full" for g in layout.groups):
            kinds = sorted({g.kind for g in layout.groups})
            raise ConfigError(f"kv_connector_extra_config.blocks_per_chunk / block_size: an offloaded block "
                              f"of {self.blocks_per_chunk} engine blocks needs every offloaded group to be "
                              f"full attention (this model has {kinds}); leave both unset")
        return layout

    # ---- worker side -----------------------------------------------------------------------------
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        """Measure block bytes, plan the pools, publish the manifest, map the shared pool."""
        copies = group_copies(kv_caches, self.group_ids)
        block_bytes = {c.group_id: c.rank_bytes * self.world_size * self.blocks_per_chunk for c in copies}
        layout = self._layout(block_bytes)
        backends = attention_backends(self._vllm_config, self.config.groups)
        manifest: dict[str, Any] = {"format": "tierkv-vllm-manifest-v1", "pid": os.getpid(),
                                    "time": time.time(), "layout": layout.model_dump(mode="json"),
                                    "attention_backends": backends}
        pools: dict[int, Any] | PoolRows
        if self.settings.daemon is None:
            plan = plan_pools(self.settings.pool_bytes, layout, self.settings.max_concurrent_requests,
                              self.settings.slots)
            manifest.update(slots=plan.slots(), plan=plan.model_dump(mode="json"))
            pools = shared_pool_tensors(self.shm_path, plan)
            log.info("tierkv pools: %s", ", ".join(f"group {g.group} {g.kind}: {g.slots} x {g.block_bytes} B"
                                                   for g in plan.groups))
        else:
            self._backends = str(backends or "") or None
            link = DaemonLink(self.settings.daemon, self.namespace, layout, DAEMON_CALL_S)
            pools = link.rows_of
            log.info("tierkv: this engine's pool is the daemon's at %s", self.settings.daemon)
        if self.rank == 0:
            tmp = f"{self.manifest_path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(manifest, f)
            os.replace(tmp, self.manifest_path)
        return TierKVWorker(copies, pools, self.rank, self.world_size, self.blocks_per_chunk)

    # ---- scheduler side --------------------------------------------------------------------------
    def _read_manifest(self) -> dict[str, Any] | None:
        deadline = time.monotonic() + self.settings.manifest_timeout_s
        while True:
            try:
                with open(self.manifest_path) as f:
                    data: dict[str, Any] = json.load(f)
                return data
            except (FileNotFoundError, json.JSONDecodeError):
                if time.monotonic() >= deadline:
                    return None
                time.sleep(0.05)

    def get_manager(self) -> OffloadingManager:
        """The scheduler's manager over the plan the worker published."""
        if self._manager is not None:
            return self._manager
        manifest = self._read_manifest()
        if manifest is None:
            if self.settings.daemon is not None:
                raise ConfigError(f"no tierkv worker manifest at {self.manifest_path} after "
                                  f"{self.settings.manifest_timeout_s} s: through the daemon, the scheduler "
                                  "needs the layout the worker measured (raise manifest_timeout_s)")
            per_block = int(self.config.worker_kv_bytes_per_block) * self.world_size
            log.warning("no tierkv worker manifest at %s: estimating %d bytes per block for every group",
                        self.manifest_path, per_block)
            layout = self._layout(dict.fromkeys(self.group_ids, per_block))
            slots = plan_pools(self.settings.pool_bytes, layout,
                               self.settings.max_concurrent_requests, self.settings.slots).slots()
        else:
            layout = Layout.model_validate(manifest["layout"])
            slots = {int(g): int(n) for g, n in manifest.get("slots", {}).items()}
            self._backends = str(manifest.get("attention_backends") or "") or None
            self._namespace = None
        s = self.settings
        cap_switch_interval(s.gil_switch_interval_s)
        if self.volatile_hashes:
            log.warning("tierkv: vLLM's prefix_caching_hash_algo is %s and PYTHONHASHSEED is not set: block "
                        "hashes are seeded per process, so tierkv's CPU pool serves this process only and "
                        "nothing in it outlives the process (set PYTHONHASHSEED, or use sha256, before "
                        "adding a persistent tier)", hash_algo(self._vllm_config))
        log.info("tierkv namespace: %s", self.namespace)
        store_config: dict[str, Any] = {
            "layout": layout, "namespace": self.namespace, "policy": s.eviction_policy,
            "max_concurrent_requests": s.max_concurrent_requests, "pin_lease_s": s.pin_lease_s,
            "recompute_tokens_per_s": s.recompute_tokens_per_s, "cost_model": s.cost_model,
            "max_pending_s": s.max_pending_s,
        }
        if s.daemon is not None:
            store_config["daemon"] = s.daemon
        else:
            store_config["tiers"] = [{"kind": "cpu", "slots": slots, "shm_path": self.shm_path,
                                      "shm_owner": True}, *s.tiers]
        self._manager = TierKVOffloadingManager(store_config, self.group_ids,
                                                enable_events=bool(self.config.enable_kv_cache_events),
                                                cleanup=[self.manifest_path],
                                                measure_recompute=s.recompute_tokens_per_s is None)
        if manifest is not None:
            # vLLM builds the scheduler after every worker has mapped the pool (the manifest is
            # written after the mapping): both names can go now, so even a killed engine leaves
            # nothing behind in shm_dir (vLLM kills a slow engine core before it shuts down).
            for path in (self.shm_path, self.manifest_path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        return self._manager

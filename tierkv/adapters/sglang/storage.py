"""``TierKVHiCacheStorage``: tierkv as an SGLang HiCache storage backend (L3).

SGLang's factory builds it as ``cls(storage_config, kwargs)``; the controller then registers the
host pools (``register_mem_pool_host``, ``register_mem_host_pool_v2`` per pool) and calls
``on_host_pools_registered``, where the store opens with one group per pool. After that SGLang's
prefetch, prefetch I/O and backup threads call the v1 (``interface_v1``), v2 (hybrid models) or
old key-value methods. None of them raises: a page that cannot be read or written is ``False``
(or ``None``) in the result, counted in :attr:`TierKVHiCacheStorage.counters`, and logged.

Semantics:

- a write returns once the pages are in tierkv's CPU pool (readable at once); the lower tiers are
  written in the background, failures there counted in :meth:`stats` (``stores_failed``);
- ``batch_exists`` answers from memory and presence probes, waiting at most ``probe_timeout_s``;
  pages found on a lower tier start moving into the CPU pool at once;
- a read verifies every record (checksum, key, layout) before the page is copied into the host
  pool; a missing, unreadable or damaged page is False and leaves its host slots untouched.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found,unused-ignore]
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolTransfer,
    PoolTransferResult,
)

from tierkv import StoreStats, TieredStore
from tierkv.adapters.sglang.config import SGLangConfig
from tierkv.adapters.sglang.fingerprint import current_server_args
from tierkv.adapters.sglang.groups import PoolGroup, StorePlan, plan_store
from tierkv.adapters.sglang.hits import PoolQuery, usable_prefix
from tierkv.adapters.sglang.keys import page_hashes
from tierkv.adapters.sglang.metrics import OpMetrics
from tierkv.adapters.sglang.runner import StoreRunner
from tierkv.adapters.sglang.transfer import Transfers

__all__ = ["TierKVHiCacheStorage"]

log = logging.getLogger("tierkv.sglang")

T = TypeVar("T")
KV = "kv"


def _name(pool_name: Any) -> str:
    """A ``PoolName`` (a str enum) or plain string as the plain string."""
    return str(getattr(pool_name, "value", pool_name))


class TierKVHiCacheStorage(HiCacheStorage):  # type: ignore[misc,unused-ignore]
    """SGLang's ``HiCacheStorage`` over a :class:`~tierkv.TieredStore` (docs/sglang.md)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        #: the tierkv keys of the extra config, validated (``ConfigError`` names a bad key)
        self.settings = SGLangConfig.from_extra(storage_config.extra_config)
        self.mem_pool_host: Any = None
        self.registered_pools: dict[Any, Any] = {}
        self.metrics = OpMetrics(bool(storage_config.enable_storage_metrics))
        self.plan: StorePlan | None = None
        self._runner: StoreRunner | None = None
        self._transfers: Transfers | None = None
        self._open_lock = threading.Lock()
        self._writer = bool(getattr(storage_config, "is_storage_writer", True))
        self._closed = False

    # ---- registration ---------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The anchor (KV) host pool."""
        self.mem_pool_host = mem_pool_host

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """One host pool of the model, by SGLang pool name (the KV pool too)."""
        name = _name(host_pool_name)
        if self.plan is not None and name not in self.plan.pools:
            log.warning("tierkv: host pool %r was registered after the store opened; its pages are not "
                        "stored (transfers of it report False)", name)
        self.registered_pools[host_pool_name] = host_pool

    def on_host_pools_registered(self) -> None:
        """Every initial pool is known: open the store (a bad setting fails SGLang's attach here)."""
        self._ensure_open()

    def _ensure_open(self) -> tuple[StorePlan, Transfers]:
        if self.plan is not None and self._transfers is not None:
            return self.plan, self._transfers
        with self._open_lock:
            if self.plan is None or self._transfers is None:
                pools = {_name(k): v for k, v in self.registered_pools.items()}
                if self.mem_pool_host is not None and KV not in pools:
                    pools = {KV: self.mem_pool_host, **pools}
                plan = plan_store(pools, self.settings, self.storage_config, current_server_args())
                runner = StoreRunner(plan.store_config)
                self._runner, self._transfers = runner, Transfers(runner)
                self.plan = plan
                if self.settings.daemon is not None:
                    pool = f"the daemon's at {self.settings.daemon}"
                else:
                    pool = f"{plan.store_config['tiers'][0]['capacity_bytes']} bytes" + (
                        "" if self.settings.cpu_bytes_to_use else " (sized from the host pools)")
                log.info("tierkv: store open, CPU pool %s, %s", pool, "; ".join(
                    f"{p.name} -> group {p.group} ({p.kind}, {p.codec.block_bytes} B per page)"
                    for p in plan.pools.values()))
            assert self.plan is not None and self._transfers is not None
            return self.plan, self._transfers

    # ---- the guard every SGLang-facing call goes through ----------------------------------------
    def _guard(self, what: str, fallback: T, fn: Callable[[], T]) -> T:
        if self._closed:
            self.metrics.count("calls_after_close")
            return fallback
        try:
            return fn()
        except Exception:
            self.metrics.count("errors")
            log.exception("tierkv: %s failed; SGLang sees a miss", what)
            return fallback

    def _pool(self, name: Any) -> PoolGroup | None:
        plan, _ = self._ensure_open()
        return plan.pools.get(_name(name))

    def _hashes(self, pool: PoolGroup, keys: Sequence[str]) -> list[bytes]:
        return page_hashes(keys, pool.salt)

    def _starts(self, pool: PoolGroup, keys: Sequence[str], host_indices: Any) -> list[int] | None:
        ps = pool.codec.page_size
        if host_indices is None or host_indices.numel() != len(keys) * ps:
            got = 0 if host_indices is None else host_indices.numel()
            log.error("tierkv: pool %s: %d keys need %d host slots, got %d", pool.name, len(keys),
                      len(keys) * ps, got)
            return None
        return _every(host_indices, ps)

    # ---- writes and reads of one pool -----------------------------------------------------------
    def _write(self, pool: PoolGroup | None, keys: Sequence[str], host_indices: Any) -> list[bool]:
        if pool is None:
            return [False] * len(keys)
        if pool.replicated and not self._writer:
            return [True] * len(keys)  # the storage writer rank stores the same bytes
        starts = self._starts(pool, keys, host_indices)
        if starts is None:
            return [False] * len(keys)
        t0 = time.perf_counter()
        _, transfers = self._ensure_open()
        try:
            transfers.write(pool, self._hashes(pool, keys), starts)
        except Exception:
            self.metrics.count("backup_pages_failed", len(keys))
            raise
        self.metrics.observe("backup", len(keys), len(keys) * pool.codec.block_bytes, t0)
        return [True] * len(keys)

    def _read(self, pool: PoolGroup | None, keys: Sequence[str], host_indices: Any) -> list[bool]:
        if pool is None:
            return [False] * len(keys)
        starts = self._starts(pool, keys, host_indices)
        if starts is None:
            return [False] * len(keys)
        t0 = time.perf_counter()
        _, transfers = self._ensure_open()
        return self._count_reads(pool, transfers.read(pool, self._hashes(pool, keys), starts), t0)

    def _count_reads(self, pool: PoolGroup, ok: list[bool], t0: float) -> list[bool]:
        """Pages read (and failed) since ``t0``, into the prefetch metrics; ``ok`` as given."""
        good = sum(ok)
        if good < len(ok):
            self.metrics.count("prefetch_pages_failed", len(ok) - good)
        self.metrics.observe("prefetch", good, good * pool.codec.block_bytes, t0)
        return ok

    def _present(self, pool: PoolGroup, keys: Sequence[str], stop_at_miss: bool) -> list[bool]:
        assert self._runner is not None
        got, timed_out = self._runner.present(pool.group, self._hashes(pool, keys),
                                              self.settings.probe_timeout_s, stop_at_miss)
        if timed_out:
            self.metrics.count("exists_timeouts", timed_out)
        return got

    # ---- v1 (interface_v1): pages addressed by host slots ---------------------------------------
    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store KV pages straight from the host pool; per page, whether tierkv holds it now."""
        return self._guard("batch_set_v1", [False] * len(keys),
                           lambda: self._write(self._pool(KV), keys, host_indices))

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Load KV pages straight into the host pool; per page, whether it loaded (verified)."""
        return self._guard("batch_get_v1", [False] * len(keys),
                           lambda: self._read(self._pool(KV), keys, host_indices))

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading KV pages some tier holds."""
        def run() -> int:
            pool = self._pool(KV)
            if pool is None or not keys:
                return 0
            got = self._present(pool, keys, stop_at_miss=True)
            return got.index(False) if False in got else len(got)

        return self._guard("batch_exists", 0, run)

    # ---- v2: several pools (hybrid models) -------------------------------------------------------
    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """The usable prefix over the KV pages and every extra pool's hit policy."""
        def run() -> PoolTransferResult:
            kv_pages = self.batch_exists(keys)
            queries = []
            for t in pool_transfers or []:
                pool = self._pool(t.name)
                policy = _name(t.hit_policy)
                if pool is None:
                    queries.append(PoolQuery(_name(t.name), policy, len(t.keys or ()) or 1,
                                             lambda pos: [False] * len(pos)))
                    continue
                queries.append(PoolQuery(pool.name, policy, len(t.keys or ()) or 1,
                                         self._presence_of(pool, keys)))
            hits = usable_prefix(kv_pages, queries)
            return PoolTransferResult(hits.pages, dict(hits.pool_pages), hits.restorable)

        return self._guard("batch_exists_v2", PoolTransferResult(0, {}), run)

    def _presence_of(self, pool: PoolGroup, keys: Sequence[str]) -> Callable[[Sequence[int]], list[bool]]:
        def present(positions: Sequence[int]) -> list[bool]:
            return self._present(pool, [keys[i] for i in positions], stop_at_miss=False)

        return present

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Load each transfer's pages into its pool; per pool name, per page whether it loaded."""
        return {t.name: self._transfer("batch_get_v2", self._read, t) for t in transfers}

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Store each transfer's pages; per pool name, per page whether tierkv holds it now."""
        return {t.name: self._transfer("batch_set_v2", self._write, t) for t in transfers}

    def _transfer(self, what: str, op: Callable[[PoolGroup | None, Sequence[str], Any], list[bool]],
                  t: PoolTransfer) -> list[bool]:
        keys = list(t.keys or ())
        return self._guard(f"{what}({_name(t.name)})", [False] * len(keys),
                           lambda: op(self._pool(t.name), keys, t.host_indices))

    # ---- the old key-value API (interface_v1 off): flat KV pages --------------------------------
    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store flat KV pages (``get_data_page(flat=True)``); True when tierkv holds all of them."""
        def run() -> bool:
            pool = self._pool(KV)
            if pool is None or values is None or len(values) != len(keys):
                return False
            if pool.replicated and not self._writer:
                return True
            t0 = time.perf_counter()
            _, transfers = self._ensure_open()
            transfers.write_flat(pool, self._hashes(pool, keys), values)
            self.metrics.observe("backup", len(keys), len(keys) * pool.codec.block_bytes, t0)
            return True

        return self._guard("batch_set", False, run)

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Load flat KV pages into ``target_locations`` (dummy flat pages); None where one did not load."""
        def run() -> list[torch.Tensor | None]:
            pool = self._pool(KV)
            if pool is None or target_locations is None or len(target_locations) != len(keys):
                return [None] * len(keys)
            t0 = time.perf_counter()
            _, transfers = self._ensure_open()
            ok = self._count_reads(pool, transfers.read_flat(pool, self._hashes(pool, keys),
                                                             target_locations), t0)
            return [t if f else None for t, f in zip(target_locations, ok, strict=True)]

        return self._guard("batch_get", [None] * len(keys), run)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """One flat KV page into ``target_location``; None when it did not load."""
        if target_location is None:
            return None
        return self.batch_get([key], [target_location])[0]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store one flat KV page."""
        return value is not None and self.batch_set([key], [value])

    def exists(self, key: str) -> bool:
        """Whether some tier holds the KV page."""
        return self.batch_exists([key]) == 1

    # ---- stats, clear, close ---------------------------------------------------------------------
    def get_stats(self) -> Any:
        """Pages and bandwidth per operation since the last call, as SGLang's ``StorageMetrics``."""
        return self.metrics.storage_metrics()

    @property
    def counters(self) -> dict[str, int]:
        """The adapter's cumulative counters: pages read and written, pages that failed, errors."""
        return dict(self.metrics.counters)

    @property
    def store(self) -> TieredStore:
        """The :class:`~tierkv.TieredStore` behind the backend (opened on first use)."""
        self._ensure_open()
        assert self._runner is not None
        return self._runner.store

    def stats(self) -> StoreStats:
        """tierkv's own counters (``TieredStore.stats()``): per tier hits, stores, failures, corrupt."""
        self._ensure_open()
        assert self._runner is not None
        return self._runner.stats()

    def flush(self) -> None:
        """Wait until the pages written so far reached every lower tier (or failed, counted)."""
        if self._runner is not None and not self._closed:
            self._runner.flush()

    def clear(self) -> None:
        """Empty tierkv's CPU pool. Records on lower tiers stay (remove them with the tier's own
        tools, e.g. ``tierkv verify`` or deleting the directory)."""
        def run() -> None:
            self._ensure_open()
            assert self._runner is not None
            dropped = self._runner.clear()
            log.info("tierkv: clear() emptied the CPU pool (%d pages); lower tiers keep their records",
                     dropped)

        self._guard("clear", None, run)

    def close(self) -> None:
        """Finish writes to the lower tiers and close the store (SGLang calls this on detach)."""
        if self._closed:
            return
        self._closed = True
        if self._runner is not None:
            self._runner.close()


def _every(indices: Any, step: int) -> list[int]:
    """Every ``step``-th host slot of ``indices``, as ints.

    Through numpy where the tensor allows it: each torch call releases the GIL, and on a busy
    machine winning it back from the I/O threads cost 0.8 ms per call here.
    """
    try:
        arr = indices.numpy()
    except (AttributeError, RuntimeError, TypeError):
        return indices.reshape(-1)[::step].tolist()  # type: ignore[no-any-return]
    return arr.reshape(-1)[::step].tolist()  # type: ignore[no-any-return]

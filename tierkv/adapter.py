"""The adapter API: what engine adapters use beyond the public front door (:mod:`tierkv`).

An adapter (``tierkv.adapters.vllm``, ``tierkv.adapters.sglang``, or one of your own for another
engine) imports :mod:`tierkv` and this module, nothing else of tierkv's: the names here are kept
stable for adapters, the modules behind them are not. Like :mod:`tierkv`, names are imported on
first use (an engine's worker process that needs only :class:`DeviceTransfer` does not load the
store).

- the key-level slot API of a running store (``store.engine``): :class:`EngineSlots`,
  :class:`KeyState`, :data:`GROUP_BYTES` (the group suffix of a full key);
- running a store's event loop for a synchronous engine: :class:`LoopThread`,
  :func:`cap_switch_interval`, :data:`ENGINE_SWITCH_INTERVAL_S`;
- pools the engine shares: :func:`shared_pool_tensors`, :func:`adopt_shared` /
  :func:`release_shared` (memory the engine owns, registered for the tier's reader processes);
- a ``tierkv serve`` daemon's pool, for an engine's processes that copy into its rows:
  :class:`DaemonLink` (a connection that maps it; ``rows_of(pool_id)``), :func:`daemon_pool_rows`
  (the rows of a pool id some link of this process mapped), :class:`DaemonStore` (a store the
  daemon serves: ``lower_tiers_local`` says where its lower tiers keep their data), :data:`AHEAD_KEYS`
  (how many keys one daemon lookup may ask, the first and those the engine asks next);
- copies between an engine's device tensors and pool rows: :class:`DeviceTransfer`, :class:`Copy`;
- a lower tier driven without a store (vLLM's secondary tier): :class:`TierGateway`,
  :class:`FsspecTier`, :class:`FsspecTierConfig`, :class:`TierContext`, :func:`redact_url`,
  :func:`is_local_url`, :func:`tier_is_local`;
- settings and metrics in the engine's own terms: :class:`StrictNumbers`, :data:`Bytes`,
  :data:`Count`, :data:`Seconds`, :data:`TokenRate`, :data:`MAX_WAIT_S`,
  :data:`MAX_RATE_TOKENS_S`, :func:`format_validation_error`; :class:`Metric`,
  :data:`LATENCY_BUCKETS`, :data:`HISTOGRAMS`, :data:`TIER_METRICS`, :data:`BACKEND_METRICS`,
  :data:`USED_BYTES`, :func:`all_metrics`, :func:`samples`, :func:`tier_samples`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierkv._lazy import lazy

if TYPE_CHECKING:
    from tierkv.backends.base import TierContext
    from tierkv.backends.fsspec import FsspecTier, FsspecTierConfig, is_local_url, redact_url
    from tierkv.backends.fsspec._open import tier_is_local
    from tierkv.blocks.pool import shared_pool_tensors
    from tierkv.blocks.sharedmem import adopt as adopt_shared
    from tierkv.blocks.sharedmem import release as release_shared
    from tierkv.bridge import ENGINE_SWITCH_INTERVAL_S, LoopThread, cap_switch_interval
    from tierkv.config import format_validation_error
    from tierkv.daemon.client import DaemonStore
    from tierkv.daemon.link import Link as DaemonLink
    from tierkv.daemon.link import mapped_pools as daemon_pool_rows
    from tierkv.daemon.slots import AHEAD_KEYS
    from tierkv.keys import GROUP_BYTES
    from tierkv.movement.engine import EngineSlots
    from tierkv.movement.gateway import TierGateway
    from tierkv.movement.lookup import KeyState
    from tierkv.observing.metrics import (
        BACKEND_METRICS,
        HISTOGRAMS,
        LATENCY_BUCKETS,
        TIER_METRICS,
        USED_BYTES,
        Metric,
        all_metrics,
        samples,
        tier_samples,
    )
    from tierkv.quantities import (
        MAX_RATE_TOKENS_S,
        MAX_WAIT_S,
        Bytes,
        Count,
        Seconds,
        StrictNumbers,
        TokenRate,
    )
    from tierkv.transfer import Copy, DeviceTransfer

_WHERE: dict[str, tuple[str, str]] = {
    **{n: ("tierkv.backends.base", n) for n in ["TierContext"]},
    **{n: ("tierkv.backends.fsspec._open", n) for n in ["is_local_url", "tier_is_local"]},
    **{n: ("tierkv.backends.fsspec", n) for n in ["FsspecTier", "FsspecTierConfig", "redact_url"]},
    **{n: ("tierkv.bridge", n) for n in ["ENGINE_SWITCH_INTERVAL_S", "LoopThread", "cap_switch_interval"]},
    **{n: ("tierkv.config", n) for n in ["format_validation_error"]},
    **{n: ("tierkv.movement.engine", n) for n in ["EngineSlots"]},
    **{n: ("tierkv.movement.gateway", n) for n in ["TierGateway"]},
    **{n: ("tierkv.keys", n) for n in ["GROUP_BYTES"]},
    **{n: ("tierkv.movement.lookup", n) for n in ["KeyState"]},
    **{n: ("tierkv.observing.metrics", n) for n in ["BACKEND_METRICS", "HISTOGRAMS", "LATENCY_BUCKETS",
                                                    "TIER_METRICS", "USED_BYTES", "Metric", "all_metrics",
                                                    "samples", "tier_samples"]},
    **{n: ("tierkv.quantities", n) for n in ["MAX_RATE_TOKENS_S", "MAX_WAIT_S", "Bytes", "Count", "Seconds",
                                          "StrictNumbers", "TokenRate"]},
    **{n: ("tierkv.blocks.pool", n) for n in ["shared_pool_tensors"]},
    "adopt_shared": ("tierkv.blocks.sharedmem", "adopt"),
    "release_shared": ("tierkv.blocks.sharedmem", "release"),
    "DaemonLink": ("tierkv.daemon.link", "Link"),
    "DaemonStore": ("tierkv.daemon.client", "DaemonStore"),
    "AHEAD_KEYS": ("tierkv.daemon.slots", "AHEAD_KEYS"),
    "daemon_pool_rows": ("tierkv.daemon.link", "mapped_pools"),
    **{n: ("tierkv.transfer", n) for n in ["Copy", "DeviceTransfer"]},
}

__all__ = [
    "AHEAD_KEYS",
    "BACKEND_METRICS",
    "Bytes",
    "Copy",
    "Count",
    "DaemonLink",
    "DaemonStore",
    "DeviceTransfer",
    "ENGINE_SWITCH_INTERVAL_S",
    "EngineSlots",
    "FsspecTier",
    "FsspecTierConfig",
    "GROUP_BYTES",
    "HISTOGRAMS",
    "KeyState",
    "LATENCY_BUCKETS",
    "LoopThread",
    "MAX_RATE_TOKENS_S",
    "MAX_WAIT_S",
    "Metric",
    "Seconds",
    "StrictNumbers",
    "TIER_METRICS",
    "TierContext",
    "TierGateway",
    "TokenRate",
    "USED_BYTES",
    "adopt_shared",
    "all_metrics",
    "daemon_pool_rows",
    "cap_switch_interval",
    "format_validation_error",
    "is_local_url",
    "tier_is_local",
    "redact_url",
    "release_shared",
    "samples",
    "shared_pool_tensors",
    "tier_samples",
]


__getattr__ = lazy(__name__, _WHERE)


def __dir__() -> list[str]:
    return list(__all__)

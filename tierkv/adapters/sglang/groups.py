"""SGLang's host pools as tierkv groups, and the store configuration that follows from them.

Each registered host pool becomes one group, in registration order (the KV pool first): ``kv`` and
other per-token pools are ``full``, ``mamba`` is ``recurrent``, ``swa`` pools are
``sliding_window`` with ``window_pages`` pages. The namespace is the engine fingerprint
(:mod:`tierkv.adapters.sglang.fingerprint`: model, weights revision, quantization, KV cache dtype,
every pool's stored page format, attention backend, tokenizer) and the ranks, so two deployments
never read each other's pages.

Rank-replicated models (MLA: SGLang's ``is_mla_model``) keep one copy per rank group: the
namespace leaves the TP rank out, only SGLang's storage writer rank stores replicated pools, and
pools that stay TP-sharded (Mamba) get rank-specific keys instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tierkv import ConfigError, GroupSpec, Layout
from tierkv.adapters.fingerprint import engine_namespace
from tierkv.adapters.sglang.config import DEFAULT_CPU_MAX, DEFAULT_CPU_MIN, PREFIX, SGLangConfig
from tierkv.adapters.sglang.fingerprint import fingerprint_fields
from tierkv.adapters.sglang.pages import PageCodec, codec_for

__all__ = ["PoolGroup", "StorePlan", "default_cpu_bytes", "kind_of", "plan_store", "rank_identity"]

_RECURRENT = frozenset({"mamba"})
_SLIDING = frozenset({"swa", "auxiliary_swa", "draft_swa"})
#: pools whose state is split across TP ranks even when the model's KV is replicated
_RANK_SHARDED = frozenset({"mamba"})


@dataclass(frozen=True)
class PoolGroup:
    """One SGLang host pool and the tierkv group that stores its pages."""

    name: str
    group: int
    codec: PageCodec
    kind: str
    #: the same bytes on every TP rank (MLA KV): only the storage writer rank stores it
    replicated: bool
    #: mixed into the keys of a rank-sharded pool whose namespace every rank shares
    salt: bytes | None


@dataclass(frozen=True)
class StorePlan:
    """The groups and the :class:`~tierkv.TieredStore` config for one set of host pools."""

    pools: dict[str, PoolGroup]
    layout: Layout
    namespace: str
    store_config: dict[str, Any]


def kind_of(name: str, settings: SGLangConfig) -> str:
    """The group kind of a pool: ``pool_kinds`` first, then what SGLang's pool name says."""
    if settings.pool_kinds and name in settings.pool_kinds:
        return settings.pool_kinds[name]
    if name in _RECURRENT:
        return "recurrent"
    return "sliding_window" if name in _SLIDING else "full"


def rank_identity(storage_config: Any) -> tuple[dict[str, str], bool]:
    """The namespace fields that name this rank, and whether the model's KV is replicated across
    TP ranks (then the TP rank is left out: one copy per rank group)."""
    sc = storage_config
    replicated = bool(sc.is_mla_model)
    parts = {} if replicated else {"tp": f"{sc.tp_rank}/{sc.tp_size}"}
    parts.update({"pp": f"{sc.pp_rank}/{sc.pp_size}", "cp": f"{sc.attn_cp_rank}/{sc.attn_cp_size}",
                  "dp": f"{getattr(sc, 'dp_rank', 0)}",
                  "dcp": f"{getattr(sc, 'dcp_rank', 0)}/{getattr(sc, 'dcp_size', 1)}"})
    return parts, replicated


def _check_names(settings: SGLangConfig, names: list[str]) -> None:
    for key in ("slots", "window_pages", "pool_kinds"):
        given: Mapping[str, Any] | None = getattr(settings, key)
        for name in given or {}:
            if name not in names:
                raise ConfigError(f"{PREFIX}.{key}.{name}: no such host pool (this model has: "
                                  f"{', '.join(names)})")


def default_cpu_bytes(pools: Mapping[str, Any], groups: Mapping[str, PoolGroup],
                      settings: SGLangConfig) -> int:
    """tierkv's CPU pool when ``cpu_bytes_to_use`` is not given: a quarter of the host pools' bytes
    (pages x page bytes; a pool that does not say its size counts as 1 GiB), never less than what
    holds ``max_concurrent_requests`` + 16 pages of every pool, within [DEFAULT_CPU_MIN,
    DEFAULT_CPU_MAX]."""
    host = 0
    floor = 0
    for name, g in groups.items():
        pool = pools[name]
        tokens = int(getattr(pool, "size", 0) or 0)
        pages = tokens // g.codec.page_size if tokens else 0
        host += pages * g.codec.block_bytes if pages else 1 << 30
        floor += (settings.max_concurrent_requests + 16) * g.codec.block_bytes
    return max(floor, min(DEFAULT_CPU_MAX, max(DEFAULT_CPU_MIN, host // 4)))


def plan_store(pools: Mapping[str, Any], settings: SGLangConfig, storage_config: Any,
               server_args: Any = None) -> StorePlan:
    """Groups, layout, namespace and store config for the host pools SGLang registered
    (name -> pool, the KV pool first); :class:`ConfigError` names a missing or bad key.
    ``server_args``: SGLang's (for the engine fingerprint; None: those fields are unknown)."""
    names = list(pools)
    if not names:
        raise ConfigError("no host pool was registered with the tierkv storage backend")
    _check_names(settings, names)
    identity, replicated = rank_identity(storage_config)
    shard_salt = f"tp={storage_config.tp_rank}/{storage_config.tp_size}".encode()
    groups: dict[str, PoolGroup] = {}
    specs = []
    for i, name in enumerate(names):
        codec = codec_for(pools[name])
        kind = kind_of(name, settings)
        window = None
        if kind == "sliding_window":
            window = (settings.window_pages or {}).get(name)
            if window is None:
                raise ConfigError(
                    f"{PREFIX}.window_pages.{name}: required for the sliding-window pool {name!r} "
                    f"(its attention window in pages: ceil(window tokens / page size))")
        specs.append(GroupSpec(kind=kind, block_bytes=codec.block_bytes, window_blocks=window))
        sharded = replicated and name in _RANK_SHARDED
        groups[name] = PoolGroup(name=name, group=i, codec=codec, kind=kind,
                                 replicated=replicated and not sharded,
                                 salt=shard_salt if sharded else None)
    anchor = groups["kv"] if "kv" in groups else groups[names[0]]
    layout = Layout(tokens_per_block=anchor.codec.page_size, groups=specs)
    pool_part = ";".join(f"{g.name}={g.codec.describe}" for g in groups.values())
    fields = {**fingerprint_fields(storage_config, server_args, pool_part), **identity}
    namespace = engine_namespace(fields, settings.namespace)
    store_config: dict[str, Any] = {"layout": layout, "namespace": namespace,
                                    "max_concurrent_requests": settings.max_concurrent_requests,
                                    "policy": settings.eviction_policy, "pin_lease_s": settings.pin_lease_s}
    if settings.daemon is not None:  # the daemon's pool and tiers
        store_config["daemon"] = settings.daemon
        return StorePlan(pools=groups, layout=layout, namespace=namespace, store_config=store_config)
    cpu_bytes = settings.cpu_bytes_to_use or default_cpu_bytes(pools, groups, settings)
    primary: dict[str, Any] = {"kind": "cpu", "capacity_bytes": cpu_bytes}
    if settings.slots:
        primary["slots"] = {groups[n].group: v for n, v in settings.slots.items()}
    store_config["tiers"] = [primary, *settings.tiers]
    return StorePlan(pools=groups, layout=layout, namespace=namespace, store_config=store_config)

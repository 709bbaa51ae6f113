"""The settings of a ``TierKVSecondaryTier`` entry in vLLM's ``secondary_tiers``, and the layout and
namespace it derives from vLLM's ``OffloadingSpec`` (:mod:`tierkv.adapters.vllm.secondary`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, PositiveFloat, ValidationError, field_validator

from tierkv import ConfigError, GroupSpec, Layout
from tierkv.adapter import ENGINE_SWITCH_INTERVAL_S, FsspecTierConfig
from tierkv.adapters.fingerprint import engine_namespace
from tierkv.adapters.vllm.fingerprint import engine_configs, fingerprint_fields

__all__ = ["TierKVSecondaryTierConfig", "build_namespace_layout", "parse_config"]


class TierKVSecondaryTierConfig(FsspecTierConfig):
    """The keys of a ``TierKVSecondaryTier`` entry in ``secondary_tiers``.

    All fields of :class:`~tierkv.backends.fsspec.FsspecTierConfig` (``url``, ``storage_options``,
    ``codec``, ``capacity_bytes``, ``fsync``, ``io_threads``, TTLs, in-flight bounds, ...) plus:

    - ``namespace``: an extra string mixed into the namespace (e.g. to keep two deployments of
      the same model apart, or to tag a fine-tune served under the base model's name).
    - ``locality``: ``"LOCAL"`` or ``"REMOTE"`` (vLLM's ``kv_load_tiers`` filter uses it).
    - ``enable_kv_events``: emit a ``BlockStored``-style ``OffloadingEvent`` for every key written
      (only when vLLM's KV cache events are enabled globally). Evictions are not reported.
    - ``gil_switch_interval_s``: at most this GIL switch interval in the scheduler's process, as in
      the connector's settings (unset: leave it as it is).

    ``read_concurrency`` bounds concurrent load jobs and ``max_inflight_ops`` concurrent store jobs;
    ``kind`` can only be ``"fsspec"``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    namespace: str = ""
    locality: Literal["LOCAL", "REMOTE"] | None = None
    enable_kv_events: bool = False
    #: vLLM's step loop spins while loads are in flight; with Python's default 5 ms switch interval
    #: every hand-over of the GIL to the tier's I/O threads waits that long
    gil_switch_interval_s: PositiveFloat | None = ENGINE_SWITCH_INTERVAL_S

    @field_validator("kind")
    @classmethod
    def _fsspec_only(cls, v: str) -> str:
        if v != "fsspec":
            raise ValueError(f"must be 'fsspec', got {v!r}")
        return v

    def tier_config(self) -> FsspecTierConfig:
        """The settings of the underlying fsspec tier."""
        return FsspecTierConfig(**self.model_dump(include=set(FsspecTierConfig.model_fields)))


def parse_config(cfg: dict[str, Any], tier_type: str) -> TierKVSecondaryTierConfig:
    try:
        return TierKVSecondaryTierConfig(**cfg)
    except ValidationError as exc:
        # Never echo input values: storage_options may hold credentials.
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
            for err in exc.errors(include_url=False, include_input=False, include_context=False)
        )
        raise ConfigError(f"secondary tier {tier_type!r}: invalid configuration: {problems}") from None


def build_namespace_layout(offloading_spec: Any, block_bytes: int, user_namespace: str = "",
                           engine: tuple[Any, Any] | None = None) -> tuple[Layout, str]:
    """The tierkv layout and namespace string for a vLLM ``OffloadingSpec`` (see the module doc);
    ``engine`` is ``(VllmConfig, KVCacheConfig)`` (default: found by
    :func:`~tierkv.adapters.vllm.fingerprint.engine_configs`)."""
    config = getattr(offloading_spec, "config", None)
    if config is None or not getattr(config, "groups", None):
        raise ConfigError("TierKVSecondaryTier needs vLLM's OffloadingSpec (with config.groups)")
    offloaded = {int(g.group_id): g for g in config.groups}
    n_groups = max(offloaded) + 1
    groups = [GroupSpec(kind="full" if i in offloaded else "scratch", block_bytes=block_bytes)
              for i in range(n_groups)]
    bpc = int(config.cache.blocks_per_chunk)
    chunk_tokens = [int(g.tokens_per_block) * bpc for g in config.groups]
    layout = Layout(tokens_per_block=chunk_tokens[0], groups=groups)
    par = config.parallel
    if engine is None:
        engine = engine_configs()
    vllm_config, kv_cache_config = engine
    parts: dict[str, Any] = {
        **fingerprint_fields(config, vllm_config, kv_cache_config, sorted(offloaded)),
        "engine": "vllm-tiering",
        "tokens_per_hash": config.cache.tokens_per_hash,
        "rank": par.rank,
        "blocks_per_chunk": bpc,
        "group_tokens": ",".join(f"{g.group_id}:{g.tokens_per_block}" for g in config.groups),
        "world_size": par.world_size,
        "tp": par.tp_size,
        "pp": par.pp_size,
        "pcp": par.pcp_size,
        "dcp": par.dcp_size,
        "kv_cache_layout": getattr(config, "kv_cache_layout", None),
        "canonical": bool(getattr(config, "canonical_layout", False)),
        "replicated": bool(getattr(offloading_spec, "replicated_layout", False)),
    }
    return layout, engine_namespace(parts, user_namespace)

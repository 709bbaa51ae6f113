"""The adapter's settings, read from vLLM's ``kv_connector_extra_config``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, ValidationError

from tierkv.config import format_validation_error
from tierkv.errors import ConfigError

__all__ = ["VLLM_OWN_KEYS", "AdapterConfig"]

#: keys of ``kv_connector_extra_config`` that vLLM itself reads; passed over, never refused
VLLM_OWN_KEYS = frozenset({
    "spec_name", "spec_module_path", "blocks_per_chunk", "block_size", "canonical_layout",
    "offload_prompt_only", "self_describing_kv_events",
})

PREFIX = "kv_connector_extra_config"


class AdapterConfig(BaseModel):
    """Every key tierkv reads from ``kv_connector_extra_config`` (see docs/vllm.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: bytes of the CPU primary pool (shared memory), split between groups by ``plan_pools``
    cpu_bytes_to_use: PositiveInt
    #: lower tiers, fastest first: ``{"kind": "fsspec", "url": ..., "codec": ...}`` and so on
    tiers: list[dict[str, Any]] = Field(default_factory=list)
    #: added to the model name and dtype to name the namespace on persistent tiers
    namespace: str = ""
    #: sizes recurrent pools (max concurrent requests x states per request)
    max_concurrent_requests: PositiveInt = 8
    eviction_policy: Literal["lru", "arc"] = "lru"
    #: pins of a request that made no call for this long are dropped (vLLM may never finish it)
    pin_lease_s: PositiveFloat = 300.0
    #: explicit slots per group index (overrides the plan, even below the recurrent floor)
    slots: dict[int, int] | None = None
    #: group index -> "full" | "sliding_window" | "recurrent" (overrides what vLLM's specs say)
    group_kinds: dict[int, Literal["full", "sliding_window", "recurrent"]] | None = None
    #: group index -> window in chunks for sliding-window groups (overrides the derived value)
    window_blocks: dict[int, int] | None = None
    #: where the shared pool and its manifest live (one file per engine id)
    shm_dir: str = "/dev/shm"
    #: how long the scheduler waits for the worker's manifest before estimating block sizes
    manifest_timeout_s: float = 60.0
    #: the cost model's recompute rate (prefill tokens/s); unset: measured from the blocks the
    #: engine stores as it computes them
    recompute_tokens_per_s: PositiveFloat | None = None
    cost_model: bool = True
    #: no request stays HIT_PENDING / RETRY longer than this (then MISS: recompute); unset: the
    #: recompute time of what it waits for, else 60 s
    max_pending_s: PositiveFloat | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> AdapterConfig:
        """Validate ``kv_connector_extra_config``; errors name the bad key."""
        data = {k: v for k, v in dict(extra).items() if k not in VLLM_OWN_KEYS}
        try:
            cfg = cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(f"invalid tierkv settings: {format_validation_error(exc, PREFIX)}") from None
        from tierkv.config import StoreConfig
        from tierkv.layout import GroupSpec, Layout

        probe = Layout(tokens_per_block=1, groups=[GroupSpec(kind="full", block_bytes=1)])
        try:
            StoreConfig(layout=probe, tiers=[{"kind": "cpu", "capacity_bytes": 1}, *cfg.tiers])
        except ConfigError as exc:
            msg = str(exc).replace("tiers.", f"{PREFIX}.tiers.").replace(f"{PREFIX}.tiers.0", "<primary>")
            for i in range(len(cfg.tiers), 0, -1):
                msg = msg.replace(f"{PREFIX}.tiers.{i}", f"{PREFIX}.tiers.{i - 1}")
            raise ConfigError(msg) from None
        return cfg

"""The backend's settings, read from SGLang's ``--hicache-storage-backend-extra-config``."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, ValidationError

from tierkv.config import format_validation_error
from tierkv.errors import ConfigError

__all__ = ["PREFIX", "SGLANG_OWN_KEYS", "SGLangConfig"]

#: keys of the extra config that SGLang itself reads (the factory, the controller); passed over
SGLANG_OWN_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "prefetch_threshold",
    "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys",
    "tp_lcm_size",
})

PREFIX = "hicache_storage_backend_extra_config"

PoolKind = Literal["full", "sliding_window", "recurrent"]


class SGLangConfig(BaseModel):
    """Every key tierkv reads from the extra config (docs/sglang.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: bytes of tierkv's CPU pool, split between the pools' groups by ``plan_pools``
    cpu_bytes_to_use: PositiveInt
    #: lower tiers, fastest first: ``{"kind": "fsspec", "url": ..., "codec": ...}`` and so on
    tiers: list[dict[str, Any]] = Field(default_factory=list)
    #: added to the model name, ranks and page geometry to name the namespace on persistent tiers
    namespace: str = ""
    #: sizes recurrent (Mamba) pools: this many states at least
    max_concurrent_requests: PositiveInt = 8
    eviction_policy: Literal["lru", "arc"] = "lru"
    #: pins of a request that made no call for this long are dropped
    pin_lease_s: PositiveFloat = 300.0
    #: explicit slots of tierkv's CPU pool per SGLang pool name (``kv``, ``mamba``, ``swa``, ...)
    slots: dict[str, PositiveInt] | None = None
    #: sliding window in pages per sliding-window pool name (required for each such pool)
    window_pages: dict[str, PositiveInt] | None = None
    #: pool name -> group kind, overriding the kind derived from the name
    pool_kinds: dict[str, PoolKind] | None = None
    #: how long ``batch_exists`` waits for presence probes of slow tiers before it answers "absent"
    probe_timeout_s: PositiveFloat = 10.0

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> SGLangConfig:
        """Validate the extra config; errors are :class:`ConfigError` naming the bad key."""
        data = {k: v for k, v in dict(extra or {}).items() if k not in SGLANG_OWN_KEYS}
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
            raise ConfigError(_renumber_tiers(str(exc))) from None
        return cfg


def _renumber_tiers(msg: str) -> str:
    """A store-config message about ``tiers.<i>`` (the probe primary is 0) in extra-config terms."""

    def one(m: re.Match[str]) -> str:
        i = int(m.group(1))
        return "<primary>" if i == 0 else f"{PREFIX}.tiers.{i - 1}"

    return re.sub(r"\btiers\.(\d+)", one, msg)

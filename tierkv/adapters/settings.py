"""What every engine adapter reads from its engine's extra-config JSON, validated the same way."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, Self

from pydantic import ConfigDict, Field, ValidationError, model_validator

from tierkv import ConfigError
from tierkv.adapter import Bytes, Count, Seconds, StrictNumbers, format_validation_error

__all__ = ["EngineSettings"]


class EngineSettings(StrictNumbers):
    """The keys every adapter shares; each adapter subclasses it with its own keys, the name of
    its engine's extra-config option (``PREFIX``, used in error messages) and the keys the engine
    itself reads from it (``OWN_KEYS``: passed over, never refused)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    PREFIX: ClassVar[str] = "extra_config"
    OWN_KEYS: ClassVar[frozenset[str]] = frozenset()

    #: bytes of tierkv's CPU pool, split between the groups by ``plan_pools`` (an adapter may
    #: leave it optional and size the pool from what its engine says)
    cpu_bytes_to_use: Bytes
    #: lower tiers, fastest first: ``{"kind": "fsspec", "url": ..., "codec": ...}`` and so on
    tiers: list[dict[str, Any]] = Field(default_factory=list)
    #: added to what the engine says of the model to name the namespace on persistent tiers
    namespace: str = ""
    #: sizes recurrent (Mamba) pools: this many requests' states at least
    max_concurrent_requests: Count = 8
    eviction_policy: Literal["slru", "lru", "arc"] = "slru"
    #: pins of a request that made no call for this long are dropped (an engine may never finish it)
    pin_lease_s: Seconds = 300.0
    #: the socket of a ``tierkv serve`` daemon: its CPU pool and tiers serve this engine, shared
    #: with the node's other engines (docs/daemon.md); unset: a store of the engine's own
    daemon: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _daemon_tiers(self) -> Self:
        if self.daemon is not None and self.tiers:
            raise ValueError("with 'daemon', the lower tiers are the daemon's (its --config file): "
                             "leave 'tiers' out")
        return self

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> Self:
        """Validate the extra config, tiers included; errors are :class:`ConfigError` naming the
        bad key as the user wrote it (``<PREFIX>.tiers.1.url``)."""
        if extra is not None and not isinstance(extra, Mapping):
            raise ConfigError(f"invalid tierkv settings: {cls.PREFIX} must be a JSON object (a mapping of "
                              f"keys to values), not {type(extra).__name__}")
        data = {k: v for k, v in dict(extra or {}).items() if k not in cls.OWN_KEYS}
        try:
            cfg = cls.model_validate(data)
        except ValidationError as exc:
            why = format_validation_error(exc, cls.PREFIX)
            raise ConfigError(f"invalid tierkv settings: {why}") from None
        from tierkv import GroupSpec, Layout, StoreConfig

        probe = Layout(tokens_per_block=1, groups=[GroupSpec(kind="full", block_bytes=1)])
        try:
            StoreConfig(layout=probe, tiers=[{"kind": "cpu", "capacity_bytes": 1}, *cfg.tiers])
        except ConfigError as exc:
            raise ConfigError(cls._renumber_tiers(str(exc))) from None
        return cfg

    @classmethod
    def _renumber_tiers(cls, msg: str) -> str:
        """A store-config message about ``tiers.<i>`` (0 is the probe's primary) in extra-config terms."""

        def one(m: re.Match[str]) -> str:
            i = int(m.group(1))
            return "<primary>" if i == 0 else f"{cls.PREFIX}.tiers.{i - 1}"

        return re.sub(r"\btiers\.(\d+)", one, msg)

"""Store configuration: pydantic models, from a dict, a JSON/YAML file, or ``TIERKV_*`` variables."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationError,
    field_validator,
    model_validator,
)

from tierkv.backends.base import TierConfig
from tierkv.backends.registry import get_backend
from tierkv.errors import ConfigError, TierKVError, format_validation_error
from tierkv.layout import Layout
from tierkv.quantities import Count, Seconds, StrictNumbers, TokenRate

__all__ = ["ENV_PREFIX", "StoreConfig", "format_validation_error", "read_config_file"]

ENV_PREFIX = "TIERKV_"


class StoreConfig(StrictNumbers):
    """Everything a :class:`~tierkv.TieredStore` needs.

    ``tiers[0]`` is the primary and must be a slot-pool tier (``cpu`` or ``device``); the others
    are lower tiers written through from the primary, fastest first.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    layout: Layout
    namespace: str = ""
    max_concurrent_requests: Count = 8
    #: the primary first, then the lower tiers; may be left out with ``daemon`` (the daemon owns them)
    tiers: list[SerializeAsAny[TierConfig]] = Field(default_factory=list)
    #: the primary pools' eviction policy (tierkv.blocks.policy): ``slru`` (segmented LRU that keeps what
    #: was used again, its protected share picked online; plain LRU where that does best), ``lru``
    #: or ``arc``
    policy: Literal["slru", "lru", "arc"] = "slru"
    #: ``queue``: a promotion that finds no slot waits in FIFO order (PENDING). ``naive``: it is a
    #: MISS, as in engines that treat a full primary as absent; kept only for comparisons.
    admission: Literal["queue", "naive"] = "queue"
    #: pins a request holds are dropped when it has made no call for this long
    pin_lease_s: Seconds = 300.0
    #: the engine's prefill throughput (tokens/s), for the cost model: a prefix is loaded from a lower
    #: tier only as far as loading beats recomputing it (engine adapters may measure and set it)
    recompute_tokens_per_s: TokenRate | None = None
    cost_model: bool = True
    #: no request stays PENDING longer than this; past it, what is not ready is a MISS (unset: the
    #: recompute time of what it waits for, with the cost model on, else 60 s)
    max_pending_s: Seconds | None = None
    #: serve Prometheus metrics at http://<metrics_host>:<metrics_port>/metrics while the store is
    #: open (needs the extra tierkv[metrics]); 0 picks a free port (``store.metrics_url`` tells)
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    metrics_host: str = "127.0.0.1"
    #: use the tierkv daemon listening on this Unix socket (``tierkv serve``) instead of an
    #: in-process store: engines on one node share its pool and tiers (docs/daemon.md)
    daemon: str | None = None

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(f"invalid store config: {format_validation_error(exc)}") from None

    @field_validator("namespace")
    @classmethod
    def _utf8_namespace(cls, value: str) -> str:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("must encode as UTF-8 (it holds a lone surrogate)") from None
        return value

    @field_validator("tiers", mode="before")
    @classmethod
    def _tier_models(cls, value: Any) -> Any:
        if not isinstance(value, list) or not value:
            raise ValueError("at least one tier is needed (the primary pool)")
        out = []
        for i, item in enumerate(value):
            if isinstance(item, TierConfig):
                out.append(item)
                continue
            if not isinstance(item, Mapping) or "kind" not in item:
                raise ValueError(f"tiers.{i}: must be a mapping with a 'kind'")
            try:
                model = get_backend(str(item["kind"])).config_model
                out.append(model.model_validate(dict(item)))
            except ValidationError as exc:
                raise ValueError(format_validation_error(exc, f"tiers.{i}")) from None
            except TierKVError as exc:
                raise ValueError(f"tiers.{i}: {exc}") from None
        return out

    @model_validator(mode="after")
    def _some_tier(self) -> StoreConfig:
        if not self.tiers and self.daemon is None:
            raise ValueError("tiers: at least one tier is needed (the primary pool), unless 'daemon' is set")
        return self

    def metrics_address(self, environ: Mapping[str, str] | None = None) -> tuple[str, int, bool] | None:
        """Where to serve metrics: ``(host, port, from_environment)``, or None.

        ``metrics_port`` in the config wins; a config without one (built in code, read from a file,
        made by an engine adapter) takes ``TIERKV_METRICS_PORT`` / ``TIERKV_METRICS_HOST``, so an
        operator can turn the endpoint on for any store without touching the code that builds it.
        """
        if self.metrics_port is not None:
            return self.metrics_host, self.metrics_port, False
        env = os.environ if environ is None else environ
        text = env.get(f"{ENV_PREFIX}METRICS_PORT", "").strip()
        if not text:
            return None
        try:
            port = int(text)
        except ValueError:
            raise ConfigError(f"{ENV_PREFIX}METRICS_PORT: not a port number: {text!r}") from None
        if not 0 <= port <= 65535:
            raise ConfigError(f"{ENV_PREFIX}METRICS_PORT: {port} is not in 0..65535")
        host = env.get(f"{ENV_PREFIX}METRICS_HOST", "").strip() or self.metrics_host
        return host, port, True

    @property
    def fingerprint(self) -> str:
        """The layout fingerprint within this config's namespace."""
        return self.layout.fingerprint(self.namespace)

    @classmethod
    def coerce(cls, config: StoreConfig | Mapping[str, Any]) -> StoreConfig:
        """``config`` itself, or a mapping validated (:meth:`from_dict`)."""
        return config if isinstance(config, StoreConfig) else cls.from_dict(config)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StoreConfig:
        """Validate a plain mapping."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"a store config must be a mapping, got {type(data).__name__}")
        return cls(**dict(data))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> StoreConfig:
        """Read a JSON or YAML file (YAML needs PyYAML)."""
        return cls.from_dict(read_config_file(path))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None,
                 base: Mapping[str, Any] | None = None) -> StoreConfig:
        """Build from ``TIERKV_CONFIG`` (a file path) and ``TIERKV_*`` overrides.

        ``TIERKV_NAMESPACE``, ``TIERKV_MAX_CONCURRENT_REQUESTS``, ``TIERKV_POLICY``,
        ``TIERKV_PIN_LEASE_S``, ``TIERKV_RECOMPUTE_TOKENS_PER_S``, ``TIERKV_MAX_PENDING_S``,
        ``TIERKV_METRICS_PORT``, ``TIERKV_METRICS_HOST`` and ``TIERKV_DAEMON`` override top-level keys;
        ``TIERKV_TIERS`` takes JSON.
        """
        env = os.environ if environ is None else environ
        data: dict[str, Any] = dict(base or {})
        if env.get(f"{ENV_PREFIX}CONFIG"):
            data.update(cls.from_file(env[f"{ENV_PREFIX}CONFIG"]).model_dump())
        for name in ("namespace", "max_concurrent_requests", "policy", "pin_lease_s",
                     "recompute_tokens_per_s", "max_pending_s", "metrics_port", "metrics_host", "daemon"):
            val = env.get(ENV_PREFIX + name.upper())
            if val is not None:
                data[name] = val
        if env.get(f"{ENV_PREFIX}TIERS"):
            try:
                data["tiers"] = json.loads(env[f"{ENV_PREFIX}TIERS"])
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{ENV_PREFIX}TIERS is not valid JSON: {exc}") from None
        return cls.from_dict(data)


def read_config_file(path: str | os.PathLike[str]) -> Any:
    """The contents of a JSON file, or a YAML one (``.yaml``/``.yml``, needs PyYAML); a
    :class:`ConfigError` naming the file and what is wrong (never the offending text)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {p}: {exc.strerror}") from None
    data: Any
    if p.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError("YAML config files need PyYAML: pip install pyyaml") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            # the problem and where, never the offending text (it may be a secret)
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or type(exc).__name__
            raise ConfigError(f"{p}: not valid YAML{where}: {problem}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{p}: not valid JSON: {exc}") from None
    return data

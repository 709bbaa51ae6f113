"""The daemon's settings file: the keys engine adapters take, plus the daemon's own."""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator

from tierkv.backends.fsspec._open import protocol_problem
from tierkv.config import StoreConfig, read_config_file
from tierkv.errors import ConfigError, format_validation_error
from tierkv.layout import Layout
from tierkv.quantities import Bytes, Count, Seconds, StrictNumbers

__all__ = ["DaemonConfig"]


class DaemonConfig(StrictNumbers):
    """What ``tierkv serve --config FILE`` reads (JSON or YAML).

    The daemon opens one store per (namespace, layout) its clients name: a CPU pool of
    ``cpu_bytes_to_use`` bytes in a shared file under ``shm_dir`` and the lower ``tiers`` below it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: bytes of each store's CPU pool (one store per namespace and layout)
    cpu_bytes_to_use: Bytes
    #: lower tiers, fastest first, as in a store config (``{"kind": "fsspec", "url": ...}``)
    tiers: list[dict[str, Any]] = Field(default_factory=list)
    #: the namespaces clients may use; empty: any
    namespaces: list[str] = Field(default_factory=list)
    max_concurrent_requests: Count = 8
    eviction_policy: Literal["slru", "lru", "arc"] = "slru"
    pin_lease_s: Seconds = 300.0
    max_pending_s: Seconds | None = None
    #: where the shared pool files live (a tmpfs: their pages are the pool's memory)
    shm_dir: str = "/dev/shm"
    #: permission bits of the socket file: owner only unless widened; an int or an octal string
    #: (``"0660"``: owner and group)
    socket_mode: int = Field(default=0o600, ge=0, le=0o777)
    #: stores (namespace and layout pairs) open at once; a client asking for one more is refused
    max_stores: Count = 8
    #: connections served at once; one more is refused
    max_clients: Count = 256
    #: how long a dropped connection's pins and reserved slots are kept before they go (a client
    #: whose call timed out may still be copying the rows it was given)
    drop_grace_s: Seconds = Field(default=10.0, ge=1.0)
    #: bytes of each store's staging file: puts that find no room in the pool are copied there and
    #: written to the lower tiers from it (0: such puts are dropped and counted)
    staging_bytes: int = Field(default=64 << 20, ge=0)
    #: serve each store's Prometheus metrics: the first store opened at this port, the next at the
    #: next port, and so on (0: a free port each); unset: none (``TIERKV_METRICS_PORT`` aside)
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    metrics_host: str = "127.0.0.1"

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(f"invalid daemon config: {format_validation_error(exc)}") from None
        probe = Layout.model_validate({"tokens_per_block": 1, "groups": [{"kind": "full", "block_bytes": 1}]})
        try:
            self.store_config(probe, "", "")
        except ConfigError as exc:  # the file's tiers.0 is the store's tiers.1 (0 is the pool)
            why = re.sub(r"\btiers\.(\d+)", lambda m: f"tiers.{int(m.group(1)) - 1}", str(exc))
            raise ConfigError(why.replace("invalid store config", "invalid daemon config", 1)) from None
        for i, tier in enumerate(self.tiers):  # found now, not when the first engine says hello
            inner = tier.get("inner")
            url = tier.get("url") or (inner.get("url") if isinstance(inner, dict) else None)
            problem = protocol_problem(url) if isinstance(url, str) else ""
            if problem:
                raise ConfigError(f"invalid daemon config: tiers.{i}.url: {problem}")

    @field_validator("socket_mode", mode="before")
    @classmethod
    def _octal(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return int(value.removeprefix("0o"), 8)
            except ValueError:
                raise ValueError(f"not an octal mode: {value!r}") from None
        return value

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> DaemonConfig:
        """Read a JSON or YAML file (by its suffix, as a store config); :class:`ConfigError` naming
        the file or the bad key."""
        data = read_config_file(path)
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the daemon config must be a mapping of keys to values")
        return cls(**data)

    def store_config(self, layout: Layout, namespace: str, shm_path: str, index: int = 0) -> StoreConfig:
        """The config of the ``index``-th store opened, serving ``namespace`` and ``layout``, its
        pool in ``shm_path``."""
        primary = {"kind": "cpu", "capacity_bytes": self.cpu_bytes_to_use, "shm_path": shm_path or None}
        port = self.metrics_port
        if port:
            port = min(65535, port + index)
        return StoreConfig(layout=layout, namespace=namespace, tiers=[primary, *self.tiers],
                           max_concurrent_requests=self.max_concurrent_requests, policy=self.eviction_policy,
                           pin_lease_s=self.pin_lease_s, max_pending_s=self.max_pending_s,
                           metrics_port=port, metrics_host=self.metrics_host)

"""The backend's settings, read from SGLang's ``--hicache-storage-backend-extra-config``."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import PositiveInt

from tierkv.adapter import Bytes, Seconds
from tierkv.adapters.settings import EngineSettings

__all__ = ["DEFAULT_CPU_MAX", "DEFAULT_CPU_MIN", "PREFIX", "SGLANG_OWN_KEYS", "SGLangConfig"]

#: bounds of the CPU pool that tierkv sizes itself when ``cpu_bytes_to_use`` is not given
DEFAULT_CPU_MIN = 256 << 20
DEFAULT_CPU_MAX = 8 << 30

#: keys of the extra config that SGLang itself reads (the factory, the controller); passed over
SGLANG_OWN_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "prefetch_threshold",
    "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys",
    "tp_lcm_size",
})

PREFIX = "hicache_storage_backend_extra_config"

PoolKind = Literal["full", "sliding_window", "recurrent"]


class SGLangConfig(EngineSettings):
    """Every key tierkv reads from the extra config (docs/sglang.md)."""

    PREFIX: ClassVar[str] = PREFIX
    OWN_KEYS: ClassVar[frozenset[str]] = SGLANG_OWN_KEYS

    #: bytes of tierkv's CPU pool; unset: a quarter of the bytes of SGLang's registered host pools,
    #: within [``DEFAULT_CPU_MIN``, ``DEFAULT_CPU_MAX``] (docs/sglang.md, Sizing)
    cpu_bytes_to_use: Bytes | None = None  # type: ignore[assignment]
    #: explicit slots of tierkv's CPU pool per SGLang pool name (``kv``, ``mamba``, ``swa``, ...)
    slots: dict[str, PositiveInt] | None = None
    #: sliding window in pages per sliding-window pool name (required for each such pool)
    window_pages: dict[str, PositiveInt] | None = None
    #: pool name -> group kind, overriding the kind derived from the name
    pool_kinds: dict[str, PoolKind] | None = None
    #: how long ``batch_exists`` waits for presence probes of slow tiers before it answers "absent"
    probe_timeout_s: Seconds = 10.0

"""The adapter's settings, read from vLLM's ``kv_connector_extra_config``."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from tierkv.adapter import ENGINE_SWITCH_INTERVAL_S, MAX_WAIT_S, Bytes, Count, Seconds, TokenRate
from tierkv.adapters.settings import EngineSettings

__all__ = ["VLLM_OWN_KEYS", "AdapterConfig"]

#: keys of ``kv_connector_extra_config`` that vLLM itself reads; passed over, never refused
VLLM_OWN_KEYS = frozenset({
    "spec_name", "spec_module_path", "blocks_per_chunk", "block_size", "canonical_layout",
    "offload_prompt_only", "self_describing_kv_events",
})

PREFIX = "kv_connector_extra_config"


class AdapterConfig(EngineSettings):
    """Every key tierkv reads from ``kv_connector_extra_config`` (see docs/vllm.md)."""

    PREFIX: ClassVar[str] = PREFIX
    OWN_KEYS: ClassVar[frozenset[str]] = VLLM_OWN_KEYS

    #: bytes of tierkv's CPU pool (not used with ``daemon``: the daemon's pool is its config's)
    cpu_bytes_to_use: Bytes | None = None  # type: ignore[assignment]
    #: explicit slots per group index (overrides the plan, even below the recurrent floor)
    slots: dict[int, Count] | None = None
    #: group index -> "full" | "sliding_window" | "recurrent" (overrides what vLLM's specs say)
    group_kinds: dict[int, Literal["full", "sliding_window", "recurrent"]] | None = None
    #: group index -> window in chunks for sliding-window groups (overrides the derived value)
    window_blocks: dict[int, Count] | None = None
    #: where the shared pool and its manifest live (one file per engine id)
    shm_dir: str = "/dev/shm"
    #: how long the scheduler waits for the worker's manifest before estimating block sizes
    manifest_timeout_s: float = Field(default=60.0, ge=0, le=MAX_WAIT_S, allow_inf_nan=False)
    #: the cost model's recompute rate (prefill tokens/s); unset: measured from the blocks the
    #: engine stores as it computes them
    recompute_tokens_per_s: TokenRate | None = None
    cost_model: bool = True
    #: no request stays HIT_PENDING / RETRY longer than this (then MISS: recompute); unset: the
    #: recompute time of what it waits for, else 60 s
    max_pending_s: Seconds | None = None
    #: at most this GIL switch interval in the scheduler's process (``sys.setswitchinterval``):
    #: vLLM's step loop spins while a restore is pending, and with Python's default 5 ms every
    #: hand-over of the GIL to tierkv's I/O threads waits that long (unset: leave it as it is)
    gil_switch_interval_s: float | None = Field(default=ENGINE_SWITCH_INTERVAL_S, gt=0, le=1.0,
                                                allow_inf_nan=False)

    @model_validator(mode="after")
    def _pool(self) -> AdapterConfig:
        if self.daemon is None and self.cpu_bytes_to_use is None:
            raise ValueError("cpu_bytes_to_use is required (the bytes of tierkv's CPU pool), unless "
                             "'daemon' names a tierkv daemon whose pool serves this engine")
        return self

    @property
    def pool_bytes(self) -> int:
        """``cpu_bytes_to_use`` of an engine with a pool of its own."""
        if self.cpu_bytes_to_use is None:
            raise ValueError("no cpu_bytes_to_use: this engine's pool is the daemon's")
        return int(self.cpu_bytes_to_use)

    @field_validator("shm_dir")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"must be an absolute directory (such as /dev/shm), got {v!r}")
        return v

"""The async tier interface every backend implements, and its capability flags."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from pydantic import ConfigDict, Field, PositiveInt, StrictBool, field_validator

from tierkv.layout import Layout
from tierkv.quantities import MAX_WAIT_S, StrictNumbers

__all__ = ["MAX_WAIT_S", "Capabilities", "KeyListener", "RowLanded", "Tier", "TierConfig", "TierContext",
           "old_name", "real_bool"]

#: called with ``"stored"`` or ``"removed"`` and the keys concerned
KeyListener = Callable[[str, list[bytes]], None]
#: called with ``i`` once row ``i`` of a ``get``'s ``out`` holds the verified block (see :meth:`Tier.get`)
RowLanded = Callable[[int], None]


@dataclass(frozen=True)
class Capabilities:
    """What a tier can do; the store and the conformance suite read these flags.

    - ``persistent``: blocks survive a restart of the process.
    - ``fast_contains``: ``contains_nowait`` answers from memory, so lookups need no probe.
    - ``listable``: ``list_keys`` enumerates what the tier holds.
    - ``deletable``: ``delete`` removes blocks.
    - ``slot_pool``: the tier is a preallocated slot pool and may be the primary (tier 0).
    - ``bounded``: the tier enforces ``capacity_bytes`` by evicting.
    - ``scattered_rows``: :meth:`Tier.get_rows` and :meth:`Tier.put_rows` move blocks straight
      between the tier and scattered rows of a larger CPU tensor (an engine's pool, whose free
      rows are rarely adjacent), in one call, with no gathered copy.
    """

    persistent: bool = False
    fast_contains: bool = False
    listable: bool = True
    deletable: bool = True
    slot_pool: bool = False
    bounded: bool = True
    scattered_rows: bool = False


class TierConfig(StrictNumbers):
    """Settings every tier has. Backends subclass this with their own fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str
    #: unset: no bound
    capacity_bytes: PositiveInt | None = None
    #: bytes in flight to this tier, for stores and (separately) for loads: past it, stores wait
    #: in a queue and loads in batches; nothing is refused for it
    max_inflight_bytes: PositiveInt = 256 << 20
    #: concurrent store calls
    max_inflight_ops: PositiveInt = 16
    #: stores waiting past this many bytes (unset: 8 x ``max_inflight_bytes``), or whose wait the
    #: tier's measured latency puts above ``shed_after_s``, are shed and counted. Loads never are.
    max_queued_bytes: PositiveInt | None = None
    shed_after_s: float = Field(default=2.0, gt=0, le=MAX_WAIT_S, allow_inf_nan=False)
    #: concurrent load and probe calls
    read_concurrency: PositiveInt = 16
    #: how long a lookup trusts a presence probe of this tier: found, and not found
    presence_ttl_s: float = Field(default=60.0, gt=0, le=MAX_WAIT_S, allow_inf_nan=False)
    negative_ttl_s: float = Field(default=1.0, gt=0, le=MAX_WAIT_S, allow_inf_nan=False)
    #: the read rate (bytes/s) the cost model assumes before the first load is measured
    read_bytes_per_s: float = Field(default=500e6, gt=0, allow_inf_nan=False)
    #: how long a store's start waits for this tier to open; a tier that has not answered by then
    #: joins in the background when it answers (unless ``required``)
    open_timeout_s: float = Field(default=10.0, gt=0, le=MAX_WAIT_S, allow_inf_nan=False)
    #: a tier that does not open within ``open_timeout_s`` fails the store's start instead
    required: StrictBool = False
    #: how long ``close()`` waits for this tier's writes (cascades, then its own close); what it
    #: could not write by then is counted (``stores_abandoned``) and logged
    close_timeout_s: float = Field(default=30.0, gt=0, le=MAX_WAIT_S, allow_inf_nan=False)
    #: while the tier is down, failed writes of blocks still in the primary wait in a queue of at
    #: most this many blocks and are written again when it answers (0: never retried)
    retry_queue_blocks: int = Field(default=65536, ge=0)
    #: how often a tier that is down is asked whether it answers again
    health_interval_s: float = Field(default=2.0, gt=0, le=MAX_WAIT_S, allow_inf_nan=False)

    @field_validator("required", mode="before")
    @classmethod
    def _real_bool(cls, value: Any) -> Any:
        return real_bool(value)


def real_bool(value: Any) -> bool:
    """``value`` when it is a bool; else a ValueError for a setting that must be one (pydantic
    would read ``"yes"``, ``"off"`` or ``1`` as one)."""
    if not isinstance(value, bool):
        raise ValueError("must be true or false (a boolean, not a string or a number)")
    return value


def old_name(data: Any, old: str, new: str, meaning: str = "") -> Any:
    """A tier's settings (a ``mode="before"`` validator's input) with ``old``, a setting's former
    name, moved to ``new``; a ValueError naming ``new`` when both are set and differ."""
    if not isinstance(data, dict) or data.get(old) is None:
        return data
    data = dict(data)
    value = data.pop(old)
    if data.get(new) not in (None, value):
        raise ValueError(f"{old} is the old name of {new}{meaning}: set {new} only (got {old}={value}, "
                         f"{new}={data[new]})")
    data[new] = value
    return data


@dataclass(frozen=True)
class TierContext:
    """What a tier learns from the store: the layout, the namespace and its fingerprint."""

    layout: Layout
    namespace: str
    fingerprint: str
    max_concurrent_requests: int = 8
    policy: str = "lru"


class Tier(ABC):
    """One level of the hierarchy, addressed by group index and key.

    Blocks travel as 2-D tensors of ``[n, block_bytes]`` bytes (any dtype whose rows are
    ``block_bytes`` long). A tier answers per key: ``get`` fills the rows it has and returns
    ``False`` for the others; a record it finds damaged is a ``False`` (and counted), never an
    exception. Exceptions mean the backend itself failed.
    """

    kind: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    config_model: ClassVar[type[TierConfig]] = TierConfig

    def __init__(self, config: TierConfig, context: TierContext) -> None:
        self.config = config
        self.context = context
        self.counters: dict[str, int] = {}
        self._listeners: list[KeyListener] = []

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the backend counter ``name`` (reported in ``stats()``)."""
        self.counters[name] = self.counters.get(name, 0) + n

    def add_listener(self, listener: KeyListener) -> None:
        """Call ``listener(event, keys)`` with ``"stored"`` / ``"removed"`` and the keys whenever
        blocks appear in or leave this tier (events for routers that place requests by cache), and
        ``"listed"`` with the keys a listing of the tier found (held then; maybe not for long)."""
        self._listeners.append(listener)

    def notify(self, event: str, keys: list[bytes]) -> None:
        """Tell the listeners (backends call this); a listener's error is logged, never raised."""
        if not keys:
            return
        for listener in list(self._listeners):
            try:
                listener(event, keys)
            except Exception:
                logging.getLogger("tierkv").exception("a tier event listener failed")

    async def open(self) -> None:  # noqa: B027
        """Acquire resources (allocate pools, connect). Called once before use."""

    async def check(self) -> None:
        """Raise when the tier does not answer (the store's health check of a tier that is down)."""
        first = next(iter(self.context.layout.cacheable_groups), 0)
        await self.contains(first, [b"tierkv-health-check" + bytes(4)])

    def abandon(self) -> None:  # noqa: B027
        """Stop waiting for I/O in flight: ``close`` past its bound on a tier that does not
        answer (a hung mount). Calls still running may end later; nothing waits for them."""

    async def close(self) -> None:  # noqa: B027
        """Release resources."""

    async def background(self) -> None:  # noqa: B027
        """Long-running upkeep (e.g. rebuilding capacity accounting); the store runs it once opened."""

    @abstractmethod
    async def put(self, group: int, keys: Sequence[bytes], blocks: torch.Tensor) -> list[bool]:
        """Store ``blocks[i]`` under ``keys[i]``; per key, whether it is now held."""

    @abstractmethod
    async def get(self, group: int, keys: Sequence[bytes], out: torch.Tensor,
                  landed: RowLanded | None = None) -> list[bool]:
        """Fill ``out[i]`` with the block of ``keys[i]``; per key, whether it was found intact.

        Rows of keys answered False hold unspecified bytes and must not be used. ``landed(i)``,
        when given, may be called once row ``i`` holds its verified block, from the thread that
        verified it, before ``get`` returns (a row it was called for is answered True); a tier
        may call it for none of them.
        """

    async def put_rows(self, group: int, keys: Sequence[bytes], src: torch.Tensor,
                       rows: Sequence[int]) -> list[bool]:
        """Store ``src[rows[i]]`` (``src``: ``[n, block_bytes]`` bytes on the CPU) under ``keys[i]``,
        as :meth:`put` does. Called only on tiers whose capabilities say ``scattered_rows``."""
        raise NotImplementedError(f"{self.kind} tier cannot write from scattered rows")

    async def get_rows(self, group: int, keys: Sequence[bytes], dest: torch.Tensor, rows: Sequence[int],
                       landed: RowLanded | None = None) -> list[bool]:
        """Fill ``dest[rows[i]]`` (``dest``: ``[n, block_bytes]`` bytes on the CPU) with the block of
        ``keys[i]``, as :meth:`get` does (``landed(i)`` names the key's position ``i``). Called
        only on tiers whose capabilities say ``scattered_rows``."""
        raise NotImplementedError(f"{self.kind} tier cannot read into scattered rows")

    @abstractmethod
    async def contains(self, group: int, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether the tier holds it (a later ``get`` may still miss)."""

    def contains_nowait(self, group: int, keys: Sequence[bytes]) -> list[bool] | None:
        """Per key presence answered from memory, or None when the tier cannot say without I/O."""
        return None

    async def delete(self, group: int, keys: Sequence[bytes]) -> None:
        """Remove keys; keys that are not held are ignored."""
        raise NotImplementedError(f"{self.kind} tier cannot delete")

    async def list_keys(self, group: int) -> list[bytes]:
        """Every key the tier holds for ``group``."""
        raise NotImplementedError(f"{self.kind} tier cannot list keys")

    def used_bytes(self) -> int | None:
        """Bytes held, where the tier knows it."""
        return None

    def describe(self) -> str:
        """A short description for logs and stats; never contains credentials."""
        return self.kind

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"

"""Model state layout: the groups of a model and how many tokens one block spans."""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from tierkv.errors import LayoutError, format_validation_error

__all__ = ["CACHEABLE_KINDS", "GroupKind", "GroupSpec", "Layout"]

GroupKind = Literal["full", "sliding_window", "recurrent", "scratch"]
CACHEABLE_KINDS: frozenset[str] = frozenset({"full", "sliding_window", "recurrent"})


class GroupSpec(BaseModel):
    """One KV cache group: its kind and the size of one block of its state.

    ``window_blocks`` is required for ``sliding_window`` groups (the number of blocks before a
    boundary that a prefix needs). ``states_per_request`` is how many blocks of a ``recurrent`` group
    one request holds at once (it sizes the recurrent pool floor).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: GroupKind
    block_bytes: int
    window_blocks: int | None = None
    states_per_request: int = 1

    def __init__(self, **data: object) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise LayoutError(f"invalid group spec: {format_validation_error(exc)}") from None

    @model_validator(mode="after")
    def _check(self) -> GroupSpec:
        if self.block_bytes <= 0:
            raise ValueError(f"block_bytes must be > 0, got {self.block_bytes}")
        if self.kind == "sliding_window":
            if self.window_blocks is None:
                raise ValueError("a sliding_window group needs window_blocks")
            if self.window_blocks <= 0:
                raise ValueError(f"window_blocks must be > 0, got {self.window_blocks}")
        elif self.window_blocks is not None:
            raise ValueError(f"window_blocks only applies to sliding_window groups, not {self.kind}")
        if self.states_per_request <= 0:
            raise ValueError(f"states_per_request must be > 0, got {self.states_per_request}")
        return self

    @property
    def cacheable(self) -> bool:
        """True for groups that get keys, lookups and slots (every kind but ``scratch``)."""
        return self.kind in CACHEABLE_KINDS

    def blocks_needed(self, k: int) -> range:
        """Block indices this group must hold for a prefix of ``k`` blocks to be usable."""
        if k <= 0 or not self.cacheable:
            return range(0)
        if self.kind == "full":
            return range(k)
        if self.kind == "sliding_window":
            assert self.window_blocks is not None
            return range(max(0, k - self.window_blocks), k)
        return range(k - 1, k)


class Layout(BaseModel):
    """The ordered groups of a model plus ``tokens_per_block``.

    Group indices are positions in ``groups`` and are kept everywhere, scratch groups included.
    ``blocks_per_record`` (default 1) is how many consecutive blocks of one prefix one record
    holds: with ``N > 1`` the unit of storage (pool slot, record, eviction) is a chunk of ``N``
    blocks keyed by its last block's hash, and every prefix-cacheable group must be ``full``
    (docs/design.md, "Several blocks to a record").
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    tokens_per_block: int
    groups: tuple[GroupSpec, ...]
    blocks_per_record: int = 1

    def __init__(self, **data: object) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise LayoutError(f"invalid layout: {format_validation_error(exc)}") from None

    @model_validator(mode="after")
    def _check(self) -> Layout:
        if self.tokens_per_block <= 0:
            raise ValueError(f"tokens_per_block must be > 0, got {self.tokens_per_block}")
        if not self.groups:
            raise ValueError("a layout needs at least one group")
        if not any(g.cacheable for g in self.groups):
            raise ValueError("a layout needs at least one prefix-cacheable group (not scratch)")
        if self.blocks_per_record <= 0:
            raise ValueError(f"blocks_per_record must be > 0, got {self.blocks_per_record}")
        if self.blocks_per_record > 1:
            others = [f"{i} ({g.kind})" for i, g in enumerate(self.groups)
                      if g.cacheable and g.kind != "full"]
            if others:
                raise ValueError(f"blocks_per_record > 1 needs every prefix-cacheable group to be full "
                                 f"attention (a sliding-window or recurrent state does not split into "
                                 f"records of several blocks); groups {', '.join(others)} are not")
        return self

    def record_layout(self) -> Layout:
        """The layout whose blocks are this layout's records: ``tokens_per_block`` and every
        group's ``block_bytes`` times ``blocks_per_record``, one block to a record. The pools,
        lookups and tiers work in these units; it is this layout itself when ``N`` is 1."""
        n = self.blocks_per_record
        if n == 1:
            return self
        return Layout(tokens_per_block=self.tokens_per_block * n,
                      groups=tuple(g.model_copy(update={"block_bytes": g.block_bytes * n})
                                   for g in self.groups))

    @property
    def cacheable_groups(self) -> tuple[int, ...]:
        """Indices of the groups that get keys, lookups and slots."""
        return tuple(i for i, g in enumerate(self.groups) if g.cacheable)

    def group(self, index: int) -> GroupSpec:
        """The spec of a prefix-cacheable group; a clear error for scratch or unknown indices."""
        from tierkv.errors import InvalidArgument

        if not isinstance(index, int) or isinstance(index, bool):
            raise InvalidArgument(f"group index must be an int, got {type(index).__name__}")
        if not 0 <= index < len(self.groups):
            raise InvalidArgument(
                f"unknown group index {index}: the layout has groups 0..{len(self.groups) - 1}"
            )
        spec = self.groups[index]
        if not spec.cacheable:
            raise InvalidArgument(
                f"group {index} is a scratch group: it is not prefix-cacheable and has no keys"
            )
        return spec

    def canonical_json(self) -> str:
        """The layout as canonical JSON (sorted keys, no whitespace): the input of the fingerprint.

        ``blocks_per_record`` is left out when it is 1, so layouts from before it existed keep
        their fingerprint (and their records)."""
        doc = self.model_dump(mode="json")
        if doc["blocks_per_record"] == 1:
            del doc["blocks_per_record"]
        return json.dumps(doc, sort_keys=True, separators=(",", ":"))

    def fingerprint(self, namespace: str = "") -> str:
        """A 32-hex-digit name for this layout within ``namespace`` (e.g. model name and dtype).

        The same layout and namespace always give the same value; any change gives another.
        """
        from tierkv.errors import ConfigError

        try:
            ns = namespace.encode("utf-8")
        except (AttributeError, UnicodeEncodeError):
            raise ConfigError("namespace must be a str that encodes as UTF-8 (no lone surrogates)") from None
        h = hashlib.sha256()
        h.update(b"tierkv-layout-v1\0")
        h.update(ns)
        h.update(b"\0")
        h.update(self.canonical_json().encode("utf-8"))
        return h.hexdigest()[:32]

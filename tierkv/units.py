"""The front door's blocks as the store's records: with ``layout.blocks_per_record = N > 1`` one
record (pool slot, file, eviction) holds ``N`` consecutive blocks of a prefix, keyed by the last
one's hash, while callers still pass one hash and one row per block (docs/design.md, "Several
blocks to a record"). With ``N = 1`` every mapping here is the identity.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tierkv.errors import InvalidArgument
from tierkv.keys import GROUP_BYTES, check_hashes, record_hashes
from tierkv.layout import Layout
from tierkv.movement.lookup import KeyState, PrefixLookup
from tierkv.tensors import byte_rows, row_span

__all__ = ["RecordUnits"]


class RecordUnits:
    """Maps a call's blocks (hashes, rows, answers) onto whole records of ``layout``."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        #: blocks to a record
        self.per = layout.blocks_per_record
        #: the layout of one record: the unit of the pools, the lookups and the cost model
        self.records = layout.record_layout()

    def keys(self, group: int, hashes: Sequence[bytes], whole: str = "") -> tuple[list[bytes], int]:
        """The keys of the whole records ``hashes`` covers, and how many blocks ``hashes`` names;
        a call named by ``whole`` takes whole records only (:class:`InvalidArgument` otherwise)."""
        hs = check_hashes(hashes)
        per = self.per
        if whole and len(hs) % per:
            raise InvalidArgument(
                f"{whole}: {len(hs)} hashes, but this layout keeps {per} blocks to a record and "
                f"{whole} takes whole records: pass a multiple of {per} hashes, from a record's first block")
        tail = group.to_bytes(GROUP_BYTES, "big")
        return [h + tail for h in record_hashes(hs, per)], len(hs)

    def rows(self, t: object, group: int, blocks: int, records: int, what: str, device: torch.device,
             writable: bool = False) -> torch.Tensor:
        """``t``, ``blocks`` rows of the group's blocks, as its first ``records`` whole records
        (``[records, record_bytes]`` bytes): a view, no copy (:func:`byte_rows` checks ``t``)."""
        rows = byte_rows(t, blocks, self.layout.groups[group].block_bytes, what, device, writable)
        if self.per == 1:
            return rows
        return row_span(rows, 0, records * self.per).view(records, rows.shape[1] * self.per)

    def block_rows(self, rows: torch.Tensor, group: int) -> torch.Tensor:
        """Whole records' rows as one row per block: a view."""
        return rows if self.per == 1 else rows.view(-1, self.layout.groups[group].block_bytes)

    def states(self, states: list[KeyState], blocks: int) -> list[KeyState]:
        """Per block, its record's answer; the blocks of a trailing record not yet full are MISS."""
        per = self.per
        if per == 1:
            return states
        return [st for st in states for _ in range(per)] + [KeyState.MISS] * (blocks - len(states) * per)

    def prefix_hashes(self, hashes: Sequence[bytes]) -> Sequence[bytes]:
        """The hashes naming the whole records of a prefix (checked when they are not the caller's)."""
        return hashes if self.per == 1 else record_hashes(check_hashes(hashes), self.per)

    def prefix(self, result: PrefixLookup) -> PrefixLookup:
        """A prefix of records as a prefix of blocks."""
        return result if self.per == 1 else PrefixLookup(result.blocks * self.per, result.state)

"""Hybrid prefix rules: which blocks of which groups a prefix of ``k`` blocks needs.

A prefix of ``k`` blocks is usable when every full group holds blocks ``0..k-1``, every
sliding-window group holds blocks ``k-window..k-1`` and every recurrent group holds block ``k-1``.
Scratch groups are never consulted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from tierkv.layout import Layout

__all__ = ["longest_prefix", "needed_blocks"]


def needed_blocks(layout: Layout, k: int) -> dict[int, range]:
    """Per prefix-cacheable group, the block indices a prefix of ``k`` blocks needs."""
    return {g: layout.groups[g].blocks_needed(k) for g in layout.cacheable_groups}


def longest_prefix(
    layout: Layout,
    n_blocks: int,
    has: Callable[[int, int], bool],
    capacity: Mapping[int, int] | None = None,
) -> int:
    """The largest ``k <= n_blocks`` whose needed blocks all satisfy ``has(group, block)``.

    ``capacity`` (group -> slots) excludes prefixes that need more blocks of a group at once than
    it could ever hold, so a prefix too big for a pool falls back to the longest one that fits.
    """
    groups = layout.cacheable_groups
    upper = n_blocks
    for g in groups:
        spec = layout.groups[g]
        if spec.kind == "full":
            if capacity is not None:
                upper = min(upper, capacity[g])
            i = 0
            while i < upper and has(g, i):
                i += 1
            upper = i
    for k in range(upper, 0, -1):
        if all(_group_ok(layout, g, k, has, capacity) for g in groups
               if layout.groups[g].kind != "full"):
            return k
    return 0


def _group_ok(layout: Layout, g: int, k: int, has: Callable[[int, int], bool],
              capacity: Mapping[int, int] | None) -> bool:
    need = layout.groups[g].blocks_needed(k)
    if capacity is not None and len(need) > capacity[g]:
        return False
    return all(has(g, i) for i in need)

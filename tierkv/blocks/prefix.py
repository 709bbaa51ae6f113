"""Hybrid prefix rules: which blocks of which groups a prefix of ``k`` blocks needs.

A prefix of ``k`` blocks is usable when every full group holds blocks ``0..k-1``, every
sliding-window group holds blocks ``k-window..k-1`` and every recurrent group holds block ``k-1``.
Scratch groups are never consulted.
"""

from __future__ import annotations

from tierkv.layout import Layout

__all__ = ["needed_blocks"]


def needed_blocks(layout: Layout, k: int) -> dict[int, range]:
    """Per prefix-cacheable group, the block indices a prefix of ``k`` blocks needs."""
    return {g: layout.groups[g].blocks_needed(k) for g in layout.cacheable_groups}

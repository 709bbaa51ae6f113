"""The usable prefix of a hybrid model's pages, as SGLang's ``batch_exists_v2`` defines it.

The KV pages give the longest run present from the start. Each extra pool then narrows it by its
hit policy: ``all_pages`` pools need every page of the prefix; ``trailing_pages`` pools (Mamba, SWA)
need only the last ``len(keys)`` pages of it, so some prefix lengths are restorable and others are
not. The answer is the longest length every pool can restore, plus the restorable lengths found.

Trailing pools are searched from the longest prefix down and only as far as the first restorable
length: the answer is then the same, and a length reported restorable always is (SGLang intersects
the lists of its ranks, so a shorter list can only cost a hit, never give a wrong one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["Hits", "PoolQuery", "usable_prefix"]

#: positions asked at once while searching a trailing pool backwards
TRAILING_WINDOW = 32

#: positions -> whether the pool holds each of them
Presence = Callable[[Sequence[int]], list[bool]]


@dataclass(frozen=True)
class PoolQuery:
    """One extra pool of a ``batch_exists_v2`` call."""

    name: str
    #: ``all_pages``, ``trailing_pages`` (anything else gives no verdict and no limit)
    policy: str
    #: pages a trailing pool needs at the end of the prefix
    trailing: int
    present: Presence


@dataclass
class Hits:
    """The answer: usable prefix, each pool's own boundary, and the restorable lengths found."""

    pages: int
    pool_pages: dict[str, int] = field(default_factory=dict)
    restorable: list[int] = field(default_factory=list)


class _Trailing:
    """A trailing pool's presence, asked lazily in windows, and its longest restorable prefix."""

    def __init__(self, q: PoolQuery) -> None:
        self.q = q
        self.t = max(1, q.trailing)
        self.known: dict[int, bool] = {}
        self.best = 0

    def ok(self, p: int, may_ask: bool) -> bool | None:
        """Whether the pool can restore a prefix of ``p`` pages; None when that needs a question
        and ``may_ask`` is False."""
        need = range(max(0, p - self.t), p)
        if any(i not in self.known for i in need):
            if not may_ask:
                return None
            ask = [i for i in range(max(0, p - self.t - TRAILING_WINDOW), p) if i not in self.known]
            self.known.update(zip(ask, self.q.present(ask), strict=True))
        good = all(self.known[i] for i in need)
        if good and not self.best:
            self.best = p
        return good


def usable_prefix(kv_pages: int, pools: Sequence[PoolQuery]) -> Hits:
    """The usable prefix given ``kv_pages`` KV pages present from the start and the extra pools."""
    hits = Hits(pages=0, pool_pages={"kv": kv_pages} if kv_pages else {})
    upper = kv_pages
    for q in pools:
        if q.policy == "all_pages" and upper:
            got = q.present(range(upper))
            upper = got.index(False) if False in got else upper
            if upper:
                hits.pool_pages[q.name] = upper
    trailing = [_Trailing(q) for q in pools if q.policy == "trailing_pages"]
    if not trailing:
        hits.restorable = list(range(1, upper + 1))
    for p in range(upper, 0, -1) if trailing else ():
        verdicts = [t.ok(p, may_ask=not hits.restorable) for t in trailing]
        if None in verdicts:
            break
        if all(verdicts):
            hits.restorable.insert(0, p)
    for t in trailing:
        if t.best:
            hits.pool_pages[t.q.name] = t.best
    hits.pages = hits.restorable[-1] if hits.restorable else 0
    return hits

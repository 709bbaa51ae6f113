"""The ``slru`` eviction policy: segmented LRU with ghost admission and a protected share it picks
online (docs/traffic.md has the traces and figures behind it).

Keys enter a *probation* segment. A key used again while resident, or inserted again soon after
it was evicted (its hash is still in the *ghost* list), moves to the *protected* segment; a key
seen once, which on real LLM traffic is most keys (three in four blocks of Mooncake's conversation
trace are never used again), is evicted from probation without pushing out what was reused.
Protected holds at most ``share`` of the capacity; past it, its least recently used keys are
demoted to probation's recent end. Eviction takes probation's least recently used key first.

No one share suits every workload: a small pool wants nearly all of it protected, a pool that holds
most of the working set wants plain LRU (``share`` 0 *is* LRU, exactly). So the policy runs a few
key-only *shadow* caches, one per candidate share, over a sample of the keys (a fixed hash picks
one key in ``rate``; each shadow is ``rate`` times smaller), counts the hits each would have had,
and every ``period`` sampled accesses adopts the share whose shadow did best, with older counts
decayed. It starts as LRU.

Every operation is O(1) (the shadows see one key in ``rate``); a change of share demotes at most
:data:`DEMOTE_STEP` keys per call, so no call stalls on a large pool. ``victims`` never changes
state. Memory: per resident key one dict entry; the ghost holds up to ``ghost_factor`` x capacity
key hashes; the shadows about ``(1 + ghost_factor) * capacity * len(shares) / rate`` ints.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence

__all__ = ["DEMOTE_STEP", "SHARES", "SLRUPolicy"]

#: the protected shares the policy chooses between (0.0 is plain LRU)
SHARES = (0.0, 0.5, 0.8, 0.95)
#: keys demoted from protected per call at most (the rest follow on later calls)
DEMOTE_STEP = 64
#: hit counts are multiplied by this at each decision, so the choice follows the traffic
DECAY = 0.8


class _Shadow:
    """A key-only segmented LRU of one protected share: what the real cache would hit with it."""

    __slots__ = ("capacity", "ghost", "ghost_cap", "hits", "limit", "ok", "prob", "prot")

    def __init__(self, capacity: int, share: float, ghost_factor: int) -> None:
        self.capacity = max(1, capacity)
        self.limit = int(share * self.capacity)
        self.prob: OrderedDict[int, None] = OrderedDict()
        self.prot: OrderedDict[int, None] = OrderedDict()
        self.ghost: OrderedDict[int, None] = OrderedDict()
        self.ghost_cap = ghost_factor * self.capacity
        self.hits = 0.0
        #: whether every sampled block of the chain being walked was a hit so far
        self.ok = True

    def access(self, h: int) -> None:
        """An access of sampled key ``h``: a hit counts while the chain's earlier blocks hit too
        (a block is of use only after every block before it)."""
        prob, prot = self.prob, self.prot
        if h in prot:
            prot.move_to_end(h)
            self.hits += self.ok
            return
        if h in prob:
            del prob[h]
            self.hits += self.ok
            self._protect(h)
            return
        self.ok = False
        if len(prob) + len(prot) >= self.capacity:
            v = prob.popitem(last=False)[0] if prob else prot.popitem(last=False)[0]
            self.ghost[v] = None
            if len(self.ghost) > self.ghost_cap:
                self.ghost.popitem(last=False)
        if h in self.ghost:
            del self.ghost[h]
            self._protect(h)
        else:
            prob[h] = None

    def _protect(self, h: int) -> None:
        self.prot[h] = None
        while len(self.prot) > self.limit:
            self.prob[self.prot.popitem(last=False)[0]] = None

    def refresh(self, h: int) -> None:
        """Move ``h`` to its segment's recent end (a chain reordered, not a use)."""
        if h in self.prot:
            self.prot.move_to_end(h)
        elif h in self.prob:
            self.prob.move_to_end(h)


class SLRUPolicy:
    """Segmented LRU, ghost admission, protected share chosen online (the module's docstring).

    ``capacity`` is the pool's slot count; ``shares`` the candidate protected shares; ``rate``
    samples one key in ``rate`` for the shadows (default: about one shadow slot per 256 slots, at
    most 16); ``period`` is the number of sampled accesses between decisions.
    """

    def __init__(self, capacity: int, shares: Sequence[float] = SHARES, ghost_factor: int = 4,
                 rate: int | None = None, period: int | None = None, chains: bool = True) -> None:
        self.capacity = max(1, capacity)
        self.shares = tuple(shares) or (0.0,)
        self.share = 0.0 if 0.0 in self.shares else self.shares[0]
        self._limit = int(self.share * self.capacity)
        self._prob: OrderedDict[bytes, None] = OrderedDict()
        self._prot: OrderedDict[bytes, None] = OrderedDict()
        #: hashes of keys evicted lately -> their parent's hash
        self._ghost: OrderedDict[int, int] = OrderedDict()
        self._ghost_cap = ghost_factor * self.capacity
        self.rate = rate or max(1, min(16, self.capacity // 256))
        self._shadows = [_Shadow(self.capacity // self.rate, s, ghost_factor) for s in self.shares]
        self.period = period or max(512, self.capacity // self.rate)
        self._sampled = 0
        #: how often the share changed (for tests and curiosity)
        self.switches = 0
        self.chains = chains
        #: resident key -> the hash of the block before it in its chain (0: none)
        self._parent: dict[bytes, int] = {}
        self._burst: list[bytes] = []
        self._burst_sampled: list[int] = []
        self._prev = 0  # hash of the key accessed last

    # ---- the shadows ---------------------------------------------------------------------------
    def _sample(self, key: bytes) -> None:
        h = zlib.crc32(key)
        if h % self.rate:
            return
        if self.chains:
            self._burst_sampled.append(h)
        for s in self._shadows:
            s.access(h)
        self._sampled += 1
        if self._sampled % self.period == 0:
            self._decide()

    def _decide(self) -> None:
        """Adopt the share whose shadow hit most (ties keep the current one); decay the counts."""
        best = max(range(len(self.shares)),
                   key=lambda i: (self._shadows[i].hits, self.shares[i] == self.share))
        if self.shares[best] != self.share:
            self.share = self.shares[best]
            self._limit = int(self.share * self.capacity)
            self.switches += 1
        for s in self._shadows:
            s.hits *= DECAY

    # ---- chains -------------------------------------------------------------------------------------
    def _follow(self, key: bytes, parent: int | None) -> int:
        """Note an access to ``key`` (before it is placed), whose parent (the block before it in
        its chain, as a hash; 0 for none) is ``parent``, or None for a key never seen: the next
        block of the chain being walked, or the start of another (the last one is then reordered,
        :meth:`_flush`). The parent to remember for ``key``."""
        prev = self._prev
        if parent is None:
            parent = prev  # stored right after the block before it (or taken for so: harmless)
        elif parent != prev and self.chains:
            self._flush()
            for sh in self._shadows:
                sh.ok = True
        if self.chains:
            self._burst.append(key)
        self._prev = hash(key)
        return parent

    def _flush(self) -> None:
        """The chain walked last, made recent deepest first: its root is the most recent key, so
        eviction takes a chain from its end (a block is of use only with every block before it)."""
        burst = self._burst
        if len(burst) > 1:
            prob, prot = self._prob, self._prot
            for key in reversed(burst):
                if key in prot:
                    prot.move_to_end(key)
                elif key in prob:
                    prob.move_to_end(key)
            for h in reversed(self._burst_sampled):
                for s in self._shadows:
                    s.refresh(h)
        burst.clear()
        self._burst_sampled.clear()

    # ---- EvictionPolicy -------------------------------------------------------------------------
    def _protect(self, key: bytes) -> None:
        prot = self._prot
        prot[key] = None
        n = DEMOTE_STEP + 1
        while len(prot) > self._limit and n:
            self._prob[prot.popitem(last=False)[0]] = None
            n -= 1

    def insert(self, key: bytes) -> None:
        """A newly resident key: protected when it was evicted lately (a ghost), else on probation."""
        if key in self._prob or key in self._prot:
            self.touch(key)
            return
        h = hash(key)
        ghost = self._ghost.pop(h, None)
        self._parent[key] = self._follow(key, ghost)
        if ghost is not None:
            self._protect(key)
        else:
            self._prob[key] = None
        self._sample(key)

    def touch(self, key: bytes) -> None:
        """A use of a resident key: from probation to protected, or to protected's recent end."""
        if key in self._prot:
            self._follow(key, self._parent.get(key, 0))
            self._prot.move_to_end(key)
        elif key in self._prob:
            self._follow(key, self._parent.get(key, 0))
            del self._prob[key]
            self._protect(key)
        else:
            return
        self._sample(key)

    def touch_many(self, keys: Sequence[bytes]) -> None:
        """:meth:`touch` of each key, in order."""
        for key in keys:
            self.touch(key)

    def remove(self, key: bytes, evicted: bool = True) -> None:
        """Forget a key; an evicted one (not one freed on purpose) is remembered as a ghost."""
        if key in self._prob:
            del self._prob[key]
        elif key in self._prot:
            del self._prot[key]
        else:
            return
        parent = self._parent.pop(key, 0)
        if evicted:
            ghost = self._ghost
            ghost[hash(key)] = parent
            if len(ghost) > self._ghost_cap:
                ghost.popitem(last=False)

    def victim(self, can_evict: Callable[[bytes], bool]) -> bytes | None:
        """The key to evict next among those ``can_evict`` accepts, or None."""
        got = self.victims(1, can_evict)
        return got[0] if got else None

    def victims(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes]:
        """Up to ``n`` keys in eviction order: probation's least recently used first, then
        protected's (nothing moves until they are removed)."""
        out: list[bytes] = []
        if n <= 0:
            return out
        for seg in (self._prob, self._prot):
            for key in seg:
                if can_evict(key):
                    out.append(key)
                    if len(out) == n:
                        return out
        return out

    def __len__(self) -> int:
        return len(self._prob) + len(self._prot)

"""The ``slru`` eviction policy: segmented LRU with ghost admission, chains evicted from their end,
and a protected share it picks online (docs/traffic.md has the traces and figures behind it).

Keys enter a *probation* segment. A key used again while resident, or inserted again soon after
it was evicted (its hash is still in the *ghost* list), moves to the *protected* segment; a key
seen once, which on real LLM traffic is most keys (three in four blocks of Mooncake's conversation
trace are never used again), is evicted from probation without pushing out what was reused.
Protected holds at most ``share`` of the capacity; past it, its least recently used keys are
demoted to probation's recent end. Eviction takes probation's least recently used key first.

Chains: a request walks its prefix root first, so recency alone would evict a chain's root first
and keep the rest of it, useless (a block is of use only after every block before it). Each key's
parent is remembered (the key used right before it when it was first stored; the ghost keeps it
across an eviction); when an access does not follow its parent, the chain walked last is made
recent deepest first, so that it is evicted from its end. No call of the pool's tells the policy
where a request starts: a wrong guess only reorders recent keys.

No one share suits every workload: a small pool wants nearly all of it protected, a pool that holds
most of the working set wants plain LRU (``share`` 0 is LRU, exactly so with ``chains=False``). So
the policy runs a few key-only *shadow* caches, one per candidate share, over a sample of the keys
(a fixed hash picks one key in ``rate``; each shadow is ``rate`` times smaller), counts the prefix
hits each would have had (a hit counts while the chain's sampled blocks before it hit too), and every
``period`` sampled accesses adopts the share whose shadow did best, with older counts decayed. It
starts as LRU.

Every operation is O(1), amortized (a chain is reordered once, when the next one starts; the
shadows see one key in ``rate``); a change of share demotes at most :data:`DEMOTE_STEP` keys per
call, so no call stalls on a large pool. ``victims`` never changes the order. Memory: per resident
key two dict entries; the ghost holds about ``ghost_factor`` x capacity key hashes (2/3 to 4/3 of
it); the shadows about ``(1 + ghost_factor) * capacity * len(shares) / rate`` ints.
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


class _Ghost:
    """Recently evicted key hashes (each with a value), the last ``capacity`` of them or so (2/3 to
    4/3 of it): two plain dicts, the newer filled to 2/3, then the older one dropped (cheaper than an
    ordered dict trimmed one key at a time)."""

    __slots__ = ("half", "new", "old")

    def __init__(self, capacity: int) -> None:
        self.half = max(1, capacity * 2 // 3)
        self.new: dict[int, int] = {}
        self.old: dict[int, int] = {}

    def add(self, h: int, value: int) -> None:
        new = self.new
        new[h] = value
        if len(new) >= self.half:
            self.old, self.new = new, {}

    def pop(self, h: int) -> int | None:
        """The value of ``h`` (forgotten now), or None when it is not remembered."""
        v = self.new.pop(h, None)
        return self.old.pop(h, None) if v is None else v

    def __len__(self) -> int:
        return len(self.new) + len(self.old)


class _Shadow:
    """A key-only segmented LRU of one protected share: what the real cache would hit with it."""

    __slots__ = ("capacity", "chains", "ghost", "hits", "limit", "ok", "prob", "prot")

    def __init__(self, capacity: int, share: float, ghost_factor: int, chains: bool = True) -> None:
        self.capacity = max(1, capacity)
        self.limit = int(share * self.capacity)
        self.prob: OrderedDict[int, None] = OrderedDict()
        self.prot: OrderedDict[int, None] = OrderedDict()
        self.ghost = _Ghost(ghost_factor * self.capacity)
        self.hits = 0.0
        #: whether every sampled block of the chain being walked was a hit so far
        self.ok = True
        #: count only hits whose chain hit before them (else every hit)
        self.chains = chains

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
        self.ok = not self.chains
        if len(prob) + len(prot) >= self.capacity:
            v = prob.popitem(last=False)[0] if prob else prot.popitem(last=False)[0]
            self.ghost.add(v, 0)
        if self.ghost.pop(h) is not None:
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
        self._ghost = _Ghost(ghost_factor * self.capacity)
        self.rate = rate or max(1, min(16, self.capacity // 256))
        self._shadows = [_Shadow(self.capacity // self.rate, s, ghost_factor, chains) for s in self.shares]
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
    def _new_chain(self) -> None:
        """An access that does not follow the last one in its chain: the chain walked last is
        done. It is made recent deepest first, so that its root is its most recent key and eviction
        takes a chain from its end (a block is of use only with every block before it)."""
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
        for s in self._shadows:
            s.ok = True

    def _shadow(self, c: int) -> None:
        """An access of sampled key ``c`` (its crc32) for the shadows."""
        if self.chains:
            self._burst_sampled.append(c)
        for s in self._shadows:
            s.access(c)
        self._sampled += 1
        if self._sampled % self.period == 0:
            self._decide()

    # ---- EvictionPolicy -------------------------------------------------------------------------
    def _protect(self, key: bytes) -> None:
        prot = self._prot
        prot[key] = None
        n = DEMOTE_STEP + 1
        while len(prot) > self._limit and n:
            self._prob[prot.popitem(last=False)[0]] = None
            n -= 1

    def insert(self, key: bytes) -> None:
        """A newly resident key: protected when it was evicted lately (a ghost), else on probation.

        Its parent (the block before it in its chain) is remembered: the ghost's record of it, or
        for a key never seen the key used last (a block is stored right after the one before it;
        a request that found nothing at all is taken for the next part of the chain before it,
        which is harmless)."""
        if key in self._parent:
            self.touch(key)
            return
        h = hash(key)
        parent = self._ghost.pop(h)
        if parent is None:
            self._parent[key] = self._prev
            self._prob[key] = None
        else:
            if parent != self._prev and self.chains:
                self._new_chain()
            self._parent[key] = parent
            self._protect(key)
        if self.chains:
            self._burst.append(key)
        self._prev = h
        c = zlib.crc32(key)
        if not c % self.rate:
            self._shadow(c)

    def touch(self, key: bytes) -> None:
        """A use of a resident key: from probation to protected, or to protected's recent end."""
        parent = self._parent.get(key)
        if parent is None:
            return
        if self.chains:
            if parent != self._prev:
                self._new_chain()
            self._burst.append(key)
        self._prev = hash(key)
        if key in self._prot:
            self._prot.move_to_end(key)
        else:
            del self._prob[key]
            self._protect(key)
        c = zlib.crc32(key)
        if not c % self.rate:
            self._shadow(c)

    def touch_many(self, keys: Sequence[bytes]) -> None:
        """:meth:`touch` of each key, in order (the same steps, with the lookups hoisted: a ``get``
        touches every block it copies)."""
        parents, prot, prob = self._parent, self._prot, self._prob
        chains, burst, rate, crc32 = self.chains, self._burst, self.rate, zlib.crc32
        for key in keys:
            parent = parents.get(key)
            if parent is None:
                continue
            if chains:
                if parent != self._prev:
                    self._new_chain()
                burst.append(key)
            self._prev = hash(key)
            if key in prot:
                prot.move_to_end(key)
            else:
                del prob[key]
                self._protect(key)
            c = crc32(key)
            if not c % rate:
                self._shadow(c)

    def remove(self, key: bytes, evicted: bool = True) -> None:
        """Forget a key; an evicted one (not one freed on purpose) is remembered as a ghost."""
        parent = self._parent.pop(key, None)
        if parent is None:
            return
        if key in self._prob:
            del self._prob[key]
        else:
            del self._prot[key]
        if evicted:
            self._ghost.add(hash(key), parent)

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

"""Eviction policies over keys: LRU, ARC and SLRU (:mod:`tierkv.blocks.segmented`, the default).

A policy orders the keys resident in one pool. It never decides alone what may go: ``victim`` takes
a predicate, and pinned or in-flight slots are simply never offered.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from tierkv.blocks.segmented import SLRUPolicy
from tierkv.errors import ConfigError

__all__ = ["DEFAULT_POLICY", "POLICIES", "ARCPolicy", "EvictionPolicy", "LRUPolicy", "SLRUPolicy",
           "make_policy"]

#: the policies :func:`make_policy` knows, and the one stores use unless told otherwise
POLICIES = ("slru", "lru", "arc")
DEFAULT_POLICY = "slru"


class EvictionPolicy(Protocol):
    """What a pool needs from an eviction policy."""

    def insert(self, key: bytes) -> None:
        """Record a newly resident key."""

    def touch(self, key: bytes) -> None:
        """Record a use of a resident key."""

    def touch_many(self, keys: Sequence[bytes]) -> None:
        """:meth:`touch` of each key, in order."""

    def remove(self, key: bytes, evicted: bool = True) -> None:
        """Forget a key that left the pool: evicted, or freed on purpose (``evicted=False``)."""

    def victim(self, can_evict: Callable[[bytes], bool]) -> bytes | None:
        """The key to evict next among those ``can_evict`` accepts, or None."""

    def victims(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes]:
        """Up to ``n`` keys to evict, in eviction order (fewer when fewer may go)."""

    def __len__(self) -> int: ...


class LRUPolicy:
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes) -> None:
        """Record a newly resident key as most recently used."""
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: bytes) -> None:
        """Move a resident key to the most recently used end."""
        if key in self._order:
            self._order.move_to_end(key)

    def touch_many(self, keys: Sequence[bytes]) -> None:
        """:meth:`touch` of each key, in order."""
        order = self._order
        for key in keys:
            if key in order:
                order.move_to_end(key)

    def remove(self, key: bytes, evicted: bool = True) -> None:
        """Forget a key."""
        self._order.pop(key, None)

    def victim(self, can_evict: Callable[[bytes], bool]) -> bytes | None:
        """The least recently used key that may be evicted."""
        for key in self._order:
            if can_evict(key):
                return key
        return None

    def victims(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes]:
        """The ``n`` least recently used keys that may be evicted (fewer when fewer may go)."""
        out: list[bytes] = []
        for key in self._order:
            if can_evict(key):
                out.append(key)
                if len(out) == n:
                    break
        return out

    def __len__(self) -> int:
        return len(self._order)


class ARCPolicy:
    """Adaptive Replacement Cache (Megiddo and Modha): balances recency and frequency.

    ``T1`` holds keys seen once, ``T2`` keys seen again; the ghost lists ``B1``/``B2`` remember
    recently evicted keys and move the target size ``p`` of ``T1`` toward whichever list would
    have kept a key that came back.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.p = 0.0
        self._t1: OrderedDict[bytes, None] = OrderedDict()
        self._t2: OrderedDict[bytes, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes) -> None:
        """Record a newly resident key, adapting ``p`` if it was a ghost."""
        c = self.capacity
        if key in self._b1:
            self.p = min(float(c), self.p + max(1.0, len(self._b2) / max(1, len(self._b1))))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self.p = max(0.0, self.p - max(1.0, len(self._b1) / max(1, len(self._b2))))
            del self._b2[key]
            self._t2[key] = None
        elif key in self._t1 or key in self._t2:
            self.touch(key)
        else:
            self._t1[key] = None
        self._trim_ghosts()

    def touch_many(self, keys: Sequence[bytes]) -> None:
        """:meth:`touch` of each key, in order."""
        for key in keys:
            self.touch(key)

    def touch(self, key: bytes) -> None:
        """A hit: the key moves to the frequent list."""
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, key: bytes, evicted: bool = True) -> None:
        """Forget a resident key; an evicted one (not one freed on purpose) is kept as a ghost."""
        if key in self._t1:
            del self._t1[key]
            if evicted:
                self._b1[key] = None
        elif key in self._t2:
            del self._t2[key]
            if evicted:
                self._b2[key] = None
        self._trim_ghosts()

    def victim(self, can_evict: Callable[[bytes], bool]) -> bytes | None:
        """From ``T1`` while it is above its target ``p``, else from ``T2``; skip what cannot go."""
        first, second = (self._t1, self._t2) if len(self._t1) > self.p else (self._t2, self._t1)
        for lst in (first, second):
            for key in lst:
                if can_evict(key):
                    return key
        return None

    def victims(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes]:
        """What ``n`` calls of :meth:`victim` would pick (nothing moves until they are removed)."""
        first, second = (self._t1, self._t2) if len(self._t1) > self.p else (self._t2, self._t1)
        out: list[bytes] = []
        for lst in (first, second):
            for key in lst:
                if can_evict(key):
                    out.append(key)
                    if len(out) == n:
                        return out
        return out

    def _trim_ghosts(self) -> None:
        c = self.capacity
        while len(self._b1) > c:
            self._b1.popitem(last=False)
        while len(self._b2) > c:
            self._b2.popitem(last=False)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """A policy by name: ``"slru"`` (the default), ``"lru"`` or ``"arc"``; ``capacity`` is the
    pool's slot count."""
    if name == "slru":
        return SLRUPolicy(capacity)
    if name == "lru":
        return LRUPolicy()
    if name == "arc":
        return ARCPolicy(capacity)
    raise ConfigError(f"unknown eviction policy {name!r}: choose one of {', '.join(map(repr, POLICIES))}")

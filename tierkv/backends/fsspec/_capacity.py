"""Capacity of a persistent tier: what it holds, in eviction order, across every node that shares it.

Several processes (serving nodes) may share one directory or bucket, each with its own store. No
node sees the others' writes, so each bounds the tier from a :class:`Ledger` it rebuilds from a
listing of the namespace: at start, periodically, and as soon as it has written a share of the
capacity since the last listing. Records are ordered by their modification time, the last write
or *touch* (a read refreshes a record's time at most once per ``touch_after_s``: ``os.utime`` on
a file system, an in-place copy on S3), so the order approximates a global LRU that needs no
atime (S3 has none; NFS often updates it once a day) and no coordination: every node evicts the
oldest records first, and deleting a record another node just deleted is harmless.

Bound (docs/tiers.md): once writers are quiet and one of them has listed the tier, the bytes held
are at most ``capacity_bytes``; while they write, at most ``capacity_bytes`` plus what each node
wrote since its last listing (``rescan_fraction`` of the capacity per node), plus records in
flight.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

__all__ = ["Ledger"]


class Ledger:
    """Records a tier holds (path -> size), least recently used first, and what to do about them.

    Pure state: the tier lists, deletes and touches; the ledger decides what.
    """

    def __init__(self, capacity: int | None, touch_after_s: float, rescan_fraction: float) -> None:
        self.capacity = capacity
        self.touch_after_s = touch_after_s
        self.rescan_bytes = int(capacity * rescan_fraction) if capacity is not None else 0
        self._order: OrderedDict[str, int] = OrderedDict()
        #: when each record was last written or touched (listing time, or this node's clock)
        self._mtime: dict[str, float] = {}
        self.used = 0
        #: bytes this node wrote since it last listed the tier
        self.written = 0
        #: records this node deleted since its last listing (a listing running meanwhile may still
        #: show them)
        self._deleted: set[str] = set()

    def __contains__(self, path: object) -> bool:
        return path in self._order

    def __len__(self) -> int:
        return len(self._order)

    def wrote(self, path: str, size: int, now: float) -> None:
        """This node wrote ``path``: the most recently used record."""
        self._put(path, size, now)
        self.written += size

    def read(self, path: str, size: int, now: float) -> bool:
        """This node read ``path`` (``size`` bytes): it moves to the recent end. True when its
        time on storage should be refreshed too (older than ``touch_after_s``)."""
        last = self._mtime.get(path)
        self._put(path, size, now if last is None or now - last >= self.touch_after_s else last)
        return last is None or now - last >= self.touch_after_s

    def read_many(self, paths: list[str], sizes: list[int], now: float) -> tuple[bool, list[str]]:
        """:meth:`read` of many records: whether any was not known yet (another node's, say), and
        the paths whose time on storage should be refreshed."""
        order, mtime, after = self._order, self._mtime, self.touch_after_s
        learned = False
        touch = []
        for path, size in zip(paths, sizes, strict=True):
            old = order.get(path)
            if old == size:
                order.move_to_end(path)
            else:
                if old is None:
                    learned = True
                else:
                    self.used -= old
                    del order[path]
                order[path] = size
                self.used += size
            last = mtime.get(path)
            if last is None or now - last >= after:
                mtime[path] = now
                touch.append(path)
        if self._deleted:
            self._deleted.difference_update(paths)
        return learned, touch

    def _put(self, path: str, size: int, mtime: float) -> None:
        self._deleted.discard(path)
        old = self._order.pop(path, None)
        if old is not None:
            self.used -= old
        self._order[path] = size
        self._mtime[path] = mtime
        self.used += size

    def forget(self, path: str) -> None:
        """``path`` is gone (deleted, found missing, corrupt)."""
        self._deleted.add(path)
        old = self._order.pop(path, None)
        self._mtime.pop(path, None)
        if old is not None:
            self.used -= old

    def victims(self) -> list[str]:
        """The oldest records to delete so that what is held fits the capacity (forgotten now)."""
        out: list[str] = []
        if self.capacity is None:
            return out
        while self.used > self.capacity and self._order:
            path, size = self._order.popitem(last=False)
            self._mtime.pop(path, None)
            self._deleted.add(path)
            self.used -= size
            out.append(path)
        return out

    def rebuild(self, records: Iterable[tuple[float, str, int]], listed_at: float,
                written_before: int = 0) -> tuple[int, list[str]]:
        """Replace what is known by a listing ``(mtime, path, size)`` that started at ``listed_at``,
        when this node had written ``written_before`` bytes since its previous listing.

        Records this node wrote or read while the listing ran keep their recent place (and stay,
        when the listing missed them), and what it wrote meanwhile still counts towards its next
        listing. Returns how many records the listing had, and the records known before that it no
        longer has (another process removed them).
        """
        during = [(p, s, t) for p, s in self._order.items() if (t := self._mtime.get(p, 0.0)) >= listed_at]
        # Every node sharing the tier must agree on the order, or nodes evicting at once each take
        # different records and together take far more than the excess: only what every node
        # sees (the storage's time, then the name where times tie) orders what the listing has.
        listed = sorted((t, path, size) for t, path, size in records)
        order: OrderedDict[str, int] = OrderedDict()
        mtime: dict[str, float] = {}
        n = 0
        for t, path, size in listed:
            if path in self._deleted:
                continue
            order[path] = size
            mtime[path] = t
            n += 1
        for path, size, t in during:
            order.pop(path, None)
            order[path] = size
            mtime[path] = t
        gone = [p for p in self._order if p not in order]
        self._deleted.clear()
        self._order, self._mtime = order, mtime
        self.used = sum(order.values())
        self.written = max(0, self.written - written_before)
        return n, gone

    def wants_listing(self) -> bool:
        """True when this node wrote enough since its last listing that the others' writes (and its
        own view of the total) should be looked at again."""
        return self.capacity is not None and self.written >= max(1, self.rescan_bytes)

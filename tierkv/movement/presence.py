"""What a gateway knows of which keys its lower tier holds: answers cached from probes, stores,
loads and listings (found for ``presence_ttl_s``, not found for ``negative_ttl_s``), asked of the
tier itself where it answers from memory."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from tierkv.backends.base import Tier

__all__ = ["PRESENCE_CACHE_ENTRIES", "Presence"]

PRESENCE_CACHE_ENTRIES = 1 << 20
#: a listing's keys are noted this many at a time (lookups wait for none of it long)
LISTED_SLICE = 4096


class Presence:
    """The presence answers of one lower tier; ``up()`` says whether it answers at all (a tier
    that is down holds nothing, for lookups)."""

    def __init__(self, tier: Tier, lock: threading.RLock, up: Callable[[], bool]) -> None:
        self.tier = tier
        self.cfg = tier.config
        self._lock = lock
        self.up = up
        self._cache: OrderedDict[bytes, tuple[bool, float]] = OrderedDict()
        #: keys whose presence is being probed now
        self.probing: set[bytes] = set()
        #: bumped whenever what is known of presence changes (lookups re-answer then)
        self.version = 0

    def changed(self) -> None:
        """Something about presence changed (the tier went down or came back)."""
        self.version += 1

    @property
    def fast(self) -> bool:
        """True when the tier answers presence from memory, without I/O."""
        return self.tier.capabilities.fast_contains

    def presence(self, group: int, key: bytes, now: float) -> bool | None:
        """True / False when known, None when a probe is needed (False while the tier is down)."""
        if not self.up():
            return False
        entry = self._cache.get(key)
        if entry is not None and entry[1] < now:
            del self._cache[key]
            entry = None
        if entry is None or (self.fast and entry[0]):
            # a tier that is not fast may still know from memory (a file tier's complete ledger)
            ans = self.tier.contains_nowait(group, [key])
            return None if ans is None else ans[0]
        return entry[0]

    def presence_many(self, group: int, keys: list[bytes], now: float) -> list[bool | None]:
        """:meth:`presence` of many keys."""
        if not self.up():
            return [False] * len(keys)
        cache = self._cache
        get = cache.get
        out: list[bool | None] = []
        if self.fast:
            ans = self.tier.contains_nowait(group, keys)
            for j, k in enumerate(keys):
                e = get(k)
                if e is not None and e[1] >= now and not e[0]:
                    out.append(False)  # a read of it failed just now
                else:
                    out.append(None if ans is None else ans[j])
            return out
        unknown: list[int] = []
        for k in keys:
            e = get(k)
            if e is None:
                unknown.append(len(out))
                out.append(None)
            elif e[1] < now:
                del cache[k]
                unknown.append(len(out))
                out.append(None)
            else:
                out.append(e[0])
        if unknown:
            # a tier that is not fast may still know from memory (a file tier's complete ledger)
            ans = self.tier.contains_nowait(group, [keys[i] for i in unknown])
            if ans is not None:
                for i, a in zip(unknown, ans, strict=True):
                    out[i] = a
        return out

    def note(self, key: bytes, present: bool, now: float | None = None) -> None:
        """Remember what a probe, a store or a load told about ``key``.

        A tier that answers presence from memory needs only the negative answers: a read that
        failed keeps the key a MISS for ``negative_ttl_s`` instead of promoting it again and again.
        """
        self.version += 1
        if self.fast and present:
            self._cache.pop(key, None)
            return
        now = time.monotonic() if now is None else now
        ttl = self.cfg.presence_ttl_s if present else self.cfg.negative_ttl_s
        self._cache[key] = (present, now + ttl)
        self._cache.move_to_end(key)
        while len(self._cache) > PRESENCE_CACHE_ENTRIES:
            self._cache.popitem(last=False)

    def note_many(self, keys: Sequence[bytes], present: Sequence[bool], now: float) -> None:
        """:meth:`note` of many keys at once (what a load or a store of a batch told)."""
        self.version += 1
        cache = self._cache
        cfg = self.cfg
        absent = (False, now + cfg.negative_ttl_s)
        if self.fast:
            for k, f in zip(keys, present, strict=True):
                cache.pop(k, None)
                if not f:
                    cache[k] = absent
        else:
            found = (True, now + cfg.presence_ttl_s)
            for k, f in zip(keys, present, strict=True):
                cache.pop(k, None)  # re-inserted: the most recent end
                cache[k] = found if f else absent
        while len(cache) > PRESENCE_CACHE_ENTRIES:
            cache.popitem(last=False)

    def on_tier_event(self, event: str, keys: list[bytes]) -> None:
        """A listing's keys are present (no probe before their first read); removed keys are
        forgotten (the next lookup probes again). In slices: lookups wait for none of it long."""
        if event not in ("listed", "removed"):
            return
        for i in range(0, len(keys), LISTED_SLICE):
            part = keys[i:i + LISTED_SLICE]
            with self._lock:
                if event == "listed":
                    self.note_many(part, [True] * len(part), time.monotonic())
                else:
                    for k in part:
                        self.forget(k)

    def forget(self, key: bytes) -> None:
        """Drop a cached presence answer."""
        self.version += 1
        self._cache.pop(key, None)

"""A :class:`~tierkv.TieredStore` on its own event loop thread, with the blocking calls SGLang's
storage threads (prefetch, prefetch I/O, backup) need.

Lookups go straight to the store (they are synchronous and thread-safe); reads and writes run on
the store's loop through :class:`~tierkv.bridge.LoopThread`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tierkv import BlockMissing, StoreStats, TieredStore, make_key
from tierkv.adapter import KeyState, LoopThread, daemon_pool_rows
from tierkv.adapters.sglang.pages import Rows

__all__ = ["Fill", "StoreRunner"]

#: ``fill(positions, rows)``: write the blocks at ``positions`` (of a call's keys) into ``rows``
Fill = Callable[[list[int], Rows], None]

#: keys asked of the store per lookup call, at most (each call's promotions must fit the group's
#: pool); one call probes them together and admits their promotions as one load, which lands batch
#: by batch (cutting calls smaller made every call wait for its own probes: 32 round trips for a
#: 128-page span of 2 MiB pages, which halved read throughput)
LOOKUP_CHUNK = 128
_POLL_START_S = 0.0005
_POLL_MAX_S = 0.01


class StoreRunner:
    """Owns the loop thread and the store; every method blocks the calling thread only."""

    def __init__(self, store_config: dict[str, Any]) -> None:
        self._loop, self.store = LoopThread.running(TieredStore(store_config))
        #: through a daemon: its pool may change (a restart), so rows are found per reservation, and
        #: reads copy out with ``get`` (no lending of the daemon's rows)
        self._daemon = self.store.config.daemon is not None
        groups = self.store.stats().groups
        self._chunk = {g.group: max(1, min(LOOKUP_CHUNK, g.slots // 2)) for g in groups}
        self._pool_rows = {} if self._daemon else _pool_tensors(self.store)
        self._pool_np = {g: t.numpy() for g, t in self._pool_rows.items()}
        self._closed = False

    def put(self, group: int, hashes: Sequence[bytes], rows: torch.Tensor) -> None:
        """Store ``rows[i]`` as block ``hashes[i]``; returns once they are in the CPU pool."""
        self._loop.call(self.store.put, group, hashes, rows)

    def write(self, group: int, hashes: Sequence[bytes], fill: Fill,
              staging: Callable[[], torch.Tensor]) -> None:
        """Store blocks ``hashes``: ``fill(positions, rows)`` writes block ``hashes[positions[j]]`` into
        ``rows[j]``. Returns once they are in the CPU pool (lower tiers are written in the background).

        The rows are reserved slots of the CPU pool itself (blocks already held are skipped), so a
        page is copied once; when the pool has no room now, they are ``staging()`` rows and the
        store takes a copy.
        """
        if self._daemon or group in self._pool_rows:
            engine = self.store.engine
            keys = [make_key(h, group) for h in hashes]
            res = engine.reserve(group, keys)
            pool = self._rows_of(res.pool, group) if res is not None else None
            if res is not None and pool is None:
                engine.commit(group, [k for k, s in zip(keys, res.slots, strict=True) if s is not None],
                              success=False)
            elif res is not None and pool is not None:
                pos = [i for i, slot in enumerate(res.slots) if slot is not None]
                new = [keys[i] for i in pos]
                try:
                    fill(pos, [pool[res.slots[i]] for i in pos])
                except BaseException:
                    engine.commit(group, new, success=False)
                    raise
                engine.commit(group, new)
                return
        rows = staging()
        fill(list(range(len(hashes))), rows)
        self.put(group, hashes, rows)

    def _rows_of(self, pool_id: str, group: int) -> torch.Tensor | None:
        """Group ``group``'s rows of the pool a reservation names (None: not mapped here)."""
        if not self._daemon:
            return self._pool_rows.get(group)
        rows = daemon_pool_rows(pool_id)
        return rows.get(group) if rows is not None else None

    def get(self, group: int, hashes: Sequence[bytes], rows: torch.Tensor) -> list[bool]:
        """Read the blocks into ``rows``; per block, whether it was read (and verified)."""
        try:
            self._loop.call(self.store.get, group, hashes, rows)
        except BlockMissing as exc:
            ok = [True] * len(hashes)
            for i in exc.missing:
                ok[i] = False
            return ok
        return [True] * len(hashes)

    def read(self, group: int, hashes: Sequence[bytes], use: Callable[[Rows, list[bool]], None],
             staging: Callable[[], torch.Tensor]) -> list[bool]:
        """Hand the blocks' rows to ``use(rows, ok)``; per block, whether it was read (and verified).

        When every block is in the CPU pool (or on its way there: ``batch_exists`` promotes what it
        finds), ``rows`` are the pool's own rows, pinned while ``use`` runs (blocks all ready: on
        this thread, without a round trip to the store's loop); otherwise the blocks are read
        into ``staging()`` (from the pool where they are, straight from a lower tier where not).
        """
        pool = self._pool_np.get(group)
        if pool is not None:
            with self.store.lend_slots(group, hashes) as slots:
                if slots is not None:
                    ok = [True] * len(hashes)
                    use([pool[s] for s in slots], ok)
                    return ok
        if not self._daemon:
            try:
                return self._loop.call(self._use_borrowed, group, hashes, use)
            except BlockMissing:
                pass
        rows = staging()
        ok = self.get(group, hashes, rows)
        use(rows, ok)
        return ok

    async def _use_borrowed(self, group: int, hashes: Sequence[bytes],
                            use: Callable[[Rows, list[bool]], None]) -> list[bool]:
        # ``use`` runs on the loop thread: one round trip instead of two, and it is a short copy
        async with self.store.borrow(group, hashes) as rows:
            ok = [True] * len(hashes)
            use(rows, ok)
            return ok

    def present(self, group: int, hashes: Sequence[bytes], timeout_s: float,
                stop_at_miss: bool) -> tuple[list[bool], int]:
        """Whether each block is held by some tier, waiting up to ``timeout_s`` for presence probes.

        With ``stop_at_miss`` the answer past the first absent block is False without asking.
        Blocks found on a lower tier start moving into the CPU pool now (tierkv's lookups promote).
        Returns the answers and how many blocks were still unknown when the time ran out (False).
        """
        n = len(hashes)
        out = [False] * n
        deadline = time.monotonic() + timeout_s
        chunk = self._chunk.get(group, 1)
        timed_out = 0
        for lo in range(0, n, chunk):
            todo = list(range(lo, min(n, lo + chunk)))
            delay = _POLL_START_S
            first_miss = n
            while True:
                states = self.store.lookup_states(group, [hashes[i] for i in todo])
                waiting = []
                for i, st in zip(todo, states, strict=True):
                    if st is KeyState.PROBING:
                        waiting.append(i)
                    elif st is KeyState.MISS:
                        first_miss = min(first_miss, i)
                    else:
                        out[i] = True
                if stop_at_miss:
                    waiting = [i for i in waiting if i < first_miss]
                if not waiting:
                    break
                if time.monotonic() >= deadline:
                    timed_out += len(waiting)
                    first_miss = min(first_miss, waiting[0])
                    break
                time.sleep(delay)
                delay = min(2 * delay, _POLL_MAX_S)
                todo = waiting
            if stop_at_miss and first_miss < n:
                for i in range(first_miss, n):
                    out[i] = False
                break
        return out, timed_out

    def flush(self) -> None:
        """Wait until every write to the lower tiers has finished (or failed, counted)."""
        self._loop.call(self.store.flush)

    def stats(self) -> StoreStats:
        """The store's counters (``TieredStore.stats()``)."""
        return self.store.stats()

    def clear(self) -> int:
        """Empty the CPU pool (lower tiers keep their blocks); how many blocks were dropped."""
        return self.store.engine.clear()

    def close(self) -> None:
        """Finish writes to the lower tiers, close the store and stop the loop thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._loop.stop()


def _pool_tensors(store: TieredStore) -> dict[int, torch.Tensor]:
    """The CPU pool's ``[slots, block_bytes]`` tensor per group, for writes into reserved slots
    (a device pool's are left out: every write to it goes through ``put``)."""
    return {g: t for g, t in store.engine.pool_rows().items() if t.device.type == "cpu"}

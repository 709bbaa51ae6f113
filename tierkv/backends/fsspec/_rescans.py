"""When a file tier lists its namespace: once after it opens (unless told not to), then, with a
capacity, every ``rescan_s`` or sooner when asked (this process wrote a share of the capacity),
each time only once the reads in flight have paused: a listing is CPU work that would slow a
restore in progress, and it can wait (at most :data:`~tierkv.backends.fsspec._driver.PAUSE_MAX_S`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio

from tierkv.backends.fsspec._driver import PAUSE_MAX_S, PAUSE_STEP_S

__all__ = ["Rescans"]


class Rescans:
    """The tier's listing schedule, and the count of reads a listing gives way to."""

    def __init__(self, first: bool, every_s: float | None) -> None:
        self._first = first
        self._every_s = every_s
        #: set once the first listing is over (or skipped)
        self.done = anyio.Event()
        self._now = anyio.Event()
        #: ``get`` calls in flight
        self.reading = 0

    def busy(self) -> bool:
        """Whether reads are in flight (a listing under way pauses between directories)."""
        return self.reading > 0

    def soon(self) -> None:
        """List again without waiting out ``every_s``."""
        self._now.set()

    async def run(self, scan: Callable[[], Awaitable[None]]) -> None:
        """Run ``scan`` on this schedule (forever, with ``every_s``)."""
        if self._first:
            await self._quiet()
            await scan()
        self.done.set()
        if not self._every_s:
            return
        while True:
            with anyio.move_on_after(self._every_s):
                await self._now.wait()
            self._now = anyio.Event()
            await self._quiet()
            await scan()

    async def _quiet(self) -> None:
        with anyio.move_on_after(PAUSE_MAX_S):
            while self.busy():
                await anyio.sleep(PAUSE_STEP_S)

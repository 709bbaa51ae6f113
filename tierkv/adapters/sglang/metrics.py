"""Per-operation observations in the form SGLang's storage metrics take, and the adapter's counters.

SGLang's scheduler asks ``get_stats()`` for a ``StorageMetrics``
(``sglang.srt.observability.metrics_collector``): lists of pages per prefetch / backup operation
and their bandwidth in GB/s, each one histogram observation. Like SGLang's own backends, the lists
hold what happened since the previous call.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

__all__ = ["OpMetrics"]


class OpMetrics:
    """Observations of reads (prefetch) and writes (backup), plus failure counters."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._lock = threading.Lock()
        self._lists: dict[str, list[Any]] = {"prefetch_pgs": [], "backup_pgs": [],
                                             "prefetch_bandwidth": [], "backup_bandwidth": []}
        #: cumulative counters (pages read, written, failed; calls that raised inside tierkv; ...)
        self.counters: Counter[str] = Counter()

    def observe(self, op: str, pages: int, nbytes: int, started: float) -> None:
        """One ``prefetch`` or ``backup`` operation of ``pages`` pages (``nbytes``), begun at ``started``
        (a ``time.perf_counter()`` value)."""
        elapsed = max(time.perf_counter() - started, 1e-9)
        with self._lock:
            self.counters[f"{op}_pages"] += pages
            self.counters[f"{op}_bytes"] += nbytes
            if self.enabled:
                self._lists[f"{op}_pgs"].append(pages)
                self._lists[f"{op}_bandwidth"].append(nbytes / elapsed / 1e9)

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name``."""
        with self._lock:
            self.counters[name] += n

    def drain(self) -> dict[str, list[Any]]:
        """The observations since the last call (then forgotten)."""
        with self._lock:
            out = {k: list(v) for k, v in self._lists.items()}
            for v in self._lists.values():
                v.clear()
        return out

    def storage_metrics(self) -> Any:
        """The observations since the last call as SGLang's ``StorageMetrics``."""
        from sglang.srt.observability.metrics_collector import (  # type: ignore[import-not-found,unused-ignore]
            StorageMetrics,
        )

        return StorageMetrics(**self.drain())

"""Types of the C module built from tierkv/records/_batchio.c (tierkv.records.batchio documents it)."""

from collections.abc import Sequence
from typing import Any

ALIGN: int
CACHESTAT: int
CHUNK_BYTES: int

def read_batch(paths: Sequence[Any], bufs: Sequence[Any], direct: bool = ...,
               nowait: bool = ...) -> list[int]: ...
def write_batch(items: Sequence[tuple[Any, Any, Any]], fsync: bool = ..., mode: int = ..., direct: bool = ...,
                direct_min: int = ..., dir_mode: int | None = ...) -> tuple[list[int], int, int]: ...

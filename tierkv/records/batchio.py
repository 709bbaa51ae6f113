"""Batch record I/O for local (or mounted) files: many records read into, or written from, the
caller's buffers in one call.

Two implementations with one API and the same results: the C module ``tierkv.records._batchio`` (built by
pip from tierkv/records/_batchio.c with the system C compiler; it makes the system calls of a whole batch
with the GIL released, on the caller's thread: the tier's own I/O threads each call it) and
the pure-Python :mod:`tierkv.records._batchio_py`, used where the C module could not be built or
when the environment sets ``TIERKV_NATIVE=0``. :func:`active` says which one this process uses.

Per item, a result is a byte count (>= 0) or ``-errno``:

``read_batch(paths, bufs, direct=False, nowait=False)``
    Each path is opened read-only, never following a symlink (``-ELOOP``) and without blocking on
    a FIFO; anything but a regular file is ``-ESPIPE``; a missing file ``-ENOENT``. Its bytes fill
    the item's buffers (one writable buffer, or a list of them filled in order, as a scatter read
    of header, row and trailer) until they are full or the file ends: the result is the bytes
    read, less than the buffers hold when the file is shorter (add a spare byte to see that a
    file is longer). ``nowait``: only what the page cache holds (``RWF_NOWAIT``): ``-EAGAIN`` when
    the device would have to be waited for (the buffers may hold part of the record; read it
    again without ``nowait``), ``-EOPNOTSUPP`` when the file system refuses such reads (tmpfs,
    FUSE). ``direct``: ``O_DIRECT`` reads through an aligned scratch buffer (any buffer, any file
    length; ``nowait`` does not apply), buffered where the file system refuses it. A read-only
    buffer is a ``TypeError`` before anything is read.

``write_batch(items, fsync=False, mode=0o600, direct=False, direct_min=65536, dir_mode=None)``
    Each item ``(final_path, tmp_path, buffers)`` is published atomically, as the local tier's
    Python path does: the buffers are written to the new file ``tmp_path`` (``O_EXCL``, ``mode``,
    widened with ``fchmod`` past the umask when not 0o600; ``None`` here: a :func:`temp_name`
    beside ``final_path``), fsynced with ``fsync``, then renamed over ``final_path`` (and its
    directory fsynced with ``fsync``). A missing directory is created with its parents
    (``dir_mode``, by default ``mode`` with the matching search bits). Records of at least
    ``direct_min`` bytes are written with ``O_DIRECT`` when ``direct``: whole 4 KiB blocks from an
    aligned scratch buffer, the rest buffered (the record format does not change); where the file
    system refuses ``O_DIRECT`` the record is written buffered. On any error the temporary file
    is removed and no file appears at ``final_path``. Returns ``(sizes, direct_writes,
    direct_refused)``.

Checksums stay with the caller (tierkv/records/format.py): xxh3_64 of a MiB costs about 18 us, and the
streaming ``xxhash.xxh3_64().update`` releases the GIL while it hashes (docs/performance-history.md,
"Native batch I/O").
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from tierkv.records import _batchio_py as batchio_py
from tierkv.records._batchio_py import has_cachestat, page_cached
from tierkv.records.tempnames import temp_name

__all__ = ["active", "has_cachestat", "implementation", "native", "native_error", "page_cached", "read_batch",
           "write_batch"]

#: the environment variable that forces the pure-Python fallback when set to 0
ENV = "TIERKV_NATIVE"

_native: ModuleType | None
_native_error: str | None
try:
    from tierkv.records import _batchio as _native
    _native_error = None
except ImportError as exc:  # not built: no compiler where the package was installed
    _native = None
    _native_error = f"tierkv.records._batchio is not built ({exc})"


def native_error() -> str | None:
    """Why the C module cannot be used in this process (None when it can)."""
    return _native_error


def _chosen() -> ModuleType:
    if _native is not None and os.environ.get(ENV, "1") != "0":
        return _native
    return batchio_py


def native() -> ModuleType | None:
    """The C module when this process uses it, else None (callers keep their own Python path)."""
    return _native if _chosen() is _native else None


def active() -> str:
    """``"native"`` (the C module) or ``"python"`` (the fallback), with the reason for the fallback:
    what ``tierkv inspect`` and the stats show."""
    if _chosen() is _native:
        return "native"
    why = f"{ENV}=0" if _native is not None else _native_error
    return f"python ({why})"


def implementation(name: str | None = None) -> ModuleType:
    """The module doing the work: ``"native"``, ``"python"``, or (None) the one :func:`active` names.
    Raises ``ImportError`` for ``"native"`` when it is not built."""
    if name is None:
        return _chosen()
    if name == "python":
        return batchio_py
    if name == "native":
        if _native is None:
            raise ImportError(_native_error)
        return _native
    raise ValueError(f"unknown batch I/O implementation {name!r}: native or python")


def read_batch(paths: Sequence[str | bytes], bufs: Sequence[Any], direct: bool = False,
               nowait: bool = False) -> list[int]:
    """Read each file into its buffers; per item the bytes read or ``-errno`` (module docstring)."""
    result: list[int] = _chosen().read_batch(paths, bufs, direct, nowait)
    return result


def write_batch(items: Sequence[tuple[str | bytes, str | bytes | None, Any]], fsync: bool = False,
                mode: int = 0o600, direct: bool = False, direct_min: int = 65536,
                dir_mode: int | None = None) -> tuple[list[int], int, int]:
    """Publish each ``(final_path, tmp_path, buffers)`` atomically; per item the bytes written or
    ``-errno``, and the counts of records written with ``O_DIRECT`` and refused it (module docstring)."""
    full = [(it[0], temp_name(os.fsdecode(it[0])), it[2]) if isinstance(it, tuple) and len(it) == 3
            and it[1] is None else it for it in items]
    result: tuple[list[int], int, int] = _chosen().write_batch(full, fsync, mode, direct, direct_min,
                                                               dir_mode)
    return result

"""The ``fsspec`` tier: one checked record per block on any fsspec URL (local paths, NFS and FUSE
mounts, S3 through obstore or s3fs, any other fsspec file system).

Its public names are :class:`FsspecTier`, :class:`FsspecTierConfig` (the settings, docs/tiers.md)
and :func:`redact_url`; the modules beside them are the tier's parts, private to it:

- ``_tier``: :class:`FsspecTier` itself (open, put, get, contains, delete, listings, eviction);
- ``_config``: its settings; ``_open``: URL checks and the driver for a protocol; ``_redact``:
  credentials out of messages and logs; ``_capacity``: the shared-capacity ledger;
- ``_driver``: the driver interface; ``_local`` (local paths: worker threads, page cache first),
  ``_remote`` (fsspec file systems, s3fs) and ``_obstore`` (S3 through obstore): the drivers;
- ``_batchio`` (+ ``_batchio_py``): record reads and writes through the C module
  ``tierkv.records._batchio`` or its Python fallback; ``_directio``: ``O_DIRECT`` writes;
  ``_readproc``: the reader processes that read into shared memory.

Names are imported on first use: a reader process imports ``_local`` without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierkv._lazy import lazy

if TYPE_CHECKING:
    from tierkv.backends.fsspec._config import FsspecTierConfig
    from tierkv.backends.fsspec._redact import redact_url
    from tierkv.backends.fsspec._tier import FsspecTier

_WHERE = {
    "FsspecTier": "tierkv.backends.fsspec._tier",
    "FsspecTierConfig": "tierkv.backends.fsspec._config",
    "redact_url": "tierkv.backends.fsspec._redact",
}

__all__ = ["FsspecTier", "FsspecTierConfig", "redact_url"]


__getattr__ = lazy(__name__, _WHERE)

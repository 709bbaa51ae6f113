"""The ``fsspec`` tier: one checked record per block on any fsspec URL (local paths, NFS and FUSE
mounts, S3 through obstore or s3fs, any other fsspec file system).

Its public names are :class:`FsspecTier`, :class:`FsspecTierConfig` (the settings, docs/tiers.md)
and :func:`redact_url`; for the tools that work on a tier's files (``tierkv audit``, the namespace
manifest, the benchmarks) also the driver interface (:class:`Driver`, :class:`Entry`,
:func:`open_driver`, :func:`url_problem`, :func:`is_local_url`), the local driver
(:class:`LocalDriver`, :func:`probe_nowait`) and :class:`Redactor`. The modules beside them are the
tier's parts, private to it:

- ``_tier``: :class:`FsspecTier` itself (open, put, get, contains, delete, listings, eviction);
- ``_config``: its settings; ``_open``: URL checks and the driver for a protocol; ``_redact``:
  credentials out of messages and logs; ``_capacity``: the shared-capacity ledger;
- ``_driver``: the driver interface; ``_local`` (local paths: worker threads, page cache first),
  ``_remote`` (fsspec file systems, s3fs) and ``_obstore`` (S3 through obstore): the drivers;
- ``_localsource``: one local record file, opened safely and read page cache first;
  ``_readproc``: the reader processes that read into shared memory (``_readchild``: their code);
  ``_rescans``: when the namespace is listed again; ``_foreign``: futures of other event loops.

Records themselves (format, reading, batch I/O, ``O_DIRECT`` writes) are :mod:`tierkv.records`.

Names are imported on first use: a reader process imports ``_local`` without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierkv._lazy import lazy

if TYPE_CHECKING:
    from tierkv.backends.fsspec._config import FsspecTierConfig
    from tierkv.backends.fsspec._driver import Driver, Entry
    from tierkv.backends.fsspec._local import LocalDriver, probe_nowait
    from tierkv.backends.fsspec._open import is_local_url, open_driver, url_problem
    from tierkv.backends.fsspec._redact import Redactor, redact_url
    from tierkv.backends.fsspec._tier import FsspecTier

_WHERE = {
    "FsspecTier": "tierkv.backends.fsspec._tier",
    "FsspecTierConfig": "tierkv.backends.fsspec._config",
    "redact_url": "tierkv.backends.fsspec._redact",
    "Redactor": "tierkv.backends.fsspec._redact",
    "Driver": "tierkv.backends.fsspec._driver",
    "Entry": "tierkv.backends.fsspec._driver",
    "LocalDriver": "tierkv.backends.fsspec._local",
    "probe_nowait": "tierkv.backends.fsspec._local",
    "is_local_url": "tierkv.backends.fsspec._open",
    "open_driver": "tierkv.backends.fsspec._open",
    "url_problem": "tierkv.backends.fsspec._open",
}

__all__ = ["Driver", "Entry", "FsspecTier", "FsspecTierConfig", "LocalDriver", "Redactor", "is_local_url",
           "open_driver", "probe_nowait", "redact_url", "url_problem"]


__getattr__ = lazy(__name__, _WHERE)

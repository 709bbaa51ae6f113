"""``fsspec``: one self-checking record per block on any fsspec URL (disk, NFS, S3, memory).

Paths derive from the namespace fingerprint, the group index and the key, so a new process serves
what an earlier one wrote with no index to rebuild; a different layout or namespace never sees it::

    <root>/<fingerprint>/g<group:08x>/<kk>/<kk>/<key hex>.tkv
    <root>/<fingerprint>/layout.json          (layout and namespace, for `tierkv inspect`)

Capacity: this process keeps an LRU of the records it knows; after a restart a background scan
adds the records already there (oldest first) and evicts down to ``capacity_bytes``.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import anyio
import numpy as np
import torch
from pydantic import Field

from tierkv.backends.base import Capabilities, Tier, TierConfig, TierContext
from tierkv.backends.fsio import TEMP_MARK, AsyncDriver, Driver, LocalDriver, SyncDriver, temp_owner_alive
from tierkv.errors import BackendNotFound, ConfigError, CorruptRecord
from tierkv.keys import key_relpath, split_key
from tierkv.record import decode_record, encode_record

__all__ = ["FsspecTier", "FsspecTierConfig", "RECORD_SUFFIX", "record_path", "redact_url"]

log = logging.getLogger("tierkv.fsspec")

RECORD_SUFFIX = ".tkv"
#: a record is at most this much larger than its block (header, key, plane table, trailer)
RECORD_OVERHEAD = 64 << 10
EXTRA_FOR_PROTOCOL = {"s3": "s3", "s3a": "s3"}


class FsspecTierConfig(TierConfig):
    """Settings of the ``fsspec`` tier."""

    kind: str = "fsspec"
    url: str
    #: passed to the fsspec file system (credentials, endpoint_url, ...); never logged or shown
    storage_options: dict[str, Any] = Field(default_factory=dict, repr=False)
    codec: Literal["none", "zstd", "zstd-shuffle"] = "none"
    elem_size: int = 2
    zstd_level: int = 1
    fsync: bool = False
    io_threads: int = 4
    #: temporary files older than this (of live or remote writers) are removed at start
    stale_temp_s: float = 3600.0
    #: rebuild capacity accounting in the background after start
    scan_on_open: bool = True


def redact_url(url: str) -> str:
    """``url`` without user info (credentials) or query string."""
    parts = urlsplit(url)
    netloc = parts.hostname or ""
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def record_path(root: str, fingerprint: str, key: bytes) -> str:
    """Where the record of ``key`` lives under ``root`` for a namespace ``fingerprint``."""
    return f"{root}/{fingerprint}/{key_relpath(key)}{RECORD_SUFFIX}"


def open_driver(url: str, storage_options: dict[str, Any], limiter: anyio.CapacityLimiter,
                threads: int, fsync: bool) -> tuple[Driver, str]:
    """The driver and root path for ``url``. Must run inside the event loop (async file systems)."""
    parts = urlsplit(url)
    protocol = parts.scheme or "file"
    if protocol in ("file", "local"):
        root = (parts.netloc + parts.path) if parts.scheme else url
        if not root.startswith("/"):
            import os

            root = os.path.abspath(root)
        return LocalDriver(limiter, threads, fsync), root.rstrip("/") or "/"
    import fsspec

    try:
        cls = fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as exc:
        extra = EXTRA_FOR_PROTOCOL.get(protocol)
        hint = f"; install it with: pip install 'tierkv[{extra}]'" if extra else ""
        raise BackendNotFound(f"no file system for {protocol}:// URLs ({exc}){hint}") from None
    if getattr(cls, "async_impl", False):
        fs = cls(asynchronous=True, skip_instance_cache=True, **storage_options)
        root = cls._strip_protocol(url).rstrip("/")
        return AsyncDriver(limiter, fs), root
    fs = cls(skip_instance_cache=True, **storage_options)
    root = "/" + cls._strip_protocol(url).strip("/")
    return SyncDriver(limiter, fs, inline=protocol == "memory"), root


class FsspecTier(Tier):
    """Records on a file system or object store, through fsspec (or os calls for local paths)."""

    kind = "fsspec"
    capabilities = Capabilities(persistent=True, fast_contains=False)
    config_model = FsspecTierConfig

    def __init__(self, config: TierConfig, context: TierContext) -> None:
        super().__init__(config, context)
        assert isinstance(config, FsspecTierConfig)
        self.cfg = config
        if config.capacity_bytes is not None and config.capacity_bytes <= 0:
            raise ConfigError(f"fsspec tier {redact_url(config.url)}: capacity_bytes must be > 0")
        self._driver: Driver | None = None
        self.root = ""
        self._known: OrderedDict[bytes, int] = OrderedDict()
        self._used = 0
        self._evicting = False
        self._scan_done = anyio.Event()

    def describe(self) -> str:
        """The URL without credentials."""
        return f"fsspec {redact_url(self.cfg.url)}"

    @property
    def driver(self) -> Driver:
        """The open driver."""
        assert self._driver is not None, "tier not open"
        return self._driver

    @property
    def ns_root(self) -> str:
        """The directory of this namespace."""
        return f"{self.root}/{self.context.fingerprint}"

    def path(self, key: bytes) -> str:
        """Where ``key``'s record lives."""
        return record_path(self.root, self.context.fingerprint, key)

    async def open(self) -> None:
        """Connect, write the namespace manifest, clean stale temporary files, start the scan."""
        limiter = anyio.CapacityLimiter(max(1, self.cfg.io_threads))
        self._driver, self.root = open_driver(self.cfg.url, self.cfg.storage_options, limiter,
                                              self.cfg.io_threads, self.cfg.fsync)
        if isinstance(self._driver, AsyncDriver) and hasattr(self._driver.fs, "set_session"):
            await self._driver.fs.set_session()
        manifest = json.dumps({"format": "tierkv-namespace-v1", "namespace": self.context.namespace,
                               "fingerprint": self.context.fingerprint,
                               "layout": self.context.layout.model_dump(mode="json")},
                              sort_keys=True, indent=1).encode()
        await self.driver.write_small(f"{self.ns_root}/layout.json", manifest)

    async def background(self) -> None:
        """Rebuild capacity accounting and remove stale temporary files (the store runs this)."""
        if self.cfg.scan_on_open:
            await self.scan()
        self._scan_done.set()

    async def close(self) -> None:
        """Close connections."""
        if self._driver is not None:
            await self._driver.close()
            self._driver = None

    async def wait_scanned(self) -> None:
        """Wait until capacity accounting has been rebuilt from what the tier holds."""
        await self._scan_done.wait()

    async def scan(self) -> None:
        """List the namespace: account for records already there, remove stale temporaries."""
        try:
            entries = await self.driver.listdir(self.ns_root)
            now = time.time()
            stale = []
            found: list[tuple[float, bytes, int]] = []
            for e in entries:
                name = e.path.rpartition("/")[2]
                if TEMP_MARK in name:
                    alive = temp_owner_alive(name)
                    if alive is False or now - e.mtime > self.cfg.stale_temp_s:
                        stale.append(e.path)
                    continue
                if not name.endswith(RECORD_SUFFIX):
                    continue
                try:
                    key = bytes.fromhex(name[: -len(RECORD_SUFFIX)])
                    split_key(key)
                except ValueError:
                    continue
                found.append((e.mtime, key, e.size))
            if stale:
                await self.driver.delete_many(stale)
                self.count("temp_removed", len(stale))
            found.sort()
            older: OrderedDict[bytes, int] = OrderedDict()
            for _, key, size in found:
                if key not in self._known:
                    older[key] = size
            self._used += sum(older.values())
            older.update(self._known)
            self._known = older
            self.count("scanned", len(found))
            await self._evict()
        except Exception as exc:
            log.warning("scan of %s failed: %s", self.describe(), exc)
            self.count("scan_errors")
        finally:
            self._scan_done.set()

    def _remember(self, key: bytes, size: int) -> None:
        old = self._known.pop(key, None)
        if old is not None:
            self._used -= old
        self._known[key] = size
        self._used += size

    def _forget(self, key: bytes) -> None:
        old = self._known.pop(key, None)
        if old is not None:
            self._used -= old

    async def _evict(self) -> None:
        cap = self.cfg.capacity_bytes
        if cap is None or self._evicting:
            return
        self._evicting = True
        try:
            while self._used > cap and self._known:
                victims = []
                while self._used > cap and self._known:
                    key, size = self._known.popitem(last=False)
                    self._used -= size
                    victims.append(key)
                await self.driver.delete_many([self.path(k) for k in victims])
                self.count("evictions", len(victims))
        finally:
            self._evicting = False

    # ---- Tier API -------------------------------------------------------------------------------
    def _encode(self, keys: Sequence[bytes], rows: np.ndarray) -> list[bytes]:
        fp = self.context.fingerprint
        return [encode_record(key=k, fingerprint=fp, payload=rows[i], codec=self.cfg.codec,
                              elem_size=self.cfg.elem_size, level=self.cfg.zstd_level)
                for i, k in enumerate(keys)]

    async def put(self, group: int, keys: Sequence[bytes], blocks: torch.Tensor) -> list[bool]:
        """Encode each block into a record and publish it atomically."""
        rows = blocks.view(torch.uint8).reshape(len(keys), -1).cpu().numpy()
        if self.cfg.codec == "none":
            records = self._encode(keys, rows)
        else:
            records = await self.driver.run(self._encode, keys, rows)
        errors = await self.driver.write_many([(self.path(k), r) for k, r in zip(keys, records, strict=True)])
        ok = []
        for k, r, err in zip(keys, records, errors, strict=True):
            if err is None:
                self._remember(k, len(r))
                ok.append(True)
            else:
                self.count("write_errors")
                log.warning("writing a record to %s failed: %s", self.describe(), _safe(err))
                ok.append(False)
        await self._evict()
        return ok

    def _decode_into(self, keys: Sequence[bytes], datas: list[Any], out: np.ndarray,
                     max_raw: int) -> list[str | None]:
        fp = self.context.fingerprint
        res: list[str | None] = []
        for i, (k, data) in enumerate(zip(keys, datas, strict=True)):
            if not isinstance(data, bytes):
                res.append(None)
                continue
            try:
                decode_record(data, key=k, fingerprint=fp, max_raw_bytes=max_raw, out=out[i])
                res.append("")
            except CorruptRecord as exc:
                res.append(exc.reason)
        return res

    async def get(self, group: int, keys: Sequence[bytes], out: torch.Tensor) -> list[bool]:
        """Read, verify and decode records into ``out``; a damaged record is a counted miss, removed."""
        out8 = out.view(torch.uint8).reshape(len(keys), -1)
        block_bytes = out8.shape[1]
        datas = await self.driver.read_many([self.path(k) for k in keys], block_bytes + RECORD_OVERHEAD)
        np_out = out8.numpy()
        if self.cfg.codec == "none":
            verdicts = self._decode_into(keys, datas, np_out, block_bytes)
        else:
            verdicts = await self.driver.run(self._decode_into, keys, datas, np_out, block_bytes)
        found, corrupt = [], []
        for k, data, v in zip(keys, datas, verdicts, strict=True):
            if v == "":
                found.append(True)
                if k in self._known:
                    self._known.move_to_end(k)
                continue
            found.append(False)
            if isinstance(data, BaseException):
                self.count("read_errors")
                log.warning("reading a record from %s failed: %s", self.describe(), _safe(data))
            elif data is None:
                self._forget(k)
            else:
                self.count("corrupt")
                self.count(f"corrupt_{v}")
                log.warning("corrupt record (%s) in %s: %s removed", v, self.describe(), k.hex())
                corrupt.append(k)
        if corrupt:
            for k in corrupt:
                self._forget(k)
            try:
                await self.driver.delete_many([self.path(k) for k in corrupt])
                self.count("corrupt_removed", len(corrupt))
            except OSError as exc:
                log.warning("removing corrupt records from %s failed: %s", self.describe(), _safe(exc))
        return found

    async def contains(self, group: int, keys: Sequence[bytes]) -> list[bool]:
        """Whether each record exists (a later ``get`` still verifies it)."""
        return await self.driver.exists_many([self.path(k) for k in keys])

    async def delete(self, group: int, keys: Sequence[bytes]) -> None:
        """Remove records."""
        for k in keys:
            self._forget(k)
        await self.driver.delete_many([self.path(k) for k in keys])

    async def list_keys(self, group: int) -> list[bytes]:
        """Keys of every record of ``group`` in this namespace."""
        entries = await self.driver.listdir(f"{self.ns_root}/g{group:08x}")
        keys = []
        for e in entries:
            name = e.path.rpartition("/")[2]
            if name.endswith(RECORD_SUFFIX) and TEMP_MARK not in name:
                try:
                    keys.append(bytes.fromhex(name[: -len(RECORD_SUFFIX)]))
                except ValueError:
                    continue
        return keys

    def used_bytes(self) -> int:
        """Bytes of the records this process knows of (all of them once the scan is done)."""
        return self._used


def _safe(exc: BaseException) -> str:
    """An error message with no credentials: the exception type and its errno/strerror only."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{type(exc).__name__}: [{exc.errno}] {exc.strerror}"
    return f"{type(exc).__name__}: {str(exc)[:200]}"

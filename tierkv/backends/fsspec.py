"""``fsspec``: one self-checking record per block on any fsspec URL (disk, NFS, S3, memory).

Paths derive from the namespace fingerprint, the group index and the key, so a new process serves
what an earlier one wrote with no index to rebuild; a different layout or namespace never sees it::

    <root>/<fingerprint>/g<group:08x>/<kk>/<kk>/<key hex>.tkv
    <root>/<fingerprint>/layout.json          (layout and namespace, for `tierkv inspect`)

Publishing is atomic: a unique temporary name in the same directory
(``.<name>.tkvtmp-<host>-<pid>-<random>``), then a rename, on file systems; one PUT on object
stores. The background scan removes temporary files whose writer is dead (same host) or that are
older than ``stale_temp_s``; so does ``tierkv verify --repair``.

Capacity: this process keeps an LRU of the records it knows (its own writes, records it read,
and, once the background scan has run, every record there, oldest first by modification time) and
deletes the least recently used past ``capacity_bytes``. Processes sharing one directory or bucket
each bound what they know; a record another process deleted is a miss, never an error.

Credentials (URL user info, secret ``storage_options``) never appear in ``repr``, ``describe()``,
logs or the :class:`~tierkv.errors.BackendError` messages the tier raises (see :class:`Redactor`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Literal
from urllib.parse import unquote, urlsplit, urlunsplit

import anyio
import numpy as np
import torch
import xxhash
from pydantic import Field, PositiveInt

from tierkv.backends.base import Capabilities, Tier, TierConfig, TierContext
from tierkv.backends.fsio import (
    TEMP_MARK,
    AsyncDriver,
    Driver,
    LocalDriver,
    SyncDriver,
    temp_owner_alive,
)
from tierkv.errors import BackendError, BackendNotFound, ConfigError, CorruptRecord
from tierkv.keys import key_relpath, split_key
from tierkv.record import (
    FIXED_HEADER_LEN,
    TRAILER_LEN,
    decode_record,
    encode_record,
    encode_record_parts,
    none_header,
)

__all__ = ["FsspecTier", "FsspecTierConfig", "RECORD_SUFFIX", "Redactor", "default_io_threads", "open_driver",
           "record_path", "redact_url"]

log = logging.getLogger("tierkv.fsspec")

RECORD_SUFFIX = ".tkv"
#: a record is at most this much larger than its block (header, key, plane table, trailer)
RECORD_OVERHEAD = 64 << 10
EXTRA_FOR_PROTOCOL = {"s3": "s3", "s3a": "s3"}
#: batches of codec ``none`` up to this size are encoded / checked in the event loop thread
INLINE_CODEC_BYTES = 1 << 20


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
    #: local paths: worker threads (default: the CPU count, 2 to 8); other file systems: worker
    #: threads or concurrent requests (default 4)
    io_threads: PositiveInt | None = None
    #: temporary files older than this (of live or remote writers) are removed at start
    stale_temp_s: float = 3600.0
    #: rebuild capacity accounting in the background after start
    scan_on_open: bool = True

    def __repr_args__(self) -> Any:
        """Fields for ``repr``/``str``: the URL without credentials, never the storage options."""
        for name, value in super().__repr_args__():
            if name == "url" and isinstance(value, str):
                value = redact_url(value)
            if name != "storage_options":
                yield name, value


def redact_url(url: str) -> str:
    """``url`` without user info (credentials) or query string."""
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def record_path(root: str, fingerprint: str, key: bytes) -> str:
    """Where the record of ``key`` lives under ``root`` for a namespace ``fingerprint``."""
    return f"{root}/{fingerprint}/{key_relpath(key)}{RECORD_SUFFIX}"


#: storage option names whose values are credentials (matched as substrings, lower case)
_SECRET_WORDS = ("key", "secret", "token", "password", "passwd", "credential", "auth", "session",
                 "signature", "sas", "private")


class Redactor:
    """Removes the credentials of one tier (URL user info, secret storage options) from text."""

    def __init__(self, url: str, storage_options: dict[str, Any]) -> None:
        found: set[str] = set()
        self._collect_url(url, found)
        self._collect(storage_options, False, found)
        #: longest first, so that a secret containing another is removed whole
        self.secrets = sorted((s for s in found if len(s) >= 3), key=len, reverse=True)

    @staticmethod
    def _collect_url(url: str, found: set[str]) -> None:
        try:
            parts = urlsplit(url)
        except ValueError:
            return
        for v in (parts.username, parts.password):
            if v:
                found.update((v, unquote(v)))
        if parts.query:
            found.add(parts.query)

    def _collect(self, value: Any, secret: bool, found: set[str]) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                name = str(k).lower()
                self._collect(v, secret or any(w in name for w in _SECRET_WORDS), found)
        elif isinstance(value, (list, tuple, set)):
            for v in value:
                self._collect(v, secret, found)
        elif isinstance(value, (str, bytes)):
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            if secret:
                found.add(text)
            elif "@" in text or "?" in text:
                self._collect_url(text, found)
        elif secret and value is not None and not isinstance(value, (bool, int, float)):
            found.add(str(value))

    def __call__(self, text: str) -> str:
        """``text`` with every credential replaced by ``***``."""
        for secret in self.secrets:
            if secret in text:
                text = text.replace(secret, "***")
        return text

    def error(self, exc: BaseException) -> str:
        """A one-line description of ``exc`` (the first leaf of an exception group), redacted."""
        while isinstance(getattr(exc, "exceptions", None), (list, tuple)) and exc.exceptions:  # type: ignore[attr-defined]
            exc = exc.exceptions[0]  # type: ignore[attr-defined]
        if isinstance(exc, OSError) and exc.strerror:
            text = f"{type(exc).__name__}: [{exc.errno}] {exc.strerror}"
        else:
            text = f"{type(exc).__name__}: {str(exc)[:300]}"
        return self(text)


def _split_userinfo(url: str, protocol: str,
                    storage_options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """For file and S3 URLs, ``url`` without user info; for S3 the user info becomes the ``key`` and
    ``secret`` options (unless set). Other protocols get the URL as fsspec would (sftp, ftp, http
    parse user info themselves); the tier's :class:`Redactor` keeps it out of messages.
    """
    parts = urlsplit(url)
    if "@" not in parts.netloc or protocol not in ("s3", "s3a", "file", "local"):
        return url, storage_options
    opts = dict(storage_options)
    if protocol in ("s3", "s3a"):
        if parts.username:
            opts.setdefault("key", unquote(parts.username))
        if parts.password:
            opts.setdefault("secret", unquote(parts.password))
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment)), opts


def default_io_threads(*, local: bool) -> int:
    """``io_threads`` when not set: the CPU count (2 to 8) for local paths, else 4 requests."""
    return max(2, min(8, os.cpu_count() or 2)) if local else 4


def open_driver(url: str, storage_options: dict[str, Any], limiter: anyio.CapacityLimiter,
                threads: int | None, fsync: bool) -> tuple[Driver, str]:
    """The driver and root path for ``url``. Must run inside the event loop (async file systems).

    Local paths get ``threads`` worker threads (None: the CPU count, 2 to 8: a page-cache read is
    CPU work, and more threads than cores only contend); other file systems are bounded by
    ``limiter``.

    User info in an S3 URL (``s3://KEY:SECRET@bucket/path``) becomes the ``key`` / ``secret``
    storage options (explicit ``storage_options`` win); in a file URL it is ignored.
    """
    parts = urlsplit(url)
    protocol = parts.scheme or "file"
    url, storage_options = _split_userinfo(url, protocol, storage_options)
    if protocol in ("file", "local"):
        parts = urlsplit(url)
        root = (parts.netloc + parts.path) if parts.scheme else url
        if not root.startswith("/"):
            root = os.path.abspath(root)
        threads = threads or default_io_threads(local=True)
        return LocalDriver(limiter, threads, fsync), root.rstrip("/") or "/"
    import fsspec

    try:
        cls = fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as exc:
        extra = EXTRA_FOR_PROTOCOL.get(protocol)
        hint = f"; install it with: pip install 'tierkv[{extra}]'" if extra else ""
        raise BackendNotFound(f"no file system for {protocol}:// URLs ({exc}){hint}") from None
    try:
        from_url = cls._get_kwargs_from_urls(url)
    except Exception:
        from_url = {}
    options = {**from_url, **storage_options}
    if getattr(cls, "async_impl", False):
        fs = cls(asynchronous=True, skip_instance_cache=True, **options)
        root = cls._strip_protocol(url).rstrip("/")
        return AsyncDriver(limiter, fs), root
    fs = cls(skip_instance_cache=True, **options)
    root = "/" + cls._strip_protocol(url).strip("/")
    return SyncDriver(limiter, fs, inline=protocol == "memory"), root


_tls = threading.local()


def _read_buffer(size: int) -> memoryview:
    """``size`` bytes of this thread's reusable read buffer (no allocation per record)."""
    buf: bytearray | None = getattr(_tls, "buf", None)
    if buf is None or len(buf) < size:
        buf = _tls.buf = bytearray(size)
    return memoryview(buf)[:size]


class FsspecTier(Tier):
    """Records on a file system or object store, through fsspec (or os calls for local paths).

    Every failure of the file system inside ``put`` / ``get`` / ``contains`` is either a per-key
    ``False`` (counted in ``counters``) or a :class:`~tierkv.errors.BackendError` whose message
    holds no credentials. A damaged record is a counted miss (``corrupt``, ``corrupt_<reason>``)
    and is removed.
    """

    kind = "fsspec"
    capabilities = Capabilities(persistent=True, fast_contains=False)
    config_model = FsspecTierConfig

    def __init__(self, config: TierConfig, context: TierContext) -> None:
        super().__init__(config, context)
        assert isinstance(config, FsspecTierConfig)
        self.cfg = config
        if config.capacity_bytes is not None and config.capacity_bytes <= 0:
            raise ConfigError(f"fsspec tier {redact_url(config.url)}: capacity_bytes must be > 0")
        self._redact = Redactor(config.url, config.storage_options)
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

    def _error(self, what: str, exc: BaseException) -> BackendError:
        return BackendError(f"{what} on {self.describe()} failed: {self._redact.error(exc)}")

    def _warn(self, what: str, exc: BaseException) -> None:
        log.warning("%s on %s failed: %s", what, self.describe(), self._redact.error(exc))

    async def open(self) -> None:
        """Connect and write the namespace manifest (``layout.json``).

        Raises :class:`~tierkv.errors.BackendError` (no credentials in it) when the file system
        cannot be reached or written.
        """
        limiter = anyio.CapacityLimiter(self.cfg.io_threads or default_io_threads(local=False))
        try:
            self._driver, self.root = open_driver(self.cfg.url, self.cfg.storage_options, limiter,
                                                  self.cfg.io_threads, self.cfg.fsync)
            if isinstance(self._driver, AsyncDriver) and hasattr(self._driver.fs, "set_session"):
                await self._driver.fs.set_session()
            manifest = json.dumps({"format": "tierkv-namespace-v1", "namespace": self.context.namespace,
                                   "fingerprint": self.context.fingerprint,
                                   "layout": self.context.layout.model_dump(mode="json")},
                                  sort_keys=True, indent=1).encode()
            await self.driver.write_small(f"{self.ns_root}/layout.json", manifest)
        except BackendNotFound:
            await self._close_quietly()
            raise
        except Exception as exc:
            await self._close_quietly()
            raise self._error("opening the tier", exc) from None

    async def _close_quietly(self) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self.close()
            except Exception:
                self._driver = None

    async def background(self) -> None:
        """Rebuild capacity accounting and remove stale temporary files (the store runs this)."""
        if self.cfg.scan_on_open:
            await self.scan()
        self._scan_done.set()

    async def close(self) -> None:
        """Close connections."""
        if self._driver is not None:
            driver, self._driver = self._driver, None
            await driver.close()

    async def wait_scanned(self) -> None:
        """Wait until :meth:`background` has rebuilt capacity accounting (it must be running)."""
        await self._scan_done.wait()

    async def scan(self) -> None:
        """List the namespace: account for records already there, remove stale temporaries.

        Temporary files whose writer is known dead (same host, pid gone) are removed at once;
        those of live or remote writers once older than ``stale_temp_s``. Records are added to
        the LRU oldest first (by modification time), then the tier is evicted down to capacity.
        """
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
            self._warn("scanning the namespace", exc)
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
                try:
                    await self.driver.delete_many([self.path(k) for k in victims])
                except Exception as exc:
                    self._warn("evicting records", exc)
                    self.count("evict_errors")
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
        """Encode each block into a record and publish it atomically; per key, whether it is stored."""
        try:
            return await self._put(keys, blocks)
        except Exception as exc:
            raise self._error("storing records", exc) from None

    def _put_local(self, keys: Sequence[bytes], rows: np.ndarray, i: int) -> int:
        """Encode record ``i`` and publish it with one ``writev``, in a worker thread: no joined copy.

        Returns the record's size, negated when it exceeds ``capacity_bytes`` (not written).
        """
        driver = self.driver
        assert isinstance(driver, LocalDriver)
        cfg = self.cfg
        parts = encode_record_parts(key=keys[i], fingerprint=self.context.fingerprint, payload=rows[i],
                                    codec=cfg.codec, elem_size=cfg.elem_size, level=cfg.zstd_level)
        size = sum(memoryview(p).nbytes for p in parts)
        if cfg.capacity_bytes is not None and size > cfg.capacity_bytes:
            return -size
        driver.write_one(self.path(keys[i]), parts)
        return size

    async def _put(self, keys: Sequence[bytes], blocks: torch.Tensor) -> list[bool]:
        rows = blocks.view(torch.uint8).reshape(len(keys), -1).cpu().numpy()
        results: list[int | BaseException]
        if isinstance(self.driver, LocalDriver):
            # encode (checksum, compression) and write of each record in one worker thread, in
            # parallel over the tier's threads
            results = list(await self.driver.map(functools.partial(self._put_local, keys, rows), len(keys)))
        else:
            if self.cfg.codec == "none" and rows.nbytes <= INLINE_CODEC_BYTES:
                records = self._encode(keys, rows)
            else:
                records = await self.driver.compute(self._encode, keys, rows)
            cap = self.cfg.capacity_bytes
            results = [-len(r) for r in records]
            todo = [i for i, r in enumerate(records) if cap is None or len(r) <= cap]
            errors = await self.driver.write_many([(self.path(keys[i]), records[i]) for i in todo])
            for i, err in zip(todo, errors, strict=True):
                results[i] = len(records[i]) if err is None else err
        ok = [False] * len(keys)
        too_large = 0
        for i, res in enumerate(results):
            if isinstance(res, BaseException):
                self.count("write_errors")
                self._warn("writing a record", res)
            elif res < 0:
                too_large += 1
            else:
                self._remember(keys[i], res)
                ok[i] = True
        if too_large:
            self.count("too_large", too_large)
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
        try:
            return await self._get(keys, out)
        except Exception as exc:
            raise self._error("reading records", exc) from None

    def _get_local(self, keys: Sequence[bytes], np_out: np.ndarray, heads: dict[int, tuple[bytes, bytes]],
                   i: int) -> int | str | None:
        """Read ``none`` record ``i`` into ``np_out[i]`` and verify it, in a worker thread.

        One ``readv`` scatters the file into its header, the output row itself and its trailer
        (plus a spare byte that catches longer files); the header must equal the one this key's
        record has (``heads[len(key)]`` around the key: one compare checks every field) and the
        xxh3 of header and row must match the trailer. The padded header puts the payload at a
        64-byte file offset, the fast case of the kernel's copy into the row. Anything else (a
        record of another codec, a damaged or foreign file) is read whole into a per-thread buffer
        and decoded by :func:`decode_record`, whose verdict counts. Returns the record's size, a
        corruption reason, or None when absent.
        """
        key, row, path = keys[i], np_out[i], self.path(keys[i])
        fixed, pad = heads[len(key)]
        expected = fixed + key + pad
        head, tail = bytearray(len(expected)), bytearray(TRAILER_LEN + 1)
        got = LocalDriver.read_scatter(path, [head, row, tail])
        if got is None:
            return None
        if got == len(head) + row.size + TRAILER_LEN and head == expected:
            digest = xxhash.xxh3_64(head)
            digest.update(row)
            if digest.intdigest() == int.from_bytes(tail[:TRAILER_LEN], "little"):
                return got
        buf = _read_buffer(row.size + RECORD_OVERHEAD + 1)
        got = LocalDriver.read_upto(path, buf)
        if got is None:
            return None
        try:
            decode_record(buf[:got], key=key, fingerprint=self.context.fingerprint,
                          max_raw_bytes=row.size, out=row)
        except CorruptRecord as exc:
            return exc.reason
        return got

    async def _get(self, keys: Sequence[bytes], out: torch.Tensor) -> list[bool]:
        out8 = out.view(torch.uint8).reshape(len(keys), -1)
        block_bytes = out8.shape[1]
        np_out = out8.numpy()
        datas: list[Any]
        verdicts: list[Any]
        if isinstance(self._driver, LocalDriver) and self.cfg.codec == "none" and keys:
            # per key length: the header every none record of this tier's blocks has, around the key
            heads = {}
            for k in keys:
                if len(k) not in heads:
                    h = none_header(key=k, fingerprint=self.context.fingerprint, raw_len=block_bytes,
                                    elem_size=self.cfg.elem_size)
                    heads[len(k)] = (h[:FIXED_HEADER_LEN], h[FIXED_HEADER_LEN + len(k):])
            one = functools.partial(self._get_local, keys, np_out, heads)
            datas = list(await self._driver.map(one, len(keys)))
            verdicts = ["" if isinstance(r, int) else r for r in datas]
        else:
            datas = await self.driver.read_many([self.path(k) for k in keys], block_bytes + RECORD_OVERHEAD)
            if self.cfg.codec == "none" and np_out.nbytes <= INLINE_CODEC_BYTES:
                verdicts = self._decode_into(keys, datas, np_out, block_bytes)
            else:
                verdicts = await self.driver.compute(self._decode_into, keys, datas, np_out, block_bytes)
        found, corrupt = [], []
        learned = False
        for k, data, v in zip(keys, datas, verdicts, strict=True):
            if v == "":
                found.append(True)
                if k in self._known:
                    self._known.move_to_end(k)
                elif isinstance(data, (bytes, int)):
                    # written by another process (or before a restart, not scanned yet)
                    self._remember(k, data if isinstance(data, int) else len(data))
                    learned = True
                continue
            found.append(False)
            if isinstance(data, BaseException):
                self.count("read_errors")
                self._warn("reading a record", data)
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
            except Exception as exc:
                self._warn("removing corrupt records", exc)
        if learned:
            await self._evict()
        return found

    async def contains(self, group: int, keys: Sequence[bytes]) -> list[bool]:
        """Whether each record exists (a later ``get`` still verifies it)."""
        try:
            return await self.driver.exists_many([self.path(k) for k in keys])
        except Exception as exc:
            raise self._error("probing records", exc) from None

    async def delete(self, group: int, keys: Sequence[bytes]) -> None:
        """Remove records."""
        for k in keys:
            self._forget(k)
        try:
            await self.driver.delete_many([self.path(k) for k in keys])
        except Exception as exc:
            raise self._error("deleting records", exc) from None

    async def list_keys(self, group: int) -> list[bytes]:
        """Keys of every record of ``group`` in this namespace."""
        try:
            entries = await self.driver.listdir(f"{self.ns_root}/g{group:08x}")
        except Exception as exc:
            raise self._error("listing records", exc) from None
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

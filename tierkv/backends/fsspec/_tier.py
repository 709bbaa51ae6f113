"""``fsspec``: one self-checking record per block on any fsspec URL (disk, NFS, S3, memory).

Paths derive from the namespace fingerprint, the group index and the key
(:mod:`tierkv.backends.namespace` owns the layout), so a new process serves what an earlier one
wrote with no index to rebuild; a different layout or namespace never sees it::

    <root>/<fingerprint>/g<group:08x>/<n0n1>/<n2n3>/<name>.tkv
    <root>/<fingerprint>/layout.json          (layout and namespace, for `tierkv inspect`)

Publishing is atomic: a unique temporary name in the same directory
(``.<name>.tkvtmp-<host>-<pid>-<random>``), then a rename, on file systems; one PUT on object
stores. The background scan removes temporary files whose writer is dead (same host) or that are
older than ``stale_temp_s``; so does ``tierkv verify --repair``.

Capacity: this process keeps an LRU of the records it knows (its own writes, records it read,
and, once the background scan has run, every record there, oldest first by modification time) and
deletes the least recently used past ``capacity_bytes``. Processes sharing one directory or bucket
each bound what they know; a record another process deleted is a miss, never an error.

Encryption at rest (``encryption_key_file``): every record written is sealed with the tier's
:class:`~tierkv.records.encryption.KeyRing` (AES-256-GCM, bound to its place: docs/format.md). A record
that does not authenticate is damaged (counted, removed); one sealed by a key this store does not
hold, or an unencrypted one with ``read_unencrypted`` off, is a miss counted apart
(``encrypted_misses``, ``unencrypted_misses``; ``newer_version_misses`` for a record a newer
tierkv wrote), said once and left in place: it may be another
tenant's. Encrypted records are read by the tier's threads, never by reader processes.

Credentials (URL user info, secret ``storage_options``) never appear in ``repr``, ``describe()``,
logs or the :class:`~tierkv.errors.BackendError` messages the tier raises (see :class:`Redactor`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import torch

from tierkv.backends.base import Capabilities, RowLanded, Tier, TierConfig, TierContext
from tierkv.backends.fsspec import _upkeep
from tierkv.backends.fsspec._capacity import Ledger
from tierkv.backends.fsspec._config import FsspecTierConfig
from tierkv.backends.fsspec._driver import Driver
from tierkv.backends.fsspec._local import LocalDriver
from tierkv.backends.fsspec._open import default_io_depth, default_io_threads, open_driver, url_problem
from tierkv.backends.fsspec._redact import Redactor, redact_library_logs, redact_url
from tierkv.backends.fsspec._remote import AsyncDriver, RetryPolicy
from tierkv.backends.fsspec._rescans import Rescans
from tierkv.backends.namespace import (
    RECORD_SUFFIX,
    listed_keys,
    manifest_path,
    namespace_path,
    record_path,
)
from tierkv.errors import BackendError, BackendNotFound, ConfigError, TierUnavailable, unavailable
from tierkv.records import encode_record_parts
from tierkv.records.encryption import KeyRing
from tierkv.records.outcomes import Failed, Skipped, Written
from tierkv.records.read import RECORD_OVERHEAD, none_heads, read_record
from tierkv.records.verdicts import Refusals, sort_reads
from tierkv.tensors import as_bytes

__all__ = ["FsspecTier", "FsspecTierConfig", "RECORD_SUFFIX", "Redactor", "default_io_depth",
           "default_io_threads", "open_driver", "record_path", "redact_url", "url_problem"]

log = logging.getLogger("tierkv.fsspec")



class FsspecTier(Tier):
    """Records on a file system or object store, through fsspec (or os calls for local paths).

    Every failure of the file system inside ``put`` / ``get`` / ``contains`` is either a per-key
    ``False`` (counted in ``counters``) or a :class:`~tierkv.errors.BackendError` whose message
    holds no credentials. A damaged or foreign record (a special file included) is a counted miss
    (``corrupt``, ``corrupt_<reason>``) and is removed.
    """

    kind = "fsspec"
    capabilities = Capabilities(persistent=True, fast_contains=False, scattered_rows=True)
    config_model = FsspecTierConfig

    def __init__(self, config: TierConfig, context: TierContext) -> None:
        super().__init__(config, context)
        assert isinstance(config, FsspecTierConfig)
        self.cfg = config
        if config.capacity_bytes is not None and config.capacity_bytes <= 0:
            raise ConfigError(f"fsspec tier {redact_url(config.url)}: capacity_bytes must be > 0")
        self._redact = Redactor(config.url, config.storage_options)
        redact_library_logs(self._redact)
        self._driver: Driver | None = None
        self.root = ""
        #: the records known (listed, written, read), least recently used first
        self._ledger = Ledger(config.capacity_bytes, config.touch_after_s, config.rescan_fraction)
        self._evicting = False
        bounded = config.capacity_bytes is not None and config.rescan_s > 0
        self._rescans = Rescans(config.scan_on_open, config.rescan_s if bounded else None)
        #: when the last listing that rebuilt the ledger began (monotonic; None: none yet)
        self._listed_at: float | None = None
        #: the encryption keys (``encryption_key_file``), loaded at open
        self._ring: KeyRing | None = None
        #: records this store may not serve (another key's, or plaintext with read_unencrypted off)
        self._refusals = Refusals(self.describe, self.count, lambda: self._ring is not None)

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
        return namespace_path(self.root, self.context.fingerprint)

    def path(self, key: bytes) -> str:
        """Where ``key``'s record lives."""
        return record_path(self.root, self.context.fingerprint, key)

    def _error(self, what: str, exc: BaseException) -> BackendError:
        where = self._redact.endpoint(self.cfg.storage_options)
        return BackendError(f"{what} on {self.describe()}{where} failed: {self._redact.error(exc)}")

    def _warn(self, what: str, exc: BaseException) -> None:
        log.warning("%s on %s failed: %s", what, self.describe(), self._redact.error(exc))

    def _warn_batch(self, what: str, errors: list[BaseException], total: int) -> None:
        """One warning for the failed records of one batch (the first error stands for the rest);
        errors that say the file system does not answer are counted apart (``unavailable_errors``:
        the store then takes the tier for down)."""
        down = sum(1 for e in errors if unavailable(e))
        if down:
            self.count("unavailable_errors", down)
        if errors:
            more = f" ({len(errors) - 1} more failed alike)" if len(errors) > 1 else ""
            log.warning("%s: %d of %d records on %s failed: %s%s", what, len(errors), total, self.describe(),
                        self._redact.error(errors[0]), more)

    async def open(self) -> None:
        """Connect, and write the namespace manifest (``layout.json``) unless it is already there.

        Raises :class:`~tierkv.errors.BackendError` (no credentials in it) when the file system
        cannot be reached, read or written; a full disk is not an error here (the records already
        there stay readable), it is logged and counted.
        """
        if self._driver is not None:  # an open cut short (a hung file system): let it go
            old, self._driver = self._driver, None
            old.abandon()
            with anyio.move_on_after(1):
                await old.close()
        cfg = self.cfg
        try:
            if cfg.encryption_key_file is not None:
                self._ring = KeyRing.from_files(cfg.encryption_key_file, cfg.encryption_old_key_files,
                                                cfg.read_unencrypted)
            retry = RetryPolicy(attempts=cfg.retry_attempts, budget_s=cfg.retry_budget_s,
                                timeout_s=cfg.request_timeout_s)
            self._driver, self.root = open_driver(cfg.url, cfg.storage_options, None, cfg.io_threads,
                                                  cfg.fsync, cfg.io_depth, retry, cfg.direct_io,
                                                  cfg.read_processes, cfg.file_mode, cfg.s3_client)
            if isinstance(self._driver, LocalDriver):
                self._driver.direct_reads = cfg.direct_reads
            if isinstance(self._driver, AsyncDriver) and hasattr(self._driver.fs, "set_session"):
                await self._driver.fs.set_session()
            await _upkeep.write_manifest(self)
            await self._driver.prepare(self.ns_root)
        except BackendNotFound:
            await self._close_quietly()
            raise
        except ConfigError as exc:
            await self._close_quietly()
            raise ConfigError(f"{self.describe()}: {exc}") from None
        except Exception as exc:
            await self._close_quietly()
            err = self._error("opening the tier", exc)
            if unavailable(exc):
                raise TierUnavailable(str(err)) from exc
            raise err from None

    async def _close_quietly(self) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self.close()
            except Exception:
                self._driver = None

    async def background(self) -> None:
        """Rebuild capacity accounting and remove stale temporary files (the store runs this); with
        ``capacity_bytes``, list the namespace again every ``rescan_s`` (sooner after this process
        wrote ``rescan_fraction`` of the capacity), so processes sharing the tier bound it together."""
        await self._rescans.run(self.scan)

    async def check(self) -> None:
        """Read the namespace manifest: raises when the file system does not answer."""
        if self._driver is None:
            raise BackendError(f"{self.describe()} is not open")
        (found,) = await self.driver.read_files([manifest_path(self.root, self.context.fingerprint)], 1 << 16)
        if isinstance(found, Failed):
            raise self._error("checking the tier", found.error)

    def abandon(self) -> None:
        """See :meth:`Tier.abandon`."""
        if self._driver is not None:
            self._driver.abandon()

    async def close(self) -> None:
        """Close connections; a tier that wrote since its last listing lists (and evicts) once more
        first, so the last of the processes sharing it to stop leaves it within capacity."""
        if self._driver is None:
            return
        if self.cfg.capacity_bytes is not None and self._ledger.written:
            with anyio.move_on_after(30):
                await self.scan()
        driver, self._driver = self._driver, None
        await driver.close()

    async def wait_scanned(self) -> None:
        """Wait until :meth:`background` has rebuilt capacity accounting (it must be running)."""
        await self._rescans.done.wait()

    async def scan(self) -> None:
        """List the namespace: account for the records there (those of every process sharing the
        tier), remove stale temporaries, evict down to capacity, oldest first (:func:`_upkeep.scan`)."""
        await _upkeep.scan(self)

    # ---- Tier API -------------------------------------------------------------------------------
    async def put(self, group: int, keys: Sequence[bytes], blocks: torch.Tensor) -> list[bool]:
        """Encode each block into a record and publish it atomically; per key, whether it is stored."""
        return await self._put(keys, lambda: blocks.view(torch.uint8).reshape(len(keys), -1).cpu().numpy())

    async def put_rows(self, group: int, keys: Sequence[bytes], src: torch.Tensor,
                       rows: Sequence[int]) -> list[bool]:
        """:meth:`put` of ``src[rows[i]]``: each record encoded from its row where it lies."""
        return await self._put(keys, lambda: _views(src, rows))

    async def _put(self, keys: Sequence[bytes], rows_of: Callable[[], Any]) -> list[bool]:
        try:
            rows = rows_of()
            cfg = self.cfg
            fp = self.context.fingerprint
            cap = cfg.capacity_bytes
            paths = [self.path(k) for k in keys]
            ring = self._ring

            def encode(i: int) -> list[Any] | None:
                parts = encode_record_parts(key=keys[i], fingerprint=fp, payload=rows[i], codec=cfg.codec,
                                            elem_size=cfg.elem_size, level=cfg.zstd_level, keys=ring)
                if cap is not None and sum(memoryview(p).nbytes for p in parts) > cap:
                    return None  # a record larger than the whole tier is never written
                return parts

            results = await self.driver.write_records(paths, encode, sum(r.nbytes for r in rows))
            now = time.time()
            ok = [False] * len(keys)
            too_large = 0
            errors: list[BaseException] = []
            # the ledger's age order: a prefix's first block the most recent, so eviction takes its end
            # first and what stays is usable (a prefix without its first block is never of any use)
            for i in reversed(range(len(results))):
                match results[i]:
                    case Written(size):
                        self._ledger.wrote(paths[i], size, now)
                        ok[i] = True
                    case Failed(error):
                        self.count("write_errors")
                        errors.append(error)
                    case Skipped():
                        too_large += 1
            self._warn_batch("writing records", errors, len(keys))
            if too_large:
                self.count("too_large", too_large)
            self.notify("stored", [k for k, good in zip(keys, ok, strict=True) if good])
            if self._ledger.wants_listing():
                self._rescans.soon()
            await _upkeep.evict(self)
            return ok
        except Exception as exc:
            raise self._error("storing records", exc) from None

    async def get(self, group: int, keys: Sequence[bytes], out: torch.Tensor,
                  landed: RowLanded | None = None) -> list[bool]:
        """Read, verify and decode records into ``out``; a damaged record is a counted miss, removed."""
        block = out.numel() * out.element_size() // max(1, len(keys))
        return await self._get(keys, lambda: as_bytes(out, len(keys), block).numpy(), block, landed)

    async def get_rows(self, group: int, keys: Sequence[bytes], dest: torch.Tensor, rows: Sequence[int],
                       landed: RowLanded | None = None) -> list[bool]:
        """:meth:`get` into ``dest[rows[i]]``: each record read straight into its row."""
        return await self._get(keys, lambda: _views(dest, rows), dest.shape[1], landed)

    async def _get(self, keys: Sequence[bytes], rows: Callable[[], Any], block_bytes: int,
                   landed: RowLanded | None) -> list[bool]:
        self._rescans.reading += 1
        try:
            np_out = rows()
            fp = self.context.fingerprint
            ring = self._ring
            heads = (none_heads(keys, fp, block_bytes, self.cfg.elem_size,
                                None if ring is None else ring.current_id)
                     if self.cfg.codec == "none" else {})
            paths = [self.path(k) for k in keys]

            job = functools.partial(read_record, keys, np_out, heads, fp, ring, landed)

            inplace = None  # reader processes verify unencrypted records only
            if heads and ring is None and self.driver.reads_in_place():
                inplace = [(heads[len(k)][0] + k + heads[len(k)][1], np_out[i]) for i, k in enumerate(keys)]
            verdicts = await self.driver.read_records(paths, block_bytes + RECORD_OVERHEAD + 1, job,
                                                      len(keys) * block_bytes, inplace, landed)
            reads = sort_reads(paths, keys, verdicts)
            if reads.errors:
                self.count("read_errors", len(reads.errors))
            for path in reads.absent:
                self._ledger.forget(path)
            for k, verdict in reads.refused:
                self._refusals.refused(k, verdict)
            for _, _, reason in reads.corrupt:
                self.count("corrupt")
                self.count(f"corrupt_{reason}")
            self._warn_batch("reading records", reads.errors, len(keys))
            # records not known yet were another process's, or not listed yet
            learned, touch = self._ledger.read_many(reads.read_paths[::-1], reads.read_sizes[::-1],
                                                    time.time())
            touch.reverse()  # in key order again: the first the newest (see the driver's touch_many)
            if reads.corrupt:
                await _upkeep.remove_corrupt(self, reads.corrupt)
            if touch and self.cfg.capacity_bytes is not None:
                try:
                    await self.driver.touch_many(touch)
                except Exception as exc:
                    self._warn("refreshing records", exc)
            if learned:
                await _upkeep.evict(self)
            return reads.found
        except Exception as exc:
            raise self._error("reading records", exc) from None
        finally:
            self._rescans.reading -= 1

    async def contains(self, group: int, keys: Sequence[bytes]) -> list[bool]:
        """Whether each record exists (a later ``get`` still verifies it).

        Records this process wrote, read or listed (its capacity ledger) are answered from memory;
        only the others are looked for on storage. One that another process removed since is
        found missing by the read that follows: a counted miss, as for any record gone meanwhile.
        """
        paths = [self.path(k) for k in keys]
        ledger = self._ledger
        out = [p in ledger for p in paths]
        ask = [i for i, known in enumerate(out) if not known]
        if not ask:
            return out
        try:
            found = await self.driver.exists_many([paths[i] for i in ask])
        except Exception as exc:
            raise self._error("probing records", exc) from None
        for i, f in zip(ask, found, strict=True):
            out[i] = f
        return out

    def contains_nowait(self, group: int, keys: Sequence[bytes]) -> list[bool] | None:
        """Presence from the ledger alone, where it is known to be complete: with ``sole_writer``
        once a listing is done, or within ``listing_trusted_s`` of the last listing; else None
        (the store probes). A record another process wrote since is a missed hit, never wrong
        bytes; one it removed is found missing by the read (a counted miss)."""
        if not self.absence_known():
            return None
        ledger = self._ledger
        return [self.path(k) in ledger for k in keys]

    def absence_known(self, now: float | None = None) -> bool:
        """Whether a record the ledger does not know may be answered absent without a probe."""
        at = self._listed_at
        if at is None or self._driver is None:
            return False
        if self.cfg.sole_writer:
            return True
        trusted = self.cfg.listing_trusted_s
        return trusted > 0 and (time.monotonic() if now is None else now) - at <= trusted

    async def delete(self, group: int, keys: Sequence[bytes]) -> None:
        """Remove records."""
        paths = [self.path(k) for k in keys]
        for p in paths:
            self._ledger.forget(p)
        gone, failed = await _upkeep.remove(self, paths)
        removed = set(gone)
        self.notify("removed", [k for k, p in zip(keys, paths, strict=True) if p in removed])
        if failed:
            raise self._error(f"deleting {len(failed)} of {len(paths)} records", failed[0][1])

    async def list_keys(self, group: int) -> list[bytes]:
        """Keys of every record of ``group`` in this namespace."""
        try:
            return await listed_keys(self.driver, self.root, self.context.fingerprint, group)
        except Exception as exc:
            raise self._error("listing records", exc) from None

    def used_bytes(self) -> int:
        """Bytes of the records this process knows of (all of them once the scan is done)."""
        if self._driver is not None:
            self.counters.update(self._driver.counts())
        return self._ledger.used


def _views(t: torch.Tensor, rows: Sequence[int]) -> list[Any]:
    """Rows ``rows`` of a ``[n, block_bytes]`` CPU byte tensor, as numpy views (no copy)."""
    whole = t.numpy()
    return [whole[r] for r in rows]

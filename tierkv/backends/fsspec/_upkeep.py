"""The upkeep of a file tier's namespace: listing it (what every process sharing it wrote), removing
stale temporary files and damaged records, and evicting down to capacity, oldest first."""

from __future__ import annotations

import errno
import logging
import time
from typing import TYPE_CHECKING

import anyio

from tierkv.backends.namespace import (
    classify,
    is_record_name,
    keys_of,
    manifest_bytes,
    manifest_path,
    newest_keys,
)
from tierkv.records.outcomes import Failed
from tierkv.records.tempnames import temp_owner_alive

if TYPE_CHECKING:
    from tierkv.backends.fsspec._tier import FsspecTier

__all__ = ["LISTED_KEYS_MAX", "evict", "remove", "remove_corrupt", "scan", "write_manifest"]

log = logging.getLogger("tierkv.fsspec")

#: a listing tells the stores above the tier of at most this many of its newest records
LISTED_KEYS_MAX = 1 << 18
#: errors that mean "the disk is full": a namespace manifest that cannot be written for them is
#: not fatal (records already there stay readable)
_FULL = (errno.ENOSPC, errno.EDQUOT)


async def scan(tier: FsspecTier) -> None:
    """List the namespace: account for the records there (those of every process sharing the
    tier), remove stale temporaries, evict down to capacity, oldest first.

    Temporary files whose writer is known dead (same host, pid gone) are removed at once;
    those of live or remote writers once older than ``stale_temp_s``. Entries that cannot be
    listed (vanished, unreadable) are skipped, never fatal.
    """
    try:
        started, written = time.time(), tier._ledger.written
        began = time.monotonic()
        entries = await tier.driver.listdir(tier.ns_root, pause=tier._rescans.busy)
        # sorting a large listing is seconds of CPU: off the event loop
        listing = await anyio.to_thread.run_sync(classify, tier.root, entries)
        now = time.time()
        old = now - tier.cfg.stale_temp_s
        stale = [e.path for e, rel, _ in listing.temps
                 if temp_owner_alive(rel.rpartition("/")[2]) is False or e.mtime < old]
        if stale:
            gone, failed = await remove(tier, stale)
            tier.count("temp_removed", len(gone))
            tier._warn_batch("removing stale temporary files", [e for _, e in failed], len(stale))
        records = listing.records.get(tier.context.fingerprint, [])
        found, gone = tier._ledger.rebuild(((e.mtime, e.path, e.size) for e, rel in records
                                            if is_record_name(rel.rpartition("/")[2])), started, written)
        tier._listed_at = began
        tier.notify("removed", keys_of(gone))  # evicted by another process, or repaired
        # what the listing saw needs no probe before its first read (the newest records first)
        tier.notify("listed", await anyio.to_thread.run_sync(newest_keys, records, LISTED_KEYS_MAX))
        tier.count("scanned", found)
        await evict(tier)
    except Exception as exc:
        tier._warn("scanning the namespace", exc)
        tier.count("scan_errors")
    finally:
        tier._rescans.done.set()

async def evict(tier: FsspecTier) -> None:
    if tier._evicting:
        return
    tier._evicting = True
    try:
        while victims := tier._ledger.victims():
            gone, failed = await remove(tier, victims)
            if failed:
                tier.count("evict_errors", len(failed))
                tier._warn_batch("evicting records", [e for _, e in failed], len(victims))
            tier.count("evictions", len(gone))
            tier.notify("removed", keys_of(gone))
    finally:
        tier._evicting = False



async def remove(tier: FsspecTier, paths: list[str]) -> tuple[list[str], list[tuple[str, BaseException]]]:
    """Delete ``paths``, each on its own: those gone, and those kept with the error that kept
    them (a failed call keeps them all; ``remove_errors`` counts every path kept)."""
    try:
        errors = await tier.driver.delete_many(paths)
    except Exception as exc:
        errors = [exc] * len(paths)
    gone = [p for p, e in zip(paths, errors, strict=True) if e is None]
    failed = [(p, e) for p, e in zip(paths, errors, strict=True) if e is not None]
    if failed:
        tier.count("remove_errors", len(failed))
    return gone, failed

async def remove_corrupt(tier: FsspecTier, corrupt: list[tuple[str, bytes, str]]) -> None:
    """Remove the records a read found damaged; one line each says whether it went."""
    paths = [path for path, _, _ in corrupt]
    for path in paths:
        tier._ledger.forget(path)
    gone, failed = await remove(tier, paths)
    kept = dict(failed)
    for path, k, reason in corrupt:
        if path in kept:
            log.warning("corrupt record (%s) in %s: %s could not be removed: %s", reason, tier.describe(),
                        k.hex(), tier._redact.error(kept[path]))
        else:
            log.warning("corrupt record (%s) in %s: %s removed", reason, tier.describe(), k.hex())
    tier.count("corrupt_removed", len(gone))
    tier.notify("removed", [k for path, k, _ in corrupt if path not in kept])


async def write_manifest(tier: FsspecTier) -> None:
    """Write the namespace manifest (``layout.json``) unless it is there already; a full disk is
    counted and logged, not raised (the records already there stay readable)."""
    ctx = tier.context
    manifest = manifest_bytes(ctx.namespace, ctx.fingerprint, ctx.layout)
    path = manifest_path(tier.root, ctx.fingerprint)
    (found,) = await tier.driver.read_files([path], len(manifest))
    if isinstance(found, Failed):
        raise found.error
    if found == manifest:
        return
    try:
        await tier.driver.write_file(path, manifest)
    except OSError as exc:
        if exc.errno not in _FULL:
            raise
        tier.count("manifest_errors")
        tier._warn("writing the namespace manifest", exc)

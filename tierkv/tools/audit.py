"""What ``tierkv inspect`` and ``tierkv verify`` do: walk a persistent tier's root, read records.

Both open the root with the same drivers as the ``fsspec`` tier
(:func:`~tierkv.backends.fsspec.open_driver`: os calls for local paths, obstore or s3fs for
S3, any other fsspec file system) and classify what they
list with :mod:`tierkv.backends.namespace`, the one owner of the paths under a tier (namespace
manifests, records, temporary files of writers, and other files, which are never touched).

:func:`inspect_tier` reads only record headers (namespaces, groups, record counts, bytes on disk,
raw bytes, codec ratio). :func:`verify_tier` checks every record completely
(:func:`~tierkv.records.verify_record`: structure, sizes, checksum, decoding) and that its key,
fingerprint and group agree with its path and its namespace's layout (an encrypted record is
decrypted and so authenticated when a key for it is given; otherwise its structure and checksum
are checked, and the report says which); with ``repair`` it deletes the
corrupt records and stale temporary files (those of dead writers on this host, or older than
``stale_temp_s``). Paths in reports are relative to the root, and the URL is shown without
credentials.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from typing import Any

import anyio

from tierkv.adapters.fingerprint import parse_engine_namespace
from tierkv.backends.fsspec import (
    Driver,
    Entry,
    LocalDriver,
    Redactor,
    open_driver,
    probe_nowait,
    redact_url,
    url_problem,
)
from tierkv.backends.namespace import (
    RECORD_SUFFIX,
    Listing,
    Manifest,
    classify,
    group_of,
    is_record_name,
    key_relpath,
    parse_manifest,
)
from tierkv.errors import BackendError, BackendNotFound, CorruptRecord
from tierkv.layout import Layout
from tierkv.records import RecordHeader, directio, read_header, verify_record
from tierkv.records.encryption import KeyRing
from tierkv.records.outcomes import Failed
from tierkv.records.read import RECORD_OVERHEAD, SpecialFile
from tierkv.records.tempnames import temp_owner_alive
from tierkv.tools.audit_reports import (
    GroupReport,
    InspectReport,
    NamespaceReport,
    Problem,
    TempFile,
    VerifyReport,
)

__all__ = [
    "GroupReport",
    "InspectReport",
    "NamespaceReport",
    "Problem",
    "TempFile",
    "VerifyReport",
    "inspect_tier",
    "verify_tier",
]

_FINGERPRINT = re.compile(r"[0-9a-f]{32}")
#: bytes read to parse a header: fixed part, a key of up to 1 KiB and a plane table of 255 planes
HEADER_PROBE = 8192
#: bound on a block's size where a namespace has no readable layout.json
DEFAULT_MAX_BLOCK_BYTES = 1 << 30
BATCH = 32

Progress = Callable[[int], None]


async def _manifest(driver: Driver, entry: Entry | None, fp: str) -> Manifest:
    if entry is None:
        return Manifest()
    data = (await driver.read_files([entry.path], 1 << 20))[0]
    if isinstance(data, Failed):
        return Manifest(state="unreadable")
    return parse_manifest(data, fp)


def _hint(url: str, root: str, listing: Listing) -> str:
    """Where the namespaces are, when there is none directly under ``root``."""
    if listing.fingerprints():
        return ""
    shown = redact_url(url).rstrip("/")
    parts = root.rstrip("/").split("/")
    for depth in range(1, min(4, len(parts))):
        if _FINGERPRINT.fullmatch(parts[-depth]):
            parent = shown.rsplit("/", depth)[0] or "/"
            where = "one level up" if depth == 1 else f"{depth} levels up"
            return (f"no tierkv namespace here: {shown} is inside namespace {parts[-depth]}; run on the "
                    f"tier's root, {where}: {parent}")
    below = listing.namespaces_below()
    if below:
        return (f"no tierkv namespace directly here; found namespaces under: "
                f"{', '.join(f'{shown}/{b}' for b in below[:5])}")
    return f"no tierkv namespace here: {shown} holds no <fingerprint>/layout.json and no records"


async def _open(url: str, storage_options: dict[str, Any] | None, concurrency: int,
                redact: Redactor) -> tuple[Driver, str]:
    problem = url_problem(url)
    if problem:
        raise BackendError(problem)
    limiter = anyio.CapacityLimiter(max(1, concurrency))
    try:
        driver, root = open_driver(url, dict(storage_options or {}), limiter, concurrency, False)
        fs = getattr(driver, "fs", None)
        if fs is not None and getattr(fs, "asynchronous", False) and hasattr(fs, "set_session"):
            await fs.set_session()
        return driver, root
    except BackendNotFound:
        raise
    except Exception as exc:
        raise BackendError(f"cannot open {redact_url(url)}: {redact.error(exc)}") from None


async def _features(driver: Driver, root: str) -> dict[str, bool]:
    """What the store's probes find at ``root`` (local paths), the same way a tier opening there."""
    if not isinstance(driver, LocalDriver):
        return {}
    nowait = await driver.run(probe_nowait, root)
    if nowait is False:
        await driver.refuse_nowait("the probe of tierkv inspect")
    feats = driver.features()
    feats["direct_io"] = bool(await driver.run(directio.probe, root)) if os.access(root, os.W_OK) else False
    return feats


#: records verify reads again through the store's own read path (page cache first, then waiting)
STORE_PATH_SAMPLE = 16


async def _read_as_the_store_does(driver: Driver, base: str, listing: Listing, report: VerifyReport,
                                  redact: Redactor) -> None:
    """Read a sample of the sound records the way a tier reads them (:meth:`Driver.read_records`
    with one scatter read per record, the C module's where it is built; on a local path, page
    cache first where the file system allows it): a root the store could not
    read is never reported sound, whatever a plain read of the same files says."""
    sound = {p.path for p in report.corrupt} | {p.path for p in report.errors}
    sample = [rel for recs in listing.records.values() for _, rel in recs if rel not in sound]
    sample = sample[:STORE_PATH_SAMPLE]
    if not sample or not report.ok:
        return
    if isinstance(driver, LocalDriver):
        await driver.prepare(base)  # the probes a tier makes at open (page-cache reads, O_DIRECT)
    limit = 1 << 20

    def job(i: int, src: Any) -> int:  # one scatter read, as a tier reads a ``none`` record
        got = src.readinto([bytearray(limit)])
        return -1 if got is None else int(got)

    results = await driver.read_records([f"{base}/{rel}" for rel in sample], limit, job, limit * len(sample))
    failed = [(rel, r.error) for rel, r in zip(sample, results, strict=True) if isinstance(r, Failed)]
    for rel, exc in failed:
        report.ok -= 1
        report.errors.append(Problem(rel, "unreadable", f"the store's read path: {redact.error(exc)}"))


def _record_dirs(root: str) -> list[Entry]:
    """Directories named as records where records belong (``<fp>/g<group>/<xx>/<yy>/<name>.tkv``)
    under a local ``root``: a listing holds files only, so it never shows them."""
    out: list[Entry] = []
    for d, dirs, _ in os.walk(root):
        rel = os.path.relpath(d, root)
        if rel.count(os.sep) == 3:
            out.extend(Entry(f"{d}/{name}", 0, 0.0) for name in dirs if name.endswith(RECORD_SUFFIX))
            dirs.clear()  # what such a directory holds is listed (as other files), never ours
    return out


async def _list(driver: Driver, root: str, url: str, redact: Redactor) -> Listing:
    if isinstance(driver, LocalDriver) and not os.path.isdir(root):
        raise BackendError(f"{redact_url(url)}: no such directory")
    try:
        entries = await driver.listdir(root)
    except Exception as exc:
        raise BackendError(f"cannot list {redact_url(url)}: {redact.error(exc)}") from None
    return classify(root, entries)


# ---- inspect ----------------------------------------------------------------------------------------
async def inspect_tier(url: str, storage_options: dict[str, Any] | None = None, *,
                       concurrency: int = 16, progress: Progress | None = None) -> InspectReport:
    """Namespaces, groups, record counts, bytes on disk, raw bytes and codec ratios under ``url``.

    Only record headers are read (the first few KiB of each record). ``progress`` is called with
    the number of records done since the last call.
    """
    redact = Redactor(url, dict(storage_options or {}))
    driver, root = await _open(url, storage_options, concurrency, redact)
    try:
        listing = await _list(driver, root, url, redact)
        report = InspectReport(url=redact_url(url), temp_files=len(listing.temps),
                               hint=_hint(url, root, listing),
                               other_files=[rel for rel, fp in listing.other if fp is None],
                               features=await _features(driver, root),
                               client="os" if isinstance(driver, LocalDriver) else driver.client)
        for fp in listing.fingerprints():
            man = await _manifest(driver, listing.manifests.get(fp), fp)
            ns = NamespaceReport(fingerprint=fp, namespace=man.namespace, layout=man.layout_json,
                                 manifest=man.state, fields=parse_engine_namespace(man.namespace),
                                 temp_files=sum(1 for _, _, f in listing.temps if f == fp),
                                 other_files=sum(1 for _, f in listing.other if f == fp))
            groups: dict[int, GroupReport] = {}
            if man.layout is not None:
                for g, spec in enumerate(man.layout.record_layout().groups):
                    if spec.kind != "scratch":
                        groups[g] = GroupReport(group=g, kind=spec.kind, block_bytes=spec.block_bytes)
            records = listing.records.get(fp, [])
            for i in range(0, len(records), BATCH * 4):
                chunk = records[i:i + BATCH * 4]
                headers = await _headers(driver, [e for e, _ in chunk])
                for (e, rel), header in zip(chunk, headers, strict=True):
                    g = group_of(rel)
                    gr = groups.setdefault(g, GroupReport(group=g))
                    gr.records += 1
                    gr.bytes_on_disk += e.size
                    if header is None:
                        gr.bad_headers += 1
                        continue
                    gr.stored_bytes += header.stored_len
                    gr.raw_bytes += header.raw_len
                    gr.codecs[header.codec] = gr.codecs.get(header.codec, 0) + 1
                    if header.key_id is not None:
                        gr.encrypted += 1
                        kid = header.key_id.hex()
                        gr.key_ids[kid] = gr.key_ids.get(kid, 0) + 1
                if progress is not None:
                    progress(len(chunk))
            ns.groups = [groups[g] for g in sorted(groups)]
            report.namespaces.append(ns)
        return report
    finally:
        await driver.close()


async def _headers(driver: Driver, entries: list[Entry]) -> list[RecordHeader | None]:
    datas = await driver.read_files([e.path for e in entries], HEADER_PROBE - 1)
    out: list[RecordHeader | None] = []
    for e, data in zip(entries, datas, strict=True):
        header = None
        if isinstance(data, bytes):
            try:
                header = read_header(data)
            except CorruptRecord as exc:
                if exc.reason == "truncated" and len(data) >= HEADER_PROBE and e.size > len(data):
                    full = (await driver.read_files([e.path], e.size))[0]
                    if isinstance(full, bytes):
                        try:
                            header = read_header(full)
                        except CorruptRecord:
                            header = None
        out.append(header)
    return out


# ---- verify -----------------------------------------------------------------------------------------
#: how a sound record was checked: not encrypted, decrypted with a given key, structure only
Checked = str


def _check(data: bytes, rel: str, fp: str, layout: Layout | None, bound: int, keys: KeyRing | None
           ) -> Problem | Checked:
    """Every check of one record against its path and layout; how it was checked when it is sound."""
    if not is_record_name(rel.rpartition("/")[2]):
        return Problem(rel, "name", "the file name is not a key")
    try:
        header = verify_record(data, max_raw_bytes=bound, keys=keys)
    except CorruptRecord as exc:
        # intact, in a format version a newer tierkv wrote: not this reader's to judge or remove
        return "newer" if exc.reason == "newer" else Problem(rel, exc.reason, str(exc))
    problem = _agrees(header, rel, fp, layout)
    if problem is not None:
        return problem
    if header.key_id is None:
        return "plain"
    return "authenticated" if keys is not None and keys.holds(header.key_id) else "structure"


def _agrees(header: RecordHeader, rel: str, fp: str, layout: Layout | None) -> Problem | None:
    """Whether the record's key, fingerprint, group and size agree with its path and layout."""
    try:
        expected_rel = f"{fp}/{key_relpath(header.key)}{RECORD_SUFFIX}"
    except ValueError:
        return Problem(rel, "key", f"record holds key {header.key.hex()}, not a tierkv key")
    if header.fingerprint != fp:
        return Problem(rel, "fingerprint", f"record fingerprint {header.fingerprint}")
    if rel.rpartition("/")[2] != expected_rel.rpartition("/")[2]:
        return Problem(rel, "key", f"record holds key {header.key.hex()}")
    if rel != expected_rel:
        return Problem(rel, "path", f"the key belongs at {expected_rel}")
    if layout is not None:
        g = group_of(rel)
        if g >= len(layout.groups) or layout.groups[g].kind == "scratch":
            return Problem(rel, "group", f"group {g} is not a prefix-cacheable group of the layout")
        if header.raw_len != layout.groups[g].block_bytes:
            return Problem(rel, "size", f"{header.raw_len} bytes, the layout's blocks are "
                                        f"{layout.groups[g].block_bytes}")
    return None


def _check_batch(items: list[tuple[Any, str, str, Layout | None, int]], keys: KeyRing | None
                 ) -> list[Problem | Checked]:
    return [_check(data, rel, fp, layout, bound, keys) for data, rel, fp, layout, bound in items]


async def verify_tier(url: str, storage_options: dict[str, Any] | None = None, *, repair: bool = False,
                      stale_temp_s: float = 3600.0, max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
                      concurrency: int = 16, progress: Progress | None = None,
                      on_total: Callable[[int], None] | None = None, keys: KeyRing | None = None
                      ) -> VerifyReport:
    """Check every record under ``url`` completely; with ``repair`` delete the corrupt ones.

    A record is corrupt when :func:`~tierkv.records.verify_record` rejects it, or its key,
    fingerprint or group disagrees with its path, or its size with its namespace's layout; so is
    something else where a record should be (a FIFO, a symlink, a directory). With ``repair``,
    corrupt records and stale temporary files (of dead writers on this host, or older than
    ``stale_temp_s``) are deleted, each on its own (a directory only when empty: one that cannot
    go stays, its :attr:`Problem.detail` says why); records that cannot be read (I/O errors) are
    reported, never deleted. ``on_total`` gets the number of records once listed, ``progress``
    the number checked since its last call. With ``keys``, encrypted records sealed by one of its keys are
    decrypted: one that does not authenticate is corrupt (``auth``); the others are checked for
    structure and checksum only (:attr:`VerifyReport.structure_only`).
    """
    redact = Redactor(url, dict(storage_options or {}))
    driver, root = await _open(url, storage_options, concurrency, redact)
    try:
        listing = await _list(driver, root, url, redact)
        base = root.rstrip("/")
        report = VerifyReport(url=redact_url(url), hint=_hint(url, root, listing), key_given=keys is not None)
        now = time.time()
        for e, rel, _ in listing.temps:
            alive = temp_owner_alive(rel.rpartition("/")[2])
            age = max(0.0, now - e.mtime)
            report.temp_files.append(TempFile(path=rel, size=e.size, age_s=round(age, 3), owner_alive=alive,
                                              stale=alive is False or age > stale_temp_s))
        dirs = None  # a listing has files only: directories where records belong are looked for apart
        if isinstance(driver, LocalDriver):
            dirs = classify(root, await driver.run(_record_dirs, root))
        total = sum(len(v) for v in listing.records.values())
        if dirs is not None:
            total += sum(len(v) for v in dirs.records.values())
        if on_total is not None:
            on_total(total)
        to_delete: list[tuple[str, Problem | TempFile]] = []
        for fp in listing.fingerprints():
            man = await _manifest(driver, listing.manifests.get(fp), fp)
            report.namespaces[fp] = man.state
            # records hold blocks_per_record blocks: sizes are checked against the record's
            layout = man.layout.record_layout() if man.state == "ok" and man.layout is not None else None
            in_place = [] if dirs is None else dirs.records.get(fp, [])
            for _, rel in in_place:
                report.checked += 1
                not_a_file = Problem(rel, "special", "a directory where a record should be")
                report.corrupt.append(not_a_file)
                to_delete.append((f"{base}/{rel}", not_a_file))
            if progress is not None and in_place:
                progress(len(in_place))
            records = listing.records.get(fp, [])
            for i in range(0, len(records), BATCH):
                chunk = records[i:i + BATCH]
                bounds = []
                for _, rel in chunk:
                    g = group_of(rel)
                    known = layout is not None and g < len(layout.groups)
                    bounds.append(layout.groups[g].block_bytes if known and layout else max_block_bytes)
                datas = await driver.read_files([e.path for e, _ in chunk],
                                               max(bounds) + RECORD_OVERHEAD)
                items = []
                for (_, rel), data, bound in zip(chunk, datas, bounds, strict=True):
                    if data is None:
                        report.vanished += 1
                    elif isinstance(data, Failed) and isinstance(data.error, SpecialFile):
                        report.checked += 1
                        special = Problem(rel, "special", data.error.strerror or "not a regular file")
                        report.corrupt.append(special)
                        to_delete.append((f"{base}/{rel}", special))
                    elif isinstance(data, Failed):
                        report.errors.append(Problem(rel, "unreadable", redact.error(data.error)))
                    else:
                        items.append((data, rel, fp, layout, bound))
                verdicts = await driver.compute(_check_batch, items, keys)
                for (_, rel, _, _, _), problem in zip(items, verdicts, strict=True):
                    report.checked += 1
                    if isinstance(problem, str):
                        report.ok += 1
                        report.authenticated += problem == "authenticated"
                        report.structure_only += problem == "structure"
                        report.newer += problem == "newer"
                    else:
                        report.corrupt.append(problem)
                        to_delete.append((f"{base}/{rel}", problem))
                if progress is not None:
                    progress(len(chunk))
        await _read_as_the_store_does(driver, base, listing, report, redact)
        if repair:
            report.repaired = True
            to_delete += [(f"{base}/{t.path}", t) for t in report.temp_files if t.stale]
            if to_delete:
                paths = [p for p, _ in to_delete]
                try:
                    kept = await driver.delete_many(paths)
                    still = await driver.exists_many(paths)
                except Exception as exc:
                    raise BackendError(f"repair of {redact_url(url)} failed: {redact.error(exc)}") from None
                for (_, item), err, there in zip(to_delete, kept, still, strict=True):
                    item.removed = err is None and not there
                    if isinstance(item, Problem) and err is not None:
                        item.detail += f"; cannot be removed: {redact.error(err)}"
        return report
    finally:
        await driver.close()

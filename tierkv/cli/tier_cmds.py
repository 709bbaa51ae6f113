"""``tierkv inspect`` and ``tierkv verify``: what a persistent tier holds, and whether it is sound."""

from __future__ import annotations

import argparse
import json
from typing import Any

from tierkv.cli.common import (
    Formatter,
    console,
    kv_pairs,
    nonneg_float,
    positive_int,
    print_table,
    progress,
    run_async,
    warn,
)

__all__ = ["add_inspect", "add_verify"]

EXIT_CLEAN, EXIT_CORRUPT, EXIT_NOTHING, EXIT_STALE = 0, 1, 2, 3


def _url_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="root of a persistent tier (the tier's url): a path or any fsspec URL "
                               "(file://, s3://, ...)")
    p.add_argument("-o", "--storage-option", action="append", metavar="KEY=VALUE", default=[],
                   help="fsspec storage option (repeatable), e.g. -o endpoint_url=http://host:9000")
    p.add_argument("--concurrency", type=positive_int, default=16, help="requests or threads in flight")
    p.add_argument("--json", action="store_true", help="print a JSON report on stdout")


def add_inspect(sub: Any) -> None:
    """The ``inspect`` command."""
    i = sub.add_parser("inspect", formatter_class=Formatter,
                       help="namespaces, groups, records, bytes and codec ratios of a tier",
                       description="List a persistent tier: its namespaces (one per model layout), groups, "
                                   "record counts, bytes on disk and codec ratios. Only record headers are "
                                   "read.\n\nExit codes: 0 a namespace was found, 2 none (the message says "
                                   "where there are) or an error.")
    _url_options(i)
    i.set_defaults(func=_inspect)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.3f}"


def _inspect(args: argparse.Namespace) -> int:
    from tierkv.tools.audit import inspect_tier

    with progress() as bar:
        task = bar.add_task("reading record headers", total=None)
        report = run_async(lambda: inspect_tier(args.url, kv_pairs(args.storage_option),
                                                concurrency=args.concurrency,
                                                progress=lambda n: bar.advance(task, n)))
    rc = EXIT_CLEAN if report.namespaces else EXIT_NOTHING
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
        return rc
    out = console()
    others = len(report.other_files) + sum(ns.other_files for ns in report.namespaces)
    out.print(f"{report.url}: {len(report.namespaces)} namespace(s), {report.temp_files} temporary file(s), "
              f"{others} other file(s)")
    if report.client:
        out.print(f"client: {report.client}")
    if report.features:
        f = report.features
        asked = "cachestat" if f.get("cachestat") else "RWF_NOWAIT"
        reads = (f"page cache first (asked with {asked}), reader processes possible"
                 if f.get("page_cache_reads")
                 else "blocking reads (this file system refuses RWF_NOWAIT: tmpfs, FUSE, some NFS)")
        direct = "supported" if f.get("direct_io") else "not used"
        native = "the C module" if f.get("native_reads") else "Python (the C module is not in use)"
        out.print(f"file system: {reads}; O_DIRECT writes {direct}; records read and written by {native}")
    if report.hint:
        warn(report.hint)
    for ns in report.namespaces:
        title = (f"{ns.namespace!r} ({ns.fingerprint})" if ns.namespace is not None
                 else f"{ns.fingerprint} (layout.json {ns.manifest})")
        if ns.fields is not None:  # an engine adapter's namespace: its fields follow the table
            title = f"{ns.fields.get('engine', '?')} {ns.fields.get('model', '?')} ({ns.fingerprint})"
        rows: list[tuple[object, ...]] = []
        for g in ns.groups:
            codecs = ", ".join(f"{k} {v}" for k, v in sorted(g.codecs.items()))
            if g.encrypted:
                ids = ", ".join(f"key id {k} {v}" for k, v in sorted(g.key_ids.items()))
                codecs += f"; encrypted {g.encrypted} ({ids})"
            if g.bad_headers:
                codecs += f" ({g.bad_headers} unreadable)"
            rows.append((g.group, g.kind or "?", g.block_bytes or "?", g.records, _human(g.bytes_on_disk),
                         _human(g.raw_bytes), _ratio(g.codec_ratio), codecs))
        rows.append(("all", "", "", ns.records, _human(ns.bytes_on_disk), _human(ns.raw_bytes),
                     _ratio(ns.codec_ratio), ""))
        print_table(title, ("group", "kind", "block bytes", "records", "on disk", "raw", "codec ratio",
                            "codecs"), rows, out)
        if ns.fields is not None:
            print_table(f"engine fingerprint of {ns.fingerprint}", ("field", "value"),
                        sorted(ns.fields.items()), out)
    return rc


def add_verify(sub: Any) -> None:
    """The ``verify`` command."""
    v = sub.add_parser("verify", formatter_class=Formatter,
                       help="check every record of a tier; --repair deletes corrupt ones",
                       description=(
                           "Check every record (checksum, decoding, key / fingerprint / group against its "
                           "path and layout) and every namespace's layout.json. Encrypted records are "
                           "decrypted, so their authenticity is checked, when --key-file (or "
                           "--old-key-file) holds their key; otherwise their structure and checksum "
                           "only. The summary says which.\n\n"
                           "Exit codes: 0 clean (or repaired); 1 corrupt or unreadable records, or a bad "
                           "layout.json, remain; 2 nothing verifiable found (the message says where the "
                           "namespaces are) or an error; 3 with --strict: stale temporary files remain."))
    _url_options(v)
    v.add_argument("--repair", action="store_true", help="delete corrupt records and stale temporary files")
    v.add_argument("--strict", action="store_true",
                   help="exit 3 when stale temporary files remain (and nothing worse)")
    v.add_argument("--stale-temp-s", type=nonneg_float, default=3600.0,
                   help="temporary files older than this are stale even when their writer may live")
    v.add_argument("--max-block-bytes", type=positive_int, default=1 << 30,
                   help="bound on a block's size for namespaces without a readable layout.json")
    v.add_argument("--key-file", metavar="PATH",
                   help="the tier's encryption_key_file: encrypted records are decrypted and authenticated")
    v.add_argument("--old-key-file", metavar="PATH", action="append", default=[],
                   help="an older key still accepted (encryption_old_key_files; repeatable)")
    v.set_defaults(func=_verify)


def _keys(args: argparse.Namespace) -> Any:
    from tierkv.errors import ConfigError
    from tierkv.records.encryption import KeyRing

    if args.key_file is None:
        if args.old_key_file:
            raise ConfigError("--old-key-file needs --key-file")
        return None
    return KeyRing.from_files(args.key_file, args.old_key_file)


def _verify(args: argparse.Namespace) -> int:
    from tierkv.tools.audit import verify_tier

    keys = _keys(args)
    with progress() as bar:
        task = bar.add_task("verifying records", total=None)
        report = run_async(lambda: verify_tier(
            args.url, kv_pairs(args.storage_option), repair=args.repair, stale_temp_s=args.stale_temp_s,
            max_block_bytes=args.max_block_bytes, concurrency=args.concurrency,
            progress=lambda n: bar.advance(task, n), on_total=lambda n: bar.update(task, total=n),
            keys=keys))
    if not report.found:
        rc = EXIT_NOTHING
    elif not report.clean:
        rc = EXIT_CORRUPT
    else:
        rc = EXIT_STALE if args.strict and report.stale else EXIT_CLEAN
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
        return rc
    out = console()
    for p in report.corrupt:
        out.print(f"{'removed' if p.removed else 'CORRUPT':8} {p.path}: {p.reason} {p.detail}")
    for p in report.errors:
        out.print(f"ERROR    {p.path}: {p.detail}")
    for fp, state in report.bad_manifests.items():
        out.print(f"LAYOUT   {fp}/layout.json: {state} (record sizes checked against --max-block-bytes only)")
    for t in report.temp_files:
        state = "removed" if t.removed else ("stale" if t.stale else "in use")
        out.print(f"{state:8} {t.path} (temporary, {t.age_s:.0f} s old)")
    out.print(f"{report.url}: {len(report.namespaces)} namespace(s), {report.checked} records checked, "
              f"{report.ok} sound, {len(report.corrupt)} corrupt ({len(report.remaining)} remaining), "
              f"{len(report.errors)} unreadable, {len(report.temp_files)} temporary file(s), "
              f"{len(report.removed)} removed")
    if report.authenticated or report.structure_only:
        how = []
        if report.authenticated:
            how.append(f"{report.authenticated} authenticated with the key (decrypted and decoded)")
        if report.structure_only:
            why = "no key given" if not report.key_given else "sealed by a key not given"
            how.append(f"{report.structure_only} checked for structure and checksum only ({why})")
        out.print(f"encrypted records: {'; '.join(how)}")
    if report.newer:
        out.print(f"{report.newer} record(s) in a newer format version (checksum sound; kept: a newer tierkv "
                  f"reads them)")
    if report.hint:
        warn(report.hint)
    if report.remaining and not args.repair:
        out.print("run again with --repair to delete the corrupt records")
    elif report.remaining:
        out.print(f"{len(report.remaining)} could not be removed (said above): remove them by hand")
    if report.stale and not args.repair:
        out.print(f"{len(report.stale)} stale temporary file(s): run again with --repair to delete them")
    return rc

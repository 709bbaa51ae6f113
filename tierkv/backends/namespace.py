"""Where a persistent tier keeps things: the one owner of its paths, names and namespace manifest.

Everything under a tier's root, relative to it::

    <fingerprint>/layout.json                                namespace manifest (informational)
    <fingerprint>/g<group:08x>/<n0n1>/<n2n3>/<name>.tkv      one record per block
    ... .<file>.tkvtmp-<host>-<pid>-<random>                 a writer's temporary file
    anything else                                            an "other" file, never touched

``<name>`` is the key's hex when the key is at most :data:`MAX_NAMED_KEY` bytes (every engine's
hashes fit: vLLM's keys are 36 bytes); a longer key is named ``k`` + the hex of its 32-byte
BLAKE2b digest, so no name exceeds a file system's 255-byte limit whatever the hash length. The
record itself always holds the whole key, which a reader checks. ``<n0n1>/<n2n3>`` are the name's
first hex digits (two levels of fan-out). Only ``[0-9a-f]``, ``g``, ``k``, ``.`` and ``/`` appear
in a record's path, so no key can name a path outside the root.

The fsspec tier and ``tierkv inspect`` / ``tierkv verify`` (:mod:`tierkv.tools.audit`) both use this
module; nothing else derives paths.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tierkv.backends.fsspec import Driver, Entry
from tierkv.keys import GROUP_BYTES, split_key
from tierkv.layout import Layout
from tierkv.records.tempnames import TEMP_MARK

__all__ = [
    "MANIFEST",
    "MAX_NAMED_KEY",
    "RECORD_SUFFIX",
    "Listing",
    "Manifest",
    "classify",
    "group_of",
    "group_path",
    "is_record_name",
    "key_from_name",
    "keys_of",
    "listed_keys",
    "key_relpath",
    "manifest_bytes",
    "manifest_path",
    "namespace_path",
    "newest_keys",
    "parse_manifest",
    "record_name",
    "record_path",
    "relative",
]

RECORD_SUFFIX = ".tkv"
MANIFEST = "layout.json"
MANIFEST_FORMAT = "tierkv-namespace-v1"
#: keys up to this many bytes are named by their hex; longer ones by a digest
MAX_NAMED_KEY = 64
_HASHED = "k"
_FP = re.compile(r"[0-9a-f]{32}")
_GROUP_DIR = re.compile(r"g[0-9a-f]{8}")
_HEX_NAME = re.compile(r"(?:[0-9a-f]{2})+")
_HASHED_NAME = re.compile(r"k[0-9a-f]{64}")


def record_name(key: bytes) -> str:
    """The file name (without suffix) of ``key``'s record."""
    if len(key) <= MAX_NAMED_KEY:
        return key.hex()
    return _HASHED + hashlib.blake2b(key, digest_size=32).hexdigest()


def key_relpath(key: bytes) -> str:
    """``g<group>/<n0n1>/<n2n3>/<name>``: where ``key``'s record lives within its namespace."""
    if not isinstance(key, (bytes, bytearray)) or len(key) <= GROUP_BYTES:
        split_key(key)  # raises the one error for what is not a key
    if len(key) <= MAX_NAMED_KEY:
        # one hex() gives the name, the fan-out digits and the group (its last 8 digits)
        name = key.hex()
        return f"g{name[-8:]}/{name[:2]}/{name[2:4]}/{name}"
    digits = hashlib.blake2b(key, digest_size=32).hexdigest()
    return f"g{key[-GROUP_BYTES:].hex()}/{digits[:2]}/{digits[2:4]}/{_HASHED}{digits}"


def namespace_path(root: str, fingerprint: str) -> str:
    """The directory (or prefix) of one namespace under ``root``."""
    return f"{root}/{fingerprint}"


def record_path(root: str, fingerprint: str, key: bytes) -> str:
    """Where the record of ``key`` lives under ``root`` for a namespace ``fingerprint``."""
    return f"{root}/{fingerprint}/{key_relpath(key)}{RECORD_SUFFIX}"


def group_path(root: str, fingerprint: str, group: int) -> str:
    """The directory (or prefix) of one group's records in a namespace."""
    return f"{root}/{fingerprint}/g{group:08x}"


async def listed_keys(driver: Driver, root: str, fingerprint: str, group: int) -> list[bytes]:
    """Keys of every record of ``group`` in the namespace, from a listing; long keys, named by a
    digest, from their record's header (a record that has none is left out)."""
    from tierkv.errors import CorruptRecord
    from tierkv.records import read_header

    listing = classify(root, await driver.listdir(group_path(root, fingerprint, group)))
    keys, unnamed = [], []
    for e, rel in listing.records.get(fingerprint, []):
        key = key_from_name(rel.rpartition("/")[2])
        if key is not None:
            keys.append(key)
        else:
            unnamed.append(e.path)
    for data in await driver.read_files(unnamed, 8192):
        if isinstance(data, bytes):
            try:
                keys.append(read_header(data).key)
            except CorruptRecord:
                continue
    return keys


def manifest_path(root: str, fingerprint: str) -> str:
    """The namespace manifest's path."""
    return f"{root}/{fingerprint}/{MANIFEST}"


def key_from_name(name: str) -> bytes | None:
    """The key a record's file name spells (hex names), or None (a digest name, or not a record)."""
    if not name.endswith(RECORD_SUFFIX) or TEMP_MARK in name:
        return None
    stem = name[: -len(RECORD_SUFFIX)]
    if not _HEX_NAME.fullmatch(stem):
        return None
    key = bytes.fromhex(stem)
    try:
        split_key(key)
    except ValueError:
        return None
    return key if len(key) <= MAX_NAMED_KEY else None


def is_record_name(name: str) -> bool:
    """True for a file name a record may have (hex of a key, or a digest name)."""
    if not name.endswith(RECORD_SUFFIX) or TEMP_MARK in name:
        return False
    stem = name[: -len(RECORD_SUFFIX)]
    return bool(_HASHED_NAME.fullmatch(stem)) or key_from_name(name) is not None


def manifest_bytes(namespace: str, fingerprint: str, layout: Layout) -> bytes:
    """The manifest a namespace's directory holds: its layout and namespace, for humans and audits."""
    return json.dumps({"format": MANIFEST_FORMAT, "namespace": namespace, "fingerprint": fingerprint,
                       "layout": layout.model_dump(mode="json")}, sort_keys=True, indent=1).encode()


@dataclass
class Manifest:
    """What a namespace's manifest says: ``state`` is ``ok``, ``missing``, ``unreadable`` or
    ``mismatch`` (layout and namespace do not hash to the directory's fingerprint)."""

    state: str = "missing"
    namespace: str | None = None
    layout_json: dict[str, Any] | None = None
    layout: Layout | None = None


def parse_manifest(data: bytes | None, fingerprint: str) -> Manifest:
    """Parse a manifest read from the namespace ``fingerprint`` (None: there is none)."""
    if data is None:
        return Manifest()
    try:
        doc = json.loads(data)
        namespace = str(doc["namespace"])
        layout = Layout.model_validate(doc["layout"])
    except Exception:
        return Manifest(state="unreadable")
    state = "ok" if layout.fingerprint(namespace) == fingerprint else "mismatch"
    return Manifest(state=state, namespace=namespace, layout_json=doc["layout"], layout=layout)


def relative(root: str, path: str) -> str:
    """``path`` relative to ``root`` (both ``/``-separated)."""
    root = root.strip("/")
    path = path.strip("/")
    return path[len(root) + 1:] if root and path.startswith(root + "/") else path


def group_of(rel: str) -> int:
    """The group index of a record at ``rel`` (relative to the root)."""
    return int(rel.split("/")[1][1:], 16)


@dataclass
class Listing:
    """A root's files, classified."""

    #: fingerprint -> (entry, path relative to the root) of every record (or file named like one:
    #: :func:`is_record_name` tells)
    records: dict[str, list[tuple[Entry, str]]] = field(default_factory=dict)
    manifests: dict[str, Entry] = field(default_factory=dict)
    #: (entry, relative path, fingerprint or None) of every temporary file
    temps: list[tuple[Entry, str, str | None]] = field(default_factory=list)
    #: (relative path, fingerprint or None) of every other file
    other: list[tuple[str, str | None]] = field(default_factory=list)

    def fingerprints(self) -> list[str]:
        """Every namespace that has any file."""
        fps = set(self.records) | set(self.manifests)
        fps.update(fp for _, _, fp in self.temps if fp)
        fps.update(fp for _, fp in self.other if fp)
        return sorted(fps)

    def namespaces_below(self) -> list[str]:
        """Relative directories holding namespaces one or more levels down (for hints)."""
        found = set()
        for rel, _ in self.other:
            parts = rel.split("/")
            for i, p in enumerate(parts[:-1]):
                if _FP.fullmatch(p) and i > 0:
                    found.add("/".join(parts[:i]))
        return sorted(found)


def classify(root: str, entries: list[Entry]) -> Listing:
    """Sort listed files into records, manifests, temporary files and others."""
    out = Listing()
    for e in entries:
        rel = relative(root, e.path)
        parts = rel.split("/")
        name = parts[-1]
        fp = parts[0] if len(parts) > 1 and _FP.fullmatch(parts[0]) else None
        if TEMP_MARK in name:
            out.temps.append((e, rel, fp))
        elif fp and len(parts) == 2 and name == MANIFEST:
            out.manifests[fp] = e
        elif fp and len(parts) == 5 and _GROUP_DIR.fullmatch(parts[1]) and name.endswith(RECORD_SUFFIX):
            out.records.setdefault(fp, []).append((e, rel))
        else:
            out.other.append((rel, fp))
    return out


def keys_of(paths: Sequence[str]) -> list[bytes]:
    """The keys of the records at ``paths`` (those named by a digest cannot be told: skipped)."""
    keys = []
    for p in paths:
        key = key_from_name(p.rpartition("/")[2])
        if key is not None:
            keys.append(key)
    return keys


def newest_keys(records: Sequence[tuple[Entry, str]], limit: int) -> list[bytes]:
    """The keys of the newest ``limit`` listed records (digest names skipped)."""
    newest = sorted(records, key=lambda r: r[0].mtime, reverse=True)[:limit]
    return keys_of([e.path for e, _ in newest])

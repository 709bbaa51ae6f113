"""The reports of ``tierkv inspect`` and ``tierkv verify`` (:mod:`tierkv.tools.audit`): per
namespace and group what a tier holds, and per record what is wrong with it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["GroupReport", "InspectReport", "NamespaceReport", "Problem", "TempFile", "VerifyReport"]


@dataclass
class GroupReport:
    """One group of one namespace."""

    group: int
    kind: str | None = None
    """The group's kind in the namespace's layout (None: no readable layout.json)."""
    block_bytes: int | None = None
    records: int = 0
    bytes_on_disk: int = 0
    """Record file sizes, headers and trailers included."""
    stored_bytes: int = 0
    """Payload bytes as stored (after the codec), from the headers."""
    raw_bytes: int = 0
    """Block bytes once decoded, from the headers."""
    codecs: dict[str, int] = field(default_factory=dict)
    encrypted: int = 0
    """Records whose payload is sealed (AES-256-GCM)."""
    key_ids: dict[str, int] = field(default_factory=dict)
    """Sealed records per key id (the id, never the key)."""
    bad_headers: int = 0
    """Records whose header could not be read or parsed (``tierkv verify`` tells why)."""

    @property
    def codec_ratio(self) -> float | None:
        """Raw bytes over stored bytes (None when nothing was stored)."""
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else None


@dataclass
class NamespaceReport:
    """One namespace (one ``<fingerprint>`` directory)."""

    fingerprint: str
    namespace: str | None = None
    layout: dict[str, Any] | None = None
    manifest: str = "missing"
    """``ok``, ``missing``, ``unreadable`` or ``mismatch`` (layout and namespace do not hash to
    the directory's fingerprint)."""
    groups: list[GroupReport] = field(default_factory=list)
    temp_files: int = 0
    other_files: int = 0
    #: the engine fingerprint's fields when the namespace is an engine adapter's (docs/design.md,
    #: "What a key means": model, revision, quantization, KV layout, hash algorithm...), else None
    fields: dict[str, str] | None = None

    def _sum(self, name: str) -> int:
        return sum(int(getattr(g, name)) for g in self.groups)

    @property
    def records(self) -> int:
        """Records in every group."""
        return self._sum("records")

    @property
    def bytes_on_disk(self) -> int:
        """Bytes of every record file."""
        return self._sum("bytes_on_disk")

    @property
    def raw_bytes(self) -> int:
        """Decoded bytes of every record."""
        return self._sum("raw_bytes")

    @property
    def stored_bytes(self) -> int:
        """Stored payload bytes of every record."""
        return self._sum("stored_bytes")

    @property
    def codec_ratio(self) -> float | None:
        """Raw bytes over stored bytes for the whole namespace."""
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else None


@dataclass
class InspectReport:
    """What :func:`inspect_tier` found under a root."""

    url: str
    namespaces: list[NamespaceReport] = field(default_factory=list)
    temp_files: int = 0
    other_files: list[str] = field(default_factory=list)
    #: when no namespace is here: where there are (or why there is none)
    hint: str = ""
    #: what the root's file system does, as the store probes it (local paths: ``page_cache_reads``,
    #: whether it reads only what the page cache holds, ``RWF_NOWAIT``; empty elsewhere)
    features: dict[str, bool] = field(default_factory=dict)
    #: the library that sent the requests: ``obstore`` or ``s3fs`` (``s3://``), ``os`` (local
    #: paths), else the fsspec file system's package
    client: str = ""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``tierkv inspect --json``)."""
        out = []
        for ns in self.namespaces:
            groups = [{**asdict(g), "codec_ratio": g.codec_ratio} for g in ns.groups]
            out.append({"fingerprint": ns.fingerprint, "namespace": ns.namespace, "manifest": ns.manifest,
                        "fingerprint_fields": ns.fields,
                        "layout": ns.layout, "records": ns.records, "bytes_on_disk": ns.bytes_on_disk,
                        "stored_bytes": ns.stored_bytes, "raw_bytes": ns.raw_bytes,
                        "codec_ratio": ns.codec_ratio, "temp_files": ns.temp_files,
                        "other_files": ns.other_files, "groups": groups})
        return {"url": self.url, "namespaces": out, "temp_files": self.temp_files,
                "other_files": self.other_files, "hint": self.hint, "features": self.features,
                "client": self.client}


@dataclass
class Problem:
    """A record that failed a check."""

    path: str
    reason: str
    """``CorruptRecord`` reason, or ``key`` / ``fingerprint`` / ``path`` / ``group`` / ``size`` /
    ``name`` for disagreements with the path or layout, or ``unreadable`` for an I/O error."""
    detail: str = ""
    removed: bool = False


@dataclass
class TempFile:
    """A temporary file a writer left (or is writing now)."""

    path: str
    size: int
    age_s: float
    owner_alive: bool | None
    """Whether the writing process still runs; None when it ran on another host."""
    stale: bool
    removed: bool = False


@dataclass
class VerifyReport:
    """What :func:`verify_tier` found (and removed)."""

    url: str
    checked: int = 0
    ok: int = 0
    vanished: int = 0
    """Records that disappeared between listing and reading (another process evicted them)."""
    corrupt: list[Problem] = field(default_factory=list)
    errors: list[Problem] = field(default_factory=list)
    """Records that could not be read (I/O errors); never removed."""
    temp_files: list[TempFile] = field(default_factory=list)
    namespaces: dict[str, str] = field(default_factory=dict)
    """fingerprint -> manifest state (see :attr:`NamespaceReport.manifest`)."""
    repaired: bool = False
    hint: str = ""
    """When no namespace is here: where there are (or why there is none)."""
    key_given: bool = False
    """Whether verify had encryption keys."""
    authenticated: int = 0
    """Sound encrypted records decrypted with a given key: their authenticity is checked."""
    structure_only: int = 0
    """Sound encrypted records whose key was not given: structure and checksum checked only."""
    newer: int = 0
    """Records of a format version newer than this reader's whose checksum holds: counted sound,
    never removed (a newer tierkv reads them)."""

    @property
    def found(self) -> bool:
        """Whether any namespace was found (else nothing was verified)."""
        return bool(self.namespaces)

    @property
    def bad_manifests(self) -> dict[str, str]:
        """Namespaces whose ``layout.json`` is missing, unreadable or does not match."""
        return {fp: state for fp, state in self.namespaces.items() if state != "ok"}

    @property
    def stale(self) -> list[TempFile]:
        """Stale temporary files still in place."""
        return [t for t in self.temp_files if t.stale and not t.removed]

    @property
    def remaining(self) -> list[Problem]:
        """Corrupt records still in place."""
        return [p for p in self.corrupt if not p.removed]

    @property
    def clean(self) -> bool:
        """Something was verified, no corrupt record remains, every record could be read and every
        namespace has its ``layout.json``."""
        return self.found and not self.remaining and not self.errors and not self.bad_manifests

    @property
    def removed(self) -> list[str]:
        """Paths deleted by the repair (corrupt records and stale temporary files)."""
        return [p.path for p in self.corrupt if p.removed] + [t.path for t in self.temp_files if t.removed]

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``tierkv verify --json``)."""
        return {"url": self.url, "checked": self.checked, "ok": self.ok, "vanished": self.vanished,
                "corrupt": [asdict(p) for p in self.corrupt], "errors": [asdict(p) for p in self.errors],
                "temp_files": [asdict(t) for t in self.temp_files], "namespaces": self.namespaces,
                "repaired": self.repaired, "removed": self.removed, "clean": self.clean,
                "found": self.found, "hint": self.hint, "key_given": self.key_given,
                "authenticated": self.authenticated, "structure_only": self.structure_only,
                "newer": self.newer}


# ---- listing ----------------------------------------------------------------------------------------

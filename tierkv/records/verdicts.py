"""What a batch of record reads came to, per record (:mod:`~tierkv.records.outcomes`):
read and verified, absent, damaged, not this store's to serve (``encrypted`` / ``plaintext`` /
``newer``: a record format version newer than this reader's), or
failed. :func:`sort_reads` sorts them for the tier; :class:`Refusals` counts the records a store
may not serve and says so once per kind."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tierkv.records.outcomes import Absent, Damaged, Failed, Found, RecordRead, Refused

__all__ = ["NOT_OURS", "Reads", "Refusals", "sort_reads"]

log = logging.getLogger("tierkv")

#: verdicts of sound records this store may not serve -> the counter of each
NOT_OURS = {"encrypted": "encrypted_misses", "plaintext": "unencrypted_misses",
            "newer": "newer_version_misses"}


@dataclass
class Reads:
    """A batch's reads, sorted (paths in key order)."""

    found: list[bool] = field(default_factory=list)
    read_paths: list[str] = field(default_factory=list)
    read_sizes: list[int] = field(default_factory=list)
    absent: list[str] = field(default_factory=list)
    #: (path, key, reason) of damaged records
    corrupt: list[tuple[str, bytes, str]] = field(default_factory=list)
    #: (key, verdict) of sound records this store may not serve
    refused: list[tuple[bytes, str]] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)


def sort_reads(paths: Sequence[str], keys: Sequence[bytes], verdicts: Sequence[RecordRead]) -> Reads:
    """Sort each record's verdict (see the module docstring)."""
    out = Reads()
    for path, k, v in zip(paths, keys, verdicts, strict=True):
        found = isinstance(v, Found)
        out.found.append(found)
        match v:
            case Found(size):
                out.read_paths.append(path)
                out.read_sizes.append(size)
            case Failed(error):
                out.errors.append(error)
            case Absent():
                out.absent.append(path)
            case Refused(reason):
                out.refused.append((k, reason))
            case Damaged(reason):
                out.corrupt.append((path, k, reason))
    return out


class Refusals:
    """Sound records a store may not serve: counted misses, left in place (they may be another
    tenant's), said once per kind."""

    def __init__(self, describe: Callable[[], str], count: Callable[[str], None],
                 has_key: Callable[[], bool]) -> None:
        self._describe = describe
        self._count = count
        self._has_key = has_key
        self._said: set[str] = set()

    def refused(self, key: bytes, verdict: str) -> None:
        """Count one, and say why the first time."""
        name = NOT_OURS[verdict]
        self._count(name)
        if verdict in self._said:
            return
        self._said.add(verdict)
        if verdict == "newer":
            why = "a newer tierkv wrote them, in a record format version this one does not know"
        elif verdict == "plaintext":
            why = "they are not encrypted and read_unencrypted is false"
        elif not self._has_key():
            why = "they are encrypted and this store has no encryption_key_file"
        else:
            why = ("they are encrypted with a key this store does not hold (another tenant's, or a "
                   "retired key)")
        log.warning("records in %s cannot be served: %s (first: %s); they are misses, counted as %s, "
                    "and stay in place", self._describe(), why, key.hex(), name)

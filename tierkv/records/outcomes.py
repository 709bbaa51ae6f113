"""What reading or writing one record came to: the typed results of the driver's two calls,
:meth:`~tierkv.backends.fsspec._driver.Driver.read_records` and
:meth:`~tierkv.backends.fsspec._driver.Driver.write_records`.

A read is :class:`Found` (read and verified), :data:`ABSENT`, :class:`Damaged` (with the reason,
removed and counted by the tier), :class:`Refused` (a sound record this store may not serve:
another tenant's or a retired key's, or unencrypted where that is off; left in place) or
:class:`Failed` (the error the I/O raised). A write is :class:`Written`, :data:`SKIPPED` (the job
declined it: a record larger than the tier) or :class:`Failed`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["ABSENT", "SKIPPED", "Absent", "Damaged", "Failed", "Found", "RecordRead",
           "RecordWrite", "Refused", "Skipped", "Written"]

@dataclass(frozen=True, slots=True)
class Found:
    """The record was read into its row and verified; ``size`` is its length on storage."""

    size: int


@dataclass(frozen=True, slots=True)
class Absent:
    """No record at that path."""


@dataclass(frozen=True, slots=True)
class Damaged:
    """A record that fails its checks (``reason``: a :class:`~tierkv.errors.CorruptRecord` reason,
    or ``special`` for a path that is not a regular file)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Refused:
    """A sound record this store may not serve (``reason``: ``encrypted``, sealed with a key this
    store lacks, or ``plaintext``, not sealed where ``read_unencrypted`` is off; the keys of
    :data:`~tierkv.records.verdicts.NOT_OURS`)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Failed:
    """The I/O raised ``error`` (the tier counts it; the record may be fine)."""

    error: BaseException


@dataclass(frozen=True, slots=True)
class Written:
    """The record was published whole; ``size`` bytes."""

    size: int


@dataclass(frozen=True, slots=True)
class Skipped:
    """The job declined to write the record."""


ABSENT: Final = Absent()
SKIPPED: Final = Skipped()

RecordRead = Found | Absent | Damaged | Refused | Failed
RecordWrite = Written | Skipped | Failed

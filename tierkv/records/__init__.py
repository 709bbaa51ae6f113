"""Records: the persistent format of one block, its encryption, reading and checking a record, what a
read or write came to, and batch record I/O (the C module ``_batchio`` and its Python twin).

The front door: every tier and tool uses records through the names here. Modules: ``format`` (the
layout, constants and header parsing), ``encode`` and ``decode``, ``encryption`` (key rings),
``read`` (one record read into its row and verified), ``outcomes`` and ``verdicts`` (what reads
and writes came to), ``batchio`` (the batch I/O front, C or Python), ``directio`` (``O_DIRECT``
writes). Names are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierkv._lazy import lazy

if TYPE_CHECKING:
    from tierkv.records.decode import decode_record, none_parts_match, sealed_none_open, verify_record
    from tierkv.records.encode import encode_record, encode_record_parts
    from tierkv.records.format import (
        CHECKSUM_ALGORITHMS,
        CODECS,
        FIXED_HEADER_LEN,
        FLAG_ENCRYPTED,
        FORMAT_VERSION,
        HEADER_ALIGN,
        MAGIC,
        MAX_KEY_LEN,
        MAX_RAW_LEN,
        PAGE_ALIGN,
        PLANE_ENTRY_LEN,
        READ_VERSIONS,
        SEAL_LEN,
        TAG_LEN,
        TRAILER_LEN,
        PlaneInfo,
        RecordHeader,
        header_align,
        header_len_for,
        none_header,
        read_header,
    )
    from tierkv.records.outcomes import (
        ABSENT,
        SKIPPED,
        Absent,
        Damaged,
        Failed,
        Found,
        RecordRead,
        RecordWrite,
        Refused,
        Skipped,
        Written,
    )
    from tierkv.records.verdicts import NOT_OURS, Reads, Refusals, sort_reads

_NAMES = {
    "format": ["CHECKSUM_ALGORITHMS", "CODECS", "FIXED_HEADER_LEN", "FLAG_ENCRYPTED", "FORMAT_VERSION",
               "HEADER_ALIGN", "MAGIC", "MAX_KEY_LEN", "MAX_RAW_LEN", "PAGE_ALIGN", "PLANE_ENTRY_LEN",
               "READ_VERSIONS", "SEAL_LEN", "TAG_LEN", "TRAILER_LEN", "PlaneInfo", "RecordHeader",
               "header_align", "header_len_for", "none_header", "read_header"],
    "encode": ["encode_record", "encode_record_parts"],
    "decode": ["decode_record", "none_parts_match", "sealed_none_open", "verify_record"],
    "outcomes": ["ABSENT", "SKIPPED", "Absent", "Damaged", "Failed", "Found", "RecordRead", "RecordWrite",
                 "Refused", "Skipped", "Written"],
    "verdicts": ["NOT_OURS", "Reads", "Refusals", "sort_reads"],
}
_WHERE = {name: f"tierkv.records.{module}" for module, names in _NAMES.items() for name in names}

__all__ = [
    "ABSENT",
    "Absent",
    "CHECKSUM_ALGORITHMS",
    "CODECS",
    "Damaged",
    "FIXED_HEADER_LEN",
    "FLAG_ENCRYPTED",
    "FORMAT_VERSION",
    "Failed",
    "Found",
    "HEADER_ALIGN",
    "MAGIC",
    "MAX_KEY_LEN",
    "MAX_RAW_LEN",
    "NOT_OURS",
    "PAGE_ALIGN",
    "PLANE_ENTRY_LEN",
    "PlaneInfo",
    "Reads",
    "READ_VERSIONS",
    "RecordHeader",
    "RecordRead",
    "RecordWrite",
    "Refusals",
    "Refused",
    "SEAL_LEN",
    "SKIPPED",
    "Skipped",
    "TAG_LEN",
    "TRAILER_LEN",
    "Written",
    "decode_record",
    "encode_record",
    "encode_record_parts",
    "header_align",
    "header_len_for",
    "none_header",
    "none_parts_match",
    "read_header",
    "sealed_none_open",
    "sort_reads",
    "verify_record",
]

__getattr__ = lazy(__name__, _WHERE)

"""Settings of the ``fsspec`` tier (:class:`FsspecTierConfig`), checked when a store opens."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveInt, StrictBool, StrictInt, field_validator, model_validator

from tierkv.backends.base import TierConfig, old_name, real_bool
from tierkv.backends.fsspec._open import is_local_url, url_problem
from tierkv.backends.fsspec._redact import redact_url
from tierkv.quantities import MAX_WAIT_S
from tierkv.records.encryption import KEY_NOT_A_PATH, looks_like_key

__all__ = ["MAX_IO_DEPTH", "MAX_READ_PROCESSES", "FsspecTierConfig"]

#: the most I/O in flight (``io_depth``, ``io_threads``) a tier may ask for: each is a thread or a
#: request; past this many a disk, an NFS server or an S3 endpoint gains nothing
MAX_IO_DEPTH = 1024
#: the most reader processes (``read_processes``): each is an interpreter with its own mappings
MAX_READ_PROCESSES = 64


class FsspecTierConfig(TierConfig):
    """Settings of the ``fsspec`` tier."""

    kind: str = "fsspec"
    url: str
    #: passed to the fsspec file system (credentials, endpoint_url, ...); never logged or shown
    storage_options: dict[str, Any] = Field(default_factory=dict, repr=False)
    codec: Literal["none", "zstd", "zstd-shuffle"] = "none"
    elem_size: int = 2
    zstd_level: int = 1
    fsync: StrictBool = False
    #: the tier's I/O in flight on its medium, the one concurrency setting every driver honours:
    #: local paths: reads that wait for the device (a record the page cache does not hold) run on
    #: this many threads, so a disk or NFS server has enough requests (default 16); object stores:
    #: requests in flight; other file systems: threads for their blocking calls (default 4)
    io_depth: PositiveInt | None = Field(default=None, le=MAX_IO_DEPTH)
    #: local paths only: threads for page-cache work, which is CPU work (default: the CPU count, 2
    #: to 8). Elsewhere the old name of ``io_depth``, still accepted.
    io_threads: PositiveInt | None = Field(default=None, le=MAX_IO_DEPTH)
    #: local paths: write records of 64 KiB and more with ``O_DIRECT`` (past the page cache, as
    #: vLLM's file tier does): ``"auto"`` where the file system supports it (found out at open),
    #: True to require it, False for buffered writes (new records then stay in the page cache,
    #: and reads of them soon after are memory copies). Reads are buffered either way.
    direct_io: Literal["auto"] | StrictBool = "auto"
    #: local paths: read a ``none`` record that is not in the page cache with ``O_DIRECT``,
    #: straight into its row, when the row is page-aligned and a whole number of pages (a pool's
    #: rows; the record's block starts on a page: docs/format.md). Such reads leave nothing in the
    #: page cache for other processes; where the file system refuses ``O_DIRECT`` they are buffered
    direct_reads: StrictBool = False
    #: local paths: reads into a pool in shared memory (the vLLM adapter's, a ``cpu`` tier with
    #: ``shm_path``) are done by this many helper processes, each with its own GIL, so a busy
    #: engine loop in this process does not slow a restore down; ``"auto"``: the CPU count, 1 to
    #: 4; 0: threads only; at most :data:`MAX_READ_PROCESSES`. Linux only (elsewhere: threads).
    read_processes: Literal["auto"] | StrictInt = "auto"
    #: local paths: the mode of every file the tier creates (records, temporaries, layout.json);
    #: its directories get the matching search bits (0o600 -> 0o700, 0o640 -> 0o750). Owner read
    #: and write are required; no execute bits. Default: owner only (a KV cache holds prompts)
    file_mode: StrictInt = Field(default=0o600, ge=0o600, le=0o666)
    #: encryption at rest: a file holding a 256-bit key as 64 hex characters, not open to group or
    #: others. Every record written is sealed with it (AES-256-GCM, bound to its place); records
    #: sealed by a key this store does not hold are misses (counted, said once, left in place)
    encryption_key_file: str | None = None
    #: older keys still accepted for reading (rotation): records they sealed are served until
    #: they are rewritten or evicted
    encryption_old_key_files: list[str] = Field(default_factory=list)
    #: with a key: whether unencrypted records (written before encryption was on) are still
    #: served; False once they are gone, so that no one who can write to the storage can plant a
    #: block this store would serve
    read_unencrypted: StrictBool = True
    #: temporary files older than this (of live or remote writers) are removed at start
    stale_temp_s: float = Field(default=3600.0, gt=0, allow_inf_nan=False)
    #: rebuild capacity accounting in the background after start
    scan_on_open: StrictBool = True
    #: with ``capacity_bytes``: list the namespace again this often (and whenever this process has
    #: written ``rescan_fraction`` of the capacity since the last listing), so that processes
    #: sharing the tier bound it together; 0: only at start
    rescan_s: float = Field(default=60.0, ge=0, allow_inf_nan=False)
    rescan_fraction: float = Field(default=0.05, gt=0, le=1, allow_inf_nan=False)
    #: presence without a probe (docs/tiers.md): no other process writes this namespace, so once a
    #: listing is done a record this store's ledger does not know (never written, read or listed)
    #: is absent, answered from memory. Default: such a record is looked for on storage (a probe:
    #: the lookup answers PENDING until it is back), since another process may have written it
    sole_writer: StrictBool = False
    #: with other writers: for this many seconds after each listing, a record the ledger does not
    #: know is taken for absent without a probe; one another process wrote since is then a missed
    #: hit (recomputed), never wrong bytes. 0: always probe
    listing_trusted_s: float = Field(default=0.0, ge=0, le=MAX_WAIT_S, allow_inf_nan=False)
    #: a record read is refreshed on storage (its time, the eviction order) at most this often
    touch_after_s: float = Field(default=300.0, gt=0, allow_inf_nan=False)
    #: remote file systems (S3...): each request's deadline, and how often transient failures (503
    #: SlowDown, a 500, a dropped connection, a timeout) are tried again, with jittered backoff,
    #: within ``retry_budget_s``; then the request counts as failed
    request_timeout_s: float = Field(default=30.0, gt=0, le=MAX_WAIT_S, allow_inf_nan=False)
    retry_attempts: PositiveInt = 4
    retry_budget_s: float = Field(default=10.0, ge=0, le=MAX_WAIT_S, allow_inf_nan=False)
    #: ``s3://`` URLs: the client that sends the requests. ``auto``: obstore (Rust, outside the
    #: GIL) where it is installed and maps every storage option, else s3fs;
    #: the environment variable ``TIERKV_S3_CLIENT`` may pick instead. ``obstore``: obstore or an
    #: error at open. ``s3fs``: s3fs. Other URLs: fsspec's file system, whatever this says.
    s3_client: Literal["auto", "obstore", "s3fs"] = "auto"

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        if isinstance(data, dict) and is_local_url(str(data.get("url", ""))):
            return data  # local paths: io_threads is a setting of its own
        return old_name(data, "io_threads", "io_depth", " off local paths (requests in flight)")

    @field_validator("fsync", "read_unencrypted", "scan_on_open", "sole_writer", mode="before")
    @classmethod
    def _real_bools(cls, v: object) -> bool:
        return real_bool(v)

    @field_validator("direct_io", mode="before")
    @classmethod
    def _auto_or_bool(cls, v: object) -> object:
        if v != "auto" and not isinstance(v, bool):
            raise ValueError('must be "auto", true or false')
        return v

    @field_validator("read_processes", mode="before")
    @classmethod
    def _auto_or_count(cls, v: object) -> object:
        count = isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_READ_PROCESSES
        if v != "auto" and not count:
            raise ValueError(f'must be "auto" or an integer 0..{MAX_READ_PROCESSES}')
        return v

    @field_validator("encryption_key_file", "encryption_old_key_files")
    @classmethod
    def _key_file_paths(cls, v: str | list[str] | None) -> str | list[str] | None:
        for path in [v] if isinstance(v, str) else v or []:
            if not path.strip():
                raise ValueError("must be the path of a key file, not empty")
            if looks_like_key(path):
                raise ValueError(KEY_NOT_A_PATH)
        return v

    @field_validator("file_mode", mode="before")
    @classmethod
    def _octal(cls, v: object) -> object:
        if isinstance(v, str):  # "0o640" or "640" in a JSON or YAML config
            try:
                return int(v.strip().removeprefix("0o"), 8)
            except ValueError:
                raise ValueError(f"{v!r} is not an octal file mode such as 0o640") from None
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError('must be an integer file mode such as 0o640 (416), or a string such as "0o640"')
        return v

    @field_validator("file_mode")
    @classmethod
    def _sane_mode(cls, v: int) -> int:
        if v & 0o600 != 0o600 or v & 0o111 or v & ~0o777:
            raise ValueError(f"{oct(v)}: owner read and write are needed, execute bits are not allowed "
                             "(directories get them from the read bits)")
        return v

    @model_validator(mode="after")
    def _keys_need_a_key(self) -> FsspecTierConfig:
        if self.encryption_key_file is None and self.encryption_old_key_files:
            raise ValueError("encryption_old_key_files needs encryption_key_file (the key records are "
                             "written with)")
        if self.encryption_key_file is None and not self.read_unencrypted:
            raise ValueError("read_unencrypted: false needs encryption_key_file")
        return self

    @field_validator("url")
    @classmethod
    def _has_location(cls, v: str) -> str:
        problem = url_problem(v)
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("elem_size")
    @classmethod
    def _elem_size(cls, v: int) -> int:
        if not 1 <= v <= 255:
            raise ValueError(f"must be 1..255 (bytes per value: 2 for bf16), got {v}")
        return v

    @field_validator("zstd_level")
    @classmethod
    def _zstd_level(cls, v: int) -> int:
        import zstandard

        if not -(1 << 17) <= v <= zstandard.MAX_COMPRESSION_LEVEL:
            raise ValueError(f"must be a zstd level, -131072..{zstandard.MAX_COMPRESSION_LEVEL}, got {v}")
        return v

    def __repr_args__(self) -> Any:
        """Fields for ``repr``/``str``: the URL without credentials, never the storage options."""
        for name, value in super().__repr_args__():
            if name == "url" and isinstance(value, str):
                value = redact_url(value)
            if name != "storage_options":
                yield name, value

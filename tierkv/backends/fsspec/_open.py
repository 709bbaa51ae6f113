"""Opening an fsspec tier's root: which URLs can be one, credentials in URLs, the driver for a
protocol (local os calls, a synchronous or an asynchronous file system) and S3's fail-fast client."""

from __future__ import annotations

import importlib.util
import inspect
import os
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import anyio

from tierkv.backends.fsspec._driver import Driver
from tierkv.backends.fsspec._local import LocalDriver
from tierkv.backends.fsspec._obstore import open_obstore
from tierkv.backends.fsspec._redact import redact_url
from tierkv.backends.fsspec._remote import AsyncDriver, RetryPolicy, SyncDriver
from tierkv.errors import BackendNotFound, ConfigError, install_hint

__all__ = ["S3_FAIL_FAST", "default_io_depth", "default_io_threads", "default_read_processes", "is_local_url",
           "open_driver", "protocol_problem", "tier_is_local", "url_problem"]

#: the extra to install for a protocol fsspec cannot load
EXTRA_FOR_PROTOCOL = {"s3": "s3", "s3a": "s3"}


#: object stores whose URLs name a bucket (or container) first
_BUCKETED = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"})


def url_problem(url: str) -> str:
    """Why ``url`` cannot be a tier's root ('' when it can): empty, a file URL with no path
    (which would put the tier in the working directory), or an object store URL with no bucket."""
    parts = urlsplit(url)
    if not url.strip() or (parts.scheme in ("", "file", "local") and not (parts.netloc + parts.path).strip()):
        return (f"names no location: {redact_url(url)!r} (a path or an fsspec URL such as "
                "file:///var/cache/tierkv or s3://bucket/prefix)")
    if parts.scheme in _BUCKETED and not parts.netloc.rpartition("@")[2].strip():
        shown = f"{parts.scheme}://{parts.path}"  # without user info: there is no host to keep
        return f"names no bucket: {shown!r} (such as {parts.scheme}://bucket/prefix)"
    return ""


def _split_userinfo(url: str, protocol: str,
                    storage_options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """For file and S3 URLs, ``url`` without user info; for S3 the user info becomes the ``key`` and
    ``secret`` options (unless set). Other protocols get the URL as fsspec would (sftp, ftp, http
    parse user info themselves); the tier's :class:`Redactor` keeps it out of messages.
    """
    parts = urlsplit(url)
    if "@" not in parts.netloc or protocol not in ("s3", "s3a", "file", "local"):
        return url, storage_options
    opts = dict(storage_options)
    if protocol in ("s3", "s3a"):
        if parts.username:
            opts.setdefault("key", unquote(parts.username))
        if parts.password:
            opts.setdefault("secret", unquote(parts.password))
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment)), opts


#: options every fsspec file system takes (its listings cache, the instance cache)
_COMMON_OPTIONS = frozenset({"use_listings_cache", "listings_expiry_time", "max_paths",
                             "skip_instance_cache"})
#: options of the local driver (fsspec's LocalFileSystem takes auto_mkdir; tierkv makes directories)
_LOCAL_OPTIONS = frozenset({"auto_mkdir"})


def _accepted_options(cls: type) -> frozenset[str] | None:
    """The keyword options a file system class names in its constructors (None: it takes any)."""
    names: set[str] = set(_COMMON_OPTIONS)
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            params = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            return None
        for p in params:
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self":
                names.add(p.name)
        if klass.__module__.startswith("fsspec.spec"):
            break  # fsspec's base keeps the rest in .storage_options without using them
        if not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(init).parameters.values()):
            break
    return frozenset(names)


def check_storage_options(protocol: str, cls: type | None, options: dict[str, Any]) -> None:
    """Refuse a storage option the file system would ignore (a typo is not silently dropped)."""
    known = _LOCAL_OPTIONS | _COMMON_OPTIONS if cls is None else _accepted_options(cls)
    if known is None:
        return
    unknown = sorted(k for k in options if k not in known)
    if unknown:
        raise ConfigError(f"storage_options: {protocol}:// takes no option {unknown[0]!r} (it takes: "
                          f"{', '.join(sorted(known))})")


def _bucket(url: str) -> str:
    return urlsplit(url).netloc


def _bucket_path(url: str) -> str:
    """``bucket/prefix`` of an S3 URL (as s3fs names paths)."""
    parts = urlsplit(url)
    return (parts.netloc + parts.path).rstrip("/")


def is_local_url(url: str) -> bool:
    """Whether ``url`` names this machine's file system (a plain path, ``file://``, ``local://``)."""
    return (urlsplit(url).scheme or "file") in ("file", "local")


def _no_file_system(protocol: str, exc: BaseException) -> str:
    extra = EXTRA_FOR_PROTOCOL.get(protocol)
    hint = f"; install it with: {install_hint(extra)}" if extra else ""
    return f"no file system for {protocol}:// URLs ({exc}){hint}"


def protocol_problem(url: str) -> str:
    """Why no file system here serves ``url``'s protocol ('' when one does: a local path, an
    fsspec protocol whose package is installed, ``s3://`` through obstore or s3fs)."""
    protocol = urlsplit(url).scheme or "file"
    if protocol in ("file", "local"):
        return ""
    import fsspec

    try:
        fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as exc:
        if protocol in ("s3", "s3a") and importlib.util.find_spec("obstore") is not None:
            return ""
        return _no_file_system(protocol, exc)
    return ""


def tier_is_local(tier: dict[str, Any]) -> bool:
    """Whether a lower tier's config (a mapping with ``kind`` and a ``url``, or an ``inner`` tier
    with one) keeps its data on this machine: memory, a plain path, ``file://``."""
    inner = tier.get("inner")
    url = str(tier.get("url") or (inner.get("url") if isinstance(inner, dict) else "") or "")
    return tier.get("kind") in ("memory", "cpu") or is_local_url(url)


def default_io_threads() -> int:
    """``io_threads`` (local paths) when not set: the CPU count, 2 to 8."""
    return max(2, min(8, os.cpu_count() or 2))


def default_io_depth(*, local: bool) -> int:
    """``io_depth`` when not set: 16 reads waiting for a local device, else 4 requests."""
    return 16 if local else 4


def default_read_processes() -> int:
    """``read_processes`` ``"auto"``: the CPU count, 1 to 4."""
    return max(1, min(4, os.cpu_count() or 1))


#: s3fs client settings tierkv uses unless the storage options set them: one attempt per request
#: (tierkv retries transient failures itself, within a bound) and timeouts that let a dead or hung
#: server fail a request in seconds, not minutes
S3_FAIL_FAST: dict[str, Any] = {"retries": {"total_max_attempts": 1, "mode": "standard"},
                                "connect_timeout": 5, "read_timeout": 30}


def open_driver(url: str, storage_options: dict[str, Any], limiter: anyio.CapacityLimiter | None,
                threads: int | None, fsync: bool, depth: int | None = None,
                retry: RetryPolicy | None = None, direct_io: bool | str = False,
                read_processes: int | str = 0, file_mode: int = 0o600,
                s3_client: str = "auto") -> tuple[Driver, str]:
    """The driver and root path for ``url``. Must run inside the event loop (async file systems).

    Local paths get ``threads`` worker threads (None: the CPU count, 2 to 8: a page-cache read is
    CPU work, and more threads than cores only contend), ``depth`` threads for reads that wait
    for the device, and ``direct_io`` (the tier's setting,
    settled by :meth:`~tierkv.backends.fsspec._local.LocalDriver.prepare`) and ``read_processes``
    (``"auto"``: :func:`default_read_processes`); other file systems are bounded by ``limiter``
    (None: one of ``depth``, the tier's ``io_depth``). ``depth`` None: :func:`default_io_depth`.

    User info in an S3 URL (``s3://KEY:SECRET@bucket/path``) becomes the ``key`` / ``secret``
    storage options (explicit ``storage_options`` win); in a file URL it is ignored.

    ``s3://`` URLs go to obstore or s3fs as ``s3_client`` says (``auto``: obstore where it
    is installed and takes every storage option, see :func:`~tierkv.backends.fsspec._obstore.open_obstore`).
    """
    parts = urlsplit(url)
    protocol = parts.scheme or "file"
    url, storage_options = _split_userinfo(url, protocol, storage_options)
    depth = depth or default_io_depth(local=protocol in ("file", "local"))
    if limiter is None:
        limiter = anyio.CapacityLimiter(depth)
    if protocol in ("file", "local"):
        check_storage_options(protocol, None, storage_options)
        parts = urlsplit(url)
        root = (parts.netloc + parts.path) if parts.scheme else url
        if not root.startswith("/"):
            root = os.path.abspath(root)
        threads = threads or default_io_threads()
        procs = default_read_processes() if read_processes == "auto" else int(read_processes)
        driver = LocalDriver(limiter, threads, fsync, depth, direct_io, procs, file_mode)
        return driver, root.rstrip("/") or "/"
    import fsspec

    s3 = protocol in ("s3", "s3a")
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as exc:
        missing = BackendNotFound(_no_file_system(protocol, exc))
        if not s3:
            raise missing from None
        obs = open_obstore(_bucket(url), storage_options, limiter, retry, s3_client, s3fs_missing=True)
        if obs is None:  # s3_client: s3fs
            raise missing from None
        return obs, _bucket_path(url)
    if s3:
        check_storage_options(protocol, cls, {k: v for k, v in storage_options.items() if k != "retries"})
        obs = open_obstore(_bucket(url), storage_options, limiter, retry, s3_client, s3fs_missing=False)
        if obs is not None:
            return obs, _bucket_path(url)
    try:
        from_url = cls._get_kwargs_from_urls(url)
    except Exception:
        from_url = {}
    options = {**from_url, **storage_options}
    retries = options.pop("retries", None) if s3 else None  # s3fs's own retry loop: an attribute
    check_storage_options(protocol, cls, {k: v for k, v in storage_options.items()
                                          if not (s3 and k == "retries")})
    if s3:
        options["config_kwargs"] = {**S3_FAIL_FAST, **dict(options.get("config_kwargs") or {})}
    if getattr(cls, "async_impl", False):
        fs = cls(asynchronous=True, skip_instance_cache=True, **options)
        if s3:  # s3fs's own retry loop (on top of botocore's): tierkv's bounds instead, unless set
            fs.retries = 1 if retries is None else int(retries)
        root = cls._strip_protocol(url).rstrip("/")
        return AsyncDriver(limiter, fs, retry), root
    fs = cls(skip_instance_cache=True, **options)
    root = "/" + cls._strip_protocol(url).strip("/")
    return SyncDriver(limiter, fs, inline=protocol == "memory"), root

"""``s3://`` through obstore (the Python bindings of Apache Arrow's Rust ``object_store``).

The fsspec tier's record format, checks and paths stay as they are; only the requests change
hands. obstore sends them from its own Rust threads, outside the GIL, so the event loop only
awaits them: against one S3 server on loopback it fetched 1 MiB objects at 1.2-2.9x s3fs's rate.

The user's interface stays fsspec's: the URL and ``storage_options`` are s3fs's, and
:func:`s3_store_config` maps them (``key`` / ``secret`` / ``token``, ``anon``,
``endpoint_url``, ``client_kwargs`` ``region_name`` / ``endpoint_url`` / ``verify``, the
``config_kwargs`` timeouts and addressing style). What has no equivalent there (an AWS profile,
``s3_additional_kwargs``, a botocore session...) leaves the tier on s3fs, and the log says why
once. The setting ``s3_client`` (``auto``, ``obstore``, ``s3fs``) picks the client; under
``auto`` the environment variable ``TIERKV_S3_CLIENT`` may pick it instead.

Semantics match :class:`~tierkv.backends.fsspec._remote.AsyncDriver` (s3fs): one PUT per record (parts
of 50 MiB from 50 MiB on, as s3fs), a missing object is a miss, listings give ``bucket/key``
paths with sizes and times, failures are translated into the ``OSError`` classes s3fs raises (503
SlowDown: ``EBUSY``, other 5xx: ``EREMOTEIO``, 416: ``EINVAL``, 403: ``PermissionError``, a
refused or dropped connection: ``ConnectionError``, a timeout: ``TimeoutError``), so retries
and the tier's up/down decisions are the same. obstore's own retries are off: tierkv's
:class:`~tierkv.backends.fsspec._remote.RetryPolicy` bounds them.
"""

from __future__ import annotations

import contextlib
import errno
import html
import importlib
import logging
import os
import re
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio

from tierkv.backends.fsspec._driver import Entry
from tierkv.backends.fsspec._foreign import ForeignFutures
from tierkv.backends.fsspec._remote import RequestDriver, RetryPolicy
from tierkv.errors import BackendNotFound, ConfigError, install_hint
from tierkv.records.tempnames import temp_name

__all__ = ["CLIENTS", "ENV_CLIENT", "MULTIPART_BYTES", "ObstoreDriver", "obstore_module", "open_obstore",
           "s3_store_config", "translate"]

log = logging.getLogger("tierkv.fsspec")

#: values of the ``s3_client`` setting
CLIENTS = ("auto", "obstore", "s3fs")

#: under ``s3_client: auto``, this environment variable may name the client (``obstore``, ``s3fs``)
ENV_CLIENT = "TIERKV_S3_CLIENT"
#: objects of this size and more go up as a multipart upload of parts this large (as s3fs does)
MULTIPART_BYTES = 50 << 20

#: s3fs options with no effect on tierkv's requests (caches of s3fs's own file objects and
#: listings, and s3fs's retry loop, which tierkv's ``retry_attempts`` replaces on both clients)
_NO_EFFECT = frozenset({"use_listings_cache", "listings_expiry_time", "max_paths", "skip_instance_cache",
                        "default_block_size", "default_fill_cache", "default_cache_type", "cache_regions",
                        "retries", "asynchronous", "loop", "max_concurrency", "fixed_upload_size"})
#: botocore config options with no effect here (tierkv bounds requests and retries itself)
_CONFIG_NO_EFFECT = frozenset({"retries", "max_pool_connections", "tcp_keepalive"})


def obstore_module() -> Any:
    """The ``obstore`` module, or None when it is not installed."""
    try:
        return importlib.import_module("obstore")
    except ImportError:
        return None


def _seconds(v: Any) -> timedelta:
    return timedelta(seconds=float(v))


def s3_store_config(options: dict[str, Any], retry: RetryPolicy,
                    environ: dict[str, str] | None = None) -> tuple[dict[str, Any], dict[str, Any], str]:
    """``(config, client_options, why_not)`` for obstore's ``S3Store`` from s3fs's
    ``storage_options``; ``why_not`` is '' when every option maps, else the first that does not."""
    env = os.environ if environ is None else environ
    config: dict[str, Any] = {}
    client: dict[str, Any] = {"connect_timeout": _seconds(5), "timeout": _seconds(retry.timeout_s)}
    ck = dict(options.get("client_kwargs") or {})
    endpoint = options.get("endpoint_url") or ck.pop("endpoint_url", None)
    ck.pop("endpoint_url", None)
    creds = {"key": "access_key_id", "secret": "secret_access_key", "token": "session_token",
             "aws_access_key_id": "access_key_id", "aws_secret_access_key": "secret_access_key",
             "aws_session_token": "session_token"}
    for k, v in options.items():
        if k in ("client_kwargs", "config_kwargs", "endpoint_url") or k in _NO_EFFECT:
            continue
        if k in creds:
            if v:
                config[creds[k]] = str(v)
        elif k == "anon":
            if v:
                config["skip_signature"] = True
        elif k == "requester_pays":
            if v:
                config["request_payer"] = True
        elif k == "use_ssl":
            if not v and not endpoint:
                return config, client, "use_ssl=False without endpoint_url"
        else:
            return config, client, f"storage option {k!r}"
    for k, v in ck.items():
        if k == "region_name":
            config["region"] = str(v)
        elif k in creds:
            config.setdefault(creds[k], str(v))
        elif k == "verify":
            if v is False:
                client["allow_invalid_certificates"] = True
            elif isinstance(v, str):
                client["root_certificate"] = Path(v).read_text()
        elif k == "use_ssl":
            if not v and not endpoint:
                return config, client, "client_kwargs use_ssl=False without endpoint_url"
        else:
            return config, client, f"client_kwargs option {k!r}"
    for k, v in dict(options.get("config_kwargs") or {}).items():
        if k in ("connect_timeout", "read_timeout"):
            client[k] = _seconds(v)
        elif k == "s3" and set(v) <= {"addressing_style"}:
            config["virtual_hosted_style_request"] = v.get("addressing_style") == "virtual"
        elif k == "region_name":
            config["region"] = str(v)
        elif k == "signature_version" and str(v) in ("s3v4", "UNSIGNED"):
            if str(v) == "UNSIGNED":
                config["skip_signature"] = True
        elif k not in _CONFIG_NO_EFFECT:
            return config, client, f"config_kwargs option {k!r}"
    if endpoint:
        config["endpoint"] = str(endpoint)
        if str(endpoint).startswith("http://"):
            client["allow_http"] = True
    elif "region" not in config and not (env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")):
        return config, client, "no region (s3fs finds a bucket's region by itself, obstore does not)"
    signs = not config.get("skip_signature")
    if signs and "access_key_id" not in config and not env.get("AWS_ACCESS_KEY_ID"):
        aws = Path(env.get("HOME") or "~").expanduser() / ".aws"
        if env.get("AWS_PROFILE") or (aws / "credentials").exists() or (aws / "config").exists():
            return config, client, "credentials from an AWS profile (obstore reads no ~/.aws files)"
    return config, client, ""


_said: set[str] = set()


def _once(msg: str, *args: Any) -> None:
    text = msg % args
    if text not in _said:
        _said.add(text)
        log.info("%s", text)


def open_obstore(bucket: str, options: dict[str, Any], limiter: anyio.CapacityLimiter,
                 retry: RetryPolicy | None, setting: str, s3fs_missing: bool) -> ObstoreDriver | None:
    """An obstore driver for ``bucket``, or None where s3fs serves it (``setting`` says so, or
    under ``auto``, obstore is missing or an option has no obstore equivalent: the log says why
    once). Raises :class:`ConfigError` or :class:`BackendNotFound` when obstore is asked for
    (``obstore``, or ``TIERKV_S3_CLIENT=obstore`` under ``auto``) and cannot serve it."""
    choice = setting
    if choice == "auto":
        choice = os.environ.get(ENV_CLIENT, "").strip().lower() or "auto"
        if choice not in CLIENTS:
            raise ConfigError(f"{ENV_CLIENT}={choice!r}: must be one of {', '.join(CLIENTS)}")
    if choice == "s3fs":
        return None
    required = choice == "obstore"
    obs = obstore_module()
    if obs is None:
        if required or s3fs_missing:
            raise BackendNotFound(f"s3_client {choice}: obstore is not installed; install it with: "
                                  f"{install_hint('s3')}")
        _once("s3:// tiers use s3fs: obstore is not installed (%s)", install_hint("s3"))
        return None
    policy = retry or RetryPolicy()
    config, client, why_not = s3_store_config(options, policy)
    if why_not:
        if required or s3fs_missing:
            raise ConfigError(f"s3_client {choice}: obstore cannot take {why_not}; use s3_client: s3fs"
                              + (f" (install it with: {install_hint('s3')})" if s3fs_missing else ""))
        _once("s3:// tier on bucket %s uses s3fs, not obstore: %s has no obstore equivalent", bucket, why_not)
        return None
    store = obs.store.S3Store(bucket, config=config, client_options=client, retry_config={"max_retries": 0})
    return ObstoreDriver(limiter, obs, store, bucket, policy)


_STATUS = re.compile(r"status code: (\d{3})")
_KIND = re.compile(r"kind: (\w+)")
_REQUEST = re.compile(r"Error performing (\w+) (\S+)")
_XML_CODE = re.compile(r"<Code>(.*?)</Code>")
_XML_MESSAGE = re.compile(r"<Message>(.*?)</Message>")


def _message(text: str, code: int) -> str:
    """obstore's error text in one line: the S3 error code and message, the request (method and
    URL: the endpoint and bucket), without the XML body and the debug dump."""
    head = text.partition("\n\nDebug source:")[0].strip()
    request = _REQUEST.search(head)
    where = f" ({request.group(1)} {request.group(2)})" if request else ""
    s3_code, s3_message = _XML_CODE.search(head), _XML_MESSAGE.search(head)
    if code and (s3_code or s3_message):
        what = ": ".join(html.unescape(m.group(1)) for m in (s3_code, s3_message) if m)
        return f"HTTP {code} {what}{where}"
    if code:
        return f"HTTP {code}{where}"
    return " ".join(head.split())[:500]


def translate(exc: BaseException) -> BaseException:
    """An obstore error as the ``OSError`` s3fs would raise for the same answer (see the module
    docstring); the message without obstore's debug dump. Other exceptions are returned as they are."""
    text = str(exc)
    status = _STATUS.search(text)
    code = int(status.group(1)) if status else 0
    msg = _message(text, code)
    if isinstance(exc, FileNotFoundError) or code == 404:
        return FileNotFoundError(errno.ENOENT, msg)
    if type(exc).__name__ in ("PermissionDeniedError", "UnauthenticatedError") or code in (401, 403):
        return PermissionError(errno.EACCES, msg)
    if code == 503:
        return OSError(errno.EBUSY, msg)
    if code >= 500:
        return OSError(errno.EREMOTEIO, msg)
    if code in (400, 416):
        return OSError(errno.EINVAL, msg)
    if code:
        return OSError(errno.EPROTO, msg)
    if type(exc).__module__.startswith("obstore") or type(exc).__name__ == "GenericError":
        kind = _KIND.search(text)
        name = kind.group(1) if kind else ""
        if name == "Connect":
            return ConnectionRefusedError(errno.ECONNREFUSED, msg)
        if name == "Timeout":
            return TimeoutError(errno.ETIMEDOUT, msg)
        if name in ("Request", "Interrupted", "Decode"):
            return ConnectionResetError(errno.ECONNRESET, msg)
    return exc


class ObstoreDriver(RequestDriver):
    """One bucket through obstore's async API; paths are ``bucket/key`` as with s3fs."""

    client = "obstore"

    def __init__(self, limiter: anyio.CapacityLimiter, obs: Any, store: Any, bucket: str,
                 retry: RetryPolicy | None = None) -> None:
        super().__init__(limiter, retry)
        self.obs = obs
        self.store = store
        self.bucket = bucket
        self._futures = ForeignFutures()

    def _key(self, path: str) -> str:
        bucket, _, key = path.strip("/").partition("/")
        if bucket != self.bucket:
            raise ValueError(f"{path!r} is not in bucket {self.bucket!r}")
        return key

    async def _call(self, fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        try:
            return await self._futures.wait(fn(self.store, *args, **kwargs))
        except Exception as exc:
            err = translate(exc)
            if err is exc:
                raise
            raise err from None

    async def _put(self, path: str, blob: bytes) -> None:
        await self._call(self.obs.put_async, self._key(path), blob,
                         use_multipart=len(blob) >= MULTIPART_BYTES, chunk_size=MULTIPART_BYTES)

    def _cat(self, limit: int) -> Callable[[str], Awaitable[Any]]:
        """One ranged GET of at most ``limit + 1`` bytes: obstore's ``Bytes`` (no copy)."""

        async def cat(path: str) -> Any:
            key = self._key(path)
            try:
                return await self._call(self.obs.get_range_async, key, start=0, end=limit + 1)
            except OSError as exc:
                # an empty object has no byte 0: S3 answers 416 to a ranged GET
                if exc.errno != errno.EINVAL or "416" not in str(exc):
                    raise
                got = await self._call(self.obs.get_async, key)
                data = await self._futures.wait(got.bytes_async())
                if len(data) > limit + 1:
                    raise
                return data

        return cat

    async def exists_many(self, paths: list[str]) -> list[bool]:
        """HEAD requests."""
        async def head(path: str) -> bool:
            await self._call(self.obs.head_async, self._key(path))
            return True

        res = await self._gather(head, [(p,) for p in paths])
        return [r is True for r in res]

    async def touch_many(self, paths: list[str]) -> None:
        """A copy to a temporary name and back (obstore's copy sets no metadata, and S3 refuses a
        copy onto itself without new metadata): the object's LastModified becomes now."""
        async def touch(path: str) -> None:
            key = self._key(path)
            tmp = self._key(temp_name(path))
            await self._call(self.obs.copy_async, key, tmp)
            try:
                await self._call(self.obs.copy_async, tmp, key)
            except Exception:
                with contextlib.suppress(Exception):
                    await self._call(self.obs.delete_async, tmp)
                raise
            # a temporary left behind (this delete failed, or the deadline cut the touch short) is
            # removed by the background scan, as any stale temporary is
            await self._call(self.obs.delete_async, tmp)

        await self._gather(touch, [(p,) for p in paths])

    async def delete_many(self, paths: list[str]) -> list[BaseException | None]:
        """DELETE requests, each on its own."""
        async def delete(path: str) -> None:
            await self._call(self.obs.delete_async, self._key(path))

        res = await self._gather(delete, [(p,) for p in paths])
        return [r if isinstance(r, BaseException) else None for r in res]

    async def listdir(self, root: str, pause: Callable[[], bool] | None = None) -> list[Entry]:
        """A recursive listing (one paginated call: ``pause`` is not asked)."""
        prefix = self._key(root)

        async def find() -> list[Entry]:
            out: list[Entry] = []
            try:
                stream = self.obs.list(self.store, prefix or None, chunk_size=1000)
                while True:
                    try:
                        chunk = await self._futures.wait(stream.__anext__())
                    except StopAsyncIteration:
                        break
                    out.extend(Entry(f"{self.bucket}/{m['path']}", int(m["size"]),
                                     m["last_modified"].timestamp()) for m in chunk)
            except Exception as exc:
                err = translate(exc)
                if err is exc:
                    raise
                raise err from None
            return out

        try:
            found: list[Entry] = await self._attempt(find, ())
        except FileNotFoundError:
            return []
        return found

    def abandon(self) -> None:
        """See :meth:`Driver.abandon`: :meth:`close` no longer waits for the requests in flight."""
        self._futures.abandon()

    async def close(self) -> None:
        """Wait for the requests in flight to end and obstore's threads to leave Python code (see
        :mod:`~tierkv.backends.fsspec._foreign`: a process that exits while one of them is there
        aborts)."""
        await self._futures.settle()

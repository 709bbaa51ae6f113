"""Credentials out of sight: URLs without user info, a tier's secrets removed from text, and the
storage libraries' own log records passed through the open tiers' redactors."""

from __future__ import annotations

import logging
import weakref
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

__all__ = ["Redactor", "redact_library_logs", "redact_url"]


def redact_url(url: str) -> str:
    """``url`` without user info (credentials) or query string."""
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


#: storage option names whose values are credentials (matched as substrings, lower case)
_SECRET_WORDS = ("key", "secret", "token", "password", "passwd", "credential", "auth", "session",
                 "signature", "sas", "private")


class Redactor:
    """Removes the credentials of one tier (URL user info, secret storage options) from text."""

    def __init__(self, url: str, storage_options: dict[str, Any]) -> None:
        found: set[str] = set()
        self._collect_url(url, found)
        self._collect(storage_options, False, found)
        #: longest first, so that a secret containing another is removed whole
        self.secrets = sorted((s for s in found if len(s) >= 3), key=len, reverse=True)

    @staticmethod
    def _collect_url(url: str, found: set[str]) -> None:
        try:
            parts = urlsplit(url)
        except ValueError:
            return
        for v in (parts.username, parts.password):
            if v:
                found.update((v, unquote(v)))
        if parts.query:
            found.add(parts.query)

    def _collect(self, value: Any, secret: bool, found: set[str]) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                name = str(k).lower()
                self._collect(v, secret or any(w in name for w in _SECRET_WORDS), found)
        elif isinstance(value, (list, tuple, set)):
            for v in value:
                self._collect(v, secret, found)
        elif isinstance(value, (str, bytes)):
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            if secret:
                found.add(text)
            elif "@" in text or "?" in text:
                self._collect_url(text, found)
        elif secret and value is not None and not isinstance(value, (bool, int, float)):
            found.add(str(value))

    def __call__(self, text: str) -> str:
        """``text`` with every credential replaced by ``***``."""
        for secret in self.secrets:
            if secret in text:
                text = text.replace(secret, "***")
        return text

    def endpoint(self, storage_options: dict[str, Any]) -> str:
        """`` (endpoint URL)`` when ``storage_options`` name one (S3-compatible servers), redacted."""
        url = storage_options.get("endpoint_url") or (storage_options.get("client_kwargs") or {}).get(
            "endpoint_url")
        return f" (endpoint {self(str(url))})" if url else ""

    def error(self, exc: BaseException) -> str:
        """A one-line description of ``exc`` (the first leaf of an exception group), redacted."""
        while isinstance(getattr(exc, "exceptions", None), (list, tuple)) and exc.exceptions:  # type: ignore[attr-defined]
            exc = exc.exceptions[0]  # type: ignore[attr-defined]
        if isinstance(exc, OSError) and exc.strerror:
            text = f"{type(exc).__name__}: [{exc.errno}] {exc.strerror}"
        elif str(exc):
            text = f"{type(exc).__name__}: {str(exc)[:300]}"
        elif isinstance(exc, TimeoutError):
            text = "TimeoutError: no answer in time"
        else:
            text = f"{type(exc).__name__} (no message)"
        return self(text)


#: loggers of the libraries an fsspec tier drives: their records pass through the redactors of the
#: open tiers (botocore logs access key ids and session tokens at DEBUG)
_LIBRARY_LOGGERS = frozenset({"botocore", "aiobotocore", "boto3", "s3fs", "fsspec", "urllib3", "aiohttp",
                              "gcsfs", "adlfs", "sshfs", "paramiko"})
_redactors: weakref.WeakSet[Redactor] = weakref.WeakSet()


def redact_library_logs(redactor: Redactor) -> None:
    """Keep ``redactor``'s credentials out of the storage libraries' log records while it lives.

    Installs (once) a log record factory that passes every record of those libraries' loggers,
    message and formatted traceback, through the redactors of the tiers that hold credentials.
    """
    if not redactor.secrets:
        return
    _redactors.add(redactor)
    current = logging.getLogRecordFactory()
    if getattr(current, "_tierkv_redacts", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = current(*args, **kwargs)
        if _redactors and record.name.partition(".")[0] in _LIBRARY_LOGGERS:
            try:
                msg = record.getMessage()
            except Exception:
                return record
            clean = msg
            for r in list(_redactors):
                clean = r(clean)
            if clean != msg:
                record.msg, record.args = clean, None
            if record.exc_info:
                text = logging.Formatter().formatException(record.exc_info)
                for r in list(_redactors):
                    text = r(text)
                record.exc_text = text
        return record

    factory._tierkv_redacts = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)

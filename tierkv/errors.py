"""Every exception tierkv raises.

All errors derive from :class:`TierKVError`, so ``except TierKVError`` catches anything the library
raises on purpose. Errors that describe bad arguments also derive from ``ValueError`` (or
``KeyError`` / ``LookupError`` where that is what a Python user expects), so existing handlers keep
working.
"""

from __future__ import annotations

import errno
from typing import Any

__all__ = [
    "BackendError",
    "BackendNotFound",
    "BenchError",
    "BlockMissing",
    "CapacityError",
    "ConfigError",
    "CorruptRecord",
    "InvalidArgument",
    "LayoutError",
    "StoreClosed",
    "TierKVError",
    "DOWN_TYPES",
    "TierUnavailable",
    "format_validation_error",
    "install_hint",
    "unavailable",
]


class TierKVError(Exception):
    """Base class of every error tierkv raises."""


class ConfigError(TierKVError, ValueError):
    """A configuration (dict, file, environment) is invalid; the message names the bad key."""


class LayoutError(ConfigError):
    """A :class:`~tierkv.Layout` or :class:`~tierkv.GroupSpec` is invalid."""


class CapacityError(ConfigError):
    """A capacity or slot budget cannot hold what the layout needs."""


class InvalidArgument(TierKVError, ValueError):
    """A call got an argument it cannot use (shape, dtype, device, group, hashes).

    Raised before any state changes.
    """


class BlockMissing(TierKVError, LookupError):
    """A block asked for by :meth:`~tierkv.TieredStore.get` is held by no tier."""

    def __init__(self, message: str, *, missing: list[int] | None = None) -> None:
        super().__init__(message)
        #: positions (in the hashes passed to ``get``) of the blocks that were missing
        self.missing: list[int] = list(missing or [])


class CorruptRecord(TierKVError):
    """A persistent record failed a check (checksum, magic, version, key, fingerprint, size).

    Inside the store this is never raised to the caller: the record is a counted miss and is removed.
    ``reason`` is a short machine-readable tag such as ``"checksum"`` or ``"truncated"``.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"corrupt record ({reason}){': ' + detail if detail else ''}")
        self.reason = reason


class BackendError(TierKVError):
    """A tier's backend failed an operation (I/O error, remote error)."""


class TierUnavailable(BackendError):
    """A tier does not answer now (down, unreachable, hung): a store opens without it and
    attaches it when it answers, unless the tier is ``required``."""


class BackendNotFound(TierKVError, LookupError):
    """No backend is registered for a tier ``kind``, or its optional dependency is missing."""


class BenchError(TierKVError):
    """A benchmark could not run or finish (a missing engine or server, a failed restore); the CLI
    prints it in one line."""


class StoreClosed(TierKVError, RuntimeError):
    """The store is not open (used outside ``async with``) or was closed."""


def format_validation_error(exc: Any, prefix: str = "") -> str:
    """A pydantic ``ValidationError`` as one line per problem, each naming its key path (e.g.
    ``tiers.1.url: Field required``), never the values given (they may hold credentials)."""
    lines = []
    for err in exc.errors(include_url=False, include_input=False, include_context=False):
        loc = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
        msg = str(err["msg"]).removeprefix("Value error, ")
        lines.append(f"{loc or '<root>'}: {msg}")
    return "; ".join(lines)


#: this project's distribution name on the package index (the import name is ``tierkv``; the index's
#: ``tierkv`` is an unrelated project)
DISTRIBUTION = "tierkv-cache"

#: what each optional extra brings, as pip requirements
EXTRAS = {
    "s3": "s3fs>=2024.6",
    "metrics": "prometheus-client>=0.20",
    "plot": "matplotlib>=3.7",
    "mooncake": "mooncake-transfer-engine-non-cuda>=0.3.13",
    "encrypt": "cryptography>=42",
}


def install_hint(extra: str) -> str:
    """How to install an optional extra into the environment that runs tierkv."""
    need = EXTRAS.get(extra, extra)
    return (f"pip install '{need}' (the [{extra}] extra of {DISTRIBUTION}; from a tierkv checkout: "
            f"pip install -e '.[{extra}]')")


#: errors of a file system that is down or unreachable (a dead FUSE daemon, a lost NFS server)
_DOWN_ERRNO = frozenset({errno.ENOTCONN, errno.ESTALE, errno.EHOSTDOWN, errno.EHOSTUNREACH,
                         errno.ENETUNREACH, errno.ENETDOWN, errno.EIO, errno.ETIMEDOUT,
                         errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED})
#: botocore / aiohttp exceptions of a server that does not answer (matched by class name)
DOWN_TYPES = frozenset({"EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError",
                         "ConnectTimeoutError", "ConnectionError", "ServerDisconnectedError",
                         "ClientConnectionError", "ClientOSError", "ProxyConnectionError",
                         "TimeoutError", "ServerTimeoutError", "TierUnavailable"})


def unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says a tier does not answer now (worth waiting for), rather than that it
    is set up wrong (a bad setting, a missing bucket, no permission: waiting will not cure it)."""
    seen = 0
    e: BaseException | None = exc
    while e is not None and seen < 8:
        if isinstance(e, OSError) and e.errno in _DOWN_ERRNO:
            return True
        if any(t.__name__ in DOWN_TYPES for t in type(e).__mro__):
            return True
        e = e.__cause__ or e.__context__
        seen += 1
    return False

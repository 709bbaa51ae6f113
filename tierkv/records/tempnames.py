"""Temporary names of records being written: ``.<name>.tkvtmp-<host>-<pid>-<random>`` beside the
record, renamed into place when whole; host and pid say who wrote one, so a sweep removes only the
leftovers of processes that are gone."""

from __future__ import annotations

import os
import secrets
import socket

__all__ = ["HOST", "TEMP_MARK", "temp_name", "temp_owner_alive"]

#: temporary files are ``.<name>.tkvtmp-<host>-<pid>-<random>``: host and pid say who wrote them
TEMP_MARK = ".tkvtmp-"
HOST = socket.gethostname().replace("-", "_")[:32] or "host"


def temp_name(path: str) -> str:
    """A unique temporary name beside ``path``."""
    head, _, tail = path.rpartition("/")
    return f"{head}/.{tail}{TEMP_MARK}{HOST}-{os.getpid()}-{secrets.token_hex(6)}"


def temp_owner_alive(name: str) -> bool | None:
    """Whether the process that wrote temporary file ``name`` still runs (None: another host)."""
    _, _, owner = name.partition(TEMP_MARK)
    parts = owner.split("-")
    if len(parts) != 3 or parts[0] != HOST or not parts[1].isdigit():
        return None
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

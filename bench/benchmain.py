"""How every script in ``bench/`` starts and ends: Ctrl-C prints one line and exits with 130.

Import it before the heavy imports (torch, vLLM: seconds), so an interrupt while they load ends
the script quietly too, and end the script with ``run(main)``: the script's own ``finally``
blocks (temporary directories, servers, child engines) run as the interrupt unwinds.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

__all__ = ["directory", "interrupted", "positive", "positive_list", "remove_at_exit", "require", "run"]

NAME = os.path.splitext(os.path.basename(sys.argv[0]))[0] or "bench"


def _while_importing(signum: int, frame: object) -> None:
    os.write(2, f"{NAME}: interrupted\n".encode())
    os._exit(130)


if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGINT, _while_importing)


def require(module: str, what: str, hint: str) -> None:
    """Exit with one line (``<script>: needs <what>: <hint>``) when ``module`` cannot be imported."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        sys.exit(f"{NAME}: needs {what}: {hint}")


def positive(text: str) -> int:
    """An argparse ``type``: a whole number of at least 1 (counts, sizes, rounds)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a whole number of at least 1, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a whole number of at least 1, not {value}")
    return value


def positive_list(text: str) -> list[int]:
    """An argparse ``type``: comma-separated whole numbers of at least 1 (``1,4``)."""
    return [positive(x) for x in text.split(",")]


def directory(text: str) -> str:
    """An argparse ``type``: a directory that exists."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"no such directory: {text}")
    return text


def remove_at_exit(path: str) -> str:
    """Remove the directory ``path`` when the script exits, however it ends (a ``finally`` that
    removes it may itself be cut short by Ctrl-C); returns ``path``."""
    atexit.register(shutil.rmtree, path, True)
    return path


def interrupted(exc: BaseException | None) -> bool:
    """Whether ``exc`` is Ctrl-C, or an error raised while Ctrl-C unwound (a cleanup it cut short:
    ``shutil.rmtree`` interrupted half-way raises ``EBADF`` from its own ``finally``). The same test
    as ``tierkv.tools.interrupts.interrupted``, kept here: bench/peers.py's children import this module
    in LMCache's and SGLang's venvs, where tierkv is not installed."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__context__
    return False


def run(main: Callable[[], int | None]) -> NoReturn:
    """Call ``main`` and exit with what it returned (``None`` is 0); on Ctrl-C, one line and 130."""
    try:
        # inside the try: a Ctrl-C that lands as the handler changes is caught like any other
        signal.signal(signal.SIGINT, signal.default_int_handler)
        code = main()
    except BaseException as exc:
        if not interrupted(exc):
            raise
        print(f"{NAME}: interrupted", file=sys.stderr)
        code = 130
    sys.exit(code)

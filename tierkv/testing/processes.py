"""Child processes that die with their parent: the test servers' and the benchmarks' engines."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import IO, Any, NoReturn

from tierkv.errors import TierKVError

__all__ = ["CHILD_ERROR", "child_failure", "free_ports", "kill_group", "run_child", "spawn"]

try:  # loaded up front: no dlopen in a child between fork and exec
    _LIBC: Any = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
except OSError:
    _LIBC = None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: killed if the parent dies


def spawn(cmd: list[str], log: IO[bytes], env: dict[str, str], cwd: str | os.PathLike[str] | None = None,
          stdin: int | None = subprocess.DEVNULL,
          stdout: int | IO[bytes] | None = None) -> subprocess.Popen[bytes]:
    """A child in its own session (Ctrl-C reaches only the parent, which stops it), killed with the
    parent; stderr (and stdout unless given) go to ``log``."""
    return subprocess.Popen(cmd, stdin=stdin, stdout=log if stdout is None else stdout, stderr=log, env=env,
                            cwd=cwd, start_new_session=True,
                            preexec_fn=_die_with_parent if _LIBC is not None else None)


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a child started by :func:`spawn` and everything in its session, then reap it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGCONT)  # a frozen child dies too
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)


#: the prefix of the one line a child process run by :func:`run_child` ends with when it fails on
#: purpose (a tierkv error, an OS error): the parent repeats that line, not the child's traceback
CHILD_ERROR = "tierkv-child-error: "


def run_child(main: Callable[[], object]) -> None:
    """Run a child process's ``main``: a tierkv or OS error ends it with one line and exit 2.

    Once ``main`` is done the process ends at once (``os._exit`` after flushing its output),
    without the interpreter's teardown: a native library's threads may still be inside Python
    code there, which aborts the process (obstore's did, until its driver's ``close`` waited for
    them: :mod:`tierkv.backends.fsspec._foreign`), and the parent would take a child that did all
    it was asked for as failed.
    """
    try:
        main()
    except (TierKVError, OSError) as exc:
        print(f"{CHILD_ERROR}{str(exc) or type(exc).__name__}", file=sys.stderr, flush=True)
        _end(2)
    _end(0)


def _end(status: int) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(status)


def child_failure(what: str, stderr: str, returncode: int | None = None) -> TierKVError:
    """The error a parent raises for a failed child: its one-line reason when :func:`run_child` gave
    one, else the end of its stderr (and how it ended, when it said nothing)."""
    for line in reversed(stderr.splitlines()):
        if line.startswith(CHILD_ERROR):
            return TierKVError(f"{what}: {line[len(CHILD_ERROR):]}")
    ended = "it exited with no message"
    if returncode is not None and returncode < 0:
        ended = f"it was killed by signal {-returncode} with no message"
    elif returncode is not None:
        ended = f"it exited with status {returncode} and no message"
    return TierKVError(f"{what}: {stderr.strip()[-500:] or ended}")


def free_ports(n: int) -> list[int]:
    """``n`` TCP ports free on 127.0.0.1 now (for servers the tests start)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()

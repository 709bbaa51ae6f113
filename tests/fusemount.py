"""A real FUSE network file system for tests: SeaweedFS's ``weed mount`` of the test server's filer.

:class:`WeedMount` mounts a fresh filer directory at a local path (``fuse3``'s ``fusermount3`` and
``/dev/fuse`` are needed: ``scripts/dev`` installs fuse3 where it runs as root), and can stop the
FUSE daemon (SIGSTOP: a hung mount), resume it, kill it (SIGKILL: every call on the mount then
fails with ENOTCONN) and mount again. ``missing()`` says what this machine lacks, for a skip that
names it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

from tierkv.testing.processes import kill_group, spawn
from tierkv.testing.seaweed import SeaweedServer

__all__ = ["WeedMount", "missing"]


def missing() -> str:
    """What this machine lacks to mount a FUSE file system ('' when nothing)."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (a container without FUSE)"
    if shutil.which("fusermount3") is None and shutil.which("fusermount") is None:
        return "fusermount3 is missing: install the OS package fuse3 (scripts/dev does where it runs as root)"
    return ""


def _unmount(path: Path) -> None:
    tool = shutil.which("fusermount3") or shutil.which("fusermount") or "fusermount3"
    subprocess.run([tool, "-u", "-z", str(path)], capture_output=True, timeout=30)


class WeedMount:
    """``weed mount`` of a new directory of ``server``'s filer at ``path``."""

    def __init__(self, server: SeaweedServer, path: Path, env: dict[str, str] | None = None) -> None:
        assert server.weed is not None
        self.server = server
        self.path = path
        self.filer_dir = f"/tierkv-fuse-{uuid.uuid4().hex[:10]}"
        self.log_path = path.parent / f"{path.name}.mount.log"
        #: the daemon's chunk cache (about 100 MB once files are read); by default ``weed mount``
        #: puts it in a new directory of $TMPDIR that nothing removes
        self.cache_dir = path.parent / f"{path.name}.cache"
        #: its control socket (by default /tmp/seaweedfs-mount-<hash>.sock, left behind when killed)
        self.socket = path.parent / f"{path.name}.sock"
        self.env = dict(os.environ) if env is None else env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> None:
        """Mount and wait until the path is a mount point."""
        self.path.mkdir(parents=True, exist_ok=True)
        p = self.server.ports
        cmd = [str(self.server.weed), "-logtostderr", "mount",
               f"-filer=127.0.0.1:{p['filer']}.{p['filer_grpc']}",
               f"-filer.path={self.filer_dir}", f"-dir={self.path}", f"-cacheDir={self.cache_dir}",
               f"-localSocket={self.socket}", "-allowOthers=false"]
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = spawn(cmd, log, self.env)
        deadline = time.monotonic() + timeout
        while not os.path.ismount(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"weed mount did not mount {self.path}: {self.log_tail()}")
            time.sleep(0.05)

    def freeze(self) -> None:
        """SIGSTOP the FUSE daemon: every call on the mount hangs until :meth:`thaw`."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT the FUSE daemon."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the FUSE daemon: the mount stays, dead (ENOTCONN), until it is mounted again."""
        if self.proc is not None:
            kill_group(self.proc)
            self.proc = None

    def remount(self) -> None:
        """Unmount the dead mount and mount the same filer directory again."""
        self.kill()
        _unmount(self.path)
        self.start()

    def close(self) -> None:
        """Unmount and stop the daemon (a frozen one too); remove its cache."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
        _unmount(self.path)
        self.kill()
        shutil.rmtree(self.cache_dir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

"""A real Mooncake Store master on loopback for tests and benchmarks: ``mooncake_master``.

``MooncakeMaster(log_dir).start()`` runs one master with its RPC port and its HTTP metrics server on
127.0.0.1 (free ports picked here; the metrics server binds every address unless told otherwise);
:attr:`MooncakeMaster.endpoint` is what a ``mooncake`` tier's ``master`` setting takes. ``kill()``
SIGKILLs it (every object's placement goes with it), ``restart()`` starts it again on the same
port, ``close()`` stops it for good.

:class:`UnfinishedPuts` is a process that starts puts on a master and never finishes them, until
it is killed: what a node killed in the middle of a put leaves behind.

The binary comes from the ``mooncake-transfer-engine-non-cuda`` wheel (the ``mooncake`` extra),
which puts ``mooncake_master`` next to the interpreter; ``$MOONCAKE_MASTER_BIN`` overrides, ``PATH``
is the last resort. :func:`missing` says what is missing (the binary, the client library or the
OS libraries it links), or None.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tierkv.errors import install_hint
from tierkv.testing.processes import free_ports, kill_group, spawn

__all__ = ["OS_PACKAGES", "MooncakeMaster", "StorageNode", "UnfinishedPuts", "find_master", "missing"]

#: Debian packages the wheel's libraries link against
OS_PACKAGES = ("libcurl4", "libibverbs1", "librdmacm1", "rdma-core", "libnuma1", "liburing2")
READY_TIMEOUT = 30.0


def find_master(name: str = "mooncake_master") -> str | None:
    """``mooncake_master`` (or another binary of the wheel, ``name``): ``$MOONCAKE_MASTER_BIN``
    (the master only), the interpreter's bin dir, then ``PATH``."""
    env = os.environ.get("MOONCAKE_MASTER_BIN") if name == "mooncake_master" else None
    if env:
        return env if os.access(env, os.X_OK) else None
    for candidate in (Path(sys.executable).parent / name, Path(sys.prefix) / "bin" / name):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which(name)


def missing() -> str | None:
    """What a test with a real master lacks here (one line), or None."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return (f"the Mooncake client cannot be imported ({exc}); {install_hint('mooncake')}, and the OS "
                f"packages {' '.join(OS_PACKAGES)}")
    if find_master() is None:
        return ("no mooncake_master binary (looked at $MOONCAKE_MASTER_BIN, the venv, PATH); "
                f"{install_hint('mooncake')}")
    return None


class MooncakeMaster:
    """One ``mooncake_master`` process on 127.0.0.1."""

    def __init__(self, log_dir: str | os.PathLike[str], lease_ms: int = 10_000,
                 eviction_high_watermark_ratio: float = 0.9, eviction_ratio: float = 0.05,
                 client_ttl_s: int = 10) -> None:
        binary = find_master()
        if binary is None:
            raise FileNotFoundError(missing() or "no mooncake_master")
        self.binary = binary
        self.port, self.metrics_port = free_ports(2)
        self.log_path = Path(log_dir) / f"mooncake-master-{self.port}.log"
        self.args = ["--rpc_address=127.0.0.1", f"--rpc_port={self.port}", "--metrics_host=127.0.0.1",
                     f"--metrics_port={self.metrics_port}", f"--default_kv_lease_ttl={lease_ms}",
                     f"--eviction_high_watermark_ratio={eviction_high_watermark_ratio}",
                     f"--eviction_ratio={eviction_ratio}",
                     f"--client_ttl={client_ttl_s}"]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:<port>``: a ``mooncake`` tier's ``master``."""
        return f"127.0.0.1:{self.port}"

    def start(self) -> MooncakeMaster:
        """Start the master and wait until its RPC port accepts connections."""
        with open(self.log_path, "ab") as log:
            self.proc = spawn([self.binary, *self.args], log, dict(os.environ))
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}; see {self.log_path}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return self
            time.sleep(0.05)
        self.close()
        raise RuntimeError(f"mooncake_master did not listen on {self.endpoint} within {READY_TIMEOUT:g}s")

    def kill(self) -> None:
        """SIGKILL the master."""
        if self.proc is not None:
            kill_group(self.proc)
            self.proc = None

    def freeze(self, frozen: bool = True) -> None:
        """SIGSTOP the master (a hung server: connections open, no answers), or SIGCONT it.

        Returns once every thread of the master is stopped (or running again): a signal is
        acted on when each thread next runs, so a thread still running when ``kill`` returns
        could answer one more request from a master a test takes for hung.
        """
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP if frozen else signal.SIGCONT)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            stopped = _all_stopped(self.proc.pid)
            if stopped is None or stopped is frozen:
                return
            time.sleep(0.001)

    def restart(self) -> MooncakeMaster:
        """Start it again on the same port (its objects are gone: a master keeps them in memory)."""
        self.kill()
        return self.start()

    def close(self) -> None:
        """Stop it for good."""
        self.kill()

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class StorageNode:
    """A ``mooncake_client`` process: a node that only contributes ``segment_bytes`` of memory to
    the master's pool (objects written by processes that contribute none live there)."""

    def __init__(self, master: MooncakeMaster, segment_bytes: int) -> None:
        binary = find_master("mooncake_client")
        if binary is None:
            raise FileNotFoundError(f"no mooncake_client binary; {install_hint('mooncake')}")
        (self.port,) = free_ports(1)
        self.log_path = master.log_path.with_name(f"mooncake-node-{self.port}.log")
        self.cmd = [binary, f"--master_server_address={master.endpoint}", "--host=127.0.0.1",
                    f"--port={self.port}", "--protocol=tcp", "--metadata_server=P2PHANDSHAKE",
                    f"--global_segment_size={segment_bytes >> 20} MB"]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> StorageNode:
        """Start it and wait until it serves (its segment is then mounted)."""
        with open(self.log_path, "ab") as log:
            self.proc = spawn(self.cmd, log, dict(os.environ))
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_client exited with {self.proc.returncode}; see {self.log_path}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return self
            time.sleep(0.05)
        self.close()
        raise RuntimeError(f"mooncake_client did not serve on port {self.port} within {READY_TIMEOUT:g}s")

    def close(self) -> None:
        """Stop it (its segment and every object in it leave the pool)."""
        if self.proc is not None:
            kill_group(self.proc)
            self.proc = None

    def __enter__(self) -> StorageNode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


#: the process of :class:`UnfinishedPuts`: a client that contributes no memory starts the puts
#: (Mooncake's put session: the master places each object and holds it as being written) and
#: waits to be killed
_UNFINISHED = """
import json, sys, time
from mooncake.store import MooncakeDistributedStore, ReplicateConfig
spec = json.loads(sys.stdin.readline())
store = MooncakeDistributedStore()
rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", spec["master"])
codes = []
if rc == 0:
    codes = list(store.batch_put_session_start(spec["names"], spec["sizes"], ReplicateConfig()))
print(json.dumps({"setup": rc, "codes": codes}), flush=True)
while True:
    time.sleep(60)
"""


class UnfinishedPuts:
    """A process that starts puts of ``names`` (``sizes`` bytes each) on ``master`` and never ends
    them, until :meth:`kill`: the master holds each name as being written, not readable, as it
    does after a node was killed in the middle of a put (Mooncake lets the unfinished put go only
    when another one starts, ``put_start_discard_timeout_sec`` later, 30 s by default)."""

    def __init__(self, master: MooncakeMaster, names: Sequence[str], sizes: Sequence[int]) -> None:
        self.master = master
        self.names = list(names)
        self.sizes = list(sizes)
        self.log_path = master.log_path.with_name(f"mooncake-unfinished-{os.getpid()}-{id(self):x}.log")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> UnfinishedPuts:
        """Start the process; return once every put has started (RuntimeError saying why not)."""
        with open(self.log_path, "ab") as log:
            self.proc = spawn([sys.executable, "-c", _UNFINISHED], log, dict(os.environ),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"master": self.master.endpoint, "names": self.names,
                                          "sizes": self.sizes}).encode() + b"\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], READY_TIMEOUT)
        line = self.proc.stdout.readline() if ready else b""
        try:
            answer = json.loads(line)
        except ValueError:
            answer = None
        if not answer or answer["setup"] != 0 or any(c != 0 for c in answer["codes"]):
            self.kill()
            raise RuntimeError(f"the unfinished puts did not start ({answer or 'no answer'}); "
                               f"see {self.log_path}")
        return self

    def kill(self) -> None:
        """SIGKILL the process (the puts stay unfinished on the master)."""
        if self.proc is not None:
            kill_group(self.proc)
            for f in (self.proc.stdin, self.proc.stdout):
                if f is not None:
                    f.close()
            self.proc = None

    def __enter__(self) -> UnfinishedPuts:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()


def _all_stopped(pid: int) -> bool | None:
    """Whether every thread of ``pid`` is stopped (state T); None where /proc cannot say."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        states = []
        for t in tasks:
            with open(f"/proc/{pid}/task/{t}/stat") as f:
                states.append(f.read().rpartition(")")[2].split()[0])
    except OSError:
        return None
    return all(st in ("T", "t") for st in states)

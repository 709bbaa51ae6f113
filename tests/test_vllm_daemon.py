"""Real vLLM CPU engines sharing one tierkv daemon (``daemon`` in kv_connector_extra_config).

Two engine processes run side by side on one daemon (its CPU pool, a file tier below): the second
is served the first's prefix from the daemon's pool without a read from the tier; the daemon is
restarted while both run and they restore the prefix from its file tier, token for token; the first
is killed (SIGKILL) in the middle of a run and the second goes on, while the daemon lets go of
what the dead engine held.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.test_daemon import ENV, Daemon
from tests.test_vllm_engine import RUNNER, same_output

pytest.importorskip("vllm.v1.kv_offload.base")

pytestmark = pytest.mark.slow

PROMPT_LEN = 200
AT_LEAST = 192  # whole 32-token engine blocks of the 200-token prompt


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return os.environ.get("TIERKV_TEST_MODELS") or str(tmp_path_factory.mktemp("models"))


class Engine:
    """A vLLM engine process taking its steps one line at a time (tests/engine/run_engine.py)."""

    def __init__(self, models_dir: str, shm: Path, sock: str, tier: str) -> None:
        args = {"model": "llama", "url": tier, "prompt_len": PROMPT_LEN, "max_model_len": 1024,
                "shm_dir": str(shm), "daemon": sock, "steps": "stdin", "max_num_seqs": 8}
        env = {**ENV, "TIERKV_TEST_MODELS": models_dir, "VLLM_LOGGING_LEVEL": "WARNING"}
        self.proc = subprocess.Popen([sys.executable, str(RUNNER), json.dumps(args)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._drain, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("[tierkv-run] "):
                self.events.put(json.loads(line.split(" ", 1)[1]))
        self.events.put({"kind": "exit"})

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line)
            del self.err[:-200]

    def send(self, step: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(step + "\n")
        self.proc.stdin.flush()

    def wait_for(self, kind: str, timeout: float = 400) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                ev = self.events.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no {kind!r} from the engine in {timeout} s:\n{''.join(self.err)[-4000:]}")
            if ev["kind"] == "exit":
                pytest.fail(f"the engine exited (rc {self.proc.wait()}):\n{''.join(self.err)[-6000:]}")
            if ev["kind"] == kind:
                return ev

    def generate(self, tag: str) -> dict[str, Any]:
        self.send(tag)
        out = self.wait_for("generate")
        assert out["tag"] == tag
        return out

    def stats(self) -> dict[str, Any]:
        self.send("stats")
        return self.wait_for("stats")

    def quit(self) -> None:
        self.send("quit")
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.wait_for("done")
        assert self.proc.wait(timeout=120) == 0, "".join(self.err)[-4000:]


def test_two_engines_share_a_prefix_through_the_daemon_and_survive_its_restart_and_a_kill(
        models_dir: str, tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    tier = f"file://{tmp_path / 'tier'}"
    daemon = Daemon(tmp_path, cpu_bytes_to_use=64 << 20, shm_dir=str(shm), drop_grace_s=2.0,
                    tiers=[{"kind": "fsspec", "url": tier}]).start()
    engines: list[Engine] = []
    try:
        first = Engine(models_dir, shm, daemon.socket, tier)
        engines.append(first)
        first.wait_for("started")
        original = first.generate("run1")
        assert original["num_cached_tokens"] == 0

        # a second engine process: the prefix comes from the daemon's pool, not from the tier
        second = Engine(models_dir, shm, daemon.socket, tier)
        engines.append(second)
        second.wait_for("started")
        shared = second.generate("run1")
        assert shared["num_cached_tokens"] >= AT_LEAST, "the second engine was not served the prefix"
        same_output(original, shared)
        file_tier = second.stats()["tiers"][1]
        assert file_tier["bytes_read"] == 0 and file_tier["promotions"] == 0, file_tier

        # the daemon restarted while both run: its pool is new and empty, its file tier is not
        rc, err = daemon.stop()
        assert rc == 0, err
        daemon.start()
        for engine in (first, second):
            engine.send("reset")  # drop vLLM's own prefix cache: the prefix must come through tierkv
            deadline = time.monotonic() + 60
            while True:
                again = engine.generate("run1")
                same_output(original, again)  # never wrong, even before the engine reattached
                if again["num_cached_tokens"] >= AT_LEAST:
                    break
                assert time.monotonic() < deadline, "the engine never restored from the restarted daemon"
                engine.send("reset")
        assert second.stats()["tiers"][1]["promotions"] > 0, "restored from the daemon's file tier"

        # the first engine killed in the middle of a run: the second serves on, the daemon lets go
        first.send("prompts=6:400:99:64")
        first.wait_for("step")
        first.send("busy")
        first.wait_for("step")
        time.sleep(1.0)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(timeout=60)
        second.send("reset")
        again = second.generate("run1")
        same_output(original, again)
        assert again["num_cached_tokens"] >= AT_LEAST
        # the killed engine's requests (six prompts) go; the second's last one is finished by vLLM
        # only in its next step, so at most that one is left
        deadline = time.monotonic() + 30
        while second.stats()["requests_active"] > 1:
            assert time.monotonic() < deadline, "the killed engine's requests outlived it in the daemon"
            time.sleep(0.5)
        second.quit()
        engines.remove(second)
        assert daemon.alive(), "the daemon must outlive its engines"
    finally:
        for engine in engines:
            if engine.proc.poll() is None:
                engine.proc.kill()
                engine.proc.wait()
        rc, err = daemon.stop()
    assert rc == 0, err
    left = sorted(p.name for p in shm.iterdir())
    assert not left, f"left in shm_dir: {left}"

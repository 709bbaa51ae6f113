"""The ``tierkv`` command as a user hits it: wrong flags, bad URLs, odd paths, Ctrl-C. One plain
line and a documented exit code, never a traceback; output whole at 80 columns and in a pipe."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
import torch

from tierkv import GroupSpec, Layout, TieredStore
from tierkv.cli import build_parser

LAYOUT = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=4096)])


def tierkv(*args: str, env: dict[str, str] | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tierkv.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "80", **(env or {})})


def no_traceback(res: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in res.stderr + res.stdout, res.stderr
    assert "rich.errors" not in res.stderr


def make_tier(root: Path, namespace: str = "cli") -> str:
    async def fill() -> str:
        cfg = {"layout": LAYOUT, "namespace": namespace,
               "tiers": [{"kind": "cpu", "slots": {0: 8}}, {"kind": "fsspec", "url": f"file://{root}"}]}
        async with TieredStore(cfg) as store:
            await store.put(0, [bytes([i]) * 16 for i in range(3)], torch.zeros(3, 4096, dtype=torch.uint8))
            await store.flush()
            return store.fingerprint

    return anyio.run(fill)


@pytest.mark.parametrize("args", [
    ["demo", "--requests", "-5"], ["demo", "--documents", "0"], ["simulate", "--kinds", "full,bogus"],
    ["simulate", "--slots", "x"], ["verify", "/tmp", "-o", "foo"],
    ["inspect", "/tmp", "--concurrency", "-1"], ["verify", "/tmp", "--stale-temp-s", "nan"],
    ["bench", "tier", "/tmp", "--blocks", "0"], ["nosuchcommand"], ["simulate", "--slots", "9=1"],
])
def test_usage_errors_exit_2_in_one_line(args: list[str]) -> None:
    res = tierkv(*args)
    assert res.returncode == 2, res
    no_traceback(res)
    assert res.stderr.strip(), "the error says something"


@pytest.mark.parametrize("url", ["nosuch://x", "/proc/nope"])
def test_bench_tier_on_an_unusable_url_is_one_line(url: str) -> None:
    """Nothing was written, so nothing to clean up: no second line about the cleanup."""
    res = tierkv("bench", "tier", url, "--no-cold", "--blocks", "4", "--block-kib", "64")
    assert res.returncode == 2, res
    no_traceback(res)
    assert res.stderr.startswith("tierkv: error:") and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_bench_tier_leaves_the_directory_as_it_found_it(tmp_path: Path) -> None:
    (tmp_path / "mine").write_text("a file of the user's")
    res = tierkv("bench", "tier", str(tmp_path), "--no-cold", "--blocks", "8", "--block-kib", "64",
                 "--json")
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["mine"]


def test_the_bad_value_is_named() -> None:
    res = tierkv("inspect", "/tmp", "--concurrency", "-1")
    assert "--concurrency" in res.stderr and "store" not in res.stderr.lower()


@pytest.mark.parametrize("lower", ["/etc/passwd/x", "bogus://x/y"])
def test_demo_with_an_unusable_lower_tier_is_one_clear_line(lower: str) -> None:
    res = tierkv("demo", "--requests", "4", "--lower", lower)
    assert res.returncode == 2
    no_traceback(res)
    assert res.stderr.startswith("tierkv: error:") and len(res.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("url", ["s3:/bucket", "", "file://", "nosuchproto://x/y"])
def test_inspect_and_verify_of_urls_that_name_nothing(url: str) -> None:
    for cmd in ("inspect", "verify"):
        res = tierkv(cmd, url)
        assert res.returncode == 2, (cmd, url, res)
        no_traceback(res)


@pytest.mark.parametrize("url", ["s3://", "s3:///kv", "gs://"])
def test_an_object_store_url_without_a_bucket_says_so(url: str) -> None:
    for cmd in ("inspect", "verify"):
        res = tierkv(cmd, url)
        assert res.returncode == 2, (cmd, url, res)
        no_traceback(res)
        scheme = url.split(":")[0]
        assert res.stderr.strip().splitlines() == [
            f"tierkv: error: names no bucket: {url!r} (such as {scheme}://bucket/prefix)"], res.stderr


def test_paths_with_markup_characters_are_shown_as_they_are(tmp_path: Path) -> None:
    for name in ("kv[bold]x", "kv[/x]"):
        root = tmp_path / name
        root.mkdir(parents=True)
        make_tier(root)
        for cmd in ("inspect", "verify"):
            res = tierkv(cmd, str(root))
            assert res.returncode == 0, res
            no_traceback(res)
            assert name in res.stdout, f"{cmd} must print the path {name!r} as it is"


def test_verify_pointed_at_the_wrong_place_says_where_the_namespaces_are(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    fp = make_tier(root)
    res = tierkv("verify", str(root / fp))
    assert res.returncode == 2 and "one level up" in res.stderr and str(root) in res.stderr
    res = tierkv("verify", str(root / fp / "g00000000"))
    assert res.returncode == 2 and "2 levels up" in res.stderr
    res = tierkv("verify", str(tmp_path))
    assert res.returncode == 2 and "found namespaces under" in res.stderr and "tier" in res.stderr
    unrelated = tmp_path / "unrelated"
    unrelated.mkdir()
    (unrelated / "notes.txt").write_text("hello")
    res = tierkv("verify", str(unrelated))
    assert res.returncode == 2 and "no tierkv namespace here" in res.stderr
    for r in (res,):
        no_traceback(r)


@pytest.mark.parametrize("damage", ["missing", "garbage"])
def test_a_missing_or_garbage_layout_json_is_not_clean(tmp_path: Path, damage: str) -> None:
    fp = make_tier(tmp_path)
    manifest = tmp_path / fp / "layout.json"
    if damage == "missing":
        manifest.unlink()
    else:
        manifest.write_text("{not json")
    res = tierkv("verify", str(tmp_path))
    assert res.returncode == 1, res
    assert "LAYOUT" in res.stdout and ("missing" in res.stdout or "unreadable" in res.stdout)


def test_stale_temporary_files_get_a_hint_and_strict_mode_exits_3(tmp_path: Path) -> None:
    fp = make_tier(tmp_path)
    stale = tmp_path / fp / ".x.tkv.tkvtmp-otherhost-1-abcdef"
    stale.write_bytes(b"half")
    os.utime(stale, (1, 1))
    res = tierkv("verify", str(tmp_path))
    assert res.returncode == 0 and "--repair" in res.stdout and "stale" in res.stdout
    assert tierkv("verify", str(tmp_path), "--strict").returncode == 3
    assert tierkv("verify", str(tmp_path), "--strict", "--repair").returncode == 0
    assert not stale.exists()


def test_output_stays_whole_at_80_columns_and_in_a_pipe(tmp_path: Path) -> None:
    root = tmp_path / ("a-rather-long-directory-name-" * 4 + "end")
    make_tier(root, namespace="a namespace with a name long enough to wrap a table title at 80 columns")
    res = tierkv("inspect", str(root))
    assert res.returncode == 0
    assert str(root) in res.stdout, "a long path is printed whole, not cut"
    assert "…" not in res.stdout
    assert "a name long enough to wrap a table title at 80 columns" in res.stdout.replace("\n", " ") or (
        "80 columns" in res.stdout)


def test_ctrl_c_exits_130_without_a_traceback() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "tierkv.cli", "demo", "--requests", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(4)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    # 130, or death by SIGINT, which a shell reports as 130 too (seen when the signal lands while
    # the interpreter is already exiting)
    assert proc.returncode in (130, -signal.SIGINT), err
    assert "Traceback" not in err and "interrupted" in err


def test_ctrl_c_while_the_commands_are_still_importing_exits_130_without_a_traceback() -> None:
    """SIGINT arrives while the command modules (torch among them) are being imported: a slow
    disk or a cold page cache makes that window seconds long."""
    code = ("import importlib.abc, os, signal, sys\n"
            "class Interrupt(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name == 'tierkv.cli.run_cmds':\n"
            "            os.kill(os.getpid(), signal.SIGINT)\n"
            "        return None\n"
            "sys.meta_path.insert(0, Interrupt())\n"
            "from tierkv.cli import main\n"
            "sys.exit(main(['demo']))\n")
    assert "interrupted" in _interrupted(code, timeout=120)


def test_ctrl_c_during_a_commands_own_imports_exits_even_if_the_import_swallows_it() -> None:
    """A command imports its heavy modules when it runs (torch's among them); a KeyboardInterrupt
    raised inside such an import can be swallowed by it (seen: the demo went on serving after
    Ctrl-C). Until the command starts its work, Ctrl-C exits at once instead."""
    code = ("import importlib.abc, os, signal, sys, time\n"
            "class Swallow(importlib.abc.MetaPathFinder):\n"
            "    fired = False\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name == 'tierkv.tools.demo' and not Swallow.fired:\n"
            "            Swallow.fired = True\n"
            "            try:\n"
            "                os.kill(os.getpid(), signal.SIGINT)\n"
            "                time.sleep(0.5)\n"
            "            except KeyboardInterrupt:\n"
            "                pass\n"
            "        return None\n"
            "from tierkv.cli import main\n"
            "sys.meta_path.insert(0, Swallow())\n"
            "sys.exit(main(['demo', '--requests', '100000']))\n")
    assert _interrupted(code, timeout=60).strip() == "tierkv: error: interrupted"


def test_ctrl_c_that_cuts_a_cleanup_short_is_still_an_interrupt(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C lands in a command's cleanup (``shutil.rmtree`` of its scratch directory, which then
    raises EBADF from its own ``finally``): the user pressed Ctrl-C, not a disk error."""
    from tierkv import cli
    from tierkv.tools import demo

    def cut_short(*args: object, **kw: object) -> int:
        try:
            raise KeyboardInterrupt
        finally:
            raise OSError(9, "Bad file descriptor")

    monkeypatch.setattr(demo, "run_demo", cut_short)
    assert cli.main(["demo"]) == cli.EXIT_INTERRUPTED
    assert capsys.readouterr().err.strip() == "tierkv: error: interrupted"


def _interrupted(code: str, timeout: float) -> str:
    """Run ``python -c code``; it must exit 130 with no traceback. Its stderr."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr
    return proc.stderr


def test_ctrl_c_ends_a_command_even_when_its_cancellation_is_swallowed() -> None:
    """asyncio turns the first Ctrl-C into a cancellation of the command's task; code that swallows
    it (a library's cleanup) must not leave the command running: it exits 130 a grace period later."""
    code = ("import anyio, sys\n"
            "from tierkv.cli import common\n"
            "common.INTERRUPT_GRACE_S = 1.0\n"
            "async def stubborn():\n"
            "    print('ready', flush=True)\n"
            "    while True:\n"
            "        try:\n"
            "            await anyio.sleep(0.05)\n"
            "        except BaseException:\n"
            "            pass\n"
            "common.run_async(stubborn)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert time.monotonic() - t0 < 10
    assert "Traceback" not in err and err.strip() == "tierkv: error: interrupted"


def test_every_option_has_help_and_shows_its_default() -> None:
    parser = build_parser()

    def walk(p: argparse.ArgumentParser) -> None:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)
                continue
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"{p.prog} {action.option_strings or action.dest} has no help"
        text = p.format_help()
        for action in p._actions:
            default = action.default
            if action.option_strings and default not in (None, False, [], argparse.SUPPRESS) and action.help:
                assert "(default:" in text, f"{p.prog} shows no defaults"

    walk(parser)
    assert "(default: None)" not in parser.format_help()
    for sub in ("demo", "simulate"):
        text = tierkv(sub, "--help").stdout
        assert "(default: None)" not in text and "(default: [])" not in text, text
        assert "default: a temporary directory" in text


def test_bench_serving_help_is_its_own() -> None:
    res = tierkv("bench", "serving", "--help")
    assert res.returncode == 0, res.stderr
    assert "usage: tierkv bench serving" in res.stdout and "--lengths" in res.stdout
    no_traceback(res)

"""bench/peers.py --quick --json, as the CI runs it: the report's shape, and every system that can run
here ran and had its loaded bytes verified by the harness (not a timed test: no figure is judged).

tierkv and vLLM's fs tier run in the project venv. LMCache runs in its own venv: the one named by
``$TIERKV_LMCACHE_PYTHON``, else ``.venv-lmcache/bin/python`` at the repo root; with neither, the
harness must say "not installed" (with the install command) and still succeed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench" / "peers.py"
ALWAYS = ("vllm-fs", "tierkv", "tierkv-zstd", "tierkv-buffered")
LMCACHE = "lmcache-disk"
SIZES = (256 << 10, 1 << 20, 2 << 20)
PHASES = (("store", None), ("load", "warm"), ("load", "cold"))


def lmcache_expected() -> bool:
    py = os.environ.get("TIERKV_LMCACHE_PYTHON") or str(REPO / ".venv-lmcache" / "bin" / "python")
    return os.access(py, os.X_OK)


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--json"], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    tail = proc.stderr[-4000:]
    assert proc.returncode == 0, f"bench/peers.py exited {proc.returncode}:\n{tail}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, f"stdout must be one JSON object, not {len(lines)} lines:\n{proc.stdout[-2000:]}"
    out: dict[str, Any] = json.loads(lines[0])
    out["_stderr"] = proc.stderr
    return out


@pytest.mark.slow
def test_vllm_closes_its_shared_regions_without_a_traceback(report: dict[str, Any]) -> None:
    """Every system under vLLM's manager shut down with the region unmapped: no view of it left."""
    err = report["_stderr"]
    assert "Failed to close" not in err and "BufferError" not in err, err[-3000:]


@pytest.mark.slow
def test_every_runnable_system_ran_and_was_verified(report: dict[str, Any]) -> None:
    assert report["verified"] is True, report["failures"]
    assert report["failures"] == []
    status = {s["system"]: s for s in report["systems"]}
    assert set(status) == {*ALWAYS, LMCACHE}
    for name in ALWAYS:
        assert status[name]["status"] == "ok", status[name]
    if lmcache_expected():
        assert status[LMCACHE]["status"] == "ok", status[LMCACHE]
    else:
        assert status[LMCACHE]["status"] == "not installed", status[LMCACHE]
        assert "pip install" in status[LMCACHE]["install"] and "lmcache" in status[LMCACHE]["install"]
    ran = [n for n, s in status.items() if s["status"] == "ok"]
    phases = report["phases"]
    for name in ran:
        for size in SIZES:
            rounds = phases[f"{name}/{size}"]
            assert len(rounds) == report["repeats"] >= 1
            for r in rounds:  # the harness compared every loaded byte with the stored one
                assert r["bad"] == 0 and r["missing"] == 0, (name, size, r)
                assert r["store_s"] > 0 and r["warm_s"] > 0 and r["cold_s"] > 0


@pytest.mark.slow
def test_results_shape(report: dict[str, Any]) -> None:
    status = {s["system"]: s["status"] for s in report["systems"]}
    rows = report["results"]
    keys = {"system", "block_bytes", "direction", "cache", "mb_s", "ratio_vs_tierkv"}
    by: dict[tuple[str, int, str, str | None], dict[str, Any]] = {}
    for row in rows:
        assert keys <= set(row), row
        assert row["direction"] in ("store", "load")
        assert row["cache"] in ((None,) if row["direction"] == "store" else ("warm", "cold"))
        by[(row["system"], row["block_bytes"], row["direction"], row["cache"])] = row
    assert len(by) == len(rows) == len(status) * len(SIZES) * len(PHASES)
    for (name, size, direction, cache), row in by.items():
        assert size in SIZES
        assert row["status"] == status[name]
        if status[name] != "ok":
            assert row["mb_s"] is None and row["ratio_vs_tierkv"] is None
            continue
        assert isinstance(row["mb_s"], float) and row["mb_s"] > 0
        assert row["verified"] is True
        if name == "tierkv":
            assert row["ratio_vs_tierkv"] is None
        else:
            tk = by[("tierkv", size, direction, cache)]["mb_s"]
            assert isinstance(row["ratio_vs_tierkv"], float) and row["ratio_vs_tierkv"] > 0
            # one round in --quick: the ratio is exactly tierkv's MB/s over this system's
            assert row["ratio_vs_tierkv"] == pytest.approx(tk / row["mb_s"], rel=1e-6)
        if direction == "store":
            assert row["disk_bytes"] > 0 and row["raw_bytes"] > 0
        if name.startswith("tierkv") and cache == "warm":  # how many records helpers read, per round
            assert len(row["reader_reads"]) == 1 and 0 <= row["reader_reads"][0]
        else:
            assert "reader_reads" not in row
    zstd = by[("tierkv-zstd", 1 << 20, "store", None)]
    plain = by[("tierkv", 1 << 20, "store", None)]
    assert zstd["disk_bytes"] < plain["disk_bytes"]  # KV-like bf16 compresses


@pytest.mark.slow
def test_guarantees_reported(report: dict[str, Any]) -> None:
    ran = {s["system"] for s in report["systems"] if s["status"] == "ok"}
    guards = {g["system"]: g for g in report["guarantees"]}
    assert set(guards) == ran
    for g in guards.values():
        assert {"wrong_bytes_detected", "capacity_held", "restart_reuse"} <= set(g), g
    for name in ("tierkv", "tierkv-zstd", "tierkv-buffered"):  # tierkv's own promises
        g = guards[name]
        assert g["wrong_bytes_detected"] is True, g
        assert g["capacity_held"] is True, g
        assert g["restart_reuse"] is True, g
    assert guards["vllm-fs"]["capacity_held"] is None  # the fs tier has no capacity setting


@pytest.mark.parametrize("flags", [["--sizes", "3Q"], ["--sizes", "5001"], ["--calls", "x"],
                                   ["--calls", "5-2"], ["--repeats", "0"], ["--mb-per-size", "-1"]])
def test_a_bad_flag_is_one_usage_line_not_a_traceback(flags: list[str]) -> None:
    proc = subprocess.run([sys.executable, str(BENCH), *flags], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("peers.py: error: " + flags[0])

"""bench/peers.py on a tiny workload (8 MB per block size, one round, every system), as the CI runs
it: the report's shape, every system that can run here ran and had its loaded bytes verified by the
harness, and the JSON, the markdown tables and the plot written by that one command say the same
(not a timed test: no figure is judged, only how the figures relate).

tierkv (both ways: vLLM's manager, and its own API in a child process) and vLLM's fs tier run in the
project venv; the device row needs fio (the OS package). LMCache runs in its own venv: the one named
by ``$TIERKV_LMCACHE_PYTHON``, else ``.venv-lmcache/bin/python`` at the repo root; with neither, the
harness must say "not installed" (with the install command) and still succeed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench" / "peers.py"
ALWAYS = ("vllm-fs", "tierkv", "tierkv-zstd", "tierkv-buffered", "tierkv-api")
LMCACHE = "lmcache-disk"
DEVICE = "device"
SYSTEMS = (DEVICE, *ALWAYS, LMCACHE)
SIZES = (256 << 10, 1 << 20, 2 << 20)
PHASES = (("store", None), ("load", "warm"), ("load", "cold"))


def lmcache_expected() -> bool:
    py = os.environ.get("TIERKV_LMCACHE_PYTHON") or str(REPO / ".venv-lmcache" / "bin" / "python")
    return os.access(py, os.X_OK)


def fio_expected() -> bool:
    return any(p and os.access(p, os.X_OK) for p in (os.environ.get("TIERKV_FIO"), shutil.which("fio"),
                                                      "/usr/bin/fio"))


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("peers-out")


@pytest.fixture(scope="module")
def report(outputs: Path) -> dict[str, Any]:
    cmd = [sys.executable, str(BENCH), "--quick", "--mb-per-size", "8", "--repeats", "1", "--window-mb", "32",
           "--calls", "2-8", "--systems", ",".join(SYSTEMS), "--json", "--json-file", str(outputs / "r.json"),
           "--markdown", str(outputs / "r.md"), "--plot", str(outputs / "r.png")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
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
    assert set(status) == set(SYSTEMS)
    for name in ALWAYS:
        assert status[name]["status"] == "ok", status[name]
    if fio_expected():
        assert status[DEVICE]["status"] == "ok", status[DEVICE]
    else:
        assert status[DEVICE]["status"] == "not installed", status[DEVICE]
        assert "fio" in status[DEVICE]["install"]
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
                assert r["store_s"] > 0 and r["cold_s"] > 0
                assert r["warm_s"] > 0 if name != DEVICE else r["warm_s"] == 0  # fio has no warm load


@pytest.mark.slow
def test_results_shape(report: dict[str, Any]) -> None:
    status = {s["system"]: s["status"] for s in report["systems"]}
    rows = report["results"]
    keys = {"system", "block_bytes", "direction", "cache", "mb_s", "ratio_vs_tierkv", "ratio_vs_tierkv_api",
            "fraction_of_device"}
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
        assert row["verified"] is True
        if name == DEVICE and cache == "warm":  # the device has no warm load: no figure, no ratio
            assert row["mb_s"] is None and row["ratio_vs_tierkv"] is None
            assert row["fraction_of_device"] is None
            continue
        assert isinstance(row["mb_s"], float) and row["mb_s"] > 0
        # one round: each ratio is exactly one MB/s over another of the same size and phase
        for base, key in (("tierkv", "ratio_vs_tierkv"), ("tierkv-api", "ratio_vs_tierkv_api")):
            if name == base:
                assert row[key] is None
            else:
                assert row[key] == pytest.approx(by[(base, size, direction, cache)]["mb_s"] / row["mb_s"],
                                                 rel=1e-6)
        dev = by[(DEVICE, size, direction, cache)]["mb_s"]
        if name == DEVICE or dev is None:  # a system's share of the device: stores and cold loads
            assert row["fraction_of_device"] is None
        else:
            assert row["fraction_of_device"] == pytest.approx(row["mb_s"] / dev, rel=1e-6)
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
    assert set(guards) == ran - {DEVICE}  # fio stores nothing to check
    for g in guards.values():
        assert {"wrong_bytes_detected", "capacity_held", "restart_reuse"} <= set(g), g
    for name in ("tierkv", "tierkv-zstd", "tierkv-buffered", "tierkv-api"):  # tierkv's own promises
        g = guards[name]
        assert g["wrong_bytes_detected"] is True, g
        assert g["capacity_held"] is True, g
        assert g["restart_reuse"] is True, g
    assert guards["vllm-fs"]["capacity_held"] is None  # the fs tier has no capacity setting


@pytest.mark.slow
def test_the_json_file_markdown_and_plot_come_from_the_printed_run(report: dict[str, Any],
                                                                   outputs: Path) -> None:
    """One command writes the JSON, the markdown tables and the PNG from the same results, each
    stamped with the run's date and commit."""
    saved = json.loads((outputs / "r.json").read_text())
    assert saved["results"] == report["results"] and saved["date"] == report["date"]
    assert report["commit"] and report["commit"] != "unknown" and report["date"].endswith("UTC")
    assert "--quick" in report["command"]
    md = (outputs / "r.md").read_text()
    assert report["date"] in md.splitlines()[0] and report["commit"] in md.splitlines()[0]
    for row in report["results"]:  # every system's store MB/s of the JSON is a cell of the table
        if row["direction"] == "store" and row["mb_s"] is not None:
            assert f"| {row['system']} | " in md and f"| {row['mb_s']:,.0f} |" in md, row
    if importlib.util.find_spec("matplotlib") is not None:
        assert (outputs / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "matplotlib is not installed" in report["_stderr"]


def test_ratios_are_paired_within_rounds_and_the_device_has_no_warm_figure() -> None:
    """A ratio is the median of per-round ratios, not a ratio of medians; the device row's warm
    figure is absent (fio reads the device only), so no system has a warm share of it."""
    sys.path.insert(0, str(REPO / "bench"))
    from peers_report import build_results

    def rnd(store: float, warm: float, cold: float) -> SimpleNamespace:
        return SimpleNamespace(store_s=store, sync_s=0.0, warm_s=warm, cold_s=cold, bad=0, missing=0,
                               disk_bytes=1, file_bytes=1, files=1, cold_dropped=True, warm_reader_reads=None)

    size = 1 << 20
    samples = {("device", size): [rnd(1.0, 0.0, 1.0), rnd(2.0, 0.0, 1.0), rnd(1.0, 0.0, 4.0)],
               ("tierkv", size): [rnd(2.0, 1.0, 2.0), rnd(2.0, 1.0, 2.0), rnd(4.0, 1.0, 2.0)],
               ("tierkv-api", size): [rnd(4.0, 2.0, 2.0), rnd(4.0, 2.0, 2.0), rnd(4.0, 2.0, 2.0)]}
    status = dict.fromkeys(("device", "tierkv", "tierkv-api"), "ok")
    rows = build_results(list(status), [size], samples, status, {size: 4_000_000}, tierkv="tierkv",
                         tierkv_api="tierkv-api", device="device")
    by = {(r["system"], r["cache"] or "store"): r for r in rows}
    # store: tierkv's rounds take 2, 2, 4 s against the device's 1, 2, 1: shares 0.5, 1.0, 0.25
    assert by[("tierkv", "store")]["fraction_of_device"] == pytest.approx(0.5)
    # tierkv's MB/s over tierkv-api's: 4/2, 4/2, 4/4 -> 2.0; the other way round 0.5, 0.5, 1.0 -> 0.5
    assert by[("tierkv-api", "store")]["ratio_vs_tierkv"] == pytest.approx(2.0)
    assert by[("tierkv", "store")]["ratio_vs_tierkv_api"] == pytest.approx(0.5)
    assert by[("tierkv", "cold")]["fraction_of_device"] == pytest.approx(0.5)  # 0.5, 0.5, 2.0
    assert by[("device", "warm")]["mb_s"] is None
    assert by[("tierkv", "warm")]["fraction_of_device"] is None
    assert by[("tierkv", "warm")]["mb_s"] == pytest.approx(4.0)


def test_compare_flags_a_ratio_that_moved_past_the_tolerance(tmp_path: Path) -> None:
    """bench/peers_compare.py: exit 0 when every shared ratio of two runs is within the tolerance,
    1 (naming the ratio) when one is not."""
    def run(x: float) -> dict[str, Any]:
        return {"bench": "peers", "date": "d", "commit": "c", "command": "q", "results": [
            {"system": "vllm-fs", "block_bytes": 1 << 20, "direction": "store", "cache": None,
             "ratio_vs_tierkv": x, "ratio_vs_tierkv_api": 1.0, "fraction_of_device": 0.5}]}

    paths = []
    for i, x in enumerate((1.0, 1.1, 1.3)):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(run(x)))
    compare = [sys.executable, str(REPO / "bench" / "peers_compare.py")]
    ok = subprocess.run([*compare, str(paths[0]), str(paths[1])], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "3 ratios; 0 apart" in ok.stdout
    bad = subprocess.run([*compare, str(paths[0]), str(paths[2])], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1
    assert "vllm-fs" in bad.stdout and "<-- over" in bad.stdout and "1 apart by more than 15%" in bad.stdout


def test_median_of_runs_takes_each_figure_across_runs_and_names_the_targets_met(tmp_path: Path) -> None:
    """bench/peers_median.py: the median over runs of each run's figure (not of the rounds pooled),
    and tierkv's targets against the peers and the device, each said met or not."""
    def run(x_store: float, cold_share: float) -> dict[str, Any]:
        row = {"block_bytes": 1 << 20, "ratio_vs_tierkv_api": None}
        return {"bench": "peers", "date": "d", "commit": "c", "machine": {"busy": False}, "results": [
            {**row, "system": "vllm-fs", "direction": "store", "cache": None, "mb_s": 100.0,
             "ratio_vs_tierkv": x_store, "fraction_of_device": 0.5},
            {**row, "system": "tierkv", "direction": "load", "cache": "cold", "mb_s": 90.0,
             "ratio_vs_tierkv": None, "fraction_of_device": cold_share}]}

    paths = []
    for i, (x, c) in enumerate(((0.8, 0.95), (1.2, 0.5), (1.1, 0.92))):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(run(x, c)))
    median = [sys.executable, str(REPO / "bench" / "peers_median.py")]
    proc = subprocess.run([*median, *map(str, paths), "--markdown", str(tmp_path / "m.md")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tierkv / vllm-fs, store >= 1.0: 1M 1.10 met" in proc.stdout  # median of 0.8, 1.2, 1.1
    assert "tierkv cold >= 0.9 of the device: 1M 0.92 met" in proc.stdout  # median of 0.95, 0.5, 0.92
    assert (tmp_path / "m.md").read_text().strip() == proc.stdout.strip()
    paths[1].write_text(json.dumps(run(0.5, 0.5)))
    proc = subprocess.run([*median, *map(str, paths)], capture_output=True, text=True, timeout=60)
    assert "1M 0.80 NOT met" in proc.stdout and "1M 0.50 NOT met" not in proc.stdout
    bad = subprocess.run([*median, str(tmp_path / "none.json")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "none.json" in bad.stderr


@pytest.mark.parametrize("flags", [["--sizes", "3Q"], ["--sizes", "5001"], ["--calls", "x"],
                                   ["--calls", "5-2"], ["--repeats", "0"], ["--mb-per-size", "-1"]])
def test_a_bad_flag_is_one_usage_line_not_a_traceback(flags: list[str]) -> None:
    proc = subprocess.run([sys.executable, str(BENCH), *flags], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("peers.py: error: " + flags[0])


@pytest.mark.slow
def test_ctrl_c_in_the_middle_of_a_run_leaves_no_scratch_directory(tmp_path: Path) -> None:
    """The run's scratch directory holds the blocks' pools and a phase's records (GBs in a full
    run): an interrupted run removed nothing and left it in /tmp, one more each time. vLLM's
    primary pool (a file in /dev/shm, memory) was left too."""
    import signal
    import time

    def pools() -> set[Path]:
        return set(Path("/dev/shm").glob("vllm_offload_peers-*")) | set(Path("/dev/shm").glob("tkpeers-*"))

    before = pools()

    proc = subprocess.Popen([sys.executable, str(BENCH), "--systems", "tierkv,tierkv-api", "--sizes", "256K",
                             "--mb-per-size", "64", "--repeats", "3", "--no-guarantees",
                             "--dir", str(tmp_path)],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(p.is_dir() and any(p.iterdir()) for p in tmp_path.glob("tkpeers-*")) or not (
                pools() - before):  # inside a phase of the tierkv row: vLLM's pool exists
            assert proc.poll() is None, "the run ended before it wrote anything"
            assert time.monotonic() < deadline, "no scratch directory and pool within 120 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err[-2000:]
    assert "peers: interrupted" in err and "Traceback" not in err, err[-2000:]
    assert not list(tmp_path.glob("tkpeers-*")), "the scratch directory was left behind"
    assert pools() <= before, "a pool in /dev/shm was left behind"

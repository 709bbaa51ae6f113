"""``tierkv bench serving --trace``: a Mooncake trace scaled and replayed through real vLLM engines.

The ceiling on hand-made traces, the scaled prompts (shared ids share prefixes, nothing else does),
one-line errors (exit 2), Ctrl-C (exit 130, nothing left behind), and a tiny generated trace end to
end with the exact --json shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import ctrl_c

from tierkv.tools.bench import serving_trace
from tierkv.tools.bench.trace_serving import (
    Scaling,
    TraceRequest,
    ceiling_tokens,
    load_trace,
    percentile,
    prompt,
)

CMD = [sys.executable, "-m", "tierkv.cli", "bench", "serving"]


def _req(*ids: int, out: int = 10) -> TraceRequest:
    return TraceRequest(0.0, 512 * len(ids), out, tuple(ids))


def _write(path: Path, reqs: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    return path


def test_the_ceiling_counts_the_leading_ids_an_earlier_prompt_began_with() -> None:
    sc = Scaling(ids_per_request=3, tokens_per_id=32)
    reqs = [_req(0, 1, 2),     # nothing before it
            _req(0, 1, 3),     # 0, 1 seen: 2 ids
            _req(0, 1, 2, 4),  # 0, 1, 2 seen (4 is cut by ids_per_request): 3 ids
            _req(5, 1),        # 1 was seen, but after 0, not 5: a prefix it never began: 0
            _req(0),           # 1 id
            _req(7, 8)]        # 0
    assert ceiling_tokens(reqs, sc) == (2 + 3 + 1) * 32
    assert ceiling_tokens(reqs, Scaling(ids_per_request=1, tokens_per_id=16)) == 3 * 16  # the 2nd, 3rd, 5th


def test_scaled_prompts_share_exactly_the_shared_ids() -> None:
    sc = Scaling(ids_per_request=4, tokens_per_id=16, max_output=3)
    a = prompt(_req(0, 1, 2), 0, sc, 1000)
    b = prompt(_req(0, 1, 9), 1, sc, 1000)
    c = prompt(_req(3, 1), 2, sc, 1000)
    assert len(a) == sc.prompt_length(_req(0, 1, 2)) == 3 * 16 + 1
    assert a[:32] == b[:32] and a[32:48] != b[32:48]
    assert c[16:32] == a[16:32]  # the same id draws the same tokens; vLLM's chained hashes still differ
    assert a[:16] != c[:16]
    assert all(3 <= t < 1000 for t in a + b + c)
    assert prompt(_req(0, 1, 2), 0, sc, 1000) == a  # deterministic
    assert sc.output_length(_req(0, out=500)) == 3 and sc.output_length(_req(0, out=0)) == 1


def test_load_trace_takes_the_first_requests_and_refuses_what_is_not_a_trace(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", [{"timestamp": 3000 * i, "input_length": 700, "output_length": 9,
                                          "hash_ids": [0, i + 1]} for i in range(5)])
    got = load_trace(path, 3)
    assert [r.hash_ids for r in got] == [(0, 1), (0, 2), (0, 3)] and got[1].timestamp_ms == 3000.0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}\n'
                   '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": ["x"]}\n')
    with pytest.raises(serving_trace.BenchError, match=":2: malformed"):
        load_trace(bad)
    with pytest.raises(serving_trace.BenchError, match="No such file"):
        load_trace(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(serving_trace.BenchError, match="no requests"):
        load_trace(tmp_path / "empty.jsonl")


def test_percentiles_interpolate() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert percentile([float(x) for x in range(11)], 0.9) == pytest.approx(9.0)
    assert percentile([], 0.5) is None


@pytest.mark.parametrize(("args", "words"), [
    (["--trace", "/nonexistent/trace.jsonl"], "No such file"),
    (["--trace", "{good}", "--requests", "0"], "positive integer"),
    (["--trace", "{good}", "--systems", "prefix,bogus"], "unknown system"),
    (["--trace", "{good}", "--no-such-flag"], "unrecognized arguments"),
    (["--trace", "{bad}"], "malformed trace line"),
    (["--trace", "{good}", "--tokens-per-id", "20"], "multiple of 16"),
])
def test_errors_are_one_line_and_exit_2(tmp_path: Path, args: list[str], words: str) -> None:
    good = _write(tmp_path / "good.jsonl", [{"timestamp": 0, "input_length": 9, "output_length": 1,
                                             "hash_ids": [0]}])
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    argv = [a.format(good=good, bad=bad) for a in args]
    proc = subprocess.run([*CMD, *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and words in proc.stderr
    assert len([ln for ln in proc.stderr.splitlines() if "error" in ln]) == 1, proc.stderr


def test_vllm_offloading_without_cuda_says_so_and_exits_0(tmp_path: Path) -> None:
    if serving_trace.cuda_available():
        pytest.skip("a CUDA device is here: the option would run")
    good = _write(tmp_path / "t.jsonl", [{"timestamp": 0, "input_length": 9, "output_length": 1,
                                          "hash_ids": [0]}])
    proc = subprocess.run([*CMD, "--trace", str(good), "--with-vllm-offloading"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "tierkv bench serving --trace: --with-vllm-offloading: vLLM's own CPUOffloadingSpec and "
        "TieringOffloadingSpec run only on CUDA (they refuse the CPU platform) and this machine has no CUDA "
        "device: nothing was run"]


def test_vllm_offloading_runs_both_of_vllms_own_specs_with_the_same_cpu_bytes(tmp_path: Path) -> None:
    args = serving_trace.build_parser().parse_args(["--trace", "t.jsonl", "--with-vllm-offloading",
                                                     "--cpu-pool-mib", "8"])
    opts = serving_trace.options_from_args(args)
    assert opts.systems[-2:] == ("vllm-offload", "vllm-tiering")
    run = serving_trace._TraceRun(opts, next(iter(serving_trace.MODELS.values())), tmp_path, tmp_path, {}, [])
    assert run.extra("vllm-offload", tmp_path / "fs") == {"spec_name": "CPUOffloadingSpec",
                                                          "cpu_bytes_to_use": 8 << 20}
    assert run.extra("vllm-tiering", tmp_path / "fs") == {
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8 << 20,
        "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "fs")}]}


def _tiny_trace(path: Path) -> Path:
    """Six requests: a shared first id, one prefix extended, one repeated whole."""
    ids = [[0, 1, 2], [0, 3], [0, 1, 2, 4], [5, 6], [0, 1, 2, 4], [5, 7]]
    return _write(path, [{"timestamp": 1000 * i, "input_length": 512 * len(h), "output_length": 50,
                          "hash_ids": h} for i, h in enumerate(ids)])


def _leftovers(prefix: str) -> set[str]:
    import tempfile

    found = set()
    for root in (tempfile.gettempdir(), "/dev/shm"):
        if os.path.isdir(root):
            found |= {os.path.join(root, n) for n in os.listdir(root) if n.startswith(prefix)}
    return found


def _engines() -> set[int]:
    """Process ids of the benchmark's engine processes (their command line names the module)."""
    out = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"tierkv.tools.bench.serving_engine" in cmd and b"tierkv-bench-trace-" in cmd:
            out.add(int(pid))
    return out


@pytest.mark.slow
def test_a_tiny_trace_end_to_end(tmp_path: Path) -> None:
    pytest.importorskip("vllm.v1.kv_offload.base")
    trace = _tiny_trace(tmp_path / "tiny.jsonl")
    details = tmp_path / "details.json"
    proc = subprocess.run([*CMD, "--trace", str(trace), "--json", "--model", "tiny", "--ids-per-request", "4",
                           "--tokens-per-id", "32", "--max-output", "2", "--vllm-cache-blocks", "32",
                           "--interleave", "3", "--details", str(details)],
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) == {"results", "ceiling_tokens"}
    assert [r["system"] for r in out["results"]] == ["prefix", "tierkv-cpu", "tierkv-file"]
    # (0,3): 1 id; (0,1,2,4): 3; (0,1,2,4) again: 4; (5,7): 1
    assert out["ceiling_tokens"] == (1 + 3 + 4 + 1) * 32
    prompt_tokens = (3 + 2 + 4 + 2 + 4 + 2) * 32 + 6
    for r in out["results"]:
        assert set(r) == {"system", "requests", "prompt_tokens", "cached_tokens", "ttft_p50_s", "ttft_p90_s"}
        assert r["requests"] == 6 and r["prompt_tokens"] == prompt_tokens
        assert 0 < r["ttft_p50_s"] <= r["ttft_p90_s"]
        assert r["cached_tokens"] <= out["ceiling_tokens"]
    # vLLM's own cache holds this tiny trace: every system serves the whole ceiling
    assert all(r["cached_tokens"] == out["ceiling_tokens"] for r in out["results"])
    full = json.loads(details.read_text())
    assert len(full["systems"]["tierkv-file"]["samples"]) == 6
    assert not _leftovers("tierkv-bench-trace-")


@pytest.mark.slow
def test_ctrl_c_stops_the_engines_and_leaves_nothing(tmp_path: Path) -> None:
    pytest.importorskip("vllm.v1.kv_offload.base")
    before, engines = _leftovers("tierkv-bench-trace-"), _engines()
    trace = _tiny_trace(tmp_path / "tiny.jsonl")
    proc = subprocess.Popen([*CMD, "--trace", str(trace), "--model", "tiny"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(8.0)  # an engine is starting
    err = ctrl_c(proc, timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("tierkv bench serving --trace: interrupted")
    assert "Traceback" not in err
    assert _leftovers("tierkv-bench-trace-") <= before
    assert _engines() <= engines


def test_the_breakdown_pairs_requests_with_prefix_caching_alone() -> None:
    from tierkv.tools.bench.serving_trace_report import breakdown

    def s(i: int, ttft: float, cached: int, queue: float = 0.0) -> dict[str, Any]:
        return {"index": i, "prompt_tokens": 65, "cached_tokens": cached, "ttft_s": ttft, "queue_s": queue,
                "trace": {"steps": 4.0}}

    base = [s(0, 0.10, 0), s(1, 0.20, 32), s(2, 0.30, 0)]
    file = [s(0, 0.11, 0, 0.01), s(1, 0.22, 32, 0.01), s(2, 0.06, 64, 0.02)]
    b = breakdown({"prefix": {"samples": base}, "tierkv-file": {"samples": file}})
    f = b["tierkv-file"]
    assert f["no_restore_requests"] == 2 and f["restored_requests"] == 1
    assert f["no_restore_ttft_ratio"] == pytest.approx(1.1)
    assert f["no_restore_ttft_diff_s"] == pytest.approx(0.015)
    assert f["restored_ttft_ratio"] == pytest.approx(0.2)
    assert f["restored_ttft_diff_s"] == pytest.approx(-0.24)
    assert f["mean_queue_s"] == pytest.approx(0.04 / 3, abs=1e-6) and f["mean_steps"] == 4.0
    assert "no_restore_requests" not in b["prefix"]

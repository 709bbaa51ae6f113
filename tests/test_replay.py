"""``tierkv replay``: request traces through a real store, hit accounting, tiers, errors."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

import anyio
import pytest
from helpers import ctrl_c

from tierkv.cli import main
from tierkv.tools.replay import ReplayOptions, replay
from tierkv.tools.traces import TraceRequest, belady_hit_rate, read_trace


def write_trace(path: Path, requests: list[tuple[int, list[int]]]) -> Path:
    with open(path, "w") as f:
        for i, (n, ids) in enumerate(requests):
            line = {"timestamp": i * 10, "input_length": n, "output_length": 7, "hash_ids": ids}
            f.write(json.dumps(line) + "\n")
    return path


def lru_model(requests: list[TraceRequest], capacity: int, block_tokens: int) -> float:
    """An independent LRU of the accounting (docs/traffic.md), to check the store against."""
    cache: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for r in requests:
        n = 0
        while n < len(r.hash_ids) and r.hash_ids[n] in cache:
            n += 1
        hit += min(n * block_tokens, r.input_length)
        total += r.input_length
        for h in r.hash_ids:
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hit / total


def generated(n: int, seed: int, docs: int = 30) -> list[tuple[int, list[int]]]:
    """Chat-like traffic: conversations that come back with their history, one-off prompts."""
    rng = random.Random(seed)
    convs: list[list[int]] = []
    fresh = 1000
    out = []
    for _ in range(n):
        c = convs[rng.randrange(len(convs))] if convs else []
        if c and rng.random() < 0.5 and len(c) < 12:  # at most 14 blocks: a request fits a pool of 16
            c.extend(range(fresh, fresh + rng.randint(1, 3)))
            fresh += 3
        else:
            c = [0, *range(fresh, fresh + rng.randint(2, 6))]  # 0: a shared system prompt
            fresh += 6
            convs.append(c)
            convs[:] = convs[-docs:]
        out.append((len(c) * 16 - rng.randint(0, 15), list(c)))
    return out


# ---- hit accounting ---------------------------------------------------------------------------------

def test_a_small_trace_hits_what_lru_hits_by_hand(tmp_path: Path) -> None:
    # capacity 4, LRU: r1 misses; r2 finds [1, 2] (1024 tokens); r3 stores 4 and 5, evicting 1
    # (the least recently used); r4 then finds nothing (its first block is gone)
    trace = write_trace(tmp_path / "t.jsonl", [(1000, [1, 2]), (1500, [1, 2, 3]), (600, [4, 5]),
                                               (1600, [1, 2, 3, 6])])
    res = anyio.run(replay, read_trace(trace), ReplayOptions(cpu_blocks=4, policy="lru"))
    assert res.hit_tokens == 1024 and res.input_tokens == 4700
    assert res.token_hit_rate == pytest.approx(1024 / 4700)
    assert res.tiers[0].hit_tokens == 1024 and res.tiers[0].hit_blocks == 2
    # Belady keeps 1, 2, 3 for r4 (4 and 5 are never used again): 1024 + 1536
    assert res.bound == pytest.approx(2560 / 4700)


def test_a_partial_last_block_counts_only_its_tokens(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [(40, [1, 2, 3]), (40, [1, 2, 3])])
    res = anyio.run(replay, read_trace(trace), ReplayOptions(block_tokens=16))
    assert res.hit_tokens == 40  # min(3 * 16, 40)


@pytest.mark.parametrize("capacity", [16, 40, 96])
def test_the_store_under_lru_agrees_with_an_independent_model(tmp_path: Path, capacity: int) -> None:
    trace = write_trace(tmp_path / "t.jsonl", generated(300, seed=capacity))
    reqs = read_trace(trace)
    res = anyio.run(replay, reqs, ReplayOptions(cpu_blocks=capacity, policy="lru", block_tokens=16))
    assert res.token_hit_rate == pytest.approx(lru_model(reqs, capacity, 16), abs=1e-12)
    assert res.policy == "lru"
    assert res.token_hit_rate <= res.bound + 1e-12


def test_unbounded_everything_hits_every_repeat(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", generated(200, seed=5))
    reqs = read_trace(trace)
    res = anyio.run(replay, reqs, ReplayOptions(block_tokens=16))
    assert res.token_hit_rate == pytest.approx(belady_hit_rate(reqs, None, 16))
    assert res.tiers[0].capacity_blocks is None


def documents_and_one_offs(n: int, seed: int) -> list[tuple[int, list[int]]]:
    """Shared documents read again and again among one-off prompts: the reuse LRU loses to the
    one-offs in between (docs/traffic.md)."""
    rng = random.Random(seed)
    docs = [[d * 100 + j for j in range(6)] for d in range(12)]
    out, fresh = [], 10**6
    for _ in range(n):
        if rng.random() < 0.35:
            out.append((7 * 16, [*docs[rng.randrange(len(docs))], fresh]))
            fresh += 1
        else:
            out.append((6 * 16, list(range(fresh, fresh + 6))))
            fresh += 6
    return out


def test_slru_beats_lru_where_reuse_hides_behind_one_offs(tmp_path: Path) -> None:
    reqs = read_trace(write_trace(tmp_path / "t.jsonl", documents_and_one_offs(2500, seed=11)))
    lru = anyio.run(replay, reqs, ReplayOptions(cpu_blocks=64, policy="lru", block_tokens=16))
    slru = anyio.run(replay, reqs, ReplayOptions(cpu_blocks=64, block_tokens=16))
    assert slru.policy == "slru"
    assert slru.token_hit_rate > 1.3 * lru.token_hit_rate, (slru.token_hit_rate, lru.token_hit_rate)


# ---- tiers --------------------------------------------------------------------------------------------

def test_two_tiers_split_the_hits(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", generated(300, seed=3))
    reqs = read_trace(trace)
    opts = ReplayOptions(cpu_blocks=16, disk_blocks=400, policy="lru", block_tokens=16,
                         recompute_tokens_per_s=1000.0)
    res = anyio.run(replay, reqs, opts)
    cpu, disk = res.tiers
    assert (cpu.kind, cpu.capacity_blocks, disk.kind, disk.capacity_blocks) == ("cpu", 16, "disk", 400)
    assert cpu.hit_tokens > 0 and disk.hit_tokens > 0
    assert cpu.hit_tokens + disk.hit_tokens == res.hit_tokens
    # the disk holds every block the cpu pool lost: as if one cache of the disk's size
    assert res.token_hit_rate == pytest.approx(lru_model(reqs, 400, 16), abs=1e-12)
    assert disk.saved_s is not None and disk.read_bytes_per_s
    assert res.stats.tiers[1].promotions > 0


def test_a_bounded_disk_tier_holds_its_blocks_and_no_more(tmp_path: Path) -> None:
    # 12 distinct blocks, then the first 4 again: a disk of 8 blocks lost them, one of 12 did not
    reqs = [(64, [i * 4 + j for j in range(4)]) for i in range(3)] + [(64, [0, 1, 2, 3])]
    trace = read_trace(write_trace(tmp_path / "t.jsonl", reqs))
    small = anyio.run(replay, trace, ReplayOptions(cpu_blocks=4, disk_blocks=8, block_tokens=16))
    big = anyio.run(replay, trace, ReplayOptions(cpu_blocks=4, disk_blocks=12, block_tokens=16))
    assert small.hit_tokens == 0
    assert big.hit_tokens == 64 and big.tiers[1].hit_tokens == 64


# ---- the command ------------------------------------------------------------------------------------

def test_json_is_one_object_of_the_documented_shape(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.jsonl", generated(50, seed=1))
    assert main(["replay", str(trace), "--cpu-blocks", "16", "--disk-blocks", "64", "--block-tokens", "16",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"requests", "input_tokens", "hit_tokens", "token_hit_rate", "policy", "tiers",
                        "bound"}
    assert out["requests"] == 50 and out["policy"] == "slru"
    assert [t["kind"] for t in out["tiers"]] == ["cpu", "disk"]
    for t in out["tiers"]:
        assert set(t) == {"kind", "capacity_blocks", "hit_tokens", "token_hit_rate"}
    assert set(out["bound"]) == {"policy", "token_hit_rate"} and out["bound"]["policy"] == "belady"
    assert sum(t["hit_tokens"] for t in out["tiers"]) == out["hit_tokens"]


def test_requests_limits_the_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.jsonl", generated(50, seed=1))
    assert main(["replay", str(trace), "--requests", "7", "--policy", "lru", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 7 and out["policy"] == "lru"


def test_the_table_names_tiers_and_the_bound(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.jsonl", generated(40, seed=2))
    assert main(["replay", str(trace), "--cpu-blocks", "8", "--disk-blocks", "32",
                 "--recompute-tokens-per-s", "5000"]) == 0
    text = capsys.readouterr().out
    for word in ("cpu", "disk", "token hit rate", "belady", "prefill saved"):
        assert word in text


@pytest.mark.parametrize(("line", "why"), [
    ("not json", "not JSON"),
    ('[1, 2]', "not a JSON object"),
    ('{"input_length": 5}', "hash_ids"),
    ('{"input_length": -5, "hash_ids": [1]}', "input_length"),
    ('{"input_length": 5, "hash_ids": [1, "x"]}', "hash_ids"),
    ('{"input_length": 5, "hash_ids": [1, 1]}', "repeats"),
    ('{"input_length": 5, "hash_ids": [1], "timestamp": "now"}', "timestamp"),
])
def test_a_malformed_line_is_one_error_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 line: str, why: str) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"input_length": 5, "hash_ids": [1]}\n\n' + line + "\n")
    assert main(["replay", str(trace)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{trace}:3:" in err[0] and why in err[0], err


def test_a_missing_file_is_one_error_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.jsonl"
    assert main(["replay", str(missing)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(missing) in err[0] and "Traceback" not in err[0]


def test_errors_from_the_console_script_have_no_traceback(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text("{}\n")
    proc = subprocess.run([sys.executable, "-m", "tierkv.cli", "replay", str(trace)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"{trace}:1:" in proc.stderr


def test_ctrl_c_exits_130_without_a_traceback(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", generated(200000, seed=4))
    proc = subprocess.Popen([sys.executable, "-m", "tierkv.cli", "replay", str(trace), "--cpu-blocks", "64"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(6)
    err = ctrl_c(proc)
    assert proc.returncode in (130, -signal.SIGINT), err
    assert "Traceback" not in err and "interrupted" in err

"""tierkv as the offloading spec of a real vLLM engine (CPU build), three tiny random-weight models.

Each engine runs in its own process (tests/engine/run_engine.py). For each model, with a file:// tier:
(a) generate, generate again (vLLM's own prefix cache: the most a restore can give), reset vLLM's
prefix cache, generate again: the same prefix comes back through tierkv, same tokens and logprobs;
(b) a new engine process (multiprocessing mode, d) gets the prefix from disk, same output; (c) a
record corrupted on disk is a miss and is recomputed: same output, no NaN. Every run leaves nothing
in shm_dir. Plus: concurrent restores from disk through a small recurrent pool (Qwen3-Next).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")  # installed by `scripts/dev test` where there is no GPU

pytestmark = pytest.mark.slow

RUNNER = Path(__file__).parent / "engine" / "run_engine.py"
MODELS: dict[str, dict[str, Any]] = {
    "llama": {"prompt_len": 200, "at_least": 192},
    "gemma3": {"prompt_len": 450, "at_least": 448},
    "qwen3next": {"prompt_len": 2300, "max_model_len": 4096, "at_least": 2112},
}
TOL = 1e-3


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return os.environ.get("TIERKV_TEST_MODELS") or str(tmp_path_factory.mktemp("models"))


def run(models_dir: str, shm: Path, **args: Any) -> list[dict[str, Any]]:
    env = {**os.environ, "TIERKV_TEST_MODELS": models_dir, "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run([sys.executable, str(RUNNER), json.dumps({"shm_dir": str(shm), **args})],
                          capture_output=True, text=True, timeout=600, env=env)
    events = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
              if line.startswith("[tierkv-run] ")]
    assert proc.returncode == 0 and events and events[-1]["kind"] == "done", \
        f"engine run failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert not list(shm.iterdir()), "the shared pool segment must be removed on shutdown"
    return events


def gen(events: list[dict[str, Any]], tag: str, prompt: int = 0) -> dict[str, Any]:
    return next(e for e in events if e["kind"] == "generate" and e["tag"] == tag and e["prompt"] == prompt)


def same_output(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["token_ids"] == b["token_ids"]
    assert all(math.isfinite(x) for x in b["logprobs"]), "NaN or inf logprobs: garbage KV was loaded"
    assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True)) <= TOL


@pytest.mark.parametrize("model", list(MODELS))
def test_prefix_restored_by_tierkv_in_a_real_engine(model: str, models_dir: str, tmp_path: Path) -> None:
    m = MODELS[model]
    base = {"model": model, "url": f"file://{tmp_path / 'tier'}", "prompt_len": m["prompt_len"],
            "max_model_len": m.get("max_model_len", 1024)}
    shm = tmp_path / "shm"
    shm.mkdir()
    # (a) same process: store, drop vLLM's own prefix cache, load back through tierkv
    ev = run(models_dir, shm, **base, steps=["run1", "run2", "reset", "run3"])
    first, third = gen(ev, "run1"), gen(ev, "run3")
    own = gen(ev, "run2")["num_cached_tokens"]  # what vLLM's own prefix cache gives
    assert first["num_cached_tokens"] == 0 and own >= m["at_least"]
    assert third["num_cached_tokens"] == own
    same_output(first, third)
    records = sorted((tmp_path / "tier").rglob("*.tkv"))
    assert records, "the prefix must have been cascaded to the file tier"
    # (b, d) a new engine process, multiprocessing mode: the prefix comes from disk
    ev = run(models_dir, shm, **base, steps=["run1"], multiprocessing=True)
    assert gen(ev, "run1")["num_cached_tokens"] == own
    same_output(first, gen(ev, "run1"))
    # (c) a record corrupted on disk is a miss, recomputed: same output, never garbage
    victim = records[len(records) // 2]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    ev = run(models_dir, shm, **base, steps=["run1"])
    out = gen(ev, "run1")
    assert out["num_cached_tokens"] < own
    same_output(first, out)
    assert not victim.exists() or victim.read_bytes() != bytes(data), "the corrupt record must be gone"


def test_an_offloaded_block_of_two_engine_blocks_restores_after_a_reset_and_a_restart(
        models_dir: str, tmp_path: Path) -> None:
    """vLLM's ``block_size`` setting (here 64 tokens: 2 engine blocks of 32) is one tierkv block of
    both engine blocks, one record each on disk; restored whole, token for token."""
    base = {"model": "llama", "url": f"file://{tmp_path / 'tier'}", "prompt_len": 200, "max_model_len": 1024,
            "extra": {"block_size": 64}}
    shm = tmp_path / "shm"
    shm.mkdir()
    ev = run(models_dir, shm, **base, steps=["run1", "run2", "reset", "run3"])
    first, third = gen(ev, "run1"), gen(ev, "run3")
    own = gen(ev, "run2")["num_cached_tokens"]
    assert first["num_cached_tokens"] == 0 and own >= 192
    assert third["num_cached_tokens"] == own - own % 64 >= 128  # whole offloaded blocks only
    same_output(first, third)
    records = sorted((tmp_path / "tier").rglob("*.tkv"))
    assert 0 < len(records) <= own // 64, "one record per two engine blocks"
    ev = run(models_dir, shm, **base, steps=["run1"], multiprocessing=True)
    assert gen(ev, "run1")["num_cached_tokens"] == third["num_cached_tokens"]
    same_output(first, gen(ev, "run1"))


def test_concurrent_restores_through_a_small_recurrent_pool(models_dir: str, tmp_path: Path) -> None:
    """Four requests restore from disk at once; each of the three GDN groups has 2 CPU slots."""
    m = MODELS["qwen3next"]
    base = {"model": "qwen3next", "url": f"file://{tmp_path / 'tier'}", "prompt_len": m["prompt_len"],
            "max_model_len": m["max_model_len"], "prompts": 4, "kv_bytes": 128 << 20}
    shm = tmp_path / "shm"
    shm.mkdir()
    ev = run(models_dir, shm, **base, steps=["run1", "run2"])
    firsts = [gen(ev, "run1", i) for i in range(4)]
    owns = [gen(ev, "run2", i)["num_cached_tokens"] for i in range(4)]
    assert min(owns) >= m["at_least"]
    ev = run(models_dir, shm, **base, steps=["run1"], extra={"slots": {"0": 2, "1": 2, "2": 2}})
    for i in range(4):
        out = gen(ev, "run1", i)
        assert out["num_cached_tokens"] == owns[i], f"request {i} was not restored whole"
        same_output(firsts[i], out)


def test_the_measured_prefill_rate_matches_the_engines_own(models_dir: str, tmp_path: Path) -> None:
    """The vLLM adapter measures the engine's prefill rate from the blocks vLLM stores as it
    computes them (the cost model's input when recompute_tokens_per_s is unset); on a real engine
    prefilling fresh prompts it is within 2x of the tokens/s the engine's own timing gives."""
    shm = tmp_path / "shm"
    shm.mkdir()
    ev = run(models_dir, shm, model="llama", url=f"file://{tmp_path / 'tier'}", steps=["rate"],
             rate_prompts=256, rate_len=480)
    rate = next(e for e in ev if e["kind"] == "rate")
    measured, engine = rate["measured_tokens_per_s"], rate["engine_tokens_per_s"]
    assert measured is not None, rate
    assert engine / 2 <= measured <= engine * 2, rate

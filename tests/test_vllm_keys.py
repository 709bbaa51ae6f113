"""Same KV or nothing, through a real vLLM engine (CPU build, a tiny random-weight Llama; each
engine in its own process, tests/engine/run_keys.py):

- the same model path with one weight tensor rewritten in place restores nothing from the records
  the old weights wrote, and its output equals a cold run of the new weights;
- ``prefix_caching_hash_algo: xxhash`` without ``PYTHONHASHSEED`` and a file tier is refused at
  start with one error naming the fix; with only a CPU pool it starts and says once that its pool
  cannot outlive the process; with ``PYTHONHASHSEED`` set, a second process restores what the first
  wrote.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_vllm_engine import MODELS, gen, models_dir, same_output

from tierkv.adapters.fingerprint import parse_engine_namespace

pytest.importorskip("vllm.v1.kv_offload.base")  # installed by `scripts/dev test` where there is no GPU

pytestmark = pytest.mark.slow

__all__ = ["models_dir"]  # a fixture, imported for this module

RUNNER = Path(__file__).parent / "engine" / "run_keys.py"
PROMPT_LEN = MODELS["llama"]["prompt_len"]
AT_LEAST = MODELS["llama"]["at_least"]
REFUSAL = "could ever find what this one writes"
ONE_POOL = "nothing in it outlives the process"


def run(models_dir: str, tmp_path: Path, env: dict[str, str] | None = None, ok: bool = True,
        **args: Any) -> tuple[list[dict[str, Any]], str]:
    """One engine process; its events and its whole output (stdout and stderr)."""
    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    base = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    full_env = {**base, "TIERKV_TEST_MODELS": models_dir, "VLLM_LOGGING_LEVEL": "WARNING", **(env or {})}
    proc = subprocess.run([sys.executable, str(RUNNER), json.dumps({"shm_dir": str(shm), "model": "llama",
                                                                    "prompt_len": PROMPT_LEN, **args})],
                          capture_output=True, text=True, timeout=600, env=full_env)
    events = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
              if line.startswith("[tierkv-run] ")]
    out = proc.stdout + proc.stderr
    if ok:
        assert proc.returncode == 0 and events and events[-1]["kind"] == "done", \
            f"engine run failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        assert not list(shm.iterdir()), "the shared pool segment must be removed on shutdown"
    return events, out


def negate_tensor(path: Path, name: str) -> None:
    """Rewrite one tensor of a safetensors file in place (same size, new values): times -1.5."""
    import torch

    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        meta = header[name]
        assert meta["dtype"] == "BF16", meta
        start, end = meta["data_offsets"]
        f.seek(8 + n + start)
        data = bytearray(f.read(end - start))
        t = torch.frombuffer(data, dtype=torch.bfloat16)
        t.mul_(-1.5)
        f.seek(8 + n + start)
        f.write(bytes(data))


def records(tier: Path) -> list[Path]:
    return sorted(tier.rglob("*.tkv"))


def test_a_changed_weight_restores_nothing_and_equals_a_cold_run(models_dir: str, tmp_path: Path) -> None:
    model = tmp_path / "model"  # made by the first run: a copy of the built model
    tier = tmp_path / "tier"
    url = f"file://{tier}"
    # the old weights write the prefix; a new process of the same weights restores it whole
    ev, _ = run(models_dir, tmp_path, url=url, model_path=str(model), steps=["run1"])
    old = gen(ev, "run1")
    ev, _ = run(models_dir, tmp_path, url=url, model_path=str(model), steps=["run1"])
    assert gen(ev, "run1")["num_cached_tokens"] >= AT_LEAST
    same_output(old, gen(ev, "run1"))
    written = records(tier)
    assert written
    negate_tensor(model / "model.safetensors", "model.layers.0.self_attn.k_proj.weight")
    # the same path, one tensor changed: nothing restored, the records of the old weights untouched
    ev, _ = run(models_dir, tmp_path, url=url, model_path=str(model), steps=["run1"])
    changed = gen(ev, "run1")
    assert changed["num_cached_tokens"] == 0
    # a cold run of the new weights (an empty tier): the same output
    cold_url = f"file://{tmp_path / 'cold'}"
    ev, _ = run(models_dir, tmp_path, url=cold_url, model_path=str(model), steps=["run1"])
    cold = gen(ev, "run1")
    assert cold["num_cached_tokens"] == 0
    same_output(cold, changed)
    assert cold["logprobs"] != old["logprobs"], "the changed tensor must change the model's KV and output"
    assert set(written) <= set(records(tier))
    namespaces = [json.loads(p.read_text())["namespace"] for p in sorted(tier.glob("*/layout.json"))]
    revisions = {parse_engine_namespace(ns)["revision"] for ns in namespaces}  # type: ignore[index]
    assert len(namespaces) == 2 and len(revisions) == 2, namespaces


def test_xxhash_without_a_seed_is_refused_with_a_persistent_tier(models_dir: str, tmp_path: Path) -> None:
    tier = tmp_path / "tier"
    ev, out = run(models_dir, tmp_path, ok=False, url=f"file://{tier}",
                  llm={"prefix_caching_hash_algo": "xxhash"}, steps=["run1"])
    errors = [e for e in ev if e["kind"] == "error"]
    assert len(errors) == 1 and not [e for e in ev if e["kind"] == "started"], out[-4000:]
    msg = errors[0]["message"]
    assert errors[0]["type"] == "ConfigError", msg
    assert REFUSAL in msg and "PYTHONHASHSEED=0" in msg and "sha256" in msg and str(tier) in msg
    assert not records(tier)


def test_xxhash_without_a_seed_and_only_a_cpu_pool_starts_and_says_so_once(models_dir: str,
                                                                          tmp_path: Path) -> None:
    ev, out = run(models_dir, tmp_path, tiers=[], llm={"prefix_caching_hash_algo": "xxhash"},
                  steps=["run1", "run2"])
    assert out.count(ONE_POOL) == 1, out[-4000:]
    assert REFUSAL not in out
    assert gen(ev, "run2")["num_cached_tokens"] >= AT_LEAST  # vLLM's own cache still works
    same_output(gen(ev, "run1"), gen(ev, "run2"))


def test_xxhash_with_a_shared_seed_restores_in_a_second_process(models_dir: str, tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'tier'}"
    xx = {"prefix_caching_hash_algo": "xxhash"}
    seed = {"PYTHONHASHSEED": "4242"}
    ev, out = run(models_dir, tmp_path, env=seed, url=url, llm=xx, steps=["run1"])
    assert ONE_POOL not in out and REFUSAL not in out
    started = next(e for e in ev if e["kind"] == "started")
    assert parse_engine_namespace(started["namespace"])["hash_algo"] == "xxhash"  # type: ignore[index]
    first = gen(ev, "run1")
    ev, _ = run(models_dir, tmp_path, env=seed, url=url, llm=xx, steps=["run1"])
    assert gen(ev, "run1")["num_cached_tokens"] >= AT_LEAST
    same_output(first, gen(ev, "run1"))

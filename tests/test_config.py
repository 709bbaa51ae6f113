"""StoreConfig: from a dict, a JSON/YAML file, the environment; errors that name the bad key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tierkv import TieredStore
from tierkv.backends.memory import MemoryTierConfig
from tierkv.backends.pooltier import CpuTierConfig, DeviceTierConfig
from tierkv.config import StoreConfig
from tierkv.errors import ConfigError
from tierkv.layout import GroupSpec, Layout

LAYOUT: dict[str, Any] = {
    "tokens_per_block": 16,
    "groups": [
        {"kind": "full", "block_bytes": 256},
        {"kind": "scratch", "block_bytes": 32},
        {"kind": "sliding_window", "block_bytes": 256, "window_blocks": 4},
        {"kind": "recurrent", "block_bytes": 1024, "states_per_request": 2},
    ],
}


def cfg_dict(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "layout": LAYOUT,
        "namespace": "model-bf16",
        "max_concurrent_requests": 4,
        "tiers": [
            {"kind": "cpu", "capacity_bytes": 1 << 20, "slots": {3: 16}},
            {"kind": "memory", "capacity_bytes": 1 << 22, "max_inflight_ops": 3},
        ],
        "policy": "arc",
    }
    d.update(over)
    return d


def check_expected(cfg: StoreConfig, namespace: str = "model-bf16") -> None:
    assert isinstance(cfg.layout, Layout)
    assert cfg.layout.groups[2] == GroupSpec(kind="sliding_window", block_bytes=256, window_blocks=4)
    assert cfg.layout.cacheable_groups == (0, 2, 3)
    assert cfg.namespace == namespace
    assert cfg.max_concurrent_requests == 4
    assert cfg.policy == "arc"
    t0, t1 = cfg.tiers
    assert type(t0) is CpuTierConfig
    assert t0.capacity_bytes == 1 << 20
    assert t0.slots == {3: 16}
    assert type(t1) is MemoryTierConfig
    assert t1.capacity_bytes == 1 << 22
    assert t1.max_inflight_ops == 3
    assert cfg.fingerprint == cfg.layout.fingerprint(namespace)


def test_from_dict() -> None:
    cfg = StoreConfig.from_dict(cfg_dict())
    check_expected(cfg)
    # defaults
    plain = StoreConfig.from_dict({"layout": LAYOUT, "tiers": [{"kind": "cpu", "capacity_bytes": 4096}]})
    assert plain.namespace == ""
    assert plain.policy == "slru"  # the default since #47 (docs/traffic.md)
    assert plain.max_concurrent_requests == 8
    assert plain.tiers[0].capacity_bytes == 4096


def test_from_dict_accepts_layout_object() -> None:
    lay = Layout(**LAYOUT)
    cfg = StoreConfig.from_dict(cfg_dict(layout=lay))
    assert cfg.layout == lay


def test_from_dict_refuses_non_mapping() -> None:
    with pytest.raises(ConfigError, match="mapping"):
        StoreConfig.from_dict([("layout", LAYOUT)])  # type: ignore[arg-type]


def test_from_json_file(tmp_path: Path) -> None:
    p = tmp_path / "tierkv.json"
    p.write_text(json.dumps(cfg_dict()))  # slots keys become strings "3" in JSON
    check_expected(StoreConfig.from_file(p))
    check_expected(StoreConfig.from_file(str(p)))


@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
def test_from_yaml_file(tmp_path: Path, suffix: str) -> None:
    p = tmp_path / f"tierkv{suffix}"
    p.write_text(
        "layout:\n"
        "  tokens_per_block: 16\n"
        "  groups:\n"
        "    - {kind: full, block_bytes: 256}\n"
        "    - {kind: scratch, block_bytes: 32}\n"
        "    - {kind: sliding_window, block_bytes: 256, window_blocks: 4}\n"
        "    - {kind: recurrent, block_bytes: 1024, states_per_request: 2}\n"
        "namespace: model-bf16\n"
        "max_concurrent_requests: 4\n"
        "policy: arc\n"
        "tiers:\n"
        "  - kind: cpu\n"
        "    capacity_bytes: 1048576\n"
        "    slots: {3: 16}\n"
        "  - kind: memory\n"
        "    capacity_bytes: 4194304\n"
        "    max_inflight_ops: 3\n"
    )
    check_expected(StoreConfig.from_file(p))


def test_from_env_file_plus_overrides(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(cfg_dict()))
    env = {"TIERKV_CONFIG": str(p), "TIERKV_NAMESPACE": "other-fp8", "UNRELATED": "x"}
    cfg = StoreConfig.from_env(env)
    check_expected(cfg, namespace="other-fp8")
    assert cfg.fingerprint != StoreConfig.from_file(p).fingerprint

    env["TIERKV_TIERS"] = json.dumps([{"kind": "device", "device": "cpu", "capacity_bytes": 65536}])
    env["TIERKV_MAX_CONCURRENT_REQUESTS"] = "2"
    env["TIERKV_POLICY"] = "lru"
    env["TIERKV_PIN_LEASE_S"] = "12.5"
    cfg2 = StoreConfig.from_env(env)
    assert len(cfg2.tiers) == 1
    assert type(cfg2.tiers[0]) is DeviceTierConfig
    assert cfg2.tiers[0].device == "cpu"  # type: ignore[attr-defined]
    assert cfg2.tiers[0].capacity_bytes == 65536
    assert cfg2.max_concurrent_requests == 2
    assert cfg2.policy == "lru"
    assert cfg2.pin_lease_s == 12.5
    assert cfg2.namespace == "other-fp8"
    assert cfg2.layout == cfg.layout


def test_from_os_environ(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "c.json"
    p.write_text(json.dumps(cfg_dict()))
    monkeypatch.setenv("TIERKV_CONFIG", str(p))
    monkeypatch.setenv("TIERKV_NAMESPACE", "from-env")
    monkeypatch.delenv("TIERKV_TIERS", raising=False)
    monkeypatch.delenv("TIERKV_MAX_CONCURRENT_REQUESTS", raising=False)
    monkeypatch.delenv("TIERKV_POLICY", raising=False)
    monkeypatch.delenv("TIERKV_PIN_LEASE_S", raising=False)
    check_expected(StoreConfig.from_env(), namespace="from-env")


def test_from_env_without_file_uses_base() -> None:
    env = {"TIERKV_TIERS": json.dumps([{"kind": "cpu", "capacity_bytes": 8192}])}
    cfg = StoreConfig.from_env(env, base={"layout": LAYOUT, "namespace": "b"})
    assert cfg.namespace == "b"
    assert cfg.tiers[0].capacity_bytes == 8192


def test_from_env_bad_values() -> None:
    base = {"layout": LAYOUT, "tiers": [{"kind": "cpu", "capacity_bytes": 8192}]}
    with pytest.raises(ConfigError, match="TIERKV_TIERS"):
        StoreConfig.from_env({"TIERKV_TIERS": "[{kind: cpu"}, base=base)
    with pytest.raises(ConfigError, match="max_concurrent_requests"):
        StoreConfig.from_env({"TIERKV_MAX_CONCURRENT_REQUESTS": "lots"}, base=base)
    with pytest.raises(ConfigError, match="policy"):
        StoreConfig.from_env({"TIERKV_POLICY": "mru"}, base=base)


def test_from_env_missing_config_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match=r"nope\.json"):
        StoreConfig.from_env({"TIERKV_CONFIG": str(missing)})


# ---- invalid files -------------------------------------------------------------------------------

def test_bad_json_file(tmp_path: Path) -> None:
    p = tmp_path / "bad.json"
    p.write_text('{"layout": {"tokens_per_block": 16,')
    with pytest.raises(ConfigError) as info:
        StoreConfig.from_file(p)
    assert "bad.json" in str(info.value)
    assert "JSON" in str(info.value)


def test_bad_yaml_file(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("layout: [unclosed\n  tiers: {\n")
    with pytest.raises(ConfigError) as info:
        StoreConfig.from_file(p)
    assert "bad.yaml" in str(info.value)
    assert "YAML" in str(info.value)


def test_yaml_file_not_a_mapping(tmp_path: Path) -> None:
    p = tmp_path / "list.yaml"
    p.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        StoreConfig.from_file(p)


def test_missing_file(tmp_path: Path) -> None:
    p = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError) as info:
        StoreConfig.from_file(p)
    assert "missing.yaml" in str(info.value)
    assert not isinstance(info.value, FileNotFoundError)


@pytest.mark.parametrize("bad_tier", [{"url": "file:///tmp/kv"}, "cpu", None])
def test_tier_without_kind_names_key(tmp_path: Path, bad_tier: Any) -> None:
    d = cfg_dict()
    d["tiers"] = [d["tiers"][0], bad_tier]
    p = tmp_path / "c.json"
    p.write_text(json.dumps(d))
    for attempt in (lambda: StoreConfig.from_dict(d), lambda: StoreConfig.from_file(p)):
        with pytest.raises(ConfigError) as info:
            attempt()
        assert "tiers.1" in str(info.value)
        assert "kind" in str(info.value)


@pytest.mark.parametrize("mutate, names", [
    (lambda d: d["tiers"].append({"kind": "no-such-tier"}), ["tiers.2", "no-such-tier"]),
    (lambda d: d.update(max_concurrent_requests="many"), ["max_concurrent_requests"]),
    (lambda d: d.update(max_concurrent_requests=0), ["max_concurrent_requests"]),
    (lambda d: d.update(pin_lease_s=-1), ["pin_lease_s"]),
    (lambda d: d.update(policy="mru"), ["policy"]),
    (lambda d: d.update(tierz=[]), ["tierz"]),
    (lambda d: d.update(tiers=[]), ["tiers"]),
    (lambda d: d.pop("layout"), ["layout"]),
    (lambda d: d["tiers"][0].update(capacity_bytes="lots"), ["tiers.0.capacity_bytes"]),
    (lambda d: d["tiers"][1].update(max_inflight_ops="x"), ["tiers.1.max_inflight_ops"]),
    (lambda d: d["tiers"][1].update(bogus=1), ["tiers.1.bogus"]),
    (lambda d: d["tiers"][0].update(slots={"three": 4}), ["tiers.0.slots"]),
    (lambda d: d.update(layout={"tokens_per_block": 16, "groups": []}), ["layout"]),
])
def test_invalid_config_names_bad_key(tmp_path: Path, mutate: Any, names: list[str]) -> None:
    d = json.loads(json.dumps(cfg_dict()))
    mutate(d)
    p = tmp_path / "c.json"
    p.write_text(json.dumps(d))
    for attempt in (lambda: StoreConfig.from_dict(d), lambda: StoreConfig.from_file(p)):
        with pytest.raises(ConfigError) as info:
            attempt()
        assert isinstance(info.value, ValueError)
        for name in names:
            assert name in str(info.value)


@pytest.mark.anyio
async def test_zero_capacity_cpu_tier_clear_error() -> None:
    cfg = {"layout": LAYOUT, "tiers": [{"kind": "cpu", "capacity_bytes": 0}]}
    with pytest.raises(ConfigError) as info:
        async with TieredStore(StoreConfig.from_dict(cfg)):
            pass
    assert "capacity_bytes" in str(info.value)
    assert "0" in str(info.value)


@pytest.mark.anyio
async def test_capacity_below_floor_clear_error() -> None:
    # floor: recurrent 4 x 2 x 1024 + 256 + 256 = 8704 bytes
    cfg = {"layout": LAYOUT, "max_concurrent_requests": 4,
           "tiers": [{"kind": "cpu", "capacity_bytes": 8703}]}
    with pytest.raises(ConfigError) as info:
        async with TieredStore(cfg):
            pass
    assert "floor" in str(info.value)
    assert "8704" in str(info.value)
    async with TieredStore({**cfg, "tiers": [{"kind": "cpu", "capacity_bytes": 8704}]}) as store:
        assert store.stats().plan.slots() == {0: 1, 2: 1, 3: 8}


# ---- round trip ----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["python", "json"])
def test_round_trip(mode: str) -> None:
    d = cfg_dict()
    d["tiers"] = [
        {"kind": "device", "device": "cpu", "capacity_bytes": 1 << 20, "slots": {0: 5, 3: 9}},
        {"kind": "cpu", "capacity_bytes": 1 << 20, "slots": {2: 3}, "shed_after_s": 0.5},
        {"kind": "memory", "presence_ttl_s": 7.0},
    ]
    cfg = StoreConfig.from_dict(d)
    dumped = cfg.model_dump(mode=mode)  # type: ignore[arg-type]
    assert dumped["tiers"][0]["device"] == "cpu"
    assert dumped["tiers"][1]["slots"] in ({2: 3}, {"2": 3})
    if mode == "json":
        dumped = json.loads(json.dumps(dumped))
    again = StoreConfig.from_dict(dumped)
    assert again == cfg
    assert [type(t) for t in again.tiers] == [DeviceTierConfig, CpuTierConfig, MemoryTierConfig]
    assert again.tiers[0].slots == {0: 5, 3: 9}  # type: ignore[attr-defined]
    assert again.tiers[1].shed_after_s == 0.5
    assert again.tiers[2].presence_ttl_s == 7.0
    assert again.fingerprint == cfg.fingerprint


def test_from_env_sets_the_metrics_endpoint_and_refuses_a_bad_port(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(cfg_dict()))
    cfg = StoreConfig.from_env({"TIERKV_CONFIG": str(p), "TIERKV_METRICS_PORT": "9464",
                                "TIERKV_METRICS_HOST": "0.0.0.0"})
    assert (cfg.metrics_port, cfg.metrics_host) == (9464, "0.0.0.0")
    with pytest.raises(ConfigError, match="metrics_port"):
        StoreConfig.from_env({"TIERKV_CONFIG": str(p), "TIERKV_METRICS_PORT": "http"})


# ---- settings that would switch the cache off or remove a bound ----------------------------------------
LAYOUT1 = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=1024)])


@pytest.mark.parametrize(("key", "value"), [
    ("recompute_tokens_per_s", float("inf")), ("recompute_tokens_per_s", 1e-9),
    ("recompute_tokens_per_s", True), ("recompute_tokens_per_s", float("nan")),
    ("max_pending_s", float("inf")), ("max_pending_s", 1e308), ("max_pending_s", True),
    ("pin_lease_s", float("nan")), ("max_concurrent_requests", True),
])
def test_store_settings_that_switch_the_cache_off_are_refused_naming_the_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=key):
        StoreConfig(layout=LAYOUT1, tiers=[{"kind": "cpu", "capacity_bytes": 1 << 20}], **{key: value})


@pytest.mark.parametrize(("key", "value"), [
    ("capacity_bytes", True), ("open_timeout_s", float("inf")), ("close_timeout_s", 0),
    ("shed_after_s", float("nan")), ("max_inflight_bytes", False),
])
def test_tier_settings_that_remove_a_bound_are_refused(key: str, value: object, tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match=key):
        StoreConfig(layout=LAYOUT1, tiers=[{"kind": "cpu", "capacity_bytes": 1 << 20},
                                           {"kind": "fsspec", "url": f"file://{tmp_path}", key: value}])


@pytest.mark.parametrize(("name", "value"), [("TIERKV_RECOMPUTE_TOKENS_PER_S", "inf"),
                                             ("TIERKV_MAX_PENDING_S", "nan"),
                                             ("TIERKV_MAX_CONCURRENT_REQUESTS", "0")])
def test_environment_settings_are_validated_the_same_way(name: str, value: str) -> None:
    env = {name: value, "TIERKV_TIERS": '[{"kind": "cpu", "capacity_bytes": 1048576}]'}
    with pytest.raises(ConfigError, match=name.removeprefix("TIERKV_").lower()):
        StoreConfig.from_env(env, base={"layout": LAYOUT1})


def test_a_measured_recompute_rate_that_is_not_a_rate_is_refused() -> None:
    from tierkv.errors import InvalidArgument
    from tierkv.movement.costmodel import CostModel

    cm = CostModel(16, 1000.0, None)
    for bad in (float("inf"), float("nan"), 0.0, -5.0, True, 1e12):
        with pytest.raises(InvalidArgument):
            cm.set_rate(bad)  # type: ignore[arg-type]
    assert cm.rate == 1000.0
    cm.set_rate(2000)
    assert cm.rate == 2000.0
    slow = CostModel(16, 1e-3, None)  # the slowest rate allowed: the deadline is still bounded
    assert slow.deadline_s(1000) <= 60.0

"""The backend registry: built-ins, registration, install hints, entry points."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from importlib.metadata import EntryPoint
from typing import Any

import pytest

from tierkv.backends import registry
from tierkv.backends.base import Tier
from tierkv.backends.memory import MemoryTier
from tierkv.backends.pooltier import CpuTier, DeviceTier
from tierkv.backends.registry import available_backends, get_backend, register_backend
from tierkv.config import StoreConfig
from tierkv.errors import BackendNotFound, ConfigError


@pytest.fixture(autouse=True)
def clean_registry() -> Iterator[None]:
    known, loaded = dict(registry._known), dict(registry._loaded)
    try:
        yield
    finally:
        registry._known.clear()
        registry._known.update(known)
        registry._loaded.clear()
        registry._loaded.update(loaded)


def fake_entry_points(eps: list[EntryPoint]) -> Any:
    def entry_points(**kw: Any) -> list[EntryPoint]:
        assert kw == {"group": "tierkv.backends"}
        return [ep for ep in eps if ep.group == kw["group"]]

    return entry_points


class MyTier(MemoryTier):
    kind = "mine"


@pytest.mark.parametrize("kind, cls", [("memory", MemoryTier), ("cpu", CpuTier), ("device", DeviceTier)])
def test_builtins(kind: str, cls: type[Tier]) -> None:
    got = get_backend(kind)
    assert got is cls
    assert issubclass(got, Tier)
    assert get_backend(kind) is got  # cached
    assert kind in available_backends()


@pytest.mark.skipif(importlib.util.find_spec("tierkv.backends.fsspec") is None,
                    reason="tierkv.backends.fsspec is not written yet")
def test_builtin_fsspec() -> None:
    cls = get_backend("fsspec")
    assert issubclass(cls, Tier)
    assert cls.capabilities.persistent


def test_unknown_kind_lists_known() -> None:
    with pytest.raises(BackendNotFound) as info:
        get_backend("no-such-kind")
    msg = str(info.value)
    assert isinstance(info.value, LookupError)
    assert "no-such-kind" in msg
    for known in ("memory", "cpu", "device", "fsspec"):
        assert known in msg


def test_unknown_kind_lists_registered() -> None:
    register_backend("mine", MyTier)
    with pytest.raises(BackendNotFound, match="mine"):
        get_backend("nope")


def test_missing_module_with_extra_gives_install_hint() -> None:
    register_backend("s3-special", "tierkv_no_such_module_xyz.tier:S3Tier", extra="s3")
    assert "s3-special" in available_backends()
    with pytest.raises(BackendNotFound) as info:
        get_backend("s3-special")
    msg = str(info.value)
    assert "s3-special" in msg
    assert "[s3]" in msg and "s3fs" in msg
    assert "pip install" in msg


def test_missing_module_without_extra_has_no_hint() -> None:
    register_backend("lost", "tierkv_no_such_module_xyz:Tier")
    with pytest.raises(BackendNotFound) as info:
        get_backend("lost")
    assert "lost" in str(info.value)
    assert "pip install" not in str(info.value)


def test_string_target_not_a_tier_class() -> None:
    register_backend("notatier", "tierkv.errors:ConfigError")
    with pytest.raises(BackendNotFound, match="not a tierkv Tier"):
        get_backend("notatier")
    register_backend("noattr", "tierkv.backends.memory:NoSuchClass")
    with pytest.raises(BackendNotFound):
        get_backend("noattr")


def test_string_target_loads_lazily() -> None:
    register_backend("mem2", "tierkv.backends.memory:MemoryTier")
    assert get_backend("mem2") is MemoryTier


def test_register_class_directly() -> None:
    register_backend("mine", MyTier)
    assert get_backend("mine") is MyTier
    assert "mine" in available_backends()
    # re-registering a kind replaces the earlier target
    register_backend("mine", "tierkv.backends.memory:MemoryTier")
    assert get_backend("mine") is MemoryTier
    register_backend("mine", MyTier)
    assert get_backend("mine") is MyTier


def test_registered_kind_usable_in_config() -> None:
    register_backend("mine", MyTier)
    cfg = StoreConfig.from_dict({
        "layout": {"tokens_per_block": 4, "groups": [{"kind": "full", "block_bytes": 8}]},
        "tiers": [{"kind": "cpu", "capacity_bytes": 64}, {"kind": "mine", "capacity_bytes": 64}],
    })
    assert cfg.tiers[1].kind == "mine"
    with pytest.raises(ConfigError, match=r"tiers\.1"):
        StoreConfig.from_dict({
            "layout": {"tokens_per_block": 4, "groups": [{"kind": "full", "block_bytes": 8}]},
            "tiers": [{"kind": "cpu", "capacity_bytes": 64}, {"kind": "theirs"}],
        })


def test_entry_point_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    eps = [
        EntryPoint(name="plugged", value="tierkv.backends.memory:MemoryTier", group="tierkv.backends"),
        EntryPoint(name="elsewhere", value="tierkv.backends.memory:MemoryTier", group="other.group"),
    ]
    monkeypatch.setattr(registry, "entry_points", fake_entry_points(eps))
    assert "plugged" in available_backends()
    assert "elsewhere" not in available_backends()
    assert get_backend("plugged") is MemoryTier
    with pytest.raises(BackendNotFound):
        get_backend("elsewhere")


def test_entry_point_does_not_shadow_builtin(monkeypatch: pytest.MonkeyPatch) -> None:
    eps = [EntryPoint(name="cpu", value="tierkv.backends.memory:MemoryTier", group="tierkv.backends")]
    monkeypatch.setattr(registry, "entry_points", fake_entry_points(eps))
    assert get_backend("cpu") is CpuTier


def test_entry_point_broken_target(monkeypatch: pytest.MonkeyPatch) -> None:
    eps = [EntryPoint(name="broken", value="tierkv_no_such_module_xyz:T", group="tierkv.backends")]
    monkeypatch.setattr(registry, "entry_points", fake_entry_points(eps))
    with pytest.raises(BackendNotFound, match="broken"):
        get_backend("broken")


def test_registry_state_is_restored() -> None:
    # the autouse fixture undid the registrations of earlier tests
    assert "mine" not in registry._known and "mine" not in registry._loaded
    assert "s3-special" not in registry._known
    assert "plugged" not in registry._known


def test_adapters_without_their_engine_say_what_to_install() -> None:
    import subprocess
    import sys

    code = ("import sys; sys.modules['vllm'] = None; sys.modules['sglang'] = None\n"
            "import tierkv.adapters.vllm as v, tierkv.adapters.sglang as s\n"
            "for mod, name in ((v, 'TierKVOffloadingSpec'), (s, 'TierKVHiCacheStorage')):\n"
            "    try:\n"
            "        getattr(mod, name)\n"
            "    except ModuleNotFoundError as e:\n"
            "        print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2, out.stderr[-2000:]
    assert "vLLM" in lines[0] and "pip install vllm" in lines[0]
    assert "SGLang" in lines[1] and "pip install 'sglang==0.5.23'" in lines[1]

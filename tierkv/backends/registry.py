"""Backend registry: tier kinds resolve to classes lazily, built-ins first, then entry points."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from tierkv.backends.base import Tier
from tierkv.errors import BackendNotFound, install_hint

__all__ = ["ENTRY_POINT_GROUP", "available_backends", "get_backend", "register_backend"]

ENTRY_POINT_GROUP = "tierkv.backends"

#: kind -> ("module:Class", extra that provides its optional dependencies or None)
_known: dict[str, tuple[str, str | None]] = {
    "memory": ("tierkv.backends.memory:MemoryTier", None),
    "cpu": ("tierkv.backends.pooltier:CpuTier", None),
    "device": ("tierkv.backends.pooltier:DeviceTier", None),
    "fsspec": ("tierkv.backends.fsspec:FsspecTier", None),
    "mooncake": ("tierkv.backends.mooncake:MooncakeTier", "mooncake"),
    "faulty": ("tierkv.testing.faults:FaultyTier", None),
}
_loaded: dict[str, type[Tier]] = {}


def register_backend(kind: str, target: str | type[Tier], extra: str | None = None) -> None:
    """Register a tier kind: a class, or ``"module:Class"`` imported on first use."""
    _loaded.pop(kind, None)
    if isinstance(target, str):
        _known[kind] = (target, extra)
    else:
        _known.pop(kind, None)
        _loaded[kind] = target


def available_backends() -> list[str]:
    """Every kind known now: built-ins, registered ones and entry points."""
    names = set(_known) | set(_loaded)
    names.update(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
    return sorted(names)


def get_backend(kind: str) -> type[Tier]:
    """The tier class for ``kind``; a clear error with an install hint when it cannot be had."""
    if kind in _loaded:
        return _loaded[kind]
    if kind not in _known:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name == kind:
                _known[kind] = (ep.value, None)
                break
        else:
            raise BackendNotFound(
                f"no tier backend named {kind!r}; known: {', '.join(available_backends())}"
            )
    target, extra = _known[kind]
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = f"; install it with: {install_hint(extra)}" if extra else ""
        raise BackendNotFound(f"tier backend {kind!r} cannot be imported ({exc}){hint}") from exc
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Tier)):
        raise BackendNotFound(f"{target} is not a tierkv Tier class")
    _loaded[kind] = cls
    return cls

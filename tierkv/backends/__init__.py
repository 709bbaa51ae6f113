"""Tier backends: the tier interface, the registry, and the built-in tiers.

Names are imported on first use, so a module that needs none of them (a reader process imports
``tierkv.backends.fsspec._local``) does not pull in torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierkv.backends.base import Capabilities, Tier, TierConfig, TierContext
    from tierkv.backends.registry import available_backends, get_backend, register_backend

_WHERE = {
    **dict.fromkeys(["Capabilities", "Tier", "TierConfig", "TierContext"], "tierkv.backends.base"),
    **dict.fromkeys(["available_backends", "get_backend", "register_backend"], "tierkv.backends.registry"),
}

__all__ = [
    "Capabilities",
    "Tier",
    "TierConfig",
    "TierContext",
    "available_backends",
    "get_backend",
    "register_backend",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'tierkv.backends' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

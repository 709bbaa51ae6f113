"""Tier backends: the tier interface, the registry, and the built-in tiers.

Names are imported on first use, so a module that needs none of them (a reader process imports
``tierkv.backends.fsspec._local``) does not pull in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierkv._lazy import lazy

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


__getattr__ = lazy(__name__, _WHERE)

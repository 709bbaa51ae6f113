"""Tier backends: the tier interface, the registry, and the built-in tiers."""

from tierkv.backends.base import Capabilities, Tier, TierConfig, TierContext
from tierkv.backends.registry import available_backends, get_backend, register_backend

__all__ = [
    "Capabilities",
    "Tier",
    "TierConfig",
    "TierContext",
    "available_backends",
    "get_backend",
    "register_backend",
]

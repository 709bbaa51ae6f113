"""The ``mooncake`` tier: checked records in a Mooncake Store cluster (docs/tiers.md).

Its public names are :class:`MooncakeTier` and :class:`MooncakeTierConfig`; beside them, private to
the tier, ``_tier`` (the tier), ``_client`` (the Mooncake client's calls, on threads of the tier's,
bounded) and ``_config`` (its settings).
"""

from __future__ import annotations

from tierkv.backends.mooncake._config import MooncakeTierConfig
from tierkv.backends.mooncake._tier import MooncakeTier

__all__ = ["MooncakeTier", "MooncakeTierConfig"]

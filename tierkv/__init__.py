"""tierkv: a tiered, asyncio-native store for LLM KV caches and other fixed-size model state.

The public front door: everything a user needs is importable from here. Names are imported on
first use, so ``import tierkv.transfer`` (torch only) does not pull in the rest of the package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierkv._lazy import lazy

if TYPE_CHECKING:
    from tierkv.blocks.pool import PoolPlan, plan_pools
    from tierkv.config import StoreConfig
    from tierkv.errors import (
        BackendError,
        BackendNotFound,
        BlockMissing,
        CapacityError,
        ConfigError,
        CorruptRecord,
        InvalidArgument,
        LayoutError,
        StoreClosed,
        TierKVError,
    )
    from tierkv.keys import make_key, split_key
    from tierkv.layout import GroupSpec, Layout
    from tierkv.observing.metrics import StoreStats, to_prometheus
    from tierkv.store import Lookup, PrefixLookup, TieredStore

__version__ = "0.1.0"

_WHERE = {
    "StoreConfig": "tierkv.config",
    **dict.fromkeys(["BackendError", "BackendNotFound", "BlockMissing", "CapacityError", "ConfigError",
                     "CorruptRecord", "InvalidArgument", "LayoutError", "StoreClosed", "TierKVError"],
                    "tierkv.errors"),
    "make_key": "tierkv.keys",
    "split_key": "tierkv.keys",
    "GroupSpec": "tierkv.layout",
    "Layout": "tierkv.layout",
    "StoreStats": "tierkv.observing.metrics",
    "to_prometheus": "tierkv.observing.metrics",
    "PoolPlan": "tierkv.blocks.pool",
    "plan_pools": "tierkv.blocks.pool",
    "Lookup": "tierkv.store",
    "PrefixLookup": "tierkv.store",
    "TieredStore": "tierkv.store",
}

__all__ = [
    "BackendError",
    "BackendNotFound",
    "BlockMissing",
    "CapacityError",
    "ConfigError",
    "CorruptRecord",
    "GroupSpec",
    "InvalidArgument",
    "Layout",
    "LayoutError",
    "Lookup",
    "PoolPlan",
    "PrefixLookup",
    "StoreClosed",
    "StoreConfig",
    "StoreStats",
    "TierKVError",
    "TieredStore",
    "__version__",
    "make_key",
    "plan_pools",
    "split_key",
    "to_prometheus",
]


__getattr__ = lazy(__name__, _WHERE)


def __dir__() -> list[str]:
    return sorted(__all__)

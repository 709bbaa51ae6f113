"""tierkv: a tiered, asyncio-native store for LLM KV caches and other fixed-size model state.

The public front door: everything a user needs is importable from here.
"""

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
from tierkv.metrics import StoreStats, to_prometheus
from tierkv.pool import PoolPlan, plan_pools
from tierkv.store import Lookup, PrefixLookup, TieredStore

__version__ = "0.1.0"

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

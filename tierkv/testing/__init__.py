"""Test helpers shipped with tierkv: the tier conformance suite and fault-injecting wrappers.

Backends (built-in or third-party) subclass :class:`TierTests` in their own test suites. The
names are imported lazily: the tools that use this package's process and server helpers
(``tierkv simulate``, the benchmarks) run where pytest is not installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierkv.testing.conformance import TierTests, conformance_layout

__all__ = ["TierTests", "conformance_layout"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from tierkv.testing import conformance

        return getattr(conformance, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

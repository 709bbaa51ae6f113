"""Test helpers shipped with tierkv: the tier conformance suite and fault-injecting wrappers.

Backends (built-in or third-party) subclass :class:`TierTests` in their own test suites.
"""

from tierkv.testing.conformance import TierTests, conformance_layout

__all__ = ["TierTests", "conformance_layout"]

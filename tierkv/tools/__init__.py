"""Tools built on the library, run by the ``tierkv`` command: ``inspect`` and ``verify``
(:mod:`~tierkv.tools.audit`), the demo, the many-process simulation (:mod:`~tierkv.tools.simulate`,
:mod:`~tierkv.tools.nodes`) and the benchmarks the command runs (:mod:`tierkv.tools.bench`).
Nothing in the library imports them."""

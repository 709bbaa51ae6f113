"""Benchmarks that need more than the library: a real serving engine, servers, child processes.

* :mod:`tierkv.tools.bench.serving`: time to first token of a real vLLM engine restoring prefixes
  from tierkv's CPU pool, a ``file://`` tier (warm and cold page cache) and an S3 tier
  (``tierkv bench serving`` / ``python -m tierkv.tools.bench.serving``).
* :mod:`tierkv.tools.bench.serving_engine`: the engine process that benchmark drives.

Nothing here is imported by the library itself.
"""

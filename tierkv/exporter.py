"""The store's metrics over HTTP for Prometheus: ``StoreConfig.metrics_port``.

While the store is open it serves ``http://<metrics_host>:<port>/metrics`` (Prometheus text
format) from a thread of prometheus-client (the optional extra ``tierkv[metrics]``); each scrape
reads ``store.stats()``, so the series are the same as :func:`tierkv.metrics.to_prometheus`'s:
counters, gauges and latency histograms in tierkv's one naming scheme (``tierkv_*``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from tierkv.errors import ConfigError, install_hint
from tierkv.metrics import StoreStats, histogram_samples, samples

__all__ = ["MetricsServer"]


class MetricsServer:
    """An HTTP endpoint serving a store's metrics; :attr:`port` is the one bound (0 picks a free one)."""

    def __init__(self, stats: Callable[[], StoreStats], host: str, port: int) -> None:
        try:
            from prometheus_client import start_http_server
            from prometheus_client.registry import CollectorRegistry
        except ImportError:
            raise ConfigError(f"metrics_port needs prometheus-client: {install_hint('metrics')}") from None
        self._stats = stats
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        try:
            self._server, self._thread = start_http_server(port, host, registry)
        except OSError as exc:
            raise ConfigError(f"metrics_port: cannot serve on {host}:{port}: {exc.strerror or exc}") from None
        self.host = host
        self.port: int = self._server.server_port

    @property
    def url(self) -> str:
        """Where the metrics are served."""
        return f"http://{self.host}:{self.port}/metrics"

    def collect(self) -> Iterator[Any]:
        """The store's samples as metric families (prometheus-client's collector protocol)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        stats = self._stats()
        families: dict[str, Any] = {}
        for m, labels, value in samples(stats):
            fam = families.get(m.name)
            if fam is None:
                cls = CounterMetricFamily if m.kind == "counter" else GaugeMetricFamily
                name = m.full_name.removesuffix("_total") if m.kind == "counter" else m.full_name
                fam = families[m.name] = cls(name, m.doc, labels=list(m.labels))
            fam.add_metric(list(labels), value)
        for m, labels, h in histogram_samples(stats):
            fam = families.get(m.name)
            if fam is None:
                fam = families[m.name] = HistogramMetricFamily(m.full_name, m.doc, labels=list(m.labels))
            buckets = [(f"{b:g}", float(c)) for b, c in zip(h.buckets, h.counts, strict=False)]
            buckets.append(("+Inf", float(h.counts[-1])))
            fam.add_metric(list(labels), buckets, h.sum)
        yield from families.values()

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

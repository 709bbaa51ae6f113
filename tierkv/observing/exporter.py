"""The store's metrics over HTTP for Prometheus: ``StoreConfig.metrics_port``.

While the store is open it serves ``http://<metrics_host>:<port>/metrics`` (Prometheus text
format) with prometheus-client's handler (the optional extra ``[metrics]``); each scrape
reads ``store.stats()``, so the series are the same as :func:`tierkv.observing.metrics.to_prometheus`'s:
counters, gauges and latency histograms in tierkv's one naming scheme (``tierkv_*``).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import ThreadingHTTPServer
from typing import Any

from tierkv.errors import ConfigError, install_hint
from tierkv.observing.metrics import StoreStats, histogram_samples, samples

__all__ = ["MetricsServer", "start_metrics"]


#: connections served at once; more wait in the listen backlog, then are refused
MAX_CONNECTIONS = 16
#: a connection that sends no complete request within this many seconds is closed
READ_TIMEOUT_S = 2.0


class MetricsServer:
    """An HTTP endpoint serving a store's metrics; :attr:`port` is the one bound (0 picks a free one).

    At most :data:`MAX_CONNECTIONS` connections are served at once, each closed when it sends no
    complete request within :data:`READ_TIMEOUT_S`; :meth:`close` closes every open connection and
    waits for every thread it started. IPv6 hosts work (``::1``, ``::``).
    """

    def __init__(self, stats: Callable[[], StoreStats], host: str, port: int) -> None:
        try:
            from prometheus_client.exposition import MetricsHandler
            from prometheus_client.registry import CollectorRegistry
        except ImportError:
            raise ConfigError(f"metrics_port needs prometheus-client: {install_hint('metrics')}") from None
        self._stats = stats
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        handler = type("TierKVMetricsHandler", (MetricsHandler.factory(registry),),
                       {"timeout": READ_TIMEOUT_S, "log_message": lambda *a: None})
        try:
            self._server = _BoundedServer((host, port), handler, MAX_CONNECTIONS)
        except (OSError, ValueError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ConfigError(f"metrics_port: cannot serve on {host}:{port}: {why}") from None
        self._thread = threading.Thread(target=self._server.serve_forever, name="tierkv-metrics", daemon=True)
        self._thread.start()
        self.host = host
        self.port: int = self._server.server_address[1]

    @property
    def url(self) -> str:
        """Where the metrics are served (an IPv6 host in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

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
        """Stop serving: no new connection, every open one closed, every thread ended."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class _BoundedServer(ThreadingHTTPServer):
    """A threading HTTP server with a bound on connections, read timeouts and a close that ends
    every connection thread."""

    daemon_threads = False
    block_on_close = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], handler: Any, max_connections: int) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self._slots = threading.BoundedSemaphore(max_connections)
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):  # too many at once: this one is closed
            self.shutdown_request(request)
            return
        with self._open_lock:
            self._open.add(request)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._done(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done(request)

    def _done(self, request: Any) -> None:
        with self._open_lock:
            if request in self._open:
                self._open.discard(request)
                self._slots.release()

    def server_close(self) -> None:
        with self._open_lock:
            for conn in list(self._open):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        super().server_close()  # joins the connection threads (block_on_close)


def start_metrics(config: Any, stats: Callable[[], StoreStats]) -> MetricsServer | None:
    """The endpoint a :class:`~tierkv.StoreConfig` asks for (``metrics_port``, else
    ``TIERKV_METRICS_PORT``), or None. A port the environment names that cannot be bound (a second
    store in one process) is one warning, not an error: the variable applies to every store."""
    address = config.metrics_address()
    if address is None:
        return None
    host, port, from_env = address
    try:
        return MetricsServer(stats, host, port)
    except ConfigError as exc:
        if not from_env:
            raise
        logging.getLogger("tierkv").warning("TIERKV_METRICS_PORT: no metrics endpoint for this store: %s",
                                            exc)
        return None

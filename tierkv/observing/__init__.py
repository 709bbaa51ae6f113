"""Observing a store: counters and their Prometheus exposition, the HTTP exporter, tier events, and
each lower tier's health as its gateway sees it."""

"""``TierKVSecondaryTier``: tierkv's persistent ``fsspec`` tier as a secondary tier of vLLM's own
``TieringOffloadingSpec``.

Users who keep vLLM's CPU primary (``TieringOffloadingSpec``) add tierkv below it with one entry in
``secondary_tiers``; nothing in vLLM is patched::

    "kv_connector_extra_config": {
      "spec_name": "TieringOffloadingSpec",
      "cpu_bytes_to_use": 8000000000,
      "secondary_tiers": [{
        "type": "TierKVSecondaryTier", "module_path": "tierkv.adapters.vllm",
        "url": "s3://bucket/kv", "codec": "zstd-shuffle", "capacity_bytes": 200000000000,
        "storage_options": {"endpoint_url": "http://minio:9000"}
      }]
    }

Every key of the tier entry besides ``type``, ``module_path`` and ``backpressure`` (which vLLM's
factory consumes) is a field of :class:`TierKVSecondaryTierConfig`; an unknown key or a bad value
raises :class:`tierkv.errors.ConfigError` naming the key.

What it stores
    One tierkv record (header, key, layout fingerprint, checksum, codec; see docs/format.md) per row
    of the primary's memoryview, i.e. per vLLM offload key (``block_hash + 4-byte big-endian group
    index``; the bytes are used as tierkv keys as they are). A record holds the whole row
    (``block_size_bytes = primary_kv_view.strides[0]``, padding included).

Namespace
    Records live under a directory named by the fingerprint of a tierkv :class:`~tierkv.Layout`
    (one ``full`` group of ``block_size_bytes`` per offloaded KV cache group at its original group
    index, ``scratch`` for the indices vLLM does not offload) within a namespace made of the model
    name, the KV cache dtype, ``tokens_per_hash``, the rank, plus the chunking and parallel layout
    (blocks per chunk, tokens per block of each group, world / TP / PP / PCP / DCP sizes, KV cache
    layout, canonical and replicated layout flags) and the optional user ``namespace``. vLLM's block
    hashes do not depend on the model, so without this two models with the same prompt would share
    keys; with it, a different model, dtype or layout never sees another's records (and a record
    that reached the wrong directory still fails its fingerprint check and is a miss).

Semantics (vLLM's ``SecondaryTierManager`` contract)
    - ``lookup`` never blocks: HIT when the record is known present (this process wrote, read or
      probed it within ``presence_ttl_s``); MISS when known absent (a probe, a failed read or a
      failed write within ``negative_ttl_s``) or when the key's group is not offloaded; RETRY while a
      write of the key or an existence probe is in flight. The first lookup of an unknown key queues
      a probe, sent to the tier's event loop at ``on_schedule_end`` (one batch per step).
    - ``submit_store`` never blocks: keys already known present (or being written) are skipped,
      the rest are written in the background straight from the primary's rows. vLLM pins those
      rows until the job is reported finished, so no copy is taken. Bytes or operations in flight
      past ``max_inflight_bytes`` / ``max_inflight_ops`` (or a queue that the measured latency says
      would take longer than ``shed_after_s``) shed the job: it finishes unsuccessful, nothing is
      written, and ``stores_shed`` counts its keys. vLLM's own ``backpressure`` setting works too.
    - ``submit_load`` never blocks: records are read, verified (checksum, key, layout fingerprint,
      size) and decoded in the background straight into the primary's rows; a record that fails
      verification is never decoded into a row. A missing, corrupt or unreadable record fails its
      key only (``JobResult.successful_keys`` lists the others, ``success`` is False); a corrupt
      record is removed and counted, and the key is a MISS from then on (no promotion livelock).
    - ``drain_jobs`` blocks until every submitted job has finished (jobs are never aborted);
      ``get_finished_jobs`` returns each finished job once; ``shutdown`` drains, closes the tier and
      stops the event loop thread.
    - Capacity (``capacity_bytes``) is enforced by the fsspec tier (LRU; reads refresh recency). A
      record evicted while this process still believes it present is found missing when a
      promotion reads it: that key's promotion fails and the key becomes a MISS.

Threads
    The fsspec tier runs on a private anyio event loop in a daemon thread (a blocking portal kept
    open for the tier's lifetime, which also runs the tier's background capacity scan). Scheduler
    calls only touch in-memory state and hand work to that loop; results come back through a
    queue that the scheduler thread drains, so presence state is owned by the scheduler thread.

Credentials in ``storage_options`` or the URL are never logged (``describe()`` redacts the URL).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import anyio
import anyio.from_thread
import numpy as np
import torch
from pydantic import ConfigDict, ValidationError, field_validator
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from tierkv.backends.base import TierContext
from tierkv.backends.fsspec import FsspecTier, FsspecTierConfig, redact_url
from tierkv.errors import BackendError, ConfigError
from tierkv.keys import GROUP_BYTES
from tierkv.layout import GroupSpec, Layout
from tierkv.lower import LowerTier

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )

__all__ = [
    "METRICS",
    "TierKVSecondaryTier",
    "TierKVSecondaryTierConfig",
    "build_namespace_layout",
]

log = logging.getLogger("tierkv.vllm")

#: probes queued by lookups are sent at ``on_schedule_end``, or as soon as this many are queued
PROBE_BATCH = 512
#: runs of consecutive primary rows at least this long are read / written in place; shorter ones
#: go through one staging buffer per group (a copy is cheaper than a tier call per short run)
DIRECT_RUN_BYTES = 1 << 20
#: copies between the primary and a staging buffer larger than this run in a worker thread
INLINE_COPY_BYTES = 1 << 20


class TierKVSecondaryTierConfig(FsspecTierConfig):
    """The keys of a ``TierKVSecondaryTier`` entry in ``secondary_tiers``.

    All fields of :class:`~tierkv.backends.fsspec.FsspecTierConfig` (``url``, ``storage_options``,
    ``codec``, ``capacity_bytes``, ``fsync``, ``io_threads``, TTLs, in-flight bounds, ...) plus:

    - ``namespace``: an extra string mixed into the namespace (e.g. to keep two deployments of
      the same model apart, or to tag a fine-tune served under the base model's name).
    - ``locality``: ``"LOCAL"`` or ``"REMOTE"`` (vLLM's ``kv_load_tiers`` filter uses it).
    - ``enable_kv_events``: emit a ``BlockStored``-style ``OffloadingEvent`` for every key written
      (only when vLLM's KV cache events are enabled globally). Evictions are not reported.

    ``read_concurrency`` bounds concurrent load jobs and ``max_inflight_ops`` concurrent store jobs;
    ``kind`` can only be ``"fsspec"``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    namespace: str = ""
    locality: Literal["LOCAL", "REMOTE"] | None = None
    enable_kv_events: bool = False

    @field_validator("kind")
    @classmethod
    def _fsspec_only(cls, v: str) -> str:
        if v != "fsspec":
            raise ValueError(f"must be 'fsspec', got {v!r}")
        return v

    def tier_config(self) -> FsspecTierConfig:
        """The settings of the underlying fsspec tier."""
        return FsspecTierConfig(**self.model_dump(include=set(FsspecTierConfig.model_fields)))


def _parse_config(cfg: dict[str, Any], tier_type: str) -> TierKVSecondaryTierConfig:
    try:
        return TierKVSecondaryTierConfig(**cfg)
    except ValidationError as exc:
        # Never echo input values: storage_options may hold credentials.
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
            for err in exc.errors(include_url=False, include_input=False, include_context=False)
        )
        raise ConfigError(f"secondary tier {tier_type!r}: invalid configuration: {problems}") from None


def build_namespace_layout(offloading_spec: Any, block_bytes: int, user_namespace: str = "") -> tuple[
        Layout, str]:
    """The tierkv layout and namespace string for a vLLM ``OffloadingSpec`` (see the module doc)."""
    config = getattr(offloading_spec, "config", None)
    if config is None or not getattr(config, "groups", None):
        raise ConfigError("TierKVSecondaryTier needs vLLM's OffloadingSpec (with config.groups)")
    offloaded = {int(g.group_id): g for g in config.groups}
    n_groups = max(offloaded) + 1
    groups = [GroupSpec(kind="full" if i in offloaded else "scratch", block_bytes=block_bytes)
              for i in range(n_groups)]
    bpc = int(config.cache.blocks_per_chunk)
    chunk_tokens = [int(g.tokens_per_block) * bpc for g in config.groups]
    layout = Layout(tokens_per_block=chunk_tokens[0], groups=groups)
    par = config.parallel
    parts = {
        "model": config.model.name,
        "dtype": config.model.dtype,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "rank": par.rank,
        "blocks_per_chunk": bpc,
        "group_tokens": ",".join(f"{g.group_id}:{g.tokens_per_block}" for g in config.groups),
        "world": par.world_size,
        "tp": par.tp_size,
        "pp": par.pp_size,
        "pcp": par.pcp_size,
        "dcp": par.dcp_size,
        "kv_layout": getattr(config, "kv_cache_layout", None),
        "canonical": bool(getattr(config, "canonical_layout", False)),
        "replicated": bool(getattr(offloading_spec, "replicated_layout", False)),
        "user": user_namespace,
    }
    namespace = "vllm-tiering|" + "|".join(f"{k}={v}" for k, v in parts.items())
    return layout, namespace


_M = "vllm:kv_offload_tierkv_"


def _counter(documentation: str) -> OffloadingMetricMetadata:
    return OffloadingCounterMetadata(documentation=documentation, labelnames=("tier",))


#: Prometheus metrics this tier reports through ``get_stats`` (all labelled by ``tier``).
METRICS: dict[str, OffloadingMetricMetadata] = {
    _M + "probes": _counter("Existence probes of keys sent to the tierkv tier."),
    _M + "stores_skipped": _counter("Keys not written to the tierkv tier because it already holds them."),
    _M + "stores_shed": _counter("Keys not written to the tierkv tier because its in-flight bounds were "
                                 "full."),
    _M + "store_failures": _counter("Keys whose write to the tierkv tier failed."),
    _M + "load_failures": _counter("Keys whose promotion from the tierkv tier failed (missing, corrupt, "
                                   "unreadable)."),
    _M + "corrupt_records": _counter("Records that failed verification (checksum, key, fingerprint, size) "
                                     "and were removed."),
    _M + "evictions": _counter("Records removed from the tierkv tier to stay within capacity_bytes."),
    _M + "used_bytes": OffloadingGaugeMetadata(
        documentation="Bytes of records the tierkv tier holds (as known to this process).",
        labelnames=("tier",)),
}


@dataclass
class _Done:
    """A finished background operation, handed from the event loop to the scheduler thread."""

    kind: Literal["store", "load", "probe"]
    job_id: int
    keys: list[bytes]
    ok: list[bool]
    elapsed: float = 0.0
    nbytes: int = 0
    #: False when the job had keys that were refused before it started (store jobs)
    complete: bool = True
    counters: dict[str, int] = field(default_factory=dict)
    used_bytes: int | None = None


def _why(exc: BaseException) -> str:
    """What went wrong, without credentials: tierkv's backend errors are redacted, others by type."""
    return str(exc)[:300] if isinstance(exc, BackendError) else type(exc).__name__


def _plan(groups: list[int], chunk_ids: list[int], block: int) -> tuple[
        list[tuple[int, int, int]], dict[int, list[int]]]:
    """How to move a job's rows: ``(direct, gathered)``.

    ``direct``: runs ``(start, stop, group)`` of one group and consecutive chunk ids, at least
    :data:`DIRECT_RUN_BYTES` long, moved in place (the rows are one contiguous tensor).
    ``gathered``: per group, the positions of the remaining keys, moved through one staging
    buffer per group (one batched tier call instead of one call per short run).
    """
    direct: list[tuple[int, int, int]] = []
    gathered: dict[int, list[int]] = {}
    start = 0
    for i in range(1, len(chunk_ids) + 1):
        if (i == len(chunk_ids) or groups[i] != groups[start]
                or chunk_ids[i] != chunk_ids[i - 1] + 1):
            if (i - start) * block >= DIRECT_RUN_BYTES or i - start == len(chunk_ids):
                direct.append((start, i, groups[start]))
            else:
                gathered.setdefault(groups[start], []).extend(range(start, i))
            start = i
    return direct, gathered


class TierKVSecondaryTier(SecondaryTierManager):  # type: ignore[misc,unused-ignore]
    """A vLLM secondary tier backed by tierkv's ``fsspec`` tier (see the module docstring)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, **cfg: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.settings = _parse_config(cfg, tier_type)
        self.locality = Locality(self.settings.locality) if self.settings.locality else None
        block = self.block_size_bytes
        view = memoryview(primary_kv_view)
        if not view.c_contiguous or view.nbytes % block:
            raise ConfigError("TierKVSecondaryTier needs a C-contiguous primary memoryview of whole rows")
        self.layout, self.namespace = build_namespace_layout(offloading_spec, block,
                                                             self.settings.namespace)
        self.fingerprint = self.layout.fingerprint(self.namespace)
        self._groups = frozenset(self.layout.cacheable_groups)
        self._rows: np.ndarray[Any, np.dtype[np.uint8]] | None = np.frombuffer(
            view, dtype=np.uint8).reshape(-1, block)
        self._num_rows = self._rows.shape[0]
        events_on = bool(getattr(getattr(offloading_spec, "kv_events_config", None),
                                 "enable_kv_cache_events", False))
        if self.settings.enable_kv_events and not events_on:
            log.warning("enable_kv_events is set on tier %r but vLLM's KV cache events are off; "
                        "no events will be emitted", tier_type)
        self._events: list[OffloadingEvent] | None = (
            [] if self.settings.enable_kv_events and events_on else None)

        # scheduler-thread state
        self._done: queue.SimpleQueue[_Done] = queue.SimpleQueue()
        self._results: list[JobResult] = []
        self._inflight: dict[int, concurrent.futures.Future[None]] = {}
        self._storing: set[bytes] = set()
        self._probing: set[bytes] = set()
        self._probe_batch: list[bytes] = []
        self._probe_futures: set[concurrent.futures.Future[None]] = set()
        self._counts: dict[str, float] = {}
        self._tier_counts: dict[str, int] = {}
        self._used_bytes: int | None = None
        self._closed = False

        self._tier = FsspecTier(self.settings.tier_config(),
                                TierContext(layout=self.layout, namespace=self.namespace,
                                            fingerprint=self.fingerprint))
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        self._background: concurrent.futures.Future[None] | None = None
        try:
            self._lower: LowerTier = self._portal.call(self._open)
        except BaseException:
            self._stop_loop()
            self._rows = None
            raise
        self._background = self._portal.start_task_soon(self._tier.background)
        log.info("tierkv secondary tier %r: %s, namespace %s (fingerprint %s), %d-byte records",
                 tier_type, self._tier.describe(), self.settings.namespace or "<default>",
                 self.fingerprint, block)

    async def _open(self) -> LowerTier:
        await self._tier.open()
        return LowerTier(1, self._tier)

    # ---- vLLM SecondaryTierManager API -----------------------------------------------------------
    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        """The metrics :meth:`get_stats` reports."""
        return dict(METRICS)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Chunk-level offloading (vLLM's default)."""
        return RequestOffloadingContext()

    def lookup(self, key: Any, req_context: ReqContext) -> LookupResult:
        """HIT / MISS from the presence cache; RETRY while a write or a probe of ``key`` runs."""
        if not self._done.empty():
            self._drain()
        if key in self._storing or key in self._probing:
            return LookupResult.RETRY
        known = self._lower.presence(0, key, time.monotonic())
        if known is not None:
            return LookupResult.HIT if known else LookupResult.MISS
        if self._closed or int.from_bytes(key[-GROUP_BYTES:], "big") not in self._groups:
            return LookupResult.MISS
        self._probing.add(key)
        self._probe_batch.append(key)
        if len(self._probe_batch) >= PROBE_BATCH:
            self._flush_probes()
        return LookupResult.RETRY

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Write the job's rows in the background, skipping keys already held or being written."""
        job_id = job_metadata.job_id
        keys = list(job_metadata.keys)
        cids = [int(c) for c in np.asarray(job_metadata.chunk_ids).reshape(-1)]
        if not self._valid_job(job_id, keys, cids):
            return
        now = time.monotonic()
        todo: list[int] = []
        skipped = 0
        for i, k in enumerate(keys):
            if k in self._storing or self._lower.presence(0, k, now) is True:
                skipped += 1
            elif int.from_bytes(k[-GROUP_BYTES:], "big") in self._groups:
                todo.append(i)
            else:
                self._count("store_failures")
        self._count("stores_skipped", skipped)
        if not todo:
            ok = len(todo) + skipped == len(keys)
            self._results.append(JobResult(job_id=job_id, success=ok, transfer_time=0.0, transfer_bytes=0))
            return
        nbytes = len(todo) * self.block_size_bytes
        if not self._lower.admit_store(nbytes):
            self._count("stores_shed", len(todo))
            self._results.append(JobResult(job_id=job_id, success=False))
            return
        sub_keys = [bytes(keys[i]) for i in todo]
        sub_cids = [cids[i] for i in todo]
        self._storing.update(sub_keys)
        all_ok = len(todo) + skipped == len(keys)
        self._inflight[job_id] = self._portal.start_task_soon(
            self._run_store, job_id, sub_keys, sub_cids, nbytes, all_ok)

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Read, verify and decode the job's records into its primary rows in the background."""
        job_id = job_metadata.job_id
        keys = [bytes(k) for k in job_metadata.keys]
        cids = [int(c) for c in np.asarray(job_metadata.chunk_ids).reshape(-1)]
        if not self._valid_job(job_id, keys, cids):
            return
        self._inflight[job_id] = self._portal.start_task_soon(self._run_load, job_id, keys, cids)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Every job finished since the last call, each reported once."""
        self._drain()
        results, self._results = self._results, []
        return results

    def has_pending_work(self) -> bool:
        """True while jobs or existence probes are in flight (keeps the engine stepping)."""
        return bool(self._inflight) or bool(self._probing)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Send the existence probes queued by this step's lookups."""
        self._drain()
        self._flush_probes()

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Events for keys written since the last call (only with ``enable_kv_events``)."""
        if not self._events:
            return ()
        events, self._events = self._events, []
        return events

    def drain_jobs(self) -> None:
        """Block until every submitted load and store job has finished (none is aborted)."""
        pending = [f for f in self._inflight.values() if not f.done()]
        if pending:
            concurrent.futures.wait(pending)
        self._drain()

    def get_stats(self) -> OffloadingConnectorStats | None:
        """Counters since the last call and the bytes held, or None when there is nothing new."""
        self._drain()
        if not self._counts and self._used_bytes is None:
            return None
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        stats = OffloadingConnectorStats()
        label = (self.tier_type,)
        for name, value in self._counts.items():
            if value:
                stats.increase_counter(_M + name, value, label)
        if self._used_bytes is not None:
            stats.set_gauge(_M + "used_bytes", self._used_bytes, label)
        self._counts = {}
        self._used_bytes = None
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        """Finish every job, close the tier and stop the event loop thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.drain_jobs()
            for f in list(self._probe_futures):
                f.cancel()
            if self._background is not None:
                self._background.cancel()
            with contextlib.suppress(Exception):
                concurrent.futures.wait([f for f in [self._background, *self._probe_futures]
                                         if f is not None], timeout=30)
            try:
                self._portal.call(self._tier.close)
            except Exception as exc:
                log.warning("closing %s failed: %s", self._tier.describe(), _why(exc))
        finally:
            self._stop_loop()
            self._drain()
            # the primary releases its memoryview after this: hold no buffer export of it
            self._rows = None

    def describe(self) -> str:
        """The tier's URL without credentials, and its namespace fingerprint."""
        return f"tierkv {redact_url(self.settings.url)} ({self.fingerprint})"

    def __repr__(self) -> str:
        return f"<TierKVSecondaryTier {self.describe()}>"

    # ---- scheduler-thread helpers ----------------------------------------------------------------
    def _count(self, name: str, n: float = 1) -> None:
        if n:
            self._counts[name] = self._counts.get(name, 0) + n

    def _valid_job(self, job_id: int, keys: Collection[bytes], cids: list[int]) -> bool:
        problem = ""
        if self._closed:
            problem = "the tier is shut down"
        elif len(keys) != len(cids):
            problem = f"{len(keys)} keys but {len(cids)} chunk ids"
        elif any(c < 0 or c >= self._num_rows for c in cids):
            problem = "a chunk id outside the primary"
        if problem:
            log.error("tierkv tier %r: job %d refused: %s", self.tier_type, job_id, problem)
            self._results.append(JobResult(job_id=job_id, success=False))
            return False
        return True

    def _flush_probes(self) -> None:
        if not self._probe_batch or self._closed:
            return
        batch, self._probe_batch = self._probe_batch, []
        fut = self._portal.start_task_soon(self._run_probe, batch)
        self._probe_futures.add(fut)
        fut.add_done_callback(self._probe_futures.discard)
        self._count("probes", len(batch))

    def _drain(self) -> None:
        """Apply everything the event loop finished (scheduler thread only)."""
        while True:
            try:
                d = self._done.get_nowait()
            except queue.Empty:
                return
            now = time.monotonic()
            if d.counters:
                for name, metric in (("corrupt", "corrupt_records"), ("evictions", "evictions")):
                    n = d.counters.get(name, 0) - self._tier_counts.get(name, 0)
                    self._count(metric, n)
                self._tier_counts = d.counters
            if d.used_bytes is not None:
                self._used_bytes = d.used_bytes
            if d.kind == "probe":
                for k, found in zip(d.keys, d.ok, strict=True):
                    self._probing.discard(k)
                    # a write or read that finished meanwhile knows better than the probe
                    if self._lower.presence(0, k, now) is None:
                        self._lower.note(k, found, now)
                continue
            self._inflight.pop(d.job_id, None)
            n_ok = sum(d.ok)
            for k, good in zip(d.keys, d.ok, strict=True):
                self._lower.note(k, good, now)
            if d.kind == "store":
                self._storing.difference_update(d.keys)
                self._lower.store_done(d.nbytes, d.elapsed if n_ok else None)
                self._count("store_failures", len(d.keys) - n_ok)
                if self._events is not None and n_ok:
                    self._events.append(OffloadingEvent(
                        keys=[OffloadKey(k) for k, g in zip(d.keys, d.ok, strict=True) if g],
                        medium=self.medium, removed=False, locality=self.locality))
                success = n_ok == len(d.keys) and d.complete
                self._results.append(JobResult(job_id=d.job_id, success=success, transfer_time=d.elapsed,
                                               transfer_bytes=n_ok * self.block_size_bytes))
            else:
                self._count("load_failures", len(d.keys) - n_ok)
                success = n_ok == len(d.keys)
                ok_keys = None if success or not n_ok else tuple(
                    OffloadKey(k) for k, g in zip(d.keys, d.ok, strict=True) if g)
                self._results.append(JobResult(job_id=d.job_id, success=success, successful_keys=ok_keys,
                                               transfer_time=d.elapsed,
                                               transfer_bytes=n_ok * self.block_size_bytes))

    def _stop_loop(self) -> None:
        with contextlib.suppress(Exception):
            self._portal_cm.__exit__(None, None, None)

    # ---- event-loop side -------------------------------------------------------------------------
    def _post(self, d: _Done) -> None:
        try:
            d.counters = dict(self._tier.counters)
            d.used_bytes = self._tier.used_bytes()
        finally:
            self._done.put(d)  # every job is reported, whatever happens

    def _tensor(self, start: int, stop: int) -> torch.Tensor:
        rows = self._rows
        assert rows is not None, "tier is shut down"
        return torch.from_numpy(rows[start:stop])

    async def _copy(self, fn: Any, nbytes: int) -> Any:
        """Run a memory copy inline when small, in a worker thread when large."""
        if nbytes <= INLINE_COPY_BYTES:
            return fn()
        return await anyio.to_thread.run_sync(fn)

    async def _run_store(self, job_id: int, keys: list[bytes], cids: list[int], nbytes: int,
                         all_ok: bool) -> None:
        ok = [False] * len(keys)
        t0 = time.monotonic()
        block = self.block_size_bytes
        try:
            groups = [int.from_bytes(k[-GROUP_BYTES:], "big") for k in keys]
            direct, gathered = _plan(groups, cids, block)

            async def put(group: int, pos: range | list[int], data: torch.Tensor | None) -> None:
                try:
                    if data is None:  # a gathered group: copy its rows out first
                        rows = self._rows
                        assert rows is not None, "tier is shut down"
                        idx = np.asarray([cids[i] for i in pos], dtype=np.int64)
                        data = torch.from_numpy(await self._copy(lambda: rows[idx], len(pos) * block))
                    res = await self._tier.put(group, [keys[i] for i in pos], data)
                    for i, good in zip(pos, res, strict=True):
                        ok[i] = good
                except Exception as exc:
                    log.warning("writing %d records to %s failed: %s", len(pos), self._tier.describe(),
                                _why(exc))

            async with self._lower.write_limiter:
                t0 = time.monotonic()
                async with anyio.create_task_group() as tg:
                    for start, stop, group in direct:
                        tg.start_soon(put, group, range(start, stop),
                                      self._tensor(cids[start], cids[stop - 1] + 1))
                    for group, pos in gathered.items():
                        tg.start_soon(put, group, pos, None)
        except Exception as exc:  # reported as a failed job, never raised
            log.warning("store job %d on %s failed: %s", job_id, self._tier.describe(), _why(exc))
        finally:
            self._post(_Done("store", job_id, keys, ok, time.monotonic() - t0, nbytes, all_ok))

    async def _run_load(self, job_id: int, keys: list[bytes], cids: list[int]) -> None:
        ok = [False] * len(keys)
        t0 = time.monotonic()
        block = self.block_size_bytes
        try:
            groups = [int.from_bytes(k[-GROUP_BYTES:], "big") for k in keys]
            direct, gathered = _plan(groups, cids, block)

            async def get_direct(start: int, stop: int, group: int) -> None:
                # records are verified before a byte is decoded into a row; a row whose record
                # fails stays unused (vLLM frees the slot of a failed key)
                try:
                    res = await self._tier.get(group, keys[start:stop],
                                               self._tensor(cids[start], cids[stop - 1] + 1))
                    ok[start:stop] = res
                except Exception as exc:
                    log.warning("reading %d records from %s failed: %s", stop - start,
                                self._tier.describe(), _why(exc))

            async def get_gathered(group: int, pos: list[int]) -> None:
                try:
                    staging = torch.empty((len(pos), block), dtype=torch.uint8)
                    res = await self._tier.get(group, [keys[i] for i in pos], staging)
                    good = [j for j, f in enumerate(res) if f]
                    if not good:
                        return
                    rows = self._rows
                    assert rows is not None, "tier is shut down"
                    src = staging.numpy()
                    dst = np.asarray([cids[pos[j]] for j in good], dtype=np.int64)

                    def scatter() -> None:  # only verified rows reach the primary
                        rows[dst] = src if len(good) == len(pos) else src[good]

                    await self._copy(scatter, len(good) * block)
                    for j in good:
                        ok[pos[j]] = True
                except Exception as exc:
                    log.warning("reading %d records from %s failed: %s", len(pos),
                                self._tier.describe(), _why(exc))

            async with self._lower.read_limiter:
                t0 = time.monotonic()
                async with anyio.create_task_group() as tg:
                    for start, stop, group in direct:
                        if group in self._groups:
                            tg.start_soon(get_direct, start, stop, group)
                    for group, pos in gathered.items():
                        if group in self._groups:
                            tg.start_soon(get_gathered, group, pos)
        except Exception as exc:  # reported as a failed job, never raised
            log.warning("load job %d on %s failed: %s", job_id, self._tier.describe(), _why(exc))
        finally:
            self._post(_Done("load", job_id, keys, ok, time.monotonic() - t0))

    async def _run_probe(self, keys: list[bytes]) -> None:
        found = [False] * len(keys)
        try:
            by_group: dict[int, list[int]] = {}
            for i, k in enumerate(keys):
                by_group.setdefault(int.from_bytes(k[-GROUP_BYTES:], "big"), []).append(i)
            async with self._lower.read_limiter:
                for group, idx in by_group.items():
                    res = await self._tier.contains(group, [keys[i] for i in idx])
                    for i, f in zip(idx, res, strict=True):
                        found[i] = f
        except Exception as exc:  # a failed probe is a (short-lived) miss
            self._tier.count("probe_errors")
            log.warning("probing %d keys on %s failed: %s", len(keys), self._tier.describe(), _why(exc))
        finally:
            self._post(_Done("probe", -1, keys, found))

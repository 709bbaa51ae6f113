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
    index, ``scratch`` for the indices vLLM does not offload) within a namespace made of the engine
    fingerprint (:mod:`tierkv.adapters.vllm.fingerprint`: model, weights revision, quantization, KV
    cache dtype, KV layout, hash algorithm, tokenizer), ``tokens_per_hash``, the rank, the chunking
    and parallel layout (blocks per chunk, tokens per block of each group, world / TP / PP / PCP /
    DCP sizes, KV cache layout, canonical and replicated layout flags) and the optional user
    ``namespace``. vLLM's block hashes do not depend on the model, so without this two models with
    the same prompt would share keys; with it, a different model, revision, dtype or layout never
    sees another's records (and a record that reached the wrong directory still fails its
    fingerprint check and is a miss).

Reproducible hashes
    With ``prefix_caching_hash_algo`` ``xxhash`` or ``xxhash_cbor`` and no ``PYTHONHASHSEED``, vLLM
    seeds its block hashes randomly in each process: nothing this tier writes could be found by
    another process, so the tier refuses to start (:class:`~tierkv.errors.ConfigError` naming the
    fix: set ``PYTHONHASHSEED``, or use ``sha256``).

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
    The fsspec tier runs on a private event loop in a daemon thread
    (:class:`~tierkv.bridge.LoopThread`, which also runs the tier's background capacity scan),
    driven through a :class:`~tierkv.movement.gateway.TierGateway` like every tierkv lower tier. Scheduler
    calls only read in-memory state and hand work to that loop; the gateway updates presence and
    counters under a lock the scheduler's calls share, and finished jobs are handed back as
    ``JobResult`` s under the same lock. vLLM's primary is a shared file mapping (in /dev/shm):
    the tier registers it (:func:`tierkv.adapter.adopt_shared`), so its reader processes, each with a
    GIL of its own, read warm records straight into the primary's rows beside the scheduler's
    loop (``read_processes``, local paths; 0 turns them off).

Credentials in ``storage_options`` or the URL are never logged (``describe()`` redacts the URL).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from tierkv import ConfigError, StoreClosed
from tierkv.adapter import (
    BACKEND_METRICS,
    GROUP_BYTES,
    HISTOGRAMS,
    TIER_METRICS,
    USED_BYTES,
    FsspecTier,
    LoopThread,
    TierContext,
    TierGateway,
    adopt_shared,
    cap_switch_interval,
    redact_url,
    release_shared,
    tier_samples,
)
from tierkv.adapters.vllm.fingerprint import check_hashes, engine_configs, hash_algo
from tierkv.adapters.vllm.manager import CounterDeltas, vllm_metric_definitions
from tierkv.adapters.vllm.secondary_config import (
    TierKVSecondaryTierConfig,
    build_namespace_layout,
    parse_config,
)

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


#: the metrics :meth:`TierKVSecondaryTier.get_stats` reports (tierkv's one naming scheme, labelled
#: by ``tier``: the secondary tier's type name, and ``kind``)
METRICS: dict[str, OffloadingMetricMetadata] = vllm_metric_definitions(
    [*TIER_METRICS.values(), *BACKEND_METRICS.values(), USED_BYTES, HISTOGRAMS["load_seconds"],
     HISTOGRAMS["store_seconds"]])


def _group(key: bytes) -> int:
    return int.from_bytes(key[-GROUP_BYTES:], "big")


def _by_group(keys: list[bytes]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, k in enumerate(keys):
        out.setdefault(_group(k), []).append(i)
    return out


class TierKVSecondaryTier(SecondaryTierManager):  # type: ignore[misc,unused-ignore]
    """A vLLM secondary tier backed by tierkv's ``fsspec`` tier (see the module docstring)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, **cfg: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.settings = parse_config(cfg, tier_type)
        cap_switch_interval(self.settings.gil_switch_interval_s)
        self.locality = Locality(self.settings.locality) if self.settings.locality else None
        block = self.block_size_bytes
        view = memoryview(primary_kv_view)
        if not view.c_contiguous or view.nbytes % block:
            raise ConfigError("TierKVSecondaryTier needs a C-contiguous primary memoryview of whole rows")
        engine = engine_configs()
        # a persistent tier is pointless (and fills up) when vLLM seeds its hashes per process
        check_hashes(hash_algo(engine[0]), [f"secondary tier {tier_type} {redact_url(self.settings.url)}"],
                     f"secondary tier {tier_type!r}")
        self.layout, self.namespace = build_namespace_layout(offloading_spec, block,
                                                             self.settings.namespace, engine)
        self.fingerprint = self.layout.fingerprint(self.namespace)
        self._groups = frozenset(self.layout.cacheable_groups)
        self._rows: torch.Tensor | None = torch.from_numpy(
            np.frombuffer(view, dtype=np.uint8).reshape(-1, block))
        self._num_rows = self._rows.shape[0]
        #: vLLM's primary is a shared file mapping: registered, reader processes read into it
        self._shared = (adopt_shared(self._rows.data_ptr(), self._rows.numel())
                        if self.settings.read_processes != 0 else None)
        events_on = bool(getattr(getattr(offloading_spec, "kv_events_config", None),
                                 "enable_kv_cache_events", False))
        if self.settings.enable_kv_events and not events_on:
            log.warning("enable_kv_events is set on tier %r but vLLM's KV cache events are off; "
                        "no events will be emitted", tier_type)
        self._events: list[OffloadingEvent] | None = (
            [] if self.settings.enable_kv_events and events_on else None)

        #: scheduler calls and the loop's updates share this lock
        self._lock = threading.RLock()
        self._results: list[JobResult] = []
        self._inflight: dict[int, concurrent.futures.Future[None]] = {}
        self._storing: set[bytes] = set()
        self._probe_batch: list[bytes] = []
        self._deltas = CounterDeltas()
        self._closed = False

        self._tier = FsspecTier(self.settings.tier_config(),
                                TierContext(layout=self.layout, namespace=self.namespace,
                                            fingerprint=self.fingerprint))
        self._gw = TierGateway(1, self._tier, self._lock)
        if self._events is not None:
            self._tier.add_listener(self._on_removed)
        self._loop = LoopThread()
        self._background: concurrent.futures.Future[None] | None = None
        try:
            self._loop.call(self._tier.open)
        except BaseException:
            self._loop.stop()
            self._forget_rows()
            raise
        self._background = self._loop.submit(self._tier.background)
        log.info("tierkv secondary tier %r: %s, namespace %s (fingerprint %s), %d-byte records",
                 tier_type, self._tier.describe(), self.settings.namespace or "<default>",
                 self.fingerprint, block)

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
        with self._lock:
            if key in self._storing or key in self._gw.probing:
                return LookupResult.RETRY
            known = self._gw.presence(0, key, time.monotonic())
            if known is not None:
                return LookupResult.HIT if known else LookupResult.MISS
            if self._closed or _group(key) not in self._groups:
                return LookupResult.MISS
            self._gw.probing.add(key)
            self._probe_batch.append(key)
            batch = self._take_probe_batch() if len(self._probe_batch) >= PROBE_BATCH else []
        self._send_probes(batch)
        return LookupResult.RETRY

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Write the job's rows in the background, skipping keys already held or being written."""
        job_id = job_metadata.job_id
        keys = [bytes(k) for k in job_metadata.keys]
        cids = [int(c) for c in np.asarray(job_metadata.chunk_ids).reshape(-1)]
        with self._lock:
            if not self._valid_job(job_id, keys, cids):
                return
            now = time.monotonic()
            todo: list[int] = []
            skipped = 0
            refused = 0
            for i, k in enumerate(keys):
                if k in self._storing or self._gw.presence(0, k, now) is True:
                    skipped += 1
                elif _group(k) in self._groups:
                    todo.append(i)
                else:
                    refused += 1
            self._gw.stats.stores_skipped += skipped
            self._gw.stats.stores_failed += refused
            admitted: list[tuple[int, list[int], int]] = []
            for group, pos in _by_group([keys[i] for i in todo]).items():
                idx = [todo[j] for j in pos]
                nbytes = len(idx) * self.block_size_bytes
                if self._gw.admit_store(nbytes):
                    admitted.append((group, idx, nbytes))
                else:
                    self._gw.shed(len(idx))
                    refused += len(idx)
            if not admitted:
                self._results.append(JobResult(job_id=job_id, success=refused == 0,
                                               transfer_time=0.0, transfer_bytes=0))
                return
            for _, idx, _ in admitted:
                self._storing.update(keys[i] for i in idx)
            self._inflight[job_id] = concurrent.futures.Future()
        self._start(job_id, self._run_store, keys, cids, admitted, refused == 0)

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Read, verify and decode the job's records into its primary rows in the background."""
        job_id = job_metadata.job_id
        keys = [bytes(k) for k in job_metadata.keys]
        cids = [int(c) for c in np.asarray(job_metadata.chunk_ids).reshape(-1)]
        with self._lock:
            if not self._valid_job(job_id, keys, cids):
                return
            self._inflight[job_id] = concurrent.futures.Future()
        self._start(job_id, self._run_load, keys, cids)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Every job finished since the last call, each reported once."""
        with self._lock:
            results, self._results = self._results, []
        return results

    def has_pending_work(self) -> bool:
        """True while jobs or existence probes are in flight (keeps the engine stepping)."""
        with self._lock:
            return bool(self._inflight) or bool(self._gw.probing)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Send the existence probes queued by this step's lookups."""
        with self._lock:
            batch = self._take_probe_batch()
        self._send_probes(batch)

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Events for keys written since the last call (only with ``enable_kv_events``)."""
        with self._lock:
            if not self._events:
                return ()
            events, self._events = self._events, []
        return events

    def drain_jobs(self) -> None:
        """Block until every submitted load and store job has finished (none is aborted)."""
        with self._lock:
            pending = [f for f in self._inflight.values() if not f.done()]
        if pending:
            concurrent.futures.wait(pending)

    def get_stats(self) -> OffloadingConnectorStats | None:
        """Counters since the last call and the gauges, or None when nothing changed."""
        labels = (self.tier_type, "fsspec")
        with self._lock:
            snap = self._gw.snapshot()
            observed = [(HISTOGRAMS["load_seconds"], labels, self._gw.load_seconds.drain()),
                        (HISTOGRAMS["store_seconds"], labels, self._gw.store_seconds.drain())]
        try:
            stats: OffloadingConnectorStats | None = self._deltas.stats(tier_samples(snap, self.tier_type),
                                                                        observed)
        except ImportError:
            return None
        return stats

    def shutdown(self) -> None:
        """Finish every job, close the tier and stop the event loop thread. Idempotent."""
        if self._closed:
            return
        with self._lock:
            self._closed = True
        try:
            self.drain_jobs()
            self._loop.cancel_spawned()  # probes in flight (the jobs have ended)
            if self._background is not None:
                self._background.cancel()
                concurrent.futures.wait([self._background], timeout=30)
            try:
                self._loop.call(self._tier.close)
            except Exception as exc:
                log.warning("closing %s failed: %s", self._tier.describe(), str(exc)[:300])
        finally:
            self._loop.stop()
            self._forget_rows()

    def _forget_rows(self) -> None:
        """Drop every hold on the primary (vLLM releases its memoryview and unmaps it next)."""
        if self._shared is not None:
            release_shared(self._shared)
            self._shared = None
        self._rows = None

    def describe(self) -> str:
        """The tier's URL without credentials, and its namespace fingerprint."""
        return f"tierkv {redact_url(self.settings.url)} ({self.fingerprint})"

    def __repr__(self) -> str:
        return f"<TierKVSecondaryTier {self.describe()}>"

    def _on_removed(self, event: str, keys: list[bytes]) -> None:
        """Records that left the tier (capacity, corruption, another process): removal events.
        Stores are reported as their jobs finish."""
        if event != "removed":
            return
        with self._lock:
            if self._events is not None:
                self._events.append(OffloadingEvent(keys=[OffloadKey(k) for k in keys], medium=self.medium,
                                                    removed=True, locality=self.locality))

    # ---- scheduler-thread helpers (under the lock) -----------------------------------------------
    def _valid_job(self, job_id: int, keys: list[bytes], cids: list[int]) -> bool:
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

    def _take_probe_batch(self) -> list[bytes]:
        if self._closed:
            return []
        batch, self._probe_batch = self._probe_batch, []
        return batch

    # ---- hand-off to the loop: never under the lock (the loop's tasks take it) --------------------
    def _send_probes(self, batch: list[bytes]) -> None:
        for group, pos in _by_group(batch).items():
            keys = [batch[i] for i in pos]
            try:
                self._loop.spawn(self._gw.probe, group, keys)
            except (StoreClosed, RuntimeError):  # the loop has stopped
                with self._lock:
                    self._gw.probing.difference_update(keys)

    def _start(self, job_id: int, fn: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> None:
        """Run job ``job_id`` (its placeholder in ``_inflight`` set) on the loop; it ends in ``_finish``."""
        try:
            self._loop.spawn(fn, job_id, *args)
        except (StoreClosed, RuntimeError):  # the loop has stopped
            self._finish(job_id, JobResult(job_id=job_id, success=False))

    # ---- event-loop side -------------------------------------------------------------------------
    def _finish(self, job_id: int, result: JobResult) -> None:
        with self._lock:
            done = self._inflight.pop(job_id, None)
            self._results.append(result)
        if done is not None:
            done.set_result(None)

    async def _run_store(self, job_id: int, keys: list[bytes], cids: list[int],
                         admitted: list[tuple[int, list[int], int]], complete: bool) -> None:
        ok = [False] * len(keys)
        t0 = time.monotonic()
        rows = self._rows
        try:
            assert rows is not None, "tier is shut down"
            for group, idx, nbytes in admitted:
                res = await self._gw.store(group, [keys[i] for i in idx], rows, [cids[i] for i in idx],
                                           nbytes)
                for i, f in zip(idx, res, strict=True):
                    ok[i] = f
        finally:
            elapsed = time.monotonic() - t0
            written = [keys[i] for _, idx, _ in admitted for i in idx if ok[i]]
            with self._lock:
                for _, idx, _ in admitted:
                    self._storing.difference_update(keys[i] for i in idx)
                if self._events is not None and written:
                    self._events.append(OffloadingEvent(keys=[OffloadKey(k) for k in written],
                                                        medium=self.medium, removed=False,
                                                        locality=self.locality))
            n_todo = sum(len(idx) for _, idx, _ in admitted)
            success = complete and len(written) == n_todo
            self._finish(job_id, JobResult(job_id=job_id, success=success, transfer_time=elapsed,
                                           transfer_bytes=len(written) * self.block_size_bytes))

    async def _run_load(self, job_id: int, keys: list[bytes], cids: list[int]) -> None:
        ok = [False] * len(keys)
        t0 = time.monotonic()
        rows = self._rows
        try:
            assert rows is not None, "tier is shut down"
            for group, pos in _by_group(keys).items():
                if group not in self._groups:
                    continue
                # a key is reported loaded only once its record is verified; the row of a key
                # that failed holds unspecified bytes and stays unused (vLLM frees its slot)
                res = await self._gw.load(group, [keys[i] for i in pos], rows, [cids[i] for i in pos])
                for i, f in zip(pos, res, strict=True):
                    ok[i] = f
        finally:
            n_ok = sum(ok)
            with self._lock:
                self._gw.stats.promotions += n_ok
                self._gw.stats.promotions_failed += len(keys) - n_ok
            success = n_ok == len(keys)
            ok_keys = None if success or not n_ok else tuple(
                OffloadKey(k) for k, g in zip(keys, ok, strict=True) if g)
            self._finish(job_id, JobResult(job_id=job_id, success=success, successful_keys=ok_keys,
                                           transfer_time=time.monotonic() - t0,
                                           transfer_bytes=n_ok * self.block_size_bytes))

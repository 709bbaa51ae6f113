"""One vLLM engine process driven by :mod:`tierkv.tools.bench.serving` (one process per engine).

    python -m tierkv.tools.bench.serving_engine '<JSON config>'

The config names a model directory (a ``config.json`` only: weights are vLLM's ``dummy`` load
format, deterministic, so every process gets the same model), the engine sizes and tierkv's
``kv_connector_extra_config``. The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
scheduler, tierkv's manager and worker all here), so its state can be read between requests.

Protocol: after start the process prints ``[tierkv-bench] {"kind": "ready", ...}`` and then reads
one JSON command per line from stdin, answering each with one ``[tierkv-bench] {...}`` line:

* ``{"cmd": "generate", "tag": T, "seed": S, "length": L}``: one request of ``L`` random token
  ids (:func:`prompt_tokens`), ``max_tokens=1``; answers the wall time of ``LLM.generate``,
  vLLM's request metrics (``first_token_latency``, queued/scheduled/first-token timestamps),
  ``num_cached_tokens``, the token and its logprob, and where the engine spent the time
  (:class:`Trace`). ``"tokens": [...]`` gives the prompt instead of ``seed``/``length``,
  ``"max_tokens": n`` more output tokens, ``"settle": "scheduler"`` waits before it only for the
  scheduler to finish the previous request (its stores reported), not for tierkv's cascades.
* ``{"cmd": "profile", "action": "start"}`` / ``{"cmd": "profile", "action": "stop", "path": P}``:
  cProfile of this process's main thread (the engine's steps) between the two; ``stop`` writes
  the pstats to ``P``.
* ``{"cmd": "reset"}``: ``llm.reset_prefix_cache()`` (vLLM's own prefix cache; tierkv's pool
  keeps its blocks).
* ``{"cmd": "idle", "wait_s": s}``: step the engine until nothing is pending (see :func:`_idle`);
  every ``generate`` does this first, untimed.
* ``{"cmd": "stats"}``: tierkv's ``TieredStore.stats()``.
* ``{"cmd": "quit"}``: shut the engine down (tierkv removes its shared pool files) and exit.

Anything else the process prints (vLLM's logs) is not part of the protocol. An error answers
``{"kind": "error", "message": ...}`` and the process exits with status 1; end of input exits too.
"""

from __future__ import annotations

import functools
import json
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["MODELS", "PREFIX", "ModelShape", "Trace", "main", "prompt_tokens", "write_model_dir"]

#: prefix of the protocol lines on stdout
PREFIX = "[tierkv-bench] "


@dataclass(frozen=True)
class ModelShape:
    """The architecture of a benchmark model (weights are dummies: only the shape matters)."""

    name: str
    architecture: str
    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype: str = "bfloat16"
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the weights and the KV cache."""
        return 4 if self.dtype == "float32" else 2

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token: layers x (K and V) x KV heads x head dim x element size."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def parameters(self) -> int:
        """Parameter count (embeddings, attention, MLP and norms)."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        per_layer = attn + 3 * self.hidden * self.intermediate + 2 * self.hidden
        if self.model_type == "qwen3":
            per_layer += 2 * self.head_dim  # q_norm, k_norm
        head = 0 if self.tie_embeddings else self.vocab * self.hidden
        return self.vocab * self.hidden + head + self.layers * per_layer + self.hidden

    def config_json(self, max_positions: int) -> dict[str, Any]:
        """A Hugging Face ``config.json`` for this shape."""
        cfg: dict[str, Any] = {
            "architectures": [self.architecture], "model_type": self.model_type,
            "num_hidden_layers": self.layers, "hidden_size": self.hidden,
            "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate,
            "vocab_size": self.vocab, "max_position_embeddings": max_positions,
            "rms_norm_eps": 1e-6, "rope_theta": self.rope_theta, "hidden_act": "silu",
            "tie_word_embeddings": self.tie_embeddings, "torch_dtype": self.dtype,
            "bos_token_id": 1, "eos_token_id": 2, "attention_bias": False,
        }
        cfg.update(self.extra)
        return cfg


#: the models the benchmark knows, by ``--model`` name
MODELS: dict[str, ModelShape] = {
    "llama-250m": ModelShape("llama-250m", "LlamaForCausalLM", "llama", layers=16, hidden=1024, heads=16,
                             kv_heads=8, head_dim=64, intermediate=2816, vocab=32000),
    "qwen3-0.6b": ModelShape("qwen3-0.6b", "Qwen3ForCausalLM", "qwen3", layers=28, hidden=1024, heads=16,
                             kv_heads=8, head_dim=128, intermediate=3072, vocab=151936, tie_embeddings=True,
                             rope_theta=1000000.0,
                             extra={"use_sliding_window": False, "max_window_layers": 28}),
    "tiny": ModelShape("tiny", "LlamaForCausalLM", "llama", layers=2, hidden=256, heads=4, kv_heads=2,
                       head_dim=64, intermediate=512, vocab=1000),
    "tiny-3l": ModelShape("tiny-3l", "LlamaForCausalLM", "llama", layers=3, hidden=256, heads=4, kv_heads=2,
                          head_dim=64, intermediate=512, vocab=1000),
    "micro-3l": ModelShape("micro-3l", "LlamaForCausalLM", "llama", layers=3, hidden=64, heads=2, kv_heads=1,
                           head_dim=32, intermediate=128, vocab=1000),
}


def write_model_dir(shape: ModelShape, path: Path, max_positions: int) -> Path:
    """Write ``path/config.json`` for ``shape`` (what vLLM's dummy load format needs); returns path."""
    path.mkdir(parents=True, exist_ok=True)
    target = path / "config.json"
    text = json.dumps(shape.config_json(max_positions), indent=1)
    if not target.exists() or target.read_text() != text:
        tmp = path / f"config.json.{os.getpid()}.tmp"
        tmp.write_text(text)
        os.replace(tmp, target)
    return path


def prompt_tokens(seed: int, length: int, vocab: int) -> list[int]:
    """``length`` random token ids in ``[3, vocab)`` (ids 0-2: pad, bos, eos), fixed by ``seed``."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def emit(kind: str, **fields: Any) -> None:
    """One protocol line on stdout."""
    sys.stdout.write(PREFIX + json.dumps({"kind": kind, **fields}) + "\n")
    sys.stdout.flush()


class Trace:
    """Where an engine spends its time: wrappers around vLLM's step, scheduler and executor and
    tierkv's manager lookups and worker copies, accumulated per request (:meth:`take`).

    * ``steps`` / ``step_s``: engine steps (schedule + execute + output) and their time;
      ``idle_steps`` / ``idle_step_s``: steps that ran no model (a request waiting on tierkv);
    * ``schedule_s``: in the scheduler (the connector's lookups are made there);
    * ``execute_s``: in the model executor (the worker's KV loads and stores, then the forward pass);
    * ``lookups`` (by result) / ``lookup_s``: tierkv manager lookups;
    * ``worker_load_s`` / ``worker_store_s``: tierkv worker copies between the pool and vLLM's KV.
    """

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self._last: dict[str, float] = {}

    def add(self, name: str, value: float) -> None:
        """Add ``value`` to counter ``name``."""
        self.totals[name] = self.totals.get(name, 0.0) + value

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` wrapped to add its duration to ``<name>_s`` and a call to ``<name>_calls``."""

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(f"{name}_s", time.perf_counter() - t0)
                self.add(f"{name}_calls", 1)

        return wrapper

    def take(self) -> dict[str, float]:
        """What was added since the last call."""
        out = {k: round(v - self._last.get(k, 0.0), 6) for k, v in self.totals.items()
               if v != self._last.get(k, 0.0)}
        self._last = dict(self.totals)
        return out

    def install(self, llm: Any) -> None:
        """Wrap the engine's step, scheduler, executor and tierkv's manager and worker classes."""
        core = llm.llm_engine.engine_core.engine_core
        step = core.step_fn

        def step_fn() -> Any:
            t0 = time.perf_counter()
            out = step()
            dt = time.perf_counter() - t0
            self.add("steps", 1)
            self.add("step_s", dt)
            if not out[1]:
                self.add("idle_steps", 1)
                self.add("idle_step_s", dt)
            return out

        core.step_fn = step_fn
        core.scheduler.schedule = self.timed("schedule", core.scheduler.schedule)
        core.model_executor.execute_model = self.timed("execute", core.model_executor.execute_model)
        from tierkv.adapters.vllm.manager import TierKVOffloadingManager
        from tierkv.adapters.vllm.worker import TierKVWorker

        trace = self
        lookup = TierKVOffloadingManager.lookup

        def counted_lookup(manager: Any, key: Any, ctx: Any) -> Any:
            t0 = time.perf_counter()
            res = lookup(manager, key, ctx)
            trace.add("lookup_s", time.perf_counter() - t0)
            trace.add(f"lookup_{getattr(res, 'name', res)}", 1)
            return res

        TierKVOffloadingManager.lookup = counted_lookup  # type: ignore[method-assign,assignment]
        TierKVWorker.submit_load = self.timed("worker_load", TierKVWorker.submit_load)  # type: ignore[method-assign]
        TierKVWorker.submit_store = self.timed("worker_store", TierKVWorker.submit_store)  # type: ignore[method-assign]


def _manager(llm: Any) -> Any:
    """tierkv's manager inside the engine (None when it cannot be reached, or is not tierkv's)."""
    from tierkv.adapters.vllm.manager import TierKVOffloadingManager

    try:
        manager = llm.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler.manager
    except AttributeError:
        return None
    return manager if isinstance(manager, TierKVOffloadingManager) else None


def _generate(llm: Any, cmd: dict[str, Any], vocab: int, trace: Trace) -> dict[str, Any]:
    from vllm import SamplingParams  # type: ignore[import-not-found,unused-ignore]

    given = cmd.get("tokens")
    tokens = ([int(t) for t in given] if given is not None
              else prompt_tokens(int(cmd["seed"]), int(cmd["length"]), vocab))
    sp = SamplingParams(max_tokens=int(cmd.get("max_tokens", 1)), temperature=0.0, logprobs=1,
                        detokenize=False, ignore_eos=True)
    # nothing left over from the previous request (its cascades too, unless settle says otherwise)
    before = _idle(llm, float(cmd.get("wait_s", 1200)), cascades=cmd.get("settle", "all") == "all")
    trace.take()
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": tokens}], sp, use_tqdm=False)[0]
    wall = time.perf_counter() - t0
    comp = out.outputs[0]
    token = int(comp.token_ids[0]) if comp.token_ids else None
    logprob = None
    if comp.logprobs and token is not None and token in comp.logprobs[0]:
        logprob = float(comp.logprobs[0][token].logprob)
    m = out.metrics
    res: dict[str, Any] = {"tag": cmd.get("tag"), "length": len(tokens), "wall_s": wall,
                           "num_cached_tokens": out.num_cached_tokens, "token": token, "logprob": logprob,
                           "ttft_vllm_s": None, "queue_s": None, "prefill_s": None,
                           "idle_before": before}
    if m is not None and getattr(m, "first_token_latency", None):
        res["ttft_vllm_s"] = float(m.first_token_latency)
        if m.scheduled_ts and m.queued_ts:
            res["queue_s"] = float(m.scheduled_ts - m.queued_ts)
        if m.first_token_ts and m.scheduled_ts:
            res["prefill_s"] = float(m.first_token_ts - m.scheduled_ts)
    res["trace"] = trace.take()
    return res


def _idle(llm: Any, timeout: float, cascades: bool = True) -> dict[str, Any]:
    """Step the engine until its scheduler has nothing left: no request, no transfer job of the
    connector, and (``cascades``) no pending work in tierkv (cascades written).

    ``LLM.generate`` returns as soon as its requests finish, but the offloading connector learns
    that a request's stores are done, and tierkv starts cascading them, only in a later engine step
    (a serving engine's busy loop keeps stepping; an offline ``LLM`` does not): without this the
    next measured request would pay for the previous one's stores.
    """
    core = llm.llm_engine.engine_core.engine_core
    t0 = time.monotonic()
    steps = 0
    while core.scheduler.has_requests():
        if time.monotonic() - t0 > timeout:
            return {"idle": False, "waited_s": time.monotonic() - t0, "steps": steps}
        llm.llm_engine.step()
        steps += 1
        time.sleep(0.002)  # leave the GIL to tierkv's I/O thread
    manager = _manager(llm) if cascades else None
    while manager is not None and manager.has_pending_work():
        if time.monotonic() - t0 > timeout:
            return {"idle": False, "waited_s": time.monotonic() - t0, "steps": steps}
        time.sleep(0.01)
    return {"idle": True, "waited_s": time.monotonic() - t0, "steps": steps}


_PROFILER: list[Any] = []


def _profile(cmd: dict[str, Any]) -> dict[str, Any]:
    """Start cProfile on this thread, or stop it and write its pstats to ``cmd["path"]``."""
    import cProfile

    if cmd.get("action") == "start":
        prof = cProfile.Profile()
        _PROFILER[:] = [prof]
        prof.enable()
        return {"profiling": True}
    if not _PROFILER:
        return {"profiling": False}
    prof = _PROFILER.pop()
    prof.disable()
    prof.dump_stats(str(cmd["path"]))
    return {"profiling": False, "path": str(cmd["path"])}


def _stats(llm: Any) -> dict[str, Any] | None:
    manager = _manager(llm)
    if manager is None:
        return None
    stats: dict[str, Any] = manager.store.stats().model_dump(mode="json")
    return stats


def main(argv: list[str] | None = None) -> int:
    """Start the engine described by the JSON config in ``argv[0]`` and serve commands from stdin."""
    args = sys.argv[1:] if argv is None else argv
    cfg: dict[str, Any] = json.loads(args[0])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        t0 = time.perf_counter()
        from vllm import LLM  # type: ignore[import-not-found,unused-ignore]
        from vllm.config import KVTransferConfig  # type: ignore[import-not-found,unused-ignore]

        kwargs: dict[str, Any] = {}
        if cfg.get("extra") is not None:
            kwargs["kv_transfer_config"] = KVTransferConfig(
                kv_connector="OffloadingConnector", kv_role="kv_both",
                kv_connector_extra_config=cfg["extra"])
        llm = LLM(model=cfg["model_dir"], load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
                  enable_prefix_caching=True, kv_cache_memory_bytes=int(cfg["kv_cache_bytes"]),
                  block_size=int(cfg["block_size"]), max_model_len=int(cfg["max_model_len"]),
                  dtype=cfg.get("dtype", "auto"), seed=0, max_num_seqs=4, disable_log_stats=False, **kwargs)
        trace = Trace()
        trace.install(llm)
        import torch

        emit("ready", startup_s=time.perf_counter() - t0, torch_threads=torch.get_num_threads(),
             vllm_version=getattr(sys.modules.get("vllm"), "__version__", None),
             tierkv=_manager(llm) is not None)
    except Exception as exc:
        emit("error", message=f"engine start failed: {type(exc).__name__}: {exc}")
        return 1
    vocab = int(cfg["vocab"])
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd: dict[str, Any] = json.loads(line)
        name = cmd.get("cmd")
        try:
            if name == "generate":
                emit("result", **_generate(llm, cmd, vocab, trace))
            elif name == "reset":
                emit("reset", ok=bool(llm.reset_prefix_cache()))
            elif name == "idle":
                emit("idle", **_idle(llm, float(cmd.get("wait_s", 600))))
            elif name == "stats":
                emit("stats", stats=_stats(llm))
            elif name == "profile":
                emit("profile", **_profile(cmd))
            elif name == "quit":
                llm.llm_engine.engine_core.shutdown()
                emit("bye")
                return 0
            else:
                emit("error", message=f"unknown command {name!r}")
                return 1
        except Exception as exc:
            emit("error", message=f"{name} failed: {type(exc).__name__}: {exc}")
            return 1
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Drive a real vLLM engine with tierkv as its offloading spec (run as a subprocess by the tests).

    python tests/vllm/run_engine.py '{"model": "llama", "url": "file:///...", "phase": "write", ...}'

Prints one JSON line per event, prefixed with "[tierkv-run] ".
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Any

MODELS = os.environ.get("TIERKV_TEST_MODELS", "/tmp/tierkv-test-models")


def emit(kind: str, **fields: Any) -> None:
    print("[tierkv-run] " + json.dumps({"kind": kind, **fields}), flush=True)


def build_model(name: str) -> str:
    """A tiny random-weight model saved with transformers (no hub)."""
    import torch
    import transformers as tf

    path = os.path.join(MODELS, name)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(0)
    common: dict[str, Any] = dict(vocab_size=1000, hidden_size=128, intermediate_size=256,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                                  pad_token_id=0, tie_word_embeddings=False)
    if name == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=2, **common))
    elif name == "gemma3":
        cfg = tf.Gemma3TextConfig(num_hidden_layers=4, sliding_window=64,
                                  layer_types=["sliding_attention"] * 3 + ["full_attention"], **common)
        model = tf.Gemma3ForCausalLM(cfg)
    elif name == "qwen3next":
        common["max_position_embeddings"] = 8192
        cfg = tf.Qwen3NextConfig(
            num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
            linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=64, shared_expert_intermediate_size=64, decoder_sparse_step=1, **common)
        model = tf.Qwen3NextForCausalLM(cfg)
    else:
        raise SystemExit(f"unknown model {name}")
    model = model.to(torch.bfloat16)
    model.config.torch_dtype = "bfloat16"
    tmp = f"{path}.tmp{os.getpid()}"
    model.save_pretrained(tmp)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        os.rename(tmp, path)
    except OSError:
        pass  # another process built it first
    return path


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(length)] for _ in range(n)]


def main() -> None:
    args = json.loads(sys.argv[1])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.get("multiprocessing") else "0"
    path = build_model(args["model"])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    extra = {"spec_name": "TierKVOffloadingSpec", "spec_module_path": "tierkv.adapters.vllm",
             "cpu_bytes_to_use": args.get("cpu_bytes", 64 << 20),
             "tiers": [{"kind": "fsspec", "url": args["url"], "codec": args.get("codec", "zstd-shuffle"),
                        **args.get("tier", {})}],
             "namespace": "tests", "manifest_timeout_s": 30, "shm_dir": args.get("shm_dir", "/dev/shm")}
    if args.get("daemon"):  # the pool and tiers are the daemon's
        extra = {k: v for k, v in extra.items() if k not in ("cpu_bytes_to_use", "tiers")}
        extra["daemon"] = args["daemon"]
    extra.update(args.get("extra", {}))
    t0 = time.perf_counter()
    llm = LLM(model=path, skip_tokenizer_init=True, enforce_eager=True, enable_prefix_caching=True,
              kv_cache_memory_bytes=args.get("kv_bytes", 64 << 20), block_size=32,
              max_model_len=args.get("max_model_len", 1024), seed=0,
              max_num_seqs=args.get("max_num_seqs", 8),
              kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                                  kv_connector_extra_config=extra))
    emit("started", seconds=round(time.perf_counter() - t0, 2))
    sp = SamplingParams(max_tokens=args.get("max_tokens", 4), temperature=0.0, logprobs=1,
                        detokenize=False, ignore_eos=True)
    ps = prompts(args.get("prompts", 1), args.get("prompt_len", 200), args.get("seed", 1234))

    def run(tag: str, salt: str | None = None) -> None:
        salted = {} if salt is None else {"cache_salt": salt}
        outs = llm.generate([{"prompt_token_ids": p, **salted} for p in ps], sp, use_tqdm=False)
        for i, out in enumerate(outs):
            c = out.outputs[0]
            lps = [next(iter(d.values())).logprob for d in (c.logprobs or [])]
            emit("generate", tag=tag, prompt=i, num_cached_tokens=out.num_cached_tokens,
                 token_ids=list(c.token_ids), logprobs=lps)

    def rate() -> None:
        """Prefill of fresh prompts (one output token each): the engine's own tokens/s against the
        rate tierkv's manager measured from the blocks it stored meanwhile."""
        n, length = args.get("rate_prompts", 64), args.get("rate_len", 480)
        fresh = prompts(n, length, args.get("seed", 1234) + 7)
        one = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True)
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in fresh], one, use_tqdm=False)
        elapsed = time.perf_counter() - t
        manager = llm.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler.manager
        emit("rate", engine_tokens_per_s=n * length / elapsed, seconds=elapsed,
             measured_tokens_per_s=manager.store.stats().cost.recompute_tokens_per_s)

    def stats() -> None:
        manager = llm.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler.manager
        st = manager.store.stats()
        emit("stats", tiers=[t.model_dump(mode="json") for t in st.tiers], lookups=st.lookups,
             requests_active=st.requests_active)

    steps = args.get("steps", ["run"])
    if steps == "stdin":  # one step per line from the test, until "quit" or the end of input
        steps = (line.strip() for line in sys.stdin if line.strip() != "quit")
    for step in steps:
        emit("step", step=step)
        if step == "stats":
            stats()
        elif step.startswith("prompts="):  # "prompts=<n>:<length>:<seed>:<max_tokens>"
            n, length, seed, max_tokens = map(int, step.removeprefix("prompts=").split(":"))
            ps = prompts(n, length, seed)
            sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1, detokenize=False,
                                ignore_eos=True)
        elif step == "reset":
            llm.reset_prefix_cache()
        elif step == "rate":
            rate()
        elif step.startswith("salt="):  # "salt=<cache_salt>:<tag>": the prompts with that cache_salt
            salt, _, tag = step.removeprefix("salt=").partition(":")
            run(tag, salt)
        else:
            run(step)
    llm.llm_engine.engine_core.shutdown()
    emit("done", seconds=round(time.perf_counter() - t0, 2))


if __name__ == "__main__":
    main()

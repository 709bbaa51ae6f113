"""The eviction policies' own cost: policy calls per second, as a ratio to LRU's.

    python bench/policy.py [--trace conversation_trace.jsonl] [--capacity 2000,6000] [--repeats 5]

A request stream (a Mooncake trace, or a generated chat-like one) is run once per policy the way
a store drives a pool: the prefix found is touched (``touch_many``), then runs of held blocks are
touched and runs of new ones stored (``victims`` for the room they need, ``remove`` of those,
``insert``). The calls are recorded, then replayed on a fresh policy ``--repeats`` times with only
the policy's calls on the clock. Printed: median calls per second (inserts + touches + victims
picked + removes) and the ratio to LRU (above 1 is faster), and the token hit rate it got.
"""

from __future__ import annotations

import benchmain  # first: Ctrl-C while the imports below load ends quietly

# isort: split

import argparse
import random
import statistics
import time
from typing import Any

from tierkv.blocks.policy import POLICIES, make_policy
from tierkv.tools.traces import read_trace

Call = tuple[str, Any]


def always(_: bytes) -> bool:
    return True


def generated(n: int, seed: int = 0) -> list[tuple[int, list[int]]]:
    """Chat-like traffic: a shared system prompt, conversations that come back longer, one-offs."""
    rng = random.Random(seed)
    convs: list[list[int]] = []
    fresh, out = 1, []
    for _ in range(n):
        if convs and rng.random() < 0.4:
            c = convs[rng.randrange(len(convs))]
            c.extend(range(fresh, fresh + rng.randint(1, 8)))
            fresh += 8
        else:
            c = [0, *range(fresh, fresh + rng.randint(2, 40))]
            fresh += 40
            convs.append(c)
            convs[:] = convs[-400:]
        out.append((len(c) * 512, list(c)))
    return out


def record(name: str, capacity: int, requests: list[tuple[int, list[int]]]) -> tuple[list[Call], float]:
    """Run the stream through a policy; the calls it got, and its token hit rate."""
    p = make_policy(name, capacity)
    calls: list[Call] = []
    resident: set[bytes] = set()
    hit = total = 0
    for length, ids in requests:
        keys = [i.to_bytes(8, "big", signed=True) + b"\0\0\0\0" for i in ids]
        n = 0
        while n < len(keys) and keys[n] in resident:
            n += 1
        hit += min(n * 512, length)
        total += length
        if n:
            p.touch_many(keys[:n])
            calls.append(("m", keys[:n]))
        i = n
        while i < len(keys):
            if keys[i] in resident:
                p.touch(keys[i])
                calls.append(("t", keys[i]))
                i += 1
                continue
            j = i
            while j < len(keys) and keys[j] not in resident:
                j += 1
            run = keys[i:j]
            need = len(resident) + len(run) - capacity
            if need > 0:
                victims = p.victims(need, always)
                calls.append(("v", need))
                for v in victims:
                    p.remove(v)
                    calls.append(("r", v))
                    resident.discard(v)
            for k in run:
                p.insert(k)
                calls.append(("i", k))
                resident.add(k)
            i = j
    return calls, hit / total


def replay_calls(name: str, capacity: int, calls: list[Call]) -> tuple[float, int]:
    """Seconds the policy's calls take, and how many calls (victims count the keys they pick)."""
    p = make_policy(name, capacity)
    ins, touch, many, victims, remove = p.insert, p.touch, p.touch_many, p.victims, p.remove
    ops = 0
    t0 = time.perf_counter()
    for op, arg in calls:
        if op == "i":
            ins(arg)
        elif op == "t":
            touch(arg)
        elif op == "m":
            many(arg)
        elif op == "v":
            victims(arg, always)
        else:
            remove(arg)
    seconds = time.perf_counter() - t0
    for op, arg in calls:
        ops += len(arg) if op == "m" else (arg if op == "v" else 1)
    return seconds, ops


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", help="a Mooncake-format trace (default: a generated chat-like stream)")
    ap.add_argument("--requests", type=benchmain.positive, default=None, help="the first N requests only")
    ap.add_argument("--capacity", type=benchmain.positive_list, default=[2000, 6000], help="pool slots")
    ap.add_argument("--repeats", type=benchmain.positive, default=5, help="timed replays (the median)")
    ap.add_argument("--policies", default=",".join(POLICIES), help="policies to time (lru always)")
    args = ap.parse_args()
    if args.trace:
        requests = [(r.input_length, list(r.hash_ids)) for r in read_trace(args.trace, args.requests)]
        source = args.trace
    else:
        requests = generated(args.requests or 10000)
        source = f"generated ({len(requests)} requests)"
    names = ["lru", *[n for n in args.policies.split(",") if n != "lru"]]
    print(f"{source}: median of {args.repeats} runs")
    print(f"{'capacity':>9} {'policy':>6} {'calls/s':>12} {'vs lru':>7} {'hit rate':>9}")
    for cap in args.capacity:
        base = 0.0
        for name in names:
            calls, rate = record(name, cap, requests)
            runs = [replay_calls(name, cap, calls) for _ in range(args.repeats)]
            per_s = statistics.median(ops / s for s, ops in runs)
            if name == "lru":
                base = per_s
            print(f"{cap:>9} {name:>6} {per_s:>12,.0f} {per_s / base:>7.2f} {rate:>9.4f}", flush=True)
    return 0


if __name__ == "__main__":
    benchmain.run(main)

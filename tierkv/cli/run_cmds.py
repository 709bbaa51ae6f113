"""``tierkv demo`` and ``tierkv simulate``: try tierkv without an engine."""

from __future__ import annotations

import argparse
import functools
import json
from typing import Any, Literal

from tierkv.cli.common import (
    Formatter,
    console,
    error,
    interrupts_raise,
    kv_pairs,
    positive_int,
    print_table,
    progress,
    run_async,
)

__all__ = ["add_demo", "add_simulate"]

KINDS = ("full", "sliding_window", "recurrent")


def add_demo(sub: Any) -> None:
    """The ``demo`` command."""
    d = sub.add_parser("demo", formatter_class=Formatter,
                       help="a hybrid model serving shared prefixes; every restore checked",
                       description="Serve requests over shared prefixes of a hybrid model (full attention, "
                                   "sliding window, recurrent state) through a CPU pool and a lower tier; "
                                   "every restored block is compared with what was stored.\n\nExit codes: "
                                   "0 every restore identical, 1 a restored block differed, 2 error.")
    d.add_argument("--requests", type=positive_int, default=48, help="requests to serve")
    d.add_argument("--documents", type=positive_int, default=12, help="distinct shared prefixes")
    d.add_argument("--seed", type=int, default=0, help="random seed of the request mix")
    d.add_argument("--lower", default=None, metavar="URL",
                   help="the lower tier: an fsspec URL (file://, s3://...) or 'memory' "
                        "(default: a temporary directory)")
    d.add_argument("--json", action="store_true", help="print a JSON report on stdout")
    d.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from tierkv.tools.demo import run_demo

    out = console()
    with progress() as bar:
        task = bar.add_task("serving requests", total=args.requests)
        res = run_async(lambda: run_demo(requests=args.requests, documents=args.documents, seed=args.seed,
                                         lower_url=args.lower, progress=lambda n: bar.advance(task, n)))
    if args.json:
        print(json.dumps({"requests": res.requests, "restored_blocks": res.restored_blocks,
                          "computed_blocks": res.computed_blocks, "mismatches": res.mismatches,
                          "bytes_restored": res.bytes_restored, "seconds": res.seconds,
                          "stats": res.stats.model_dump()}, indent=2))
        return 1 if res.mismatches else 0
    print_table("pool plan (primary, cpu)", ("group", "kind", "slots", "block bytes", "bytes", "why"),
                [(g.group, g.kind, g.slots, g.block_bytes, g.bytes, g.reason) for g in res.plan.groups], out)
    print_table("tiers", ("tier", "kind", "hits", "misses", "read MiB", "written MiB", "stores", "shed",
                          "failed"),
                [(t.index, t.kind, t.hits, t.misses, f"{t.bytes_read / 2**20:.1f}",
                  f"{t.bytes_written / 2**20:.1f}", t.stores, t.stores_shed, t.stores_failed)
                 for t in res.stats.tiers], out)
    mib = res.bytes_restored / 2**20
    out.print(f"requests {res.requests}, blocks restored {res.restored_blocks}, computed "
              f"{res.computed_blocks}, steps waited {res.steps_waited}")
    rate = mib / max(res.seconds, 1e-9)
    out.print(f"restored {mib:.1f} MiB in {res.seconds:.2f} s ({rate:.1f} MiB/s end to end, block "
              "generation and checks included)")
    if res.mismatches:
        out.print(f"FAILED: {res.mismatches} restored blocks differ from what was stored")
        return 1
    out.print("every restored block equals what was stored")
    return 0


def _kinds(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(f"kinds are a comma-separated list of {', '.join(KINDS)}; "
                                         f"got {', '.join(bad) or 'nothing'}")
    return kinds


def _slot(text: str) -> tuple[int, int]:
    group, sep, slots = text.partition("=")
    try:
        g, n = int(group), int(slots)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not GROUP=SLOTS (e.g. 1=3)") from None
    if not sep or g < 0 or n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: GROUP must be >= 0 and SLOTS > 0")
    return g, n


def add_simulate(sub: Any) -> None:
    """The ``simulate`` command."""
    s = sub.add_parser("simulate", formatter_class=Formatter,
                       help="replay concurrent restores step by step, or nodes sharing a tier",
                       description="D documents are written to a lower tier by one process; a new process "
                                   "restores R requests in the same step through small pools (--compare "
                                   "also runs a naive policy that treats a full pool as a miss).\n\nWith "
                                   "--nodes N: N processes, each its own store, share one tier (--url: a "
                                   "directory, a bucket, or mooncake://HOST:PORT, a Mooncake Store master); "
                                   "all write at once, then each restores what "
                                   "another wrote; with --capacity-bytes, the tier's bytes once they stop "
                                   "are reported against it.\n\nExit codes: 0 every restore identical (and "
                                   "the tier within capacity), 1 otherwise, 2 error.")
    s.add_argument("--documents", type=positive_int, default=4, help="documents (prefixes) to write")
    s.add_argument("--requests", type=positive_int, default=4, help="requests restoring at once")
    s.add_argument("--blocks", type=positive_int, default=8, help="blocks per document")
    s.add_argument("--kinds", type=_kinds, default="full,recurrent",
                   help=f"group kinds in index order, comma-separated ({', '.join(KINDS)})")
    s.add_argument("--slots", nargs="*", type=_slot, default=[(1, 3)], metavar="GROUP=SLOTS",
                   help="primary slots of a group index (repeatable)")
    s.add_argument("--default-slots", type=positive_int, default=256, help="slots of groups not in --slots")
    s.add_argument("--window-blocks", type=positive_int, default=2, help="window of sliding-window groups")
    s.add_argument("--block-bytes", type=positive_int, default=4096, help="bytes per block")
    s.add_argument("--url", default=None, help="lower tier URL (default: a temporary directory)")
    s.add_argument("-o", "--storage-option", action="append", metavar="KEY=VALUE", default=[],
                   help="fsspec storage option of --url (repeatable)")
    s.add_argument("--policy", choices=["queue", "naive"], default="queue", help="admission policy")
    s.add_argument("--compare", action="store_true", help="run tierkv's policy and the naive one")
    s.add_argument("--max-steps", type=positive_int, default=200, help="steps before giving up")
    s.add_argument("--same-process", action="store_true", help="write the documents in this process")
    s.add_argument("--nodes", type=positive_int, default=None,
                   help="run this many node processes sharing the tier instead")
    s.add_argument("--capacity-bytes", type=positive_int, default=None,
                   help="with --nodes: the shared tier's capacity")
    s.add_argument("--json", action="store_true", help="print a JSON report on stdout")
    s.set_defaults(func=_simulate)


def _simulate(args: argparse.Namespace) -> int:
    if args.nodes is not None:
        return _nodes(args)
    from tierkv.tools.simulate import Scenario, run_scenario

    slots = dict(args.slots)
    kinds = args.kinds if isinstance(args.kinds, list) else _kinds(args.kinds)
    unknown = sorted(g for g in slots if g >= len(kinds))
    if unknown:
        error(f"--slots names group {unknown[0]}, but --kinds gives groups 0..{len(kinds) - 1}")
        return 2
    policies: list[Literal["queue", "naive"]] = ["queue", "naive"] if args.compare else [args.policy]
    results = {}
    for policy in policies:
        sc = Scenario(documents=args.documents, requests=args.requests, blocks=args.blocks, kinds=kinds,
                      slots=slots, default_slots=args.default_slots, window_blocks=args.window_blocks,
                      block_bytes=args.block_bytes, url=args.url,
                      storage_options=kv_pairs(args.storage_option),
                      admission=policy, max_steps=args.max_steps, writer_subprocess=not args.same_process)
        results[policy] = run_async(functools.partial(run_scenario, sc))
    if args.json:
        print(json.dumps({p: r.to_json() for p, r in results.items()}, indent=1))
    else:
        out = console()
        for policy, res in results.items():
            print_table(f"{policy} admission: restored {res.restored_fraction:.3f} of the tokens on disk, "
                        f"mean steps waited {res.mean_steps_waited:.2f}",
                        ("request", "document", "steps waited", "tokens restored", "from scratch"),
                        [(r.request, r.document, r.steps_waited, r.tokens_restored,
                          "yes" if r.from_scratch else "no") for r in res.requests], out)
    bad = any(r.mismatches for res in results.values() for r in res.requests)
    return 1 if bad else 0


def _nodes(args: argparse.Namespace) -> int:
    import tempfile

    from tierkv.tools.nodes import run_nodes

    interrupts_raise()  # Ctrl-C unwinds: the node processes are stopped and the directory removed
    with tempfile.TemporaryDirectory(prefix="tierkv-nodes-") as tmp:
        res = run_nodes(nodes=args.nodes, url=args.url or f"file://{tmp}", documents=args.documents,
                        blocks=args.blocks, block_bytes=args.block_bytes, capacity_bytes=args.capacity_bytes,
                        storage_options=kv_pairs(args.storage_option))
    if args.json:
        print(json.dumps(res.to_json(), indent=1))
    else:
        out = console()
        print_table(f"{args.nodes} nodes sharing one tier",
                    ("node", "blocks written", "restored", "identical", "missing", "stores failed"),
                    [(n["node"], n["written"], n["restored"], n["identical"], n["missing"],
                      n["stores_failed"]) for n in res.nodes], out)
        if res.capacity_bytes is not None:
            out.print(f"the tier holds {res.held_bytes:,} bytes for a capacity of {res.capacity_bytes:,}")
        if res.usable_share is not None:
            out.print(f"{res.usable_share:.1%} of the {res.held_records:,} records held belong to usable "
                      "prefixes (all their blocks there from the first)")
        out.print("ok" if res.ok else "FAILED")
    return 0 if res.ok else 1

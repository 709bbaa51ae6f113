"""The ``tierkv`` command: ``demo``, ``inspect``, ``verify``, ``simulate``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import anyio

__all__ = ["main"]


def _cmd_demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from tierkv.demo import run_demo

    console = Console(stderr=False)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("serving requests", total=args.requests)
        res = anyio.run(lambda: run_demo(requests=args.requests, documents=args.documents,
                                         seed=args.seed, lower_url=args.lower,
                                         progress=lambda n: progress.advance(task, n)))
    if args.json:
        print(json.dumps({"requests": res.requests, "restored_blocks": res.restored_blocks,
                          "computed_blocks": res.computed_blocks, "mismatches": res.mismatches,
                          "bytes_restored": res.bytes_restored, "seconds": res.seconds,
                          "stats": res.stats.model_dump()}, indent=2))
        return 1 if res.mismatches else 0
    plan = Table(title="pool plan (primary, cpu)")
    for col in ("group", "kind", "slots", "block bytes", "bytes", "why"):
        plan.add_column(col)
    for g in res.plan.groups:
        plan.add_row(str(g.group), g.kind, str(g.slots), str(g.block_bytes), str(g.bytes), g.reason)
    console.print(plan)
    tiers = Table(title="tiers")
    for col in ("tier", "kind", "hits", "misses", "read MiB", "written MiB", "stores", "shed", "failed"):
        tiers.add_column(col)
    for t in res.stats.tiers:
        tiers.add_row(str(t.index), t.kind, str(t.hits), str(t.misses), f"{t.bytes_read / 2**20:.1f}",
                      f"{t.bytes_written / 2**20:.1f}", str(t.stores), str(t.stores_shed),
                      str(t.stores_failed))
    console.print(tiers)
    mib = res.bytes_restored / 2**20
    console.print(f"requests {res.requests}, blocks restored {res.restored_blocks}, computed "
                  f"{res.computed_blocks}, steps waited {res.steps_waited}")
    console.print(f"restored {mib:.1f} MiB in {res.seconds:.2f} s ({mib / max(res.seconds, 1e-9):.1f} MiB/s "
                  f"end to end, block generation and checks included)")
    if res.mismatches:
        console.print(f"[red]FAILED: {res.mismatches} restored blocks differ from what was stored[/red]")
        return 1
    console.print("[green]every restored block equals what was stored[/green]")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``tierkv`` command."""
    p = argparse.ArgumentParser(prog="tierkv", description="tiered KV-cache store")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="simulate a hybrid model serving shared prefixes; verify restores")
    d.add_argument("--requests", type=int, default=48)
    d.add_argument("--documents", type=int, default=12)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--lower", default=None,
                   help="lower tier: an fsspec URL, or 'memory' (default: a temporary directory)")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=_cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tierkv`` console script."""
    args = build_parser().parse_args(argv)
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())

"""The ``tierkv`` command: ``demo``, ``inspect``, ``verify``, ``simulate``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, Literal

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


def _storage_options(pairs: Sequence[str] | None) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; a VALUE that parses as JSON is used as such (numbers, objects)."""
    out: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"tierkv: error: storage option {key!r} is not KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def _fail(exc: BaseException) -> int:
    from rich.console import Console

    Console(stderr=True).print(f"[red]tierkv: error:[/red] {exc}", markup=True, highlight=False)
    return 2


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.3f}"


def _cmd_inspect(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from tierkv.audit import inspect_tier
    from tierkv.errors import TierKVError

    try:
        report = anyio.run(lambda: inspect_tier(args.url, _storage_options(args.storage_option),
                                                concurrency=args.concurrency))
    except TierKVError as exc:
        return _fail(exc)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
        return 0
    console = Console()
    console.print(f"[bold]{report.url}[/bold]: {len(report.namespaces)} namespace(s), "
                  f"{report.temp_files} temporary file(s), {len(report.other_files)} other file(s)",
                  soft_wrap=True, highlight=False)
    for ns in report.namespaces:
        title = (f"{ns.namespace!r} ({ns.fingerprint})" if ns.namespace is not None
                 else f"{ns.fingerprint} (layout.json {ns.manifest})")
        table = Table(title=title)
        for col in ("group", "kind", "block bytes", "records", "on disk", "raw", "codec ratio", "codecs"):
            table.add_column(col)
        for g in ns.groups:
            codecs = ", ".join(f"{k} {v}" for k, v in sorted(g.codecs.items()))
            if g.bad_headers:
                codecs += f" ({g.bad_headers} unreadable)"
            table.add_row(str(g.group), g.kind or "?", str(g.block_bytes or "?"), str(g.records),
                          _human_bytes(g.bytes_on_disk), _human_bytes(g.raw_bytes),
                          _ratio(g.codec_ratio), codecs)
        table.add_row("all", "", "", str(ns.records), _human_bytes(ns.bytes_on_disk),
                      _human_bytes(ns.raw_bytes), _ratio(ns.codec_ratio), "", style="bold")
        console.print(table)
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from tierkv.audit import verify_tier
    from tierkv.errors import TierKVError

    console = Console(stderr=True)
    try:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("verifying records", total=None)
            report = anyio.run(lambda: verify_tier(
                args.url, _storage_options(args.storage_option), repair=args.repair,
                stale_temp_s=args.stale_temp_s, max_block_bytes=args.max_block_bytes,
                concurrency=args.concurrency, progress=lambda n: progress.advance(task, n),
                on_total=lambda n: progress.update(task, total=n)))
    except TierKVError as exc:
        return _fail(exc)
    rc = 0 if report.clean else 1
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
        return rc
    out = Console()
    for p in report.corrupt:
        state = "removed" if p.removed else "CORRUPT"
        out.print(f"{state:8} {p.path}: {p.reason} {p.detail}", highlight=False, markup=False, soft_wrap=True)
    for p in report.errors:
        out.print(f"ERROR    {p.path}: {p.detail}", highlight=False, markup=False, soft_wrap=True)
    for t in report.temp_files:
        state = "removed" if t.removed else ("stale" if t.stale else "in use")
        out.print(f"{state:8} {t.path} (temporary, {t.age_s:.0f} s old)", highlight=False, markup=False,
                  soft_wrap=True)
    out.print(f"{report.url}: {report.checked} records checked, {report.ok} sound, "
              f"{len(report.corrupt)} corrupt ({len(report.remaining)} remaining), "
              f"{len(report.errors)} unreadable, {len(report.temp_files)} temporary file(s), "
              f"{len(report.removed)} removed", highlight=False, markup=False, soft_wrap=True)
    if report.remaining and not args.repair:
        out.print("run again with --repair to delete the corrupt records", highlight=False, soft_wrap=True)
    return rc


def _add_url_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="root of a persistent tier: a path or any fsspec URL (file://, s3://, ...)")
    p.add_argument("-o", "--storage-option", action="append", metavar="KEY=VALUE",
                   help="fsspec storage option (repeatable), e.g. -o endpoint_url=http://host:9000")
    p.add_argument("--concurrency", type=int, default=16, help="requests / threads in flight")
    p.add_argument("--json", action="store_true", help="print a JSON report on stdout")


def _cmd_simulate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from tierkv.simulate import Scenario, run_scenario

    try:
        slots = {int(k): int(v) for k, v in (kv.split("=", 1) for kv in args.slots)}
    except ValueError:
        print("--slots takes GROUP=SLOTS pairs, e.g. --slots 1=3", file=sys.stderr)
        return 2
    kinds = args.kinds.split(",")
    policies: list[Literal["queue", "naive"]] = ["queue", "naive"] if args.compare else [args.policy]
    results = {}
    for policy in policies:
        sc = Scenario(documents=args.documents, requests=args.requests, blocks=args.blocks, kinds=kinds,
                      slots=slots, default_slots=args.default_slots, window_blocks=args.window_blocks,
                      block_bytes=args.block_bytes, url=args.url, admission=policy,
                      max_steps=args.max_steps, writer_subprocess=not args.same_process)
        results[policy] = anyio.run(run_scenario, sc)
    if args.json:
        print(json.dumps({p: r.to_json() for p, r in results.items()}, indent=1))
    else:
        console = Console()
        for policy, res in results.items():
            t = Table(title=f"{policy} admission: restored {res.restored_fraction:.3f} of the tokens on disk,"
                            f" mean steps waited {res.mean_steps_waited:.2f}")
            for col in ("request", "document", "steps waited", "tokens restored", "from scratch"):
                t.add_column(col)
            for r in res.requests:
                t.add_row(str(r.request), str(r.document), str(r.steps_waited), str(r.tokens_restored),
                          "yes" if r.from_scratch else "no")
            console.print(t)
    bad = any(r.mismatches for res in results.values() for r in res.requests)
    return 1 if bad else 0


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
    i = sub.add_parser("inspect", help="namespaces, groups, record counts, bytes and codec ratios of a tier")
    _add_url_options(i)
    i.set_defaults(func=_cmd_inspect)
    v = sub.add_parser("verify", help="check every record of a tier; --repair deletes corrupt ones",
                       description="Check every record (checksum, decoding, key / fingerprint / group "
                                   "against its path). Exit status 0 when clean or repaired, 1 when "
                                   "corrupt or unreadable records remain, 2 on errors.")
    _add_url_options(v)
    v.add_argument("--repair", action="store_true",
                   help="delete corrupt records and stale temporary files")
    v.add_argument("--stale-temp-s", type=float, default=3600.0,
                   help="temporary files older than this are stale even when their writer may live")
    v.add_argument("--max-block-bytes", type=int, default=1 << 30,
                   help="bound on a block's size for namespaces without a readable layout.json")
    v.set_defaults(func=_cmd_verify)
    s = sub.add_parser("simulate", help="replay concurrent restores from a lower tier, step by step",
                       description="D documents are written to a lower tier by one process; a new "
                                   "process restores R requests in the same step through small pools.")
    s.add_argument("--documents", type=int, default=4)
    s.add_argument("--requests", type=int, default=4)
    s.add_argument("--blocks", type=int, default=8, help="blocks per document")
    s.add_argument("--kinds", default="full,recurrent",
                   help="group kinds in index order (full, sliding_window, recurrent)")
    s.add_argument("--slots", nargs="*", default=["1=3"], metavar="GROUP=SLOTS",
                   help="primary slots per group index (default 1=3)")
    s.add_argument("--default-slots", type=int, default=256, help="slots of groups not in --slots")
    s.add_argument("--window-blocks", type=int, default=2)
    s.add_argument("--block-bytes", type=int, default=4096)
    s.add_argument("--url", default=None, help="lower tier URL (default: a temporary directory)")
    s.add_argument("--policy", choices=["queue", "naive"], default="queue")
    s.add_argument("--compare", action="store_true", help="run tierkv's and the naive policy")
    s.add_argument("--max-steps", type=int, default=200)
    s.add_argument("--same-process", action="store_true", help="write the documents in this process")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_cmd_simulate)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tierkv`` console script."""
    args = build_parser().parse_args(argv)
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())

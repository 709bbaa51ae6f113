"""How many calls and modules one restore and one store pass through: the walk docs/design.md tells.

    python bench/hops.py [--json]

A restore: a store writes 8 blocks to a ``file://`` tier and closes; a new store (empty primary)
serves ``lookup_prefix`` until it is not PENDING, then ``get``. A store: ``put`` of 8 new blocks,
until their records are on the tier. Each path crosses threads: the caller's thread, a task on the
store's loop, a tier thread; what is counted is the tierkv functions on the stack (a hop is a call
into one of them) at the moments the work changes hands or bytes move:

* restore: ``lookup_prefix`` down to where the promotion is started (the caller's thread), the
  promotion's task down to the driver's ``read_records`` (the loop), and the tier thread down to
  the check of the record's bytes in its row (``none_parts_match``, as ``read_into`` calls it);
* store: ``put`` down to where the cascade is started, the cascade's task down to the driver's
  ``write_records``, and the tier thread down to the record's file write (``write_batch``).

The figure is the sum of the three stacks' tierkv frames (hops) and the number of tierkv modules
in them. It runs against whatever ``tierkv`` is first on ``sys.path``, so the same script measures
an older checkout (``git worktree add``) for a before-and-after.
"""

from __future__ import annotations

import benchmain  # first: Ctrl-C while the imports below load ends quietly

# isort: split

import argparse
import functools
import importlib
import json
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from typing import Any

import anyio
import torch

from tierkv import GroupSpec, Layout, Lookup, StoreConfig, TieredStore

BLOCK = 4096
N = 8


def _first(*paths: str) -> tuple[Any, str]:
    """The first ``module:attr.attr`` of ``paths`` that exists here (module names moved over time;
    the older names first, so that an older checkout never finds a newer module elsewhere on the path)."""
    for path in paths:
        mod, _, attr = path.partition(":")
        try:
            obj: Any = importlib.import_module(mod)
        except ImportError:
            continue
        owner, name = obj, attr
        for part in attr.split("."):
            owner, name = obj, part
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is not None:
            return owner, name
    raise SystemExit(f"hops: none of {paths} exists in this tierkv")


class Stacks:
    """The tierkv frames on the stack at each watched call (the first call of each)."""

    def __init__(self, root: str) -> None:
        self.root = root + "tierkv/"
        self.armed = False
        self.seen: dict[str, list[tuple[str, str]]] = {}
        self.where: dict[str, str] = {}
        self.lock = threading.Lock()
        self.undo: list[Callable[[], None]] = []

    def watch(self, label: str, *paths: str) -> None:
        owner, name = _first(*paths)
        original = getattr(owner, name)
        stacks = self
        module = owner if isinstance(owner, type(sys)) else sys.modules[owner.__module__]
        self.where[label] = module.__file__ or label

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            stacks.note(label)
            return original(*args, **kwargs)

        setattr(owner, name, wrapper)
        self.undo.append(lambda: setattr(owner, name, original))

    def note(self, label: str) -> None:
        if not self.armed:
            return
        stack = traceback.extract_stack()[:-2]
        frames = [(f.filename, f.name) for f in stack if f.filename.startswith(self.root)]
        frames.append((self.where[label], label.rsplit(" ", 1)[-1]))
        with self.lock:
            self.seen.setdefault(label, frames)

    def restore(self) -> None:
        for undo in reversed(self.undo):
            undo()
        self.undo.clear()


def _module(filename: str, root: str) -> str:
    return filename[len(root):].removesuffix(".py").replace("/", ".").removesuffix(".__init__")


def _summary(stacks: Stacks, labels: list[str], root: str) -> dict[str, Any]:
    hops = 0
    modules: set[str] = set()
    walk = {}
    for label in labels:
        frames = stacks.seen.get(label)
        if frames is None:
            raise SystemExit(f"hops: the walk never reached {label}")
        hops += len(frames)
        modules |= {_module(f, root) for f, _ in frames}
        walk[label] = [f"{_module(f, root)}.{name}" for f, name in frames]
    return {"hops": hops, "modules": len(modules), "module_names": sorted(modules), "walk": walk}


async def _run() -> dict[str, Any]:
    import tierkv

    root = tierkv.__file__.rsplit("/tierkv/", 1)[0] + "/"
    layout = Layout(groups=[GroupSpec(kind="full", block_bytes=BLOCK)], tokens_per_block=16)
    hashes = [bytes([i]) * 16 for i in range(N)]
    blocks = torch.randint(0, 255, (N, BLOCK), dtype=torch.uint8)
    with tempfile.TemporaryDirectory() as tmp:
        config = StoreConfig(layout=layout, namespace="hops", tiers=[
            {"kind": "cpu", "capacity_bytes": 1 << 20}, {"kind": "fsspec", "url": f"file://{tmp}"}])
        stacks = Stacks(root)
        stacks.watch("put > start", "tierkv.cascade:Cascader.start", "tierkv.movement.cascade:Cascader.start")
        stacks.watch("cascade task > store", "tierkv.gateway:TierGateway.store",
                     "tierkv.movement.gateway:TierGateway.store")
        stacks.watch("batch task > write_records", "tierkv.backends.fsspec._local:LocalDriver.write_records")
        stacks.watch("tier thread > write_batch", "tierkv.backends.fsspec._batchio:write_batch",
                     "tierkv.records.batchio:write_batch")
        try:
            async with TieredStore(config) as store:
                await store.idle()
                stacks.armed = True
                await store.put(0, hashes, blocks)
                await store.flush()
        finally:
            stacks.restore()
        store_walk = _summary(stacks, list(stacks.where), root)

        stacks = Stacks(root)
        stacks.watch("lookup > start", "tierkv.promotion:Promoter.start",
                     "tierkv.movement.promotion:Promoter.start")
        stacks.watch("promotion task > load", "tierkv.gateway:TierGateway.load",
                     "tierkv.movement.gateway:TierGateway.load")
        stacks.watch("batch task > read_records", "tierkv.backends.fsspec._local:LocalDriver.read_records")
        stacks.watch("tier thread > none_parts_match", "tierkv.backends.recordread:none_parts_match",
                     "tierkv.recordread:none_parts_match", "tierkv.records.read:none_parts_match")
        out = torch.empty_like(blocks)
        try:
            async with TieredStore(config) as store:
                await store.idle()
                stacks.armed = True
                while True:
                    found = store.lookup_prefix(hashes, "r")
                    if found.state is not Lookup.PENDING:
                        break
                    await anyio.sleep(0.001)
                await store.get(0, hashes[: found.blocks], out[: found.blocks], request_id="r")
                store.release("r")
        finally:
            stacks.restore()
        if not torch.equal(out, blocks):
            raise SystemExit("hops: the restored blocks differ from those stored")
        restore_walk = _summary(stacks, list(stacks.where), root)
    return {"restore": restore_walk, "store": store_walk}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    result = anyio.run(_run)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    for name in ("restore", "store"):
        walk = result[name]
        print(f"{name}: {walk['hops']} hops over {walk['modules']} modules")
        for label, frames in walk["walk"].items():
            print(f"  {label} ({len(frames)}): " + " > ".join(frames))
    return 0


if __name__ == "__main__":
    benchmain.run(main)

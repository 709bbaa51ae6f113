"""``tierkv simulate --nodes N``: serving nodes sharing one persistent tier.

N processes, each with its own :class:`~tierkv.TieredStore` (its own CPU pool) over one tier URL
(a bucket, an NFS export, a shared directory). Every node writes its own documents (prefixes of
blocks whose bytes derive from their hash), all at once; then every node restores the documents the
next node wrote and checks them byte for byte. With ``capacity_bytes`` the nodes write more than
the tier may hold between them, and the report says how many bytes the tier holds once they stop.

With ``--url mooncake://host:port`` the nodes share a Mooncake Store cluster instead: each node's
``mooncake`` tier contributes a segment to the pool, and since the objects live in the nodes'
segments, a node keeps its store (and segment) open until every node has restored.

A node runs as ``python -m tierkv.tools.nodes`` with its spec as one JSON line on stdin (credentials
never appear on a command line) and answers with one JSON line on stdout.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from tierkv.errors import ConfigError
from tierkv.layout import GroupSpec, Layout
from tierkv.store import Lookup, TieredStore
from tierkv.testing.processes import child_failure, run_child
from tierkv.tools.demo import block_for, chain_hashes

__all__ = ["MOONCAKE", "NodesResult", "run_nodes"]

GROUP = 0
#: the URL scheme of a Mooncake Store cluster: ``mooncake://<master host>:<port>``
MOONCAKE = "mooncake://"
#: what each node contributes to a Mooncake cluster's pool
SEGMENT_BYTES = 256 << 20


def _layout(block_bytes: int) -> Layout:
    return Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=block_bytes)])


def _config(spec: dict[str, Any]) -> dict[str, Any]:
    tier: dict[str, Any]
    if spec["url"].startswith(MOONCAKE):
        tier = {"kind": "mooncake", "master": spec["url"][len(MOONCAKE):], "segment_bytes": SEGMENT_BYTES}
    else:
        tier = {"kind": "fsspec", "url": spec["url"], "storage_options": spec.get("storage_options") or {},
                "rescan_s": spec.get("rescan_s", 2.0)}
    if spec.get("capacity_bytes"):
        tier["capacity_bytes"] = spec["capacity_bytes"]
    tier["required"] = True  # the shared tier is what is simulated: one that does not answer fails the run
    return {"layout": _layout(spec["block_bytes"]), "namespace": "tierkv-simulate-nodes",
            "tiers": [{"kind": "cpu", "slots": {GROUP: spec["blocks"] + 8}}, tier]}


def _doc(node: int, d: int, blocks: int) -> list[bytes]:
    return chain_hashes(100_000 * (node + 1) + d, blocks)


async def _node(spec: dict[str, Any]) -> dict[str, Any]:
    node, blocks, bb = spec["node"], spec["blocks"], spec["block_bytes"]
    out: dict[str, Any] = {"node": node, "written": 0, "restored": 0, "identical": 0, "missing": 0}
    shared_memory = spec["url"].startswith(MOONCAKE)  # the objects live in the nodes' segments
    async with contextlib.AsyncExitStack() as stack:
        store = await stack.enter_async_context(TieredStore(_config(spec)))
        for d in range(spec["documents"]):
            hs = _doc(node, d, blocks)
            await store.put(GROUP, hs, torch.stack([block_for(h, GROUP, bb) for h in hs]))
            await store.flush()
            store.engine.clear()  # this node's pool forgets: what comes back comes from the tier
            out["written"] += blocks
        t = store.stats().tiers[1]
        out["stores_failed"], out["stores_shed"] = t.stores_failed, t.stores_shed
        if not shared_memory:
            await stack.aclose()
        # the others are writing too: wait until they are done before restoring what one of them wrote
        sys.stdout.write(json.dumps({"event": "written"}) + "\n")
        sys.stdout.flush()
        sys.stdin.readline()
        if not shared_memory:
            store = await stack.enter_async_context(TieredStore(_config({**spec, "capacity_bytes": None})))
        await _restore(store, spec, out)
        if shared_memory:  # keep the segment until every node has restored
            sys.stdout.write(json.dumps({"event": "restored"}) + "\n")
            sys.stdout.flush()
            sys.stdin.readline()
    return out


async def _restore(store: TieredStore, spec: dict[str, Any], out: dict[str, Any]) -> None:
    """Restore the documents the next node wrote; count what came back and whether identical."""
    node, blocks, bb = spec["node"], spec["blocks"], spec["block_bytes"]
    other = (node + 1) % spec["nodes"]
    for d in range(spec["documents"]):
        hs = _doc(other, d, blocks)
        rid = f"restore-{d}"
        with anyio.fail_after(120):
            while (pl := store.lookup_prefix(hs, request_id=rid)).state is Lookup.PENDING:
                await anyio.sleep(0.01)
        got = pl.blocks if pl.state is Lookup.HIT else 0
        out["missing"] += blocks - got
        if got:
            buf = torch.empty((got, bb), dtype=torch.uint8)
            await store.get(GROUP, hs[:got], buf, request_id=rid)
            out["restored"] += got
            out["identical"] += sum(bool(torch.equal(buf[i], block_for(h, GROUP, bb)))
                                    for i, h in enumerate(hs[:got]))
        store.release(rid)


@dataclass
class NodesResult:
    """What the nodes did, and what the tier holds afterwards."""

    nodes: list[dict[str, Any]] = field(default_factory=list)
    capacity_bytes: int | None = None
    held_bytes: int | None = None
    #: records the tier holds once every node has written
    held_records: int | None = None
    #: the share of those records that belong to a usable prefix (one whose blocks are all there
    #: from its first): what eviction left that can still be restored
    usable_share: float | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Every restored block was identical, and the tier is within capacity (when bounded)."""
        identical = all(n["identical"] == n["restored"] for n in self.nodes)
        within = self.capacity_bytes is None or (self.held_bytes or 0) <= self.capacity_bytes
        return identical and within

    def to_json(self) -> dict[str, Any]:
        """A plain dict for ``--json``."""
        return {"nodes": self.nodes, "capacity_bytes": self.capacity_bytes, "held_bytes": self.held_bytes,
                "held_records": self.held_records, "usable_share": self.usable_share,
                "seconds": self.seconds, "ok": self.ok}


async def _held(spec: dict[str, Any]) -> tuple[int, int]:
    """Bytes and records in the namespace, listed by a store that writes nothing."""
    from tierkv.tools.audit import inspect_tier

    report = await inspect_tier(spec["url"], spec.get("storage_options") or {})
    return (sum(ns.bytes_on_disk for ns in report.namespaces), sum(ns.records for ns in report.namespaces))


def run_nodes(*, nodes: int, url: str, documents: int, blocks: int, block_bytes: int,
              capacity_bytes: int | None = None, storage_options: dict[str, Any] | None = None,
              timeout_s: float = 600.0) -> NodesResult:
    """Run the nodes as processes; each writes ``documents`` x ``blocks`` blocks, then restores
    the next node's documents."""
    if url.startswith(MOONCAKE) and capacity_bytes is not None:
        raise ConfigError("--capacity-bytes does not apply to a mooncake:// tier: its master bounds the pool "
                          "(the nodes' segments) and evicts")
    t0 = time.perf_counter()
    spec = {"nodes": nodes, "url": url, "documents": documents, "blocks": blocks, "block_bytes": block_bytes,
            "capacity_bytes": capacity_bytes, "storage_options": storage_options or {}}
    procs = [subprocess.Popen([sys.executable, "-m", "tierkv.tools.nodes"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(nodes)]
    try:
        for i, p in enumerate(procs):
            assert p.stdin is not None
            p.stdin.write(json.dumps({**spec, "node": i}) + "\n")
            p.stdin.flush()
        for p in procs:  # every node has written (and closed its writing store)
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line:
                raise child_failure("a node failed while writing", _tail(p))
        shared_memory = url.startswith(MOONCAKE)
        held, records = (None, None) if shared_memory else anyio.run(_held, spec)
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        if shared_memory:  # every node has restored; then they may leave (with their segments)
            for p in procs:
                assert p.stdout is not None
                if not p.stdout.readline():
                    raise child_failure("a node failed while restoring", _tail(p))
            for p in procs:
                assert p.stdin is not None
                p.stdin.write("done\n")
                p.stdin.flush()
        results = []
        for p in procs:
            out, err = p.communicate(timeout=timeout_s)
            if p.returncode != 0 or not out.strip():
                raise child_failure("a node failed while restoring", err)
            results.append(json.loads(out.strip().splitlines()[-1]))
        usable = sum(int(n["restored"]) for n in results)  # blocks of prefixes restorable from block 0
        return NodesResult(nodes=results, capacity_bytes=capacity_bytes, held_bytes=held,
                           held_records=records, usable_share=usable / records if records else None,
                           seconds=time.perf_counter() - t0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _tail(p: subprocess.Popen[str]) -> str:
    p.kill()
    _, err = p.communicate()
    return err


def _main() -> None:
    spec = json.loads(sys.stdin.readline())
    print(json.dumps(anyio.run(_node, spec)))


if __name__ == "__main__":
    run_child(_main)

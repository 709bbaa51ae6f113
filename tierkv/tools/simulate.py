"""``tierkv simulate``: replay a restore scenario step by step.

One process writes ``documents`` documents to a lower tier and exits; a new process (this one) opens a
store with small primary pools and ``requests`` requests look up their prefixes in the same step.
Each step every waiting request calls ``lookup_prefix``; between steps background work runs. A request
that gets a HIT loads its blocks (checked byte for byte), releases its pins and finishes; a MISS, or a
HIT shorter than the document, computes the rest from scratch. The same scenario can run under the
``naive`` admission policy (a full primary is a miss) for comparison.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import anyio
import torch

from tierkv.layout import GroupSpec, Layout
from tierkv.store import Lookup, TieredStore
from tierkv.testing.processes import child_failure, run_child
from tierkv.tools.demo import block_for, chain_hashes

__all__ = ["RequestResult", "Scenario", "SimulationResult", "run_scenario", "write_documents"]

GroupKindName = Literal["full", "sliding_window", "recurrent"]
#: how long the writer process may take
WRITER_TIMEOUT_S = 600.0


@dataclass
class Scenario:
    """What to replay. ``slots`` gives the primary pool per group index (the others get ``default_slots``)."""

    documents: int = 4
    requests: int = 4
    blocks: int = 8
    kinds: list[str] = field(default_factory=lambda: ["full", "recurrent"])
    slots: dict[int, int] = field(default_factory=lambda: {1: 3})
    default_slots: int = 256
    window_blocks: int = 2
    block_bytes: int = 4096
    tokens_per_block: int = 16
    url: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    admission: Literal["queue", "naive"] = "queue"
    max_steps: int = 200
    writer_subprocess: bool = True
    codec: str = "none"

    def layout(self) -> Layout:
        """The layout the scenario's groups describe."""
        groups = [GroupSpec(kind=k, block_bytes=self.block_bytes,
                            window_blocks=self.window_blocks if k == "sliding_window" else None)
                  for k in self.kinds]
        return Layout(tokens_per_block=self.tokens_per_block, groups=groups)

    def lower(self) -> dict[str, Any]:
        """The lower tier's config."""
        assert self.url is not None
        return {"kind": "fsspec", "url": self.url, "storage_options": self.storage_options,
                "codec": self.codec, "negative_ttl_s": 30.0, "required": True}

    def store_config(self) -> dict[str, Any]:
        """The reader's store config: small primary pools over the lower tier."""
        slots = {g: self.slots.get(g, self.default_slots) for g in range(len(self.kinds))}
        return {"layout": self.layout(), "namespace": "simulate", "admission": self.admission,
                "max_concurrent_requests": max(1, self.requests),
                "tiers": [{"kind": "cpu", "slots": slots}, self.lower()]}


@dataclass
class RequestResult:
    """What happened to one request."""

    request: int
    document: int
    steps_waited: int = 0
    blocks_restored: int = 0
    tokens_restored: int = 0
    tokens_on_disk: int = 0
    from_scratch: bool = False
    mismatches: int = 0


@dataclass
class SimulationResult:
    """Per request results and totals."""

    scenario: dict[str, Any]
    requests: list[RequestResult]
    steps: int = 0
    lookups: dict[str, int] = field(default_factory=dict)

    @property
    def restored_fraction(self) -> float:
        """Tokens restored over tokens on disk."""
        disk = sum(r.tokens_on_disk for r in self.requests)
        return sum(r.tokens_restored for r in self.requests) / disk if disk else 1.0

    @property
    def mean_steps_waited(self) -> float:
        """Mean steps a request waited before loading or computing."""
        return sum(r.steps_waited for r in self.requests) / max(1, len(self.requests))

    def to_json(self) -> dict[str, Any]:
        """A plain dict for ``--json``."""
        return {"scenario": self.scenario, "steps": self.steps, "lookups": self.lookups,
                "restored_fraction": self.restored_fraction,
                "mean_steps_waited": self.mean_steps_waited,
                "requests": [asdict(r) for r in self.requests]}


def _doc_hashes(sc: Scenario, d: int) -> list[bytes]:
    return chain_hashes(1000 + d, sc.blocks)


async def write_documents(sc: Scenario) -> None:
    """Write every block of every document of every group to the lower tier, then close."""
    layout = sc.layout()
    cfg = {"layout": layout, "namespace": "simulate", "max_concurrent_requests": 1,
           "tiers": [{"kind": "cpu", "slots": {g: sc.blocks * sc.documents for g in range(len(sc.kinds))}},
                     sc.lower()]}
    async with TieredStore(cfg) as store:
        for d in range(sc.documents):
            hs = _doc_hashes(sc, d)
            for g in layout.cacheable_groups:
                data = torch.stack([block_for(h, g, sc.block_bytes) for h in hs])
                await store.put(g, hs, data)
            await store.flush()  # a writer that outruns the tier would see its cascades shed
        failed = sum(t.stores_failed + t.stores_shed for t in store.stats().tiers[1:])
        if failed:
            raise RuntimeError(f"the writer could not store {failed} blocks")


async def _write_in_subprocess(sc: Scenario) -> None:
    """Write the documents in a process of their own. Cancelled (Ctrl-C), the process is killed
    and waited for before the scenario's directory is removed: an interrupt that only cancelled
    the wait left it writing into a directory that was being removed."""
    cmd = [sys.executable, "-m", "tierkv.tools.simulate", "--write", json.dumps(asdict(sc))]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = await anyio.to_thread.run_sync(proc.communicate, None, WRITER_TIMEOUT_S,
                                                abandon_on_cancel=True)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if proc.returncode != 0:
        raise child_failure("the writer process failed", err, proc.returncode)


async def _restore(store: TieredStore, sc: Scenario, r: RequestResult, hs: list[bytes], k: int) -> None:
    layout = store.layout
    rid = f"req-{r.request}"
    for g in layout.cacheable_groups:
        need = list(layout.groups[g].blocks_needed(k))
        if not need:
            continue
        out = torch.empty((len(need), sc.block_bytes), dtype=torch.uint8)
        await store.get(g, [hs[i] for i in need], out, request_id=rid)
        for j, i in enumerate(need):
            if not torch.equal(out[j], block_for(hs[i], g, sc.block_bytes)):
                r.mismatches += 1
    r.blocks_restored = k
    r.tokens_restored = k * sc.tokens_per_block


async def run_scenario(sc: Scenario) -> SimulationResult:
    """Write the documents (in another process unless told otherwise), then replay the restores."""
    tmp = None
    if sc.url is None:
        tmp = tempfile.TemporaryDirectory(prefix="tierkv-sim-")
        sc.url = f"file://{tmp.name}"
    try:
        if sc.writer_subprocess:
            await _write_in_subprocess(sc)
        else:
            await write_documents(sc)
        results = [RequestResult(request=i, document=i % sc.documents,
                                 tokens_on_disk=sc.blocks * sc.tokens_per_block)
                   for i in range(sc.requests)]
        steps = 0
        async with TieredStore(sc.store_config()) as store:
            waiting = list(results)
            while waiting and steps < sc.max_steps:
                steps += 1
                still: list[RequestResult] = []
                for r in waiting:
                    hs = _doc_hashes(sc, r.document)
                    pl = store.lookup_prefix(hs, request_id=f"req-{r.request}")
                    if pl.state is Lookup.PENDING:
                        r.steps_waited += 1
                        still.append(r)
                        continue
                    if pl.state is Lookup.HIT:
                        await _restore(store, sc, r, hs, pl.blocks)
                    r.from_scratch = r.blocks_restored == 0
                    store.release(f"req-{r.request}")
                waiting = still
                await store.idle()
            for r in waiting:
                r.from_scratch = True
            lookups = store.stats().lookups
        return SimulationResult(scenario=asdict(sc), requests=results, steps=steps, lookups=lookups)
    finally:
        if tmp is not None:
            tmp.cleanup()
            sc.url = None


def _main_write(params: str) -> None:
    anyio.run(write_documents, Scenario(**json.loads(params)))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--write":
        run_child(lambda: _main_write(sys.argv[2]))
    else:
        sys.exit("usage: python -m tierkv.tools.simulate --write PARAMS_JSON (use `tierkv simulate`)")

"""One node of tests/test_s3_nodes.py: a process with its own TieredStore (its own CPU pool) whose
fsspec tier is shared with other nodes (one S3 bucket, or one local directory).

``python tests/s3_node.py MODE``; the first line on stdin is a JSON spec (credentials stay off the
command line): ``url``, ``storage_options``, ``namespace``, and per mode:

``write`` (``docs``, ``blocks``, ``seed``)
    Write ``docs`` prefixes of ``blocks`` full blocks each, plus the recurrent state at each
    prefix's end; flush; print one JSON line of tier counters.
``restore`` (``docs``, ``blocks``, ``seed``)
    For each prefix another node wrote: ``lookup_prefix`` until the answer settles, then ``get`` the
    blocks and the state it reported; print one JSON line: per document the prefix found and whether
    the bytes are the writer's.
``fill`` (``capacity_bytes``, ``count``, ``batch``, ``seed``)
    Open a store whose tier has ``capacity_bytes``; print ``{"event": "ready"}``; wait for a ``go``
    line; write ``count`` blocks ``batch`` at a time (flushing each); print ``{"event": "written",
    ...}``; stay open (quiet) until a ``quit`` line; close; print ``{"event": "closed", ...}``.

Block bytes derive from their key (``crash_writer.data_of``), so any node can check what it reads.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import anyio
import torch
from crash_writer import FULL, REC, data_of, hash_of, store_layout

from tierkv import BlockMissing, TieredStore
from tierkv.keys import make_key

BB = 4096
RB = 8192


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def config(spec: dict[str, Any], slots: dict[int, int], **tier: Any) -> dict[str, Any]:
    """A cpu primary and the shared fsspec tier (codec none: record sizes are predictable)."""
    return {"layout": store_layout(), "namespace": spec["namespace"], "max_concurrent_requests": 2,
            "tiers": [{"kind": "cpu", "slots": slots},
                      {"kind": "fsspec", "url": spec["url"], "codec": "none",
                       "storage_options": spec.get("storage_options", {}), **tier}]}


def doc_hashes(seed: int, doc: int, blocks: int) -> list[bytes]:
    """The prefix hashes of document ``doc`` of writer ``seed``."""
    return [hash_of(seed * 1000 + doc, i) for i in range(blocks)]


def full_rows(hs: list[bytes]) -> torch.Tensor:
    return torch.stack([data_of(make_key(h, FULL), BB) for h in hs])


def state_row(h: bytes) -> torch.Tensor:
    return data_of(make_key(h, REC), RB)[None]


def _tier_counts(store: TieredStore) -> dict[str, Any]:
    st = store.stats().tiers[1]
    return {"stores": st.stores, "failed": st.stores_failed, "shed": st.stores_shed,
            "used_bytes": st.used_bytes, "backend": st.backend}


async def write(spec: dict[str, Any]) -> None:
    async with TieredStore(config(spec, {FULL: 64, REC: 4})) as store:
        for d in range(spec["docs"]):
            hs = doc_hashes(spec["seed"], d, spec["blocks"])
            await store.put(FULL, hs, full_rows(hs))
            await store.put(REC, hs[-1:], state_row(hs[-1]))
            await store.flush()
        _emit({"event": "written", **_tier_counts(store)})


async def restore_doc(store: TieredStore, hs: list[bytes], rid: str) -> dict[str, Any]:
    """Restore one document as an engine does: ``lookup_prefix`` until the answer settles, then
    ``get`` of the prefix found (its full blocks and the recurrent state at its end). The answers,
    the blocks found, whether their bytes are the writer's, and how long the answer took."""
    answers = []
    t0 = time.monotonic()
    with anyio.fail_after(60):
        while True:
            p = store.lookup_prefix(hs, request_id=rid)
            answers.append([p.blocks, p.state.value])
            if p.state.value != "pending":
                break
            await store.idle()
            await anyio.sleep(0.02)
    n = p.blocks
    result: dict[str, Any] = {"answers": answers, "blocks": n, "equal": None, "state_equal": None,
                              "settle_s": time.monotonic() - t0}
    if n:
        out = torch.zeros((n, BB), dtype=torch.uint8)
        rec = torch.zeros((1, RB), dtype=torch.uint8)
        try:
            await store.get(FULL, hs[:n], out, request_id=rid)
            result["equal"] = bool(torch.equal(out, full_rows(hs[:n])))
            await store.get(REC, hs[n - 1:n], rec, request_id=rid)
            result["state_equal"] = bool(torch.equal(rec, state_row(hs[n - 1])))
        except BlockMissing as exc:
            result["missing"] = exc.missing
    store.release(rid)
    return result


async def restore(spec: dict[str, Any]) -> None:
    async with TieredStore(config(spec, {FULL: 64, REC: 4})) as store:
        docs = [await restore_doc(store, doc_hashes(spec["seed"], d, spec["blocks"]), f"doc-{d}")
                for d in range(spec["docs"])]
        _emit({"event": "restored", "docs": docs, **_tier_counts(store)})


async def fill(spec: dict[str, Any]) -> None:
    cfg = config(spec, {FULL: 8, REC: 1}, capacity_bytes=spec["capacity_bytes"])
    async with TieredStore(cfg) as store:
        _emit({"event": "ready"})
        line = await anyio.to_thread.run_sync(sys.stdin.readline)
        if line.strip() != "go":
            raise SystemExit(f"expected 'go', got {line!r}")
        hs = [hash_of(100 + spec["seed"], i) for i in range(spec["count"])]
        batch = spec["batch"]
        for i in range(0, len(hs), batch):
            await store.put(FULL, hs[i:i + batch], full_rows(hs[i:i + batch]))
            await store.flush()
        _emit({"event": "written", **_tier_counts(store)})
        line = await anyio.to_thread.run_sync(sys.stdin.readline)
        counts = _tier_counts(store)
    _emit({"event": "closed", "last_line": line.strip(), **counts})


def main(argv: list[str]) -> int:
    spec = json.loads(sys.stdin.readline())
    mode = {"write": write, "restore": restore, "fill": fill}[argv[0]]
    anyio.run(mode, spec)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""One node of tests/test_mooncake_nodes.py: a process with its own TieredStore (its own CPU pool)
and a ``mooncake`` tier whose client contributes a segment to the cluster's pool.

``python tests/mooncake_node.py``; the first line on stdin is a JSON spec: ``master``,
``namespace``, ``docs``, ``blocks``, ``seed``. The node writes ``docs`` prefixes of ``blocks`` full
blocks each (seed ``seed``) plus the recurrent state at each prefix's end, flushes and prints
``{"event": "written", ...}``; then, per line ``restore <seed>``, restores that writer's prefixes
(``lookup_prefix`` until the answer settles, then ``get``) and prints ``{"event": "restored",
"docs": [...]}``: per document the answers, the prefix found and whether its bytes are the
writer's. ``write <seed>`` writes the prefixes of another seed (``in_tier``: all of them landed in
Mooncake). ``quit`` closes the store (its segment, and every object in it, leaves the cluster).

Block bytes derive from their key (``crash_writer.data_of``), so any node can check what it reads.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import anyio
from crash_writer import FULL, REC, store_layout
from s3_node import doc_hashes, full_rows, restore_doc, state_row

from tierkv import BackendError, TieredStore
from tierkv.keys import make_key


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def config(spec: dict[str, Any]) -> dict[str, Any]:
    return {"layout": store_layout(), "namespace": spec["namespace"], "max_concurrent_requests": 2,
            "tiers": [{"kind": "cpu", "slots": {FULL: 64, REC: 4}},
                      {"kind": "mooncake", "master": spec["master"], "segment_bytes": 16 << 20,
                       "buffer_bytes": 16 << 20, "health_interval_s": 0.5}]}


def counts(store: TieredStore) -> dict[str, Any]:
    st = store.stats().tiers[1]
    return {"stores": st.stores, "failed": st.stores_failed, "shed": st.stores_shed, "backend": st.backend}


async def restore(store: TieredStore, seed: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
    docs = []
    for d in range(spec["docs"]):
        result = await restore_doc(store, doc_hashes(seed, d, spec["blocks"]), f"r{seed}-{d}")
        result["first"], result["answers"] = result["answers"][0], result["answers"][-3:]
        docs.append(result)
    return docs


async def write(store: TieredStore, seed: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Write the prefixes of ``seed``; whether every block is in the Mooncake tier afterwards."""
    keys = []
    for d in range(spec["docs"]):
        hs = doc_hashes(seed, d, spec["blocks"])
        await store.put(FULL, hs, full_rows(hs))
        await store.put(REC, hs[-1:], state_row(hs[-1]))
        await store.flush()
        keys += [make_key(h, FULL) for h in hs]
    try:
        in_tier = all(await store.tiers[1].contains(FULL, keys))
    except BackendError:
        in_tier = False
    return {"event": "written", "in_tier": in_tier, **counts(store)}


async def node(spec: dict[str, Any]) -> None:
    async with TieredStore(config(spec)) as store:
        _emit(await write(store, spec["seed"], spec))
        while True:
            line = (await anyio.to_thread.run_sync(sys.stdin.readline)).split()
            if not line or line[0] == "quit":
                break
            if line[0] == "write":
                _emit(await write(store, int(line[1]), spec))
                continue
            docs = await restore(store, int(line[1]), spec)
            _emit({"event": "restored", "docs": docs, **counts(store)})
        t0 = time.monotonic()
    _emit({"event": "closed", "close_s": time.monotonic() - t0})


if __name__ == "__main__":
    anyio.run(node, json.loads(sys.stdin.readline()))

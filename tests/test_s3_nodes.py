"""Several nodes (processes, each with its own TieredStore and CPU pool) sharing one fsspec tier:
one SeaweedFS bucket (through each S3 client: obstore, s3fs), or one local directory. The nodes
run ``tests/s3_node.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import test_fsspec_process as process_tests
from crash_writer import FULL, hash_of, store_layout
from s3clients import CLIENTS
from seaweed import seaweed

from tierkv.backends.fsspec._obstore import ENV_CLIENT
from tierkv.keys import make_key
from tierkv.records import encode_record

__all__ = ["seaweed"]  # the fixture, imported for this module

NODE = str(Path(__file__).parent / "s3_node.py")
NS = "nodes"
#: a process's start (python, torch, tierkv imports) on a loaded 2-core machine, and one mode's work
START_S, WORK_S = 120.0, 180.0


@dataclass
class Shared:
    """The tier every node opens: its URL, s3fs options, and the records in it (name -> bytes)."""

    url: str
    storage_options: dict[str, Any]
    records: Callable[[], dict[str, int]]


def _dir_records(root: Path) -> dict[str, int]:
    out = {}
    for p in root.rglob("*.tkv"):
        try:
            out[str(p)] = p.stat().st_size
        except FileNotFoundError:  # evicted while listed
            continue
    return out


@pytest.fixture(params=["file", *(f"s3-{c}" for c in CLIENTS)])
def shared(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Shared:
    if request.param == "file":
        root = tmp_path / "shared"
        root.mkdir()
        return Shared(f"file://{root}", {}, lambda: _dir_records(root))
    monkeypatch.setenv(ENV_CLIENT, request.param.removeprefix("s3-"))  # the nodes inherit it
    server = request.getfixturevalue("seaweed")
    bucket = server.new_bucket()

    def records() -> dict[str, int]:
        return {k: v for k, v in server.objects(bucket, "kv/").items() if k.endswith(".tkv")}

    return Shared(f"s3://{bucket}/kv", server.storage_options(), records)


class Node(process_tests.NodeProcess):
    """One ``s3_node.py`` process in ``mode`` (write, restore, fill)."""

    def __init__(self, mode: str, spec: dict[str, Any], log: Path) -> None:
        super().__init__([NODE, mode], spec, log)


@contextmanager
def nodes(tmp_path: Path, mode: str, specs: list[dict[str, Any]]) -> Iterator[list[Node]]:
    """Start one node per spec (all at once); kill any still running on the way out."""
    started = []
    try:
        for i, spec in enumerate(specs):
            started.append(Node(mode, spec, tmp_path / f"{mode}-{i}.stderr"))
        yield started
    finally:
        for n in started:
            if n.proc.poll() is None:
                n.proc.kill()
                n.proc.wait()


def spec(shared: Shared, **kw: Any) -> dict[str, Any]:
    return {"url": shared.url, "storage_options": shared.storage_options, "namespace": NS, **kw}


# ---- one node writes, others restore -------------------------------------------------------------
DOCS, BLOCKS = 4, 12


@pytest.mark.slow
def test_nodes_restore_identically_the_prefixes_another_node_wrote(shared: Shared, tmp_path: Path) -> None:
    with nodes(tmp_path, "write", [spec(shared, docs=DOCS, blocks=BLOCKS, seed=1)]) as (writer,):
        wrote = writer.event("written", START_S + WORK_S)
        writer.finish()
    assert wrote["stores"] == DOCS * (BLOCKS + 1) and wrote["failed"] == 0 and wrote["shed"] == 0, wrote
    assert len(shared.records()) == DOCS * (BLOCKS + 1)

    # two other nodes at once, each with its own (empty) CPU pool
    with nodes(tmp_path, "restore", [spec(shared, docs=DOCS, blocks=BLOCKS, seed=1)] * 2) as readers:
        results = [r.event("restored", START_S + WORK_S) for r in readers]
        for r in readers:
            r.finish()
    for res in results:
        for d, doc in enumerate(res["docs"]):
            assert doc["answers"][0][1] == "pending", f"doc {d}: a prefix that may be on the tier is " \
                                                      f"PENDING, never MISS: {doc['answers']}"
            assert doc["answers"][-1] == [BLOCKS, "hit"], (d, doc)
            assert doc["equal"] is True and doc["state_equal"] is True, (d, doc)
        assert res["backend"].get("corrupt", 0) == 0 and res["backend"].get("read_errors", 0) == 0, res


# ---- all nodes write at once: the shared tier's capacity -------------------------------------------
NODES = 3
CAPACITY_RECORDS = 60
#: blocks per put (and flush) of a fill node
BATCH = 4
#: once the writers are quiet, the shared tier may exceed ``capacity_bytes`` by at most this many
#: records per node: one batch each, published just before it stopped and not yet seen (counted) by
#: the other nodes
IN_FLIGHT_RECORDS_PER_NODE = BATCH
#: how long the tier may take, once writers are quiet, to get within capacity + margin (a tier-wide
#: bound may act in the background, e.g. after re-listing the shared namespace)
QUIET_S = 10.0
#: the bound must not be met by discarding more than the excess (nodes that ordered records each
#: their own way kept 42-63% on obstore and 83-97% on s3fs; one order for all keeps 100-115%)
MIN_KEPT_FRACTION = 0.8


def _record_len() -> int:
    key = make_key(hash_of(0, 0), FULL)
    return len(encode_record(key=key, fingerprint=store_layout().fingerprint(NS), payload=bytes(4096),
                             codec="none"))


@pytest.mark.slow
def test_nodes_writing_at_once_keep_the_shared_tier_within_capacity(shared: Shared, tmp_path: Path) -> None:
    """3 nodes write 3x the tier's ``capacity_bytes`` between them; once they are quiet the shared
    bucket / directory holds at most ``capacity_bytes`` plus the in-flight margin."""
    record = _record_len()
    capacity = CAPACITY_RECORDS * record
    margin = NODES * IN_FLIGHT_RECORDS_PER_NODE * record
    per_node = 3 * CAPACITY_RECORDS // NODES
    specs = [spec(shared, capacity_bytes=capacity, count=per_node, batch=BATCH, seed=s) for s in range(NODES)]
    with nodes(tmp_path, "fill", specs) as fills:
        for n in fills:
            n.event("ready", START_S)
        for n in fills:
            n.send("go")
        written = [n.event("written", WORK_S) for n in fills]
        for w in written:  # every write itself succeeded: the bound is not met by failing writes
            assert w["stores"] == per_node and w["failed"] == 0 and w["shed"] == 0, w
        deadline = time.monotonic() + QUIET_S
        while True:
            quiet = shared.records()
            if sum(quiet.values()) <= capacity + margin or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        for n in fills:
            n.send("quit")
        closed = [n.event("closed", WORK_S) for n in fills]
        for n in fills:
            n.finish()
    total = sum(quiet.values())
    assert total <= capacity + margin, (
        f"{len(quiet)} records, {total} bytes in the shared tier {QUIET_S:.0f}s after {NODES} nodes wrote "
        f"{NODES * per_node} records ({NODES * per_node * record} bytes, 3x capacity) and went quiet: "
        f"over capacity_bytes={capacity} + in-flight margin {margin} ({IN_FLIGHT_RECORDS_PER_NODE} records "
        f"per node). Each node only bounds the records it knows "
        f"(used_bytes per node: {[c['used_bytes'] for c in closed]}); the tier needs a tier-wide bound.")
    assert total >= MIN_KEPT_FRACTION * capacity, f"only {total} of {capacity} bytes kept"

"""Three nodes (processes, each with its own TieredStore, CPU pool and Mooncake segment) sharing one
Mooncake Store cluster through a real ``mooncake_master``. The nodes run ``tests/mooncake_node.py``.

Mooncake keeps each object in the memory segment of one of the nodes: the nodes stay up while the
others restore, and a node that exits takes its objects with it (misses elsewhere, never wrong
bytes).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import test_fsspec_process as process_tests

from tierkv.testing.mooncake import MooncakeMaster, missing

WHY = missing()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"Mooncake is not usable here: {WHY}")

NODE = str(Path(__file__).parent / "mooncake_node.py")
NODES, DOCS, BLOCKS = 3, 3, 8
#: a process's start (python, torch, tierkv imports) on a loaded 2-core machine, and one step's work
START_S, WORK_S = 120.0, 120.0


class Node(process_tests.NodeProcess):
    """One ``mooncake_node.py`` process: commands on its stdin, JSON events on its stdout."""

    def __init__(self, spec: dict[str, Any], log: Path) -> None:
        super().__init__([NODE], spec, log)

    def restore(self, seed: int) -> list[dict[str, Any]]:
        self.send(f"restore {seed}")
        docs: list[dict[str, Any]] = self.event("restored", WORK_S)["docs"]
        return docs


@contextmanager
def cluster(tmp_path: Path) -> Iterator[tuple[MooncakeMaster, list[Node]]]:
    """A master and three nodes that each wrote their prefixes (seed = node index)."""
    ns = f"nodes-{uuid.uuid4().hex[:8]}"
    with MooncakeMaster(tmp_path, client_ttl_s=2) as master:
        nodes = [Node({"master": master.endpoint, "namespace": ns, "docs": DOCS, "blocks": BLOCKS, "seed": i},
                      tmp_path / f"node-{i}.stderr") for i in range(NODES)]
        try:
            for n in nodes:
                wrote = n.event("written", START_S + WORK_S)
                assert wrote["stores"] == DOCS * (BLOCKS + 1) and wrote["failed"] == 0, wrote
            yield master, nodes
        finally:
            for n in nodes:
                if n.proc.poll() is None:
                    n.proc.kill()
                    n.proc.wait()


@pytest.mark.slow
def test_each_node_restores_another_nodes_prefixes_identically(tmp_path: Path) -> None:
    with cluster(tmp_path) as (_, nodes):
        for i, n in enumerate(nodes):
            other = (i + 1) % NODES
            for d, doc in enumerate(n.restore(other)):
                assert doc["first"][1] == "pending", f"node {i} doc {d}: the tier may hold it: PENDING first"
                assert doc["answers"][-1] == [BLOCKS, "hit"], (i, d, doc)
                assert doc["equal"] is True and doc["state_equal"] is True, (i, d, doc)
        for n in nodes:
            n.send("quit")
            assert n.event("closed", WORK_S)["close_s"] < 30


@pytest.mark.slow
def test_a_killed_nodes_blocks_are_misses_elsewhere_never_wrong_bytes(tmp_path: Path) -> None:
    """Node 0 is SIGKILLed: the objects in its segment are gone. Nodes 1 and 2 restore node 0's
    prefixes at once (before the master drops node 0): each lookup settles within seconds; what is
    served is node 0's bytes; what was in its segment is missing."""
    with cluster(tmp_path) as (_, nodes):
        nodes[0].proc.kill()
        nodes[0].proc.wait()
        served = lost = 0
        for n in nodes[1:]:
            for d, doc in enumerate(n.restore(0)):
                assert doc["settle_s"] < 10, f"a read of a gone node's object costs a transfer timeout " \
                                             f"(about 1 s), not more: {doc}"
                assert doc["equal"] is not False and doc["state_equal"] is not False, (d, doc)
                served += doc["blocks"] if doc["equal"] else 0
                lost += BLOCKS - doc["blocks"] if doc["equal"] or doc["blocks"] == 0 else BLOCKS
        assert lost > 0, "node 0's segment held some of its objects; they must be gone"
        for n in nodes[1:]:
            n.send("quit")
            assert n.event("closed", WORK_S)["close_s"] < 30


@pytest.mark.slow
def test_the_master_killed_and_restarted_under_the_nodes(tmp_path: Path) -> None:
    """The master SIGKILLed and restarted (empty) under three running nodes: none restarts; new
    prefixes written by one node are restored identically by another."""
    with cluster(tmp_path) as (master, nodes):
        master.kill()
        master.restart()
        for seed in range(10, 60):  # until node 0's clients and the store take the tier for up again
            nodes[0].send(f"write {seed}")
            if nodes[0].event("written", WORK_S)["in_tier"]:
                break
            time.sleep(0.5)  # the nodes mount their segments again on their next heartbeat
        else:
            raise AssertionError("node 0 never wrote to the restarted master")
        for n in nodes[1:]:
            for d, doc in enumerate(n.restore(seed)):
                assert doc["answers"][-1] == [BLOCKS, "hit"], (d, doc)
                assert doc["equal"] is True and doc["state_equal"] is True, (d, doc)
        for n in nodes:
            n.send("quit")
            assert n.event("closed", WORK_S)["close_s"] < 30


@pytest.mark.slow
def test_simulate_nodes_on_a_mooncake_cluster(tmp_path: Path) -> None:
    """``tierkv simulate --nodes 3 --url mooncake://HOST:PORT``: every node restores another's
    documents identically; ``--capacity-bytes`` does not apply there, said in one line."""
    with MooncakeMaster(tmp_path) as master:
        url = f"mooncake://{master.endpoint}"
        proc = subprocess.run([sys.executable, "-m", "tierkv.cli", "simulate", "--nodes", "3", "--url", url,
                               "--documents", "2", "--blocks", "6", "--json"],
                              capture_output=True, text=True, timeout=START_S + WORK_S,
                              env=process_tests._env())
        assert proc.returncode == 0, proc.stderr[-3000:]
        report = json.loads(proc.stdout)
        assert report["ok"] and [n["identical"] for n in report["nodes"]] == [12, 12, 12], report
        bad = subprocess.run([sys.executable, "-m", "tierkv.cli", "simulate", "--nodes", "2", "--url", url,
                              "--capacity-bytes", "1000000"], capture_output=True, text=True, timeout=START_S,
                             env=process_tests._env())
        assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
        lines = bad.stderr.strip().splitlines()
        assert len(lines) == 1 and "master bounds the pool" in lines[0], bad.stderr


def test_simulate_on_a_master_that_does_not_answer_fails_in_one_line() -> None:
    """The shared tier is what ``simulate`` exercises: when it never answers, the run fails (exit 2,
    one line naming the endpoint), instead of reporting every node's blocks missing as "ok"."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    proc = subprocess.run([sys.executable, "-m", "tierkv.cli", "simulate", "--nodes", "2", "--url",
                           f"mooncake://127.0.0.1:{port}", "--documents", "1", "--blocks", "2"],
                          capture_output=True, text=True, timeout=START_S + WORK_S, env=process_tests._env())
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "required" in lines[0], proc.stderr

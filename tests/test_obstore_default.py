"""obstore is the default client of ``s3://`` tiers, s3fs the fallback (issue 50).

1. A store whose ``s3://`` tier names no ``s3_client`` sends its requests through obstore (the
   tier's counters say ``client_obstore``); storage options obstore cannot map (an s3fs-only
   option) leave it on s3fs, which then serves the same store.
2. Short processes that use such a store exit cleanly however they end: a normal ``async with``
   exit, a store never closed (``main`` returns), ``sys.exit`` inside the store's context, an
   exception raised inside it, SIGTERM while the store's requests are in flight. obstore's requests
   complete on tokio threads; a process that exits while one of them is inside Python code dies by
   SIGABRT with no message (:mod:`tierkv.backends.fsspec._foreign`), so every way of ending is
   tried many times against a real S3 server (SeaweedFS).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from seaweed import SeaweedServer, seaweed

from tierkv import GroupSpec, Layout, TieredStore
from tierkv.backends.fsspec._config import FsspecTierConfig
from tierkv.backends.fsspec._obstore import ENV_CLIENT

__all__ = ["seaweed"]  # the fixture, imported for this module

BB = 4096
LAYOUT = {"tokens_per_block": 16, "groups": [{"kind": "full", "block_bytes": BB}]}


def _config(url: str, opts: dict[str, Any]) -> dict[str, Any]:
    """A cpu primary and an ``s3://`` tier with no ``s3_client`` setting."""
    return {"layout": Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=BB)]),
            "namespace": "default-client",
            "tiers": [{"kind": "cpu", "slots": {0: 8}},
                      {"kind": "fsspec", "url": url, "storage_options": opts}]}


async def _round_trip(store: TieredStore) -> dict[str, Any]:
    """Store 4 blocks, forget the primary's copies, restore them from S3; the tier's counters."""
    hs = [bytes([i]) * 16 for i in range(4)]
    data = torch.randint(0, 256, (4, BB), dtype=torch.uint8)
    await store.put(0, hs, data)
    await store.flush()
    store.engine.clear()
    out = torch.zeros_like(data)
    await store.get(0, hs, out)
    assert torch.equal(out, data)
    return dict(store.stats().tiers[1].backend)


# ---- 1. the default and the fallback --------------------------------------------------------------
def test_the_setting_defaults_to_auto() -> None:
    assert FsspecTierConfig(url="s3://b/kv").s3_client == "auto"


@pytest.mark.anyio
async def test_an_s3_tier_with_no_client_setting_uses_obstore(seaweed: SeaweedServer,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_CLIENT, raising=False)
    bucket = seaweed.new_bucket()
    async with TieredStore(_config(f"s3://{bucket}/kv", seaweed.storage_options())) as store:
        backend = await _round_trip(store)
        assert type(store.tiers[1]._driver).__name__ == "ObstoreDriver"  # type: ignore[attr-defined]
    assert backend.get("client_obstore") == 1 and "client_s3fs" not in backend, backend
    assert backend.get("read_errors", 0) == 0 and backend.get("write_errors", 0) == 0, backend


#: storage options s3fs takes and obstore cannot map: ``open_obstore`` leaves such a tier on s3fs
UNMAPPED = {
    "s3_additional_kwargs": {"s3_additional_kwargs": {}},
    "config_kwargs user_agent_extra": {"config_kwargs": {"user_agent_extra": "tierkv-test"}},
}


@pytest.mark.anyio
@pytest.mark.parametrize("extra", list(UNMAPPED.values()), ids=list(UNMAPPED))
async def test_options_obstore_cannot_map_fall_back_to_s3fs(seaweed: SeaweedServer, extra: dict[str, Any],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_CLIENT, raising=False)
    bucket = seaweed.new_bucket()
    async with TieredStore(_config(f"s3://{bucket}/kv", seaweed.storage_options(**extra))) as store:
        backend = await _round_trip(store)
    assert backend.get("client_s3fs") == 1 and "client_obstore" not in backend, backend
    assert backend.get("read_errors", 0) == 0 and backend.get("write_errors", 0) == 0, backend


# ---- 2. short processes exit cleanly, whichever way they end ---------------------------------------
_CHILD = r'''
import json, os, sys, time
import anyio, torch
from tierkv import TieredStore

MODE, cfg = sys.argv[1], json.loads(sys.argv[2])
BB = cfg["layout"]["groups"][0]["block_bytes"]


def ending():
    print(f"ending {time.time()}", flush=True)


async def work(store, seed):
    hs = [os.urandom(16) for _ in range(4)]
    data = torch.randint(0, 256, (4, BB), dtype=torch.uint8)
    await store.put(0, hs, data)
    await store.flush()
    store.engine.clear()
    out = torch.zeros_like(data)
    await store.get(0, hs, out)
    assert torch.equal(out, data)
    assert store.stats().tiers[1].backend.get("client_obstore") == 1
    # more puts, not flushed: their cascade to S3 is in flight when the process ends
    await store.put(0, [os.urandom(16) for _ in range(4)], data)


async def main():
    if MODE == "never_closed":
        store = TieredStore(cfg)
        await store.open()
        await work(store, 0)
        ending()
        return
    async with TieredStore(cfg) as store:
        await work(store, 0)
        if MODE == "sigterm":
            print("ready", flush=True)
            while True:  # stores and restores until the parent's SIGTERM
                await work(store, 1)
        ending()
        if MODE == "sys_exit":
            sys.exit(3)
        if MODE == "raise":
            raise RuntimeError("deliberate failure inside the store")


anyio.run(main)
'''

#: how each way of ending should end: the exit status a user expects, and for ``raise`` the one
#: traceback Python prints for an uncaught exception (theirs, unchained, once)
MODES = {"with": 0, "never_closed": 0, "sys_exit": 3, "raise": 1, "sigterm": -signal.SIGTERM}
#: what a process whose store was never closed may say as it exits, and nothing else: the store's
#: background loop (a daemon thread) stops with the interpreter, and a cascade it had scheduled for
#: the blocks put last but not yet started is a coroutine never awaited (those blocks were never
#: written to S3: nobody closed the store, which would have waited for them)
NEVER_AWAITED = re.compile(r"^(sys:1: RuntimeWarning: coroutine '[\w.<>]+' was never awaited"
                           r"|RuntimeWarning: Enable tracemalloc to get the object allocation traceback)$")
#: a child that does not exit this long after its work is done (or after SIGTERM) hangs: closing
#: waits at most a few seconds for obstore's requests (``_foreign.WAIT_S`` + ``SETTLE_S``); the rest
#: is the interpreter's teardown (torch), 0.2 s on an idle machine, up to 11 s on 2 CPU cores
#: running 9 processes' worth of work
PROMPT_S = 20.0
#: children per way of ending: 5 x 2 = 10 processes, about 60 s on 2 busy CPU cores (each child
#: imports torch and tierkv, opens a store, stores and restores: about 3 s of CPU);
#: ``TIERKV_EXIT_CHILDREN_PER_MODE=20`` runs 100
PER_MODE = int(os.environ.get("TIERKV_EXIT_CHILDREN_PER_MODE", "2"))
#: children run at once
PARALLEL = 3


def _child(script: Path, mode: str, cfg: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.Popen([sys.executable, str(script), mode, json.dumps(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    signalled = None
    if mode == "sigterm":
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "ready": its first round trip is done, the next one running
        if line.strip() == "ready":
            time.sleep(random.uniform(0.0, 0.3))  # somewhere in a store or a restore
            signalled = time.time()
            proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=60 + PROMPT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return {"mode": mode, "rc": "hung", "out": out, "err": err, "late_s": None}
    ended = time.time()
    marks = [float(x.split()[1]) for x in out.splitlines() if x.startswith("ending ")]
    start = signalled if mode == "sigterm" else (marks[0] if marks else None)
    return {"mode": mode, "rc": proc.returncode, "out": out, "err": err,
            "late_s": None if start is None else ended - start}


def _problems(r: dict[str, Any]) -> list[str]:
    mode, err = r["mode"], r["err"]
    found = []
    if r["rc"] != MODES[mode]:
        found.append(f"exit status {r['rc']}, expected {MODES[mode]}")
    if r["late_s"] is None:
        found.append("never reached its end (no 'ending' line, or no SIGTERM sent)")
    elif r["late_s"] > PROMPT_S:
        found.append(f"exited {r['late_s']:.1f} s after its end")
    if mode == "raise":
        # the user's exception, as Python prints any uncaught one: one traceback, its last line
        # the exception, nothing chained to it (no error from closing the store), nothing else
        lines = err.strip().splitlines()
        if err.count("Traceback (most recent call last)") != 1 or not err.startswith("Traceback") \
                or lines[-1] != "RuntimeError: deliberate failure inside the store" \
                or "During handling" in err or "direct cause" in err:
            found.append("not exactly the one traceback of the raised exception")
    elif [line for line in err.splitlines() if not (mode == "never_closed" and NEVER_AWAITED.search(line))]:
        found.append("wrote to stderr")
    return found


@pytest.mark.slow
def test_short_processes_on_obstore_exit_cleanly_however_they_end(seaweed: SeaweedServer, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_CLIENT, raising=False)
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = {k: v for k, v in os.environ.items() if k != ENV_CLIENT}
    jobs = []
    for i in range(PER_MODE):
        for mode in MODES:
            url = f"s3://{seaweed.new_bucket('exit')}/kv{i}"
            cfg = {"layout": LAYOUT, "namespace": "exit", "tiers": [
                {"kind": "cpu", "slots": {"0": 16}},
                {"kind": "fsspec", "url": url, "storage_options": seaweed.storage_options()}]}
            jobs.append((mode, cfg))
    random.Random(50).shuffle(jobs)
    with ThreadPoolExecutor(PARALLEL) as pool:
        results = list(pool.map(lambda j: _child(script, j[0], j[1], env), jobs))
    bad = [(r, p) for r in results if (p := _problems(r))]
    summary = Counter((r["mode"], r["rc"]) for r in results)
    detail = "\n".join(f"{r['mode']}: {'; '.join(p)}\n  stderr: {r['err'][-1500:]!r}" for r, p in bad[:5])
    assert not bad, f"{len(bad)} of {len(results)} children did not end cleanly ({dict(summary)}):\n{detail}"
    assert len(results) == PER_MODE * len(MODES)

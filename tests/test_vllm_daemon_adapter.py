"""The vLLM adapter through the tierkv daemon, against vLLM's own types (no engine): two engines'
managers and workers share the daemon's pool, and a load prepared before the daemon was killed
still copies the bytes its lookups pinned, never another block's."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_daemon import Daemon

base = pytest.importorskip("vllm.v1.kv_offload.base")  # installed by `scripts/dev test` where there is no GPU

from tests.test_vllm_adapter import Engine, ctx, key, offloading_config  # noqa: E402
from tierkv.errors import ConfigError  # noqa: E402

LookupResult = base.LookupResult


class DaemonEngine(Engine):
    """An engine whose kv_connector_extra_config names the daemon (no pool or tiers of its own)."""

    def __init__(self, tmp_path: Path, sock: str, engine: str, events: bool = False) -> None:
        os.makedirs(tmp_path / "shm", exist_ok=True)
        cfg = offloading_config(tmp_path, [(0, 16)], {}, engine)
        extra = {"daemon": sock, "shm_dir": str(tmp_path / "shm"), "manifest_timeout_s": 5.0,
                 "max_pending_s": 2.0}
        self.cfg = dataclasses.replace(cfg, extra_config=extra, enable_kv_cache_events=events)
        from tests.test_vllm_adapter import kv_caches
        from tierkv.adapters.vllm import TierKVOffloadingSpec

        self.caches, self.gpu = kv_caches(1)
        self.worker = TierKVOffloadingSpec(self.cfg).get_worker(self.caches)
        self.spec = TierKVOffloadingSpec(self.cfg)
        self.manager = self.spec.get_manager()
        self.job = 0


@pytest.fixture
def daemon(tmp_path: Path) -> Any:
    d = Daemon(tmp_path, cpu_bytes_to_use=256 << 10, shm_dir=str(tmp_path),
               tiers=[{"kind": "fsspec", "url": f"file://{tmp_path / 'tier'}"}]).start()
    yield d
    rc, err = d.stop()
    assert rc == 0, err


def test_two_engines_share_blocks_through_the_daemon_and_a_killed_daemon_never_serves_wrong_bytes(
        daemon: Daemon, tmp_path: Path) -> None:
    a = DaemonEngine(tmp_path / "a", daemon.socket, "engine-a")
    b = DaemonEngine(tmp_path / "b", daemon.socket, "engine-b")
    try:
        keys = [key(i, 0) for i in range(4)]
        want = a.gpu[[1, 2, 3, 4]].clone()
        out = a.store(keys, [1, 2, 3, 4], [4], ctx("r1"))
        assert out.keys_to_store == keys and out.store_spec.pool, "a daemon's slots name their pool"
        a.manager.store.stats()  # a round trip on a's connection: its commit (not answered) is done

        # engine b (another manager and worker): the blocks are HIT in the daemon's pool
        assert [b.manager.lookup(k, ctx("r2")) for k in keys] == [LookupResult.HIT] * 4
        b.load(keys, [10, 11, 12, 13], [4], ctx("r2"))
        assert torch.equal(b.gpu[[10, 11, 12, 13]], want)
        b.manager.on_request_finished(ctx("r2"))
        deadline = time.monotonic() + 60
        while len(list((tmp_path / "tier").rglob("*.tkv"))) < 4:  # the daemon wrote them down
            assert time.monotonic() < deadline, "the daemon never wrote the blocks to its file tier"
            time.sleep(0.05)

        # looked up (pinned) and then the daemon is killed before the load is prepared: the load
        # still copies what was pinned, from the pool those slots belong to
        assert [b.manager.lookup(k, ctx("r3")) for k in keys] == [LookupResult.HIT] * 4
        assert daemon.proc is not None
        daemon.proc.kill()
        daemon.proc.wait()
        daemon.start()  # a new pool file; the old one's rows are no one's now
        others = [key(i, 0) for i in range(10, 14)]
        deadline = time.monotonic() + 30
        while (new := a.store(others, [5, 6, 7, 8], [4], ctx("r4"))) is None:  # until a reattaches
            assert time.monotonic() < deadline, "the manager never reattached"
            time.sleep(0.05)
        assert new.store_spec.pool != out.store_spec.pool  # the new pool's rows: other blocks now
        spec = b.manager.prepare_load(keys, ctx("r3"))
        assert spec.pool == out.store_spec.pool
        b.job += 1
        assert b.worker.submit_load(b.job, spec, base.GPULoadStoreSpec([20, 21, 22, 23], [4], [0]))
        b.worker.wait({b.job})
        assert [r.success for r in b.worker.get_finished()] == [True]
        assert torch.equal(b.gpu[[20, 21, 22, 23]], want), "a load prepared before the restart"
        b.manager.complete_load(keys, ctx("r3"))

        # the restarted daemon's blocks come back from its file tier, the same bytes
        deadline = time.monotonic() + 30
        while [b.manager.lookup(k, ctx("r5")) for k in keys] != [LookupResult.HIT] * 4:
            assert time.monotonic() < deadline, "the restarted daemon never promoted the blocks"
            time.sleep(0.05)
        b.load(keys, [30, 31, 32, 33], [4], ctx("r5"))
        assert torch.equal(b.gpu[[30, 31, 32, 33]], want)
    finally:
        a.close()
        b.close()


def test_an_engine_whose_daemon_is_not_there_serves_on_with_misses(tmp_path: Path) -> None:
    """The daemon not started (or gone): the engine starts, every lookup is MISS, stores are
    skipped (prepare_store None: vLLM keeps the blocks on the GPU), nothing raises or hangs."""
    e = DaemonEngine(tmp_path, str(tmp_path / "nobody.sock"), "engine-c")
    try:
        keys = [key(i, 0) for i in range(3)]
        t0 = time.monotonic()
        assert [e.manager.lookup(k, ctx("r1")) for k in keys] == [LookupResult.MISS] * 3
        assert e.manager.prepare_store(keys, ctx("r1")) is None
        e.manager.on_request_finished(ctx("r1"))
        e.manager.get_stats()  # vLLM asks after every step: it must not raise
        assert time.monotonic() - t0 < 5
    finally:
        e.close()


def test_kv_cache_events_through_the_daemon_report_its_pool_and_tiers(daemon: Daemon, tmp_path: Path) -> None:
    """With vLLM's KV cache events on, an engine on the daemon reports the blocks it stores, every
    block that leaves the daemon's pool (whichever engine's store pushed it out: the pool is
    theirs together), the daemon's file tier as local storage, and, after a daemon restart, its
    blocks that were in the lost pool as removed."""
    a = DaemonEngine(tmp_path / "a", daemon.socket, "engine-a", events=True)
    b = DaemonEngine(tmp_path / "b", daemon.socket, "engine-b")
    cpu, storage = base.Medium.CPU, base.Medium.STORAGE
    seen: dict[tuple[Any, bool], list[bytes]] = {}

    def take() -> None:
        for ev in a.manager.take_events():
            if ev.medium is storage:
                assert ev.locality is base.Locality.LOCAL
            seen.setdefault((ev.medium, ev.removed), []).extend(bytes(k) for k in ev.keys)

    try:
        mine = [key(i, 0) for i in range(4)]
        a.store(mine, [1, 2, 3, 4], [4], ctx("a1"))
        evicted: list[bytes] = []
        for r in range(64):  # engine b stores until a's blocks are all pushed out
            theirs = [key(100 + 4 * r + i, 0) for i in range(4)]
            out = b.store(theirs, [5, 6, 7, 8], [4], ctx(f"b{r}"))
            if out is not None:
                evicted += [bytes(k) for k in out.evicted_keys]
            if set(mine) <= set(evicted):
                break
            time.sleep(0.05)  # the daemon writes blocks down before they may go
        assert set(mine) <= set(evicted)
        deadline = time.monotonic() + 30
        while sorted(seen.get((cpu, True), [])) != sorted(evicted):
            assert time.monotonic() < deadline, (len(seen.get((cpu, True), [])), len(evicted))
            time.sleep(0.05)
            take()
        assert seen[(cpu, False)] == mine
        while not set(mine) <= set(seen.get((storage, False), [])):
            assert time.monotonic() < deadline, "the daemon's tier writes were never reported"
            take()
            time.sleep(0.05)

        again = [key(i, 0) for i in range(200, 202)]
        a.store(again, [5, 6], [2], ctx("a2"))
        assert daemon.proc is not None
        daemon.proc.kill()
        daemon.proc.wait()
        daemon.start()
        while not set(again) <= set(seen[(cpu, True)]):
            assert time.monotonic() < deadline, "the blocks lost with the daemon's pool were never reported"
            take()
            time.sleep(0.05)
    finally:
        a.close()
        b.close()


def test_a_daemon_engine_refuses_tiers_of_its_own_in_one_clear_error(tmp_path: Path) -> None:
    from tierkv.adapters.vllm import TierKVOffloadingSpec

    cfg = offloading_config(tmp_path, [(0, 16)], {"daemon": "/nonexistent.sock"}, "engine-x")
    with pytest.raises(ConfigError, match="the lower tiers are the daemon's"):
        TierKVOffloadingSpec(cfg)
    no_pool = dataclasses.replace(cfg, extra_config={}, enable_kv_cache_events=False)
    with pytest.raises(ConfigError, match="cpu_bytes_to_use is required"):
        TierKVOffloadingSpec(no_pool)


def test_a_prefix_lookup_through_the_daemon_asks_ahead_in_one_message_and_stops_at_a_miss(
        daemon: Daemon, tmp_path: Path) -> None:
    """vLLM looks a prefix up one key at a time; through the daemon each would be a message. The
    keys vLLM will ask next (their positions, which its scheduler records in the request context)
    go with the first: one message answers them, up to the first MISS, and the load reads the
    right rows."""
    a = DaemonEngine(tmp_path / "a", daemon.socket, "engine-a")
    b = DaemonEngine(tmp_path / "b", daemon.socket, "engine-b")
    try:
        keys = [key(i, 0) for i in range(12)]
        stored = [k for i, k in enumerate(keys) if i != 8]  # the prefix breaks at key 8
        a.store(stored[:4], [1, 2, 3, 4], [4], ctx("w1"))
        a.store(stored[4:8], [5, 6, 7, 8], [4], ctx("w2"))
        a.store(stored[8:], [9, 10, 11], [3], ctx("w3"))
        a.manager.store.stats()  # a round trip on a's connection: its commits (not answered) are done
        want = a.gpu[[1, 2, 3, 4, 5, 6, 7, 8]].clone()

        c = ctx("r")
        for i, k in enumerate(keys):  # as vLLM's scheduler does before its lookups
            c.set_offload_key_position(k, (i + 1) * 16)
        link = b.manager.engine._link  # type: ignore[attr-defined]
        answers: list[dict[str, Any]] = []
        call = link.call

        def counted(msg: dict[str, Any], **kw: Any) -> Any:
            got = call(msg, **kw)
            if msg.get("op") == "state":
                answers.append(got[0])
            return got
        link.call = counted

        def scan() -> list[Any]:  # vLLM's maximal prefix lookup: on until the first MISS
            results = []
            for k in keys:
                results.append(b.manager.lookup(k, c))
                if results[-1] is LookupResult.MISS:
                    break
            return results

        # key 8 is in no pool: the daemon looks for it in its file tier (RETRY) and vLLM scans on
        assert scan() == [LookupResult.HIT] * 8 + [LookupResult.RETRY] + [LookupResult.HIT] * 3
        assert len(answers) == 1 and len(answers[0]["k"]) == 12, "one message for the whole prefix"
        deadline = time.monotonic() + 30
        while (again := scan()) != [LookupResult.HIT] * 8 + [LookupResult.MISS]:  # vLLM's next steps
            assert time.monotonic() < deadline, again
            time.sleep(0.05)
        assert len(answers[-1]["k"]) == 9, "nothing asked (or pinned) past the first MISS"
        b.load(keys[:8], [20, 21, 22, 23, 24, 25, 26, 27], [8], c)
        assert torch.equal(b.gpu[20:28], want)
        b.manager.on_request_finished(c)
    finally:
        a.close()
        b.close()

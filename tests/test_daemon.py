"""The tierkv daemon (``tierkv serve``) with real daemon and client processes: stores of one
namespace and layout share blocks across processes, other namespaces never see them, bad clients
are disconnected while others are served, a killed client's pins and half-done puts go, a killed
daemon costs lookups nothing but a MISS, and a restarted one serves the lower tier's data again."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import FULL, REC, SW, blocks, hashes, hybrid_layout
from tierkv import BlockMissing, GroupSpec, InvalidArgument, Layout, Lookup, TieredStore
from tierkv.daemon.protocol import MAX_MESSAGE, encode, recv_message

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
SMALL = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=4096)])
#: 1 MiB of these is 8 slots: a pool a few puts fill
BIG = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=131072)])
BIG_SLOTS = 8


class Daemon:
    """A ``tierkv serve`` process on a temporary socket."""

    def __init__(self, tmp: Path, **settings: Any) -> None:
        self.socket = str(tmp / "d.sock")
        self.config = tmp / "daemon.json"
        self.config.write_text(json.dumps({"cpu_bytes_to_use": 1 << 20, "shm_dir": str(tmp), **settings}))
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> Daemon:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tierkv.cli", "serve", "--config", str(self.config),
             "--socket", self.socket], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        assert self.proc.stderr is not None
        line = self.proc.stderr.readline()  # torch's import: slow on a busy machine
        assert "serving on" in line, line + self.proc.stderr.read()
        return self

    def store(self, layout: Layout = SMALL, namespace: str = "", **kw: Any) -> TieredStore:
        return TieredStore({"layout": layout, "namespace": namespace, "daemon": self.socket,
                            "max_pending_s": 2.0, **kw})

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> tuple[int, str]:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            _, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            pytest.fail("the daemon did not stop on SIGTERM")
        return self.proc.returncode, err


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("daemon"), namespaces=["", "a", "b"], drop_grace_s=1.0).start()
    yield d
    rc, err = d.stop()
    assert rc == 0, err
    assert not os.path.exists(d.socket), "the socket file outlived the daemon"
    assert not list(Path(d.config).parent.glob("tierkv-daemon-*")), "a pool file outlived the daemon"


#: a client in a process of its own: puts blocks, optionally pins them for a request, then waits
CLIENT = """
import sys, time, anyio, torch
from tierkv import TieredStore, Layout
from tests.helpers import FULL, REC, SW, blocks, hashes, hybrid_layout
sock, layout, n, doc, pin = sys.argv[1], Layout.model_validate_json(sys.argv[2]), *map(int, sys.argv[3:6])
async def main():
    async with TieredStore({"layout": layout, "daemon": sock}) as s:
        hs = hashes(n, doc)
        await s.put(0, hs, blocks(n, layout.groups[0].block_bytes, seed=doc))
        if pin:
            assert len(set(s.lookup(0, hs, request_id="r"))) == 1
        print(s.stats().put_blocks_dropped, flush=True)
        if pin:
            time.sleep(600)
anyio.run(main)
"""


def client(d: Daemon, layout: Layout, n: int, doc: int, pin: bool = False) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", CLIENT, d.socket, layout.model_dump_json(), str(n),
                             str(doc), str(int(pin))], env=ENV, cwd=ROOT, stdout=subprocess.PIPE, text=True)


def raw(d: Daemon) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(d.socket)
    return s


def hello(namespace: str = "", layout: Layout = SMALL) -> dict[str, Any]:
    return {"op": "hello", "version": 1, "namespace": namespace, "layout": layout.model_dump(mode="json")}


def refused(s: socket.socket) -> str:
    """The error the daemon answered, after which it hung up."""
    answer = recv_message(s)
    assert answer.get("fatal") is True, answer
    try:
        assert s.recv(1) == b"", "the daemon kept the connection open"
    except ConnectionResetError:  # closed with our bytes unread: hung up all the same
        pass
    s.close()
    return str(answer["error"])


async def test_two_processes_share_a_block_through_the_daemons_pool(daemon: Daemon) -> None:
    proc = client(daemon, SMALL, 6, doc=1)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and out.strip() == "0"
    async with daemon.store() as store:
        hs = hashes(6, 1)
        assert store.lookup(0, hs) == [Lookup.HIT] * 6  # in the daemon's pool: no tier is below it
        assert store.lookup_prefix(hs).blocks == 6
        got = torch.zeros(6, 4096, dtype=torch.uint8)
        hits = store.stats().tiers[0].hits
        await store.get(0, hs, got)
        assert torch.equal(got, blocks(6, 4096, seed=1))
        pool = store.stats().tiers[0]
        assert pool.kind == "cpu" and len(store.stats().tiers) == 1
        assert pool.hits == hits + 6, "a get reads the pool, counted as in-process"


async def test_stores_of_other_namespaces_never_see_the_blocks(daemon: Daemon) -> None:
    hs = hashes(3, 2)
    async with daemon.store(namespace="a") as a, daemon.store(namespace="b") as b:
        await a.put(0, hs, blocks(3, 4096, seed=2))
        assert a.lookup(0, hs) == [Lookup.HIT] * 3
        assert b.lookup(0, hs) == [Lookup.MISS] * 3
        with pytest.raises(BlockMissing):
            await b.get(0, hs, torch.zeros(3, 4096, dtype=torch.uint8))
    with pytest.raises(InvalidArgument, match="not served"):
        async with daemon.store(namespace="c"):
            pass


async def test_bad_clients_are_answered_and_disconnected_while_others_are_served(daemon: Daemon) -> None:
    hs = hashes(2, 3)
    async with daemon.store() as good:
        await good.put(0, hs, blocks(2, 4096, seed=3))
        s = raw(daemon)
        s.sendall(struct.pack(">I", 5) + b"hello")
        assert "not valid JSON" in refused(s)
        s = raw(daemon)
        s.sendall(b"GET / HTTP/1.1\r\n\r\n")
        assert "over the" in refused(s)
        s = raw(daemon)
        s.sendall(struct.pack(">I", MAX_MESSAGE + 1))
        assert "over the" in refused(s)
        s = raw(daemon)
        s.sendall(encode(hello("intruder")))
        assert "not served" in refused(s)
        s = raw(daemon)
        s.sendall(encode({"op": "lookup", "g": 0, "h": []}))
        assert "hello first" in refused(s)
        s = raw(daemon)
        s.sendall(encode(hello()) + encode({"op": "lookup", "g": "zero", "h": ["00"]}))
        assert "pools" in recv_message(s)
        assert "g (the group)" in refused(s)
        s = raw(daemon)
        s.sendall(b"\x00\x00\x00")  # half a header, then gone
        s.close()
        assert daemon.alive()
        assert good.lookup(0, hs) == [Lookup.HIT] * 2
        with pytest.raises(InvalidArgument):  # a call the store refuses: an error, and the store goes on
            good.lookup(7, hs)
        assert good.lookup(0, hs) == [Lookup.HIT] * 2


async def test_a_killed_clients_pins_and_half_done_puts_are_dropped(daemon: Daemon) -> None:
    old, new = hashes(BIG_SLOTS, 4), hashes(BIG_SLOTS, 5)
    holder = client(daemon, BIG, BIG_SLOTS, doc=4, pin=True)
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "0"  # every slot holds one of its blocks, pinned
    async with daemon.store(BIG) as store:
        data = blocks(BIG_SLOTS, 131072, seed=5)
        dropped = store.stats().put_blocks_dropped
        await store.put(0, new, data)
        assert store.stats().put_blocks_dropped == dropped + BIG_SLOTS  # nothing evictable while pinned
        holder.kill()
        holder.wait()
        deadline = time.monotonic() + 30
        while store.lookup(0, old[:1]) != [Lookup.HIT] or store.stats().requests_active:
            assert time.monotonic() < deadline, "the killed client's request outlived it"
            time.sleep(0.02)
        await store.put(0, new, data)
        assert store.lookup(0, new) == [Lookup.HIT] * BIG_SLOTS  # the old blocks were evicted
        got = torch.zeros_like(data)
        await store.get(0, new, got)
        assert torch.equal(got, data)

        # a put reserved and never committed (its client went away mid-copy) is never visible
        half = hashes(2, 6)
        s = raw(daemon)
        s.sendall(encode(hello(layout=BIG)))
        recv_message(s)
        s.sendall(encode({"op": "reserve", "g": 0, "h": [h.hex() for h in half]}))
        assert all(slot is not None for slot in recv_message(s)["slots"])
        assert store.lookup(0, half) == [Lookup.PENDING] * 2
        s.close()
        deadline = time.monotonic() + 30
        while store.lookup(0, half) != [Lookup.MISS] * 2:
            assert time.monotonic() < deadline, "a half-done put stayed in the pool"
            time.sleep(0.02)
        await store.put(0, half, data[:2])
        assert store.lookup(0, half) == [Lookup.HIT] * 2


@pytest.mark.parametrize("per", [1, 2], ids=["blocks", "records-of-2"])
async def test_a_put_that_finds_no_room_in_the_pool_is_written_to_the_lower_tier(tmp_path: Path,
                                                                                per: int) -> None:
    """As in-process: blocks that find no free or evictable slot go to the lower tiers (copied
    through the daemon's staging file, never the socket); without staging they are dropped, counted
    (records, with several blocks to one)."""
    layout = BIG if per == 1 else Layout(tokens_per_block=8, blocks_per_record=per,
                                         groups=[GroupSpec(kind="full", block_bytes=131072 // per)])
    n = BIG_SLOTS * per  # blocks that fill the pool's 8 slots
    for staging, direct in ((64 << 20, BIG_SLOTS), (0, 0)):
        (tmp_path / str(staging)).mkdir()
        d = Daemon(tmp_path / str(staging), staging_bytes=staging,
                   tiers=[{"kind": "fsspec", "url": f"file://{tmp_path}/tier{staging}"}]).start()
        try:
            holder = client(d, layout, n, doc=4, pin=True)
            assert holder.stdout is not None
            assert holder.stdout.readline().strip() == "0"  # every slot pinned
            async with d.store(layout) as store:
                data, new = blocks(n, 131072 // per, seed=5), hashes(n, 5)
                await store.put(0, new, data)
                st = store.stats()
                assert st.put_blocks_direct == direct and st.put_blocks_dropped == BIG_SLOTS - direct
                holder.kill()
                holder.wait()
                if direct:
                    await store.flush()
                    deadline = time.monotonic() + 30
                    while store.lookup(0, new, request_id="r") != [Lookup.HIT] * n:
                        assert time.monotonic() < deadline, "the blocks never came back from the tier"
                        time.sleep(0.05)
                    got = torch.zeros_like(data)
                    await store.get(0, new, got, request_id="r")
                    assert torch.equal(got, data)
        finally:
            rc, err = d.stop()
        assert rc == 0, err


async def test_the_daemon_serves_its_stores_metrics_and_tells_its_clients_where(tmp_path: Path) -> None:
    import urllib.request

    d = Daemon(tmp_path, metrics_port=0).start()
    try:
        async with d.store(SMALL, namespace="m") as store:
            await store.put(0, hashes(3, 1), blocks(3, 4096, seed=1))
            url = store.metrics_url
            assert url is not None and url.startswith("http://127.0.0.1:")
            with urllib.request.urlopen(url, timeout=30) as r:
                text = r.read().decode()
            ready = [x for x in text.splitlines() if x.startswith("tierkv_pool_ready{")]
            assert ready and sum(float(x.split()[-1]) for x in ready) == 3, text[-2000:]
    finally:
        rc, err = d.stop()
    assert rc == 0, err


async def test_an_old_pool_stays_mapped_for_loads_prepared_before_a_restart_then_is_freed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a daemon restart the old pool stays readable in the client (a load prepared from
    earlier lookups reads it), and is let go RETIRE_S later: its pages do not stay pinned."""
    from tierkv.daemon import link

    d = Daemon(tmp_path).start()
    try:
        async with d.store(SMALL) as store:
            store.lookup(0, hashes(1, 1))
            old = store.engine.pool_of("nobody")
            assert old and link.mapped_pools(old) is not None
            assert d.proc is not None
            d.proc.kill()
            d.proc.wait()
            d.start()
            deadline = time.monotonic() + 30
            while store.engine.pool_of("nobody") in ("", old):
                assert time.monotonic() < deadline, "the store never reattached"
                store.lookup(0, hashes(1, 1))
                time.sleep(0.05)
            assert link.mapped_pools(old) is not None, "a load prepared before the restart reads it"
            monkeypatch.setattr(link, "RETIRE_S", 0.5)
            time.sleep(0.6)
            assert link.mapped_pools(old) is None, "the old pool outlived its retirement"
            assert link.mapped_pools(store.engine.pool_of("nobody")) is not None
    finally:
        rc, err = d.stop()
    assert rc == 0, err


async def test_slots_answered_on_one_connection_are_never_used_with_anothers_rows(daemon: Daemon) -> None:
    """A reconnection between a call and the use of its slots (another thread's call, a daemon
    restart): the call's connection is no longer attached, so its slots are not used at all."""
    async with daemon.store(SMALL) as store:
        link = store._link  # type: ignore[attr-defined]
        _, first = link.call({"op": "ping"})
        assert link.attached(first) is not None and link.attached(first).pools
        link.close()
        link.closed = False
        time.sleep(0.06)  # past the reconnection back-off
        _, second = link.call({"op": "ping"})
        assert second != first
        assert link.attached(first) is None, "an old connection's slots would land in the new rows"
        assert link.attached(second) is not None


async def test_a_dropped_connections_slots_go_to_no_one_else_within_the_grace(tmp_path: Path) -> None:
    """A client whose connection broke (a call that timed out) may still be copying into the rows
    it reserved: they are handed to no one else for ``drop_grace_s``, then freed."""
    d = Daemon(tmp_path, drop_grace_s=3.0).start()
    try:
        async with d.store(BIG) as store:
            s = raw(d)
            s.sendall(encode(hello(layout=BIG)))
            recv_message(s)
            s.sendall(encode({"op": "reserve", "g": 0, "h": [h.hex() for h in hashes(BIG_SLOTS, 1)]}))
            assert None not in recv_message(s)["slots"]
            s.close()
            time.sleep(0.5)  # the daemon has seen the connection go
            data, mine = blocks(BIG_SLOTS, 131072, seed=2), hashes(BIG_SLOTS, 2)
            dropped = store.stats().put_blocks_dropped
            await store.put(0, mine, data)
            assert store.stats().put_blocks_dropped == dropped + BIG_SLOTS, "rows handed out in the grace"
            deadline = time.monotonic() + 30
            while store.lookup(0, hashes(1, 1)) != [Lookup.MISS]:
                assert time.monotonic() < deadline, "the reserved rows were never freed"
                time.sleep(0.05)
            await store.put(0, mine, data)
            assert store.lookup(0, mine) == [Lookup.HIT] * BIG_SLOTS
    finally:
        rc, err = d.stop()
    assert rc == 0, err


async def test_the_socket_and_the_pool_are_owner_only_by_default_and_ctrl_c_stops_cleanly(
        daemon: Daemon, tmp_path: Path) -> None:
    assert stat.S_IMODE(os.stat(daemon.socket).st_mode) == 0o600
    async with daemon.store():  # its pool file exists
        pass
    pools = list(Path(daemon.config).parent.glob("tierkv-daemon-*"))
    assert pools and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in pools)
    wide = Daemon(tmp_path, socket_mode="0660").start()
    try:
        assert stat.S_IMODE(os.stat(wide.socket).st_mode) == 0o660
    finally:
        assert wide.proc is not None
        wide.proc.send_signal(signal.SIGINT)  # Ctrl-C: a clean stop too
        rc, err = wide.stop()
    assert rc == 0, err
    assert not os.path.exists(wide.socket)


async def test_a_killed_daemon_costs_a_miss_and_a_restarted_one_serves_the_lower_tier(tmp_path: Path) -> None:
    d = Daemon(tmp_path, tiers=[{"kind": "fsspec", "url": f"file://{tmp_path}/tier"}]).start()
    hs, data = hashes(4, 7), blocks(4, 4096, seed=7)
    try:
        async with d.store(max_pending_s=1.0) as store:
            await store.put(0, hs, data)
            await store.flush()
            assert d.proc is not None
            d.proc.kill()
            d.proc.wait()
            for _ in range(20):
                t0 = time.monotonic()
                assert store.lookup(0, hs) == [Lookup.MISS] * 4
                assert store.lookup_prefix(hs).blocks == 0
                assert time.monotonic() - t0 < 1.0
            with pytest.raises(BlockMissing):
                await store.get(0, hs, torch.zeros_like(data))
            dropped = store.stats().put_blocks_dropped
            await store.put(0, hashes(1, 8), data[:1])
            assert store.stats().put_blocks_dropped == dropped + 1
            assert not store.connected

            settings = json.loads(d.config.read_text())
            d.config.write_text(json.dumps({**settings, "namespaces": ["someone-else"]}))
            d.start()  # back, but no longer serving this namespace: the engine serves on, MISS
            time.sleep(0.1)
            assert store.lookup(0, hs) == [Lookup.MISS] * 4 and not store.connected
            assert d.stop()[0] == 0

            d.config.write_text(json.dumps(settings))
            d.start()  # the same socket path; a new pool, the same file tier
            deadline = time.monotonic() + 30
            while store.lookup_prefix(hs, request_id="again").state is not Lookup.HIT:
                assert time.monotonic() < deadline, "the store never reattached"
                time.sleep(0.05)
            got = torch.zeros_like(data)
            await store.get(0, hs, got, request_id="again")
            assert torch.equal(got, data)
            assert store.stats().tiers[1].hits > 0  # read back from the file tier
    finally:
        rc, err = d.stop()
    assert rc == 0, err


def test_serve_refuses_a_bad_config_or_socket_path_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"cpu_bytes_to_use": -1}))
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"cpu_bytes_to_use": 1 << 20}))
    tier = tmp_path / "tier.json"
    tier.write_text(json.dumps({"cpu_bytes_to_use": 1 << 20, "tiers": [{"kind": "nope"}]}))
    protocol = tmp_path / "protocol.json"  # refused at start, not when the first engine says hello
    protocol.write_text(json.dumps({"cpu_bytes_to_use": 1 << 20, "tiers": [
        {"kind": "fsspec", "url": f"file://{tmp_path}/t"}, {"kind": "fsspec", "url": "nosuchfs://bucket/kv"}]}))
    cases = ((bad, tmp_path / "s", "cpu_bytes_to_use"), (tier, tmp_path / "s", "tiers.0"),
             (protocol, tmp_path / "s", "tiers.1.url: no file system for nosuchfs:// URLs"),
             (good, tmp_path / "missing" / "s", "cannot listen"), (good, good, "not a socket"))
    for config, sock, says in cases:
        r = subprocess.run([sys.executable, "-m", "tierkv.cli", "serve", "--config", str(config), "--socket",
                            str(sock)], env=ENV, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, r.stderr
        assert r.stderr.count("\n") == 1 and r.stderr.startswith("tierkv: error: "), r.stderr
        assert says in r.stderr


async def test_a_store_whose_daemon_is_not_there_answers_at_once_and_checks_its_arguments(
        tmp_path: Path) -> None:
    from tierkv import StoreClosed
    from tierkv.daemon.client import DaemonStore

    store = TieredStore({"layout": SMALL, "daemon": str(tmp_path / "nobody.sock"), "max_pending_s": 0.5})
    assert isinstance(store, DaemonStore)
    hs = hashes(3, 9)
    with pytest.raises(StoreClosed):
        store.lookup(0, hs)
    async with store:
        t0 = time.monotonic()
        assert store.lookup(0, hs) == [Lookup.MISS] * 3
        assert store.lookup_prefix(hs).state is Lookup.MISS
        with pytest.raises(BlockMissing):
            await store.get(0, hs, torch.zeros(3, 4096, dtype=torch.uint8))
        await store.put(0, hs, blocks(3, 4096))
        assert time.monotonic() - t0 < 0.5
        st = store.stats()
        assert st.put_blocks_dropped == 3 and st.lookups["miss"] >= 4
        with pytest.raises(InvalidArgument):
            await store.put(0, hs, blocks(2, 4096))  # rows that do not match the hashes
        with pytest.raises(InvalidArgument):
            store.lookup(0, [hs[0], hs[0]])
        with pytest.raises(BlockMissing):
            async with store.borrow(0, hs):
                pass
        with pytest.raises(InvalidArgument, match="lend_slots is not available through the tierkv daemon"):
            with store.lend_slots(0, hs):
                pass


async def test_several_blocks_to_a_record_answer_as_in_process_and_share_the_records(tmp_path: Path) -> None:
    """``blocks_per_record = 4`` through the daemon: the same answers, errors and records on disk as
    an in-process store, which reads the daemon's records (and the daemon, after a restart, too)."""
    chunked = Layout(tokens_per_block=16, blocks_per_record=4, groups=[
        GroupSpec(kind="full", block_bytes=1024), GroupSpec(kind="scratch", block_bytes=64),
        GroupSpec(kind="full", block_bytes=2048)])
    tier = {"kind": "fsspec", "url": f"file://{tmp_path}/tier"}
    hs, data = hashes(10, 9), {0: blocks(10, 1024, seed=1), 2: blocks(10, 2048, seed=2)}
    d = Daemon(tmp_path, tiers=[tier]).start()
    try:
        async with d.store(chunked, namespace="c") as store:
            for g, rows in data.items():
                await store.put(g, hs, rows)
            await store.flush()
            assert len(list((tmp_path / "tier").rglob("*.tkv"))) == 2 * 2  # a trailing 2 blocks: no record
            assert store.lookup(0, hs) == [Lookup.HIT] * 8 + [Lookup.MISS] * 2
            ans = store.lookup_prefix(hs)
            assert (ans.blocks, ans.state) == (8, Lookup.HIT)
            for g, rows in data.items():
                out = torch.zeros(4, rows.shape[1], dtype=torch.uint8)
                await store.get(g, hs[4:8], out, request_id="r")
                assert torch.equal(out, rows[4:8])
                async with store.borrow(g, hs[:8]) as lent:  # a copy of its own through the daemon
                    assert lent.shape == (8, rows.shape[1]) and torch.equal(lent, rows[:8])
            with pytest.raises(InvalidArgument, match="multiple of 4 hashes"):
                await store.get(0, hs[:6], torch.zeros(6, 1024, dtype=torch.uint8))
            with pytest.raises(BlockMissing):
                await store.get(0, hs[2:6], torch.zeros(4, 1024, dtype=torch.uint8))  # inside a record
            assert d.proc is not None
            d.proc.kill()
            d.proc.wait()
            d.start()
            deadline = time.monotonic() + 30
            while (ans := store.lookup_prefix(hs, request_id="again")).state is not Lookup.HIT:
                assert time.monotonic() < deadline, f"the records never came back from the tier: {ans}"
                time.sleep(0.05)
            assert ans.blocks == 8
            out = torch.zeros(8, 2048, dtype=torch.uint8)
            await store.get(2, hs[:8], out, request_id="again")
            assert torch.equal(out, data[2][:8])
        async with TieredStore({"layout": chunked, "namespace": "c",
                                "tiers": [{"kind": "cpu", "capacity_bytes": 1 << 20}, tier]}) as alone:
            out = torch.zeros(8, 1024, dtype=torch.uint8)
            await alone.get(0, hs[:8], out)  # the daemon's records, read in-process
            assert torch.equal(out, data[0][:8])
    finally:
        rc, err = d.stop()
    assert rc == 0, err


async def test_prefix_lookups_follow_the_hybrid_rules_as_in_process(daemon: Daemon) -> None:
    layout = hybrid_layout(bb=1024, window=2)
    hs = hashes(6, 11)
    puts = {FULL: list(range(6)), SW: [2, 3, 4, 5], REC: [3]}  # a recurrent state at block 3 only
    local = TieredStore({"layout": layout, "tiers": [{"kind": "cpu", "capacity_bytes": 1 << 20}]})
    async with daemon.store(layout, namespace="a") as remote, local:
        for store in (remote, local):
            for group, idx in puts.items():
                nbytes = layout.groups[group].block_bytes
                await store.put(group, [hs[i] for i in idx], blocks(len(idx), nbytes, seed=group))
        answers = [(remote.lookup_prefix(hs[:k]), local.lookup_prefix(hs[:k])) for k in range(1, 7)]
    assert [r for r, _ in answers] == [lo for _, lo in answers]
    assert answers[3][0].blocks == 4 and answers[5][0].blocks == 4  # the recurrent state decides

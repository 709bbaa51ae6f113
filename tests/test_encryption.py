"""Encryption at rest: sealed records bound to their place, key files, rotation, tenants sharing
one directory or bucket, and the key kept out of every output."""

from __future__ import annotations

import json
import os
import secrets
import struct
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch
import xxhash
from s3util import new_bucket, s3_endpoint, storage_options
from test_fsspec_tier import logs

from tierkv import GroupSpec, Layout, Lookup, StoreConfig, TieredStore
from tierkv.backends.base import TierContext
from tierkv.backends.fsspec import FsspecTier, FsspecTierConfig
from tierkv.cli import main
from tierkv.errors import ConfigError, CorruptRecord
from tierkv.keys import make_key
from tierkv.observing.metrics import to_prometheus
from tierkv.records import (
    FIXED_HEADER_LEN,
    TAG_LEN,
    TRAILER_LEN,
    decode_record,
    encode_record,
    read_header,
    verify_record,
)
from tierkv.records.encryption import KeyRing, key_id, load_key_file
from tierkv.testing import conformance_layout

__all__ = ["logs", "s3_endpoint"]  # fixtures, imported for this module

pytestmark = pytest.mark.anyio

LAYOUT = conformance_layout()
FULL = 0
BB = LAYOUT.groups[FULL].block_bytes
NS = "enc-tests"
FP = LAYOUT.fingerprint(NS)
#: stores serve whole prefixes: one attention group, so a prefix is its blocks
STORE_LAYOUT = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=BB)])


def key_file(tmp_path: Path, name: str = "key", mode: int = 0o600) -> tuple[Path, bytes]:
    key = secrets.token_bytes(32)
    path = tmp_path / name
    path.write_text(key.hex() + "\n")
    path.chmod(mode)
    return path, key


def ctx(namespace: str = NS) -> TierContext:
    return TierContext(layout=LAYOUT, namespace=namespace, fingerprint=LAYOUT.fingerprint(namespace))


def tier(url: str, namespace: str = NS, **kw: Any) -> FsspecTier:
    return FsspecTier(FsspecTierConfig(url=url, **kw), ctx(namespace))


def keys(n: int, salt: int = 0) -> list[bytes]:
    return [make_key(bytes([salt]) * 4 + i.to_bytes(28, "big"), FULL) for i in range(n)]


def rand(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, BB), dtype=torch.uint8, generator=g)


def fix_checksum(rec: bytearray) -> bytes:
    end = len(rec) - TRAILER_LEN
    rec[end:] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(rec[:end])))
    return bytes(rec)


async def cli(*args: str) -> int:
    """``tierkv ARGS`` (it runs its own event loop: in a thread)."""
    rc: int = await anyio.to_thread.run_sync(main, list(args))
    return rc


async def get(t: FsspecTier, ks: list[bytes]) -> tuple[list[bool], torch.Tensor]:
    out = torch.zeros(len(ks), BB, dtype=torch.uint8)
    return await t.get(FULL, ks, out), out


# ---- the record --------------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["none", "zstd", "zstd-shuffle"])
def test_a_sealed_record_round_trips_and_hides_its_block(codec: str) -> None:
    ring = KeyRing(secrets.token_bytes(32))
    block = np.frombuffer(b"prompt text " * 1000, dtype=np.uint8)
    k = keys(1)[0]
    rec = encode_record(key=k, fingerprint=FP, payload=block, codec=codec, keys=ring)
    header = read_header(rec)
    assert header.encrypted and header.key_id == ring.current_id and len(header.nonce) == 12
    assert len(rec) == header.header_len + header.stored_len + TAG_LEN + TRAILER_LEN
    assert b"prompt text" not in rec
    out = decode_record(rec, key=k, fingerprint=FP, max_raw_bytes=block.size, keys=ring)
    assert out.tobytes() == block.tobytes()
    # a fresh nonce per record: the same block sealed twice differs
    again = encode_record(key=k, fingerprint=FP, payload=block, codec=codec, keys=ring)
    assert read_header(again).nonce != header.nonce and again[header.header_len:] != rec[header.header_len:]
    # structure and checksum without the key; a reader without the key never decodes it
    assert verify_record(rec, max_raw_bytes=block.size).encrypted
    with pytest.raises(CorruptRecord) as info:
        decode_record(rec, key=k, fingerprint=FP, max_raw_bytes=block.size)
    assert info.value.reason == "encrypted"


def test_every_header_field_is_authenticated() -> None:
    """Any header byte changed (checksum fixed, so only GCM can tell) fails authentication or a
    structural check; a changed payload or tag byte fails authentication."""
    ring = KeyRing(secrets.token_bytes(32))
    block = np.arange(4096, dtype=np.uint8)
    k = keys(1)[0]
    rec = encode_record(key=k, fingerprint=FP, payload=block, keys=ring)
    header = read_header(rec)
    for pos in [*range(header.header_len), header.header_len + 5, len(rec) - TRAILER_LEN - 1]:
        bad = bytearray(rec)
        bad[pos] ^= 0x01
        with pytest.raises(CorruptRecord) as info:
            decode_record(fix_checksum(bad), key=k, fingerprint=FP, max_raw_bytes=block.size, keys=ring)
        assert "xxh3_64 mismatch" not in str(info.value), pos  # the checksum was fixed


def test_key_files_must_be_private_and_hold_one_key(tmp_path: Path) -> None:
    path, key = key_file(tmp_path)
    assert load_key_file(str(path)) == key
    path.chmod(0o640)
    with pytest.raises(ConfigError, match=f"{path}.*open to group or others") as info:
        load_key_file(str(path))
    assert key.hex() not in str(info.value)
    path.chmod(0o600)
    for text in ["", key.hex()[:-2], key.hex() + "00", "zz" + key.hex()[2:], key.hex() + "\n" + key.hex()]:
        path.write_text(text)
        with pytest.raises(ConfigError, match="64 hex characters") as info:
            load_key_file(str(path))
        assert str(path) in str(info.value) and (not text or text[:20] not in str(info.value))
    with pytest.raises(ConfigError, match="no such file"):
        load_key_file(str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match="not a regular file"):
        load_key_file(str(tmp_path))


def test_without_cryptography_the_error_says_how_to_install_it(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    path, _ = key_file(tmp_path)
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers.aead", None)
    with pytest.raises(ConfigError, match=r"cryptography.*pip install 'cryptography>=42'.*\[encrypt\]"):
        KeyRing.from_files(str(path))


def test_settings_that_need_a_key_say_so(tmp_path: Path) -> None:
    def config(**fs: Any) -> None:
        StoreConfig(layout=STORE_LAYOUT, tiers=[{"kind": "cpu", "slots": {0: 4}},
                                                {"kind": "fsspec", "url": f"file://{tmp_path}", **fs}])

    with pytest.raises(ConfigError, match="encryption_old_key_files needs encryption_key_file"):
        config(encryption_old_key_files=["/x"])
    with pytest.raises(ConfigError, match="read_unencrypted"):
        config(read_unencrypted=False)


async def test_a_store_refuses_a_key_file_others_can_read(tmp_path: Path) -> None:
    path, key = key_file(tmp_path, mode=0o644)
    cfg = _tenant(f"file://{tmp_path}/kv", path, NS)
    with pytest.raises(ConfigError, match=str(path)) as info:
        async with TieredStore(cfg):
            pass
    assert key.hex() not in str(info.value)


# ---- the tier ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["none", "zstd-shuffle"])
async def test_a_tier_with_a_key_seals_what_it_writes_and_reads_it_back(tmp_path: Path, codec: str) -> None:
    path, _ = key_file(tmp_path)
    ks, data = keys(6), rand(6, seed=1)
    t = tier(f"file://{tmp_path}/kv", codec=codec, encryption_key_file=str(path))
    await t.open()
    try:
        assert await t.put(FULL, ks, data) == [True] * 6
        for k, row in zip(ks, data, strict=True):
            raw = Path(t.path(k)).read_bytes()
            assert read_header(raw).encrypted
            assert row[:64].numpy().tobytes() not in raw
        found, out = await get(t, ks)
        assert found == [True] * 6 and torch.equal(out, data)
        assert not any(n.startswith("corrupt") or n.endswith("misses") for n in t.counters)
    finally:
        await t.close()


async def test_a_record_moved_to_another_place_fails_authentication(tmp_path: Path) -> None:
    """A record copied to another key's path, its header's key (and group) rewritten and its checksum
    fixed, is a counted miss (``auth``) and removed; so is one moved to another namespace."""
    path, _ = key_file(tmp_path)
    ks, data = keys(3), rand(3, seed=2)
    a = tier(f"file://{tmp_path}/kv", encryption_key_file=str(path))
    b = tier(f"file://{tmp_path}/kv", namespace="other-tenant", encryption_key_file=str(path))
    await a.open()
    await b.open()
    try:
        await a.put(FULL, ks[:1], data[:1])
        rec = bytearray(Path(a.path(ks[0])).read_bytes())
        # to another block key in the same namespace
        moved = bytearray(rec)
        moved[FIXED_HEADER_LEN:FIXED_HEADER_LEN + len(ks[1])] = ks[1]
        Path(a.path(ks[1])).write_bytes(fix_checksum(moved))
        # to the same block key in another namespace: the fingerprint rewritten
        elsewhere = bytearray(rec)
        elsewhere[24:40] = bytes.fromhex(b.context.fingerprint)
        Path(b.path(ks[0])).parent.mkdir(parents=True, exist_ok=True)
        Path(b.path(ks[0])).write_bytes(fix_checksum(elsewhere))
        found, _ = await get(a, ks[1:2])
        assert found == [False] and a.counters["corrupt_auth"] == 1 and a.counters["corrupt_removed"] == 1
        assert not Path(a.path(ks[1])).exists()
        found, _ = await get(b, ks[:1])
        assert found == [False] and b.counters["corrupt_auth"] == 1 and not Path(b.path(ks[0])).exists()
        # a plain copy (header untouched) is caught by the key check before
        Path(a.path(ks[2])).write_bytes(bytes(rec))
        found, _ = await get(a, ks[2:3])
        assert found == [False] and a.counters["corrupt_key"] == 1
        found, out = await get(a, ks[:1])  # the original is sound
        assert found == [True] and torch.equal(out[0], data[0])
    finally:
        await a.close()
        await b.close()


async def test_a_flipped_ciphertext_bit_with_a_fixed_checksum_is_a_counted_miss(tmp_path: Path) -> None:
    path, _ = key_file(tmp_path)
    ks, data = keys(2), rand(2, seed=3)
    t = tier(f"file://{tmp_path}/kv", encryption_key_file=str(path))
    await t.open()
    try:
        await t.put(FULL, ks, data)
        rec = bytearray(Path(t.path(ks[0])).read_bytes())
        rec[read_header(rec).header_len + 100] ^= 0x40
        Path(t.path(ks[0])).write_bytes(fix_checksum(rec))
        found, out = await get(t, ks)
        assert found == [False, True] and torch.equal(out[1], data[1])
        assert t.counters["corrupt_auth"] == 1 and not Path(t.path(ks[0])).exists()
    finally:
        await t.close()


async def test_old_records_stay_readable_and_keys_rotate(tmp_path: Path, logs: Any) -> None:
    url = f"file://{tmp_path}/kv"
    old_path, _ = key_file(tmp_path, "old")
    new_path, _ = key_file(tmp_path, "new")
    plain_ks, old_ks, new_ks = keys(2, salt=1), keys(2, salt=2), keys(2, salt=3)
    data = rand(2, seed=4)
    t = tier(url)  # before encryption: unencrypted records
    await t.open()
    await t.put(FULL, plain_ks, data)
    await t.close()
    t = tier(url, encryption_key_file=str(old_path))
    await t.open()
    assert (await get(t, plain_ks))[0] == [True, True], "unencrypted records written before stay readable"
    await t.put(FULL, old_ks, data)
    await t.close()
    # rotation: the new key writes, the old one still reads
    t = tier(url, encryption_key_file=str(new_path), encryption_old_key_files=[str(old_path)])
    await t.open()
    try:
        found, out = await get(t, old_ks)
        assert found == [True, True] and torch.equal(out, data)
        await t.put(FULL, new_ks, data)
        assert read_header(Path(t.path(new_ks[0])).read_bytes()).key_id == key_id(
            bytes.fromhex(new_path.read_text()))
    finally:
        await t.close()
    # the old key retired: its records are misses, counted, said once, left in place
    t = tier(url, encryption_key_file=str(new_path), read_unencrypted=False)
    await t.open()
    try:
        assert (await get(t, old_ks))[0] == [False, False]
        assert (await get(t, plain_ks))[0] == [False, False]
        assert (await get(t, new_ks))[0] == [True, True]
        assert t.counters["encrypted_misses"] == 2 and t.counters["unencrypted_misses"] == 2
        assert "corrupt" not in t.counters
        assert all(Path(t.path(k)).exists() for k in old_ks + plain_ks)
    finally:
        await t.close()
    said = [line for line in logs.lines if "cannot be served" in line]
    assert len(said) == 2, said


async def test_a_store_without_the_key_says_so_once_and_counts(tmp_path: Path, logs: Any) -> None:
    path, _ = key_file(tmp_path)
    url = f"file://{tmp_path}/kv"
    ks, data = keys(5), rand(5, seed=5)
    t = tier(url, encryption_key_file=str(path))
    await t.open()
    await t.put(FULL, ks, data)
    await t.close()
    t = tier(url)
    await t.open()
    try:
        assert (await get(t, ks[:3]))[0] == [False] * 3
        assert (await get(t, ks[3:]))[0] == [False] * 2
        assert t.counters["encrypted_misses"] == 5 and "corrupt" not in t.counters
    finally:
        await t.close()
    said = [line for line in logs.lines if "cannot be served" in line]
    assert len(said) == 1 and "no encryption_key_file" in said[0], said


# ---- tenants -----------------------------------------------------------------------------------------
async def _served(store: TieredStore, hs: list[bytes], data: torch.Tensor) -> int:
    """How many of ``hs`` the store serves as a prefix (and they hold ``data``)."""
    with anyio.fail_after(30):
        while (found := store.lookup_prefix(hs, request_id="r")).state is Lookup.PENDING:
            await anyio.sleep(0.005)
    n = found.blocks if found.state is Lookup.HIT else 0
    if n:
        out = torch.empty(n, BB, dtype=torch.uint8)
        await store.get(FULL, hs[:n], out, request_id="r")
        assert torch.equal(out, data[:n]), "a block that is not the one stored was served"
    store.release("r")
    return n


def _tenant(url: str, key: Path, namespace: str, opts: dict[str, Any] | None = None) -> dict[str, Any]:
    fs: dict[str, Any] = {"kind": "fsspec", "url": url, "encryption_key_file": str(key)}
    if opts:
        fs["storage_options"] = opts
    return {"layout": STORE_LAYOUT, "namespace": namespace, "tiers": [{"kind": "cpu", "slots": {0: 8}}, fs]}


@pytest.mark.parametrize("where", ["file", "s3"])
@pytest.mark.parametrize("namespaces", ["same", "different"])
async def test_tenants_with_different_keys_never_serve_each_others_blocks(
        tmp_path: Path, s3_endpoint: str, where: str, namespaces: str) -> None:
    opts = storage_options(s3_endpoint) if where == "s3" else None
    url = f"s3://{new_bucket(s3_endpoint)}/kv" if where == "s3" else f"file://{tmp_path}/kv"
    key_a, _ = key_file(tmp_path, "a")
    key_b, _ = key_file(tmp_path, "b")
    ns_b = NS if namespaces == "same" else "tenant-b"
    hs = [bytes([7]) * 4 + i.to_bytes(28, "big") for i in range(4)]  # the same prompt for both
    data_a, data_b = rand(4, seed=10), rand(4, seed=11)
    async with TieredStore(_tenant(url, key_a, NS, opts)) as a:
        await a.put(FULL, hs, data_a)
        await a.flush()
    async with TieredStore(_tenant(url, key_b, ns_b, opts)) as b:
        assert await _served(b, hs, data_a) == 0
        if namespaces == "same":
            assert b.stats().tiers[1].backend["encrypted_misses"] >= 1
        await b.put(FULL, hs[:2], data_b[:2])  # same namespace: overwrites tenant A's records there
        await b.flush()
    async with TieredStore(_tenant(url, key_a, NS, opts)) as a:
        served = await _served(a, hs, data_a)  # checks that whatever is served is A's
        assert served == (0 if namespaces == "same" else 4)
        backend = a.stats().tiers[1].backend
        assert "corrupt" not in backend
        if namespaces == "same":
            assert backend["encrypted_misses"] >= 1


# ---- the key stays secret ----------------------------------------------------------------------------
def _assert_no_key(key: bytes, *texts: object) -> None:
    for t in texts:
        raw = t if isinstance(t, bytes) else str(t).encode("utf-8", "surrogateescape")
        low = raw.lower()
        assert key.hex().encode() not in low, raw[:2000]
        assert key not in raw, raw[:2000]


async def test_the_key_never_appears_in_logs_errors_stats_metrics_reprs_or_the_cli(
        tmp_path: Path, logs: Any, capsys: pytest.CaptureFixture[str]) -> None:
    path, key = key_file(tmp_path)
    other_path, other = key_file(tmp_path, "other")
    url = f"file://{tmp_path}/kv"
    cfg = _tenant(url, path, NS)
    config = StoreConfig(**cfg)
    hs = [bytes([9]) * 4 + i.to_bytes(28, "big") for i in range(4)]
    data = rand(4, seed=12)
    async with TieredStore(config) as store:
        await store.put(FULL, hs, data)
        await store.flush()
        t = store.tiers[1]
        assert isinstance(t, FsspecTier)
        ring = t._ring
        # damage one record (auth failure, logged) and plant one of another key (said once)
        rec = bytearray(Path(t.path(make_key(hs[1], FULL))).read_bytes())
        rec[read_header(bytes(rec)).header_len + 72] ^= 1  # in the ciphertext
        Path(t.path(make_key(hs[1], FULL))).write_bytes(fix_checksum(rec))
        foreign = encode_record(key=make_key(hs[2], FULL), fingerprint=t.context.fingerprint,
                                payload=data[2].numpy(), keys=KeyRing(other))
        Path(t.path(make_key(hs[2], FULL))).write_bytes(foreign)
        store.engine.clear()
        await _served(store, hs, data)
        st = store.stats()
        assert st.tiers[1].backend["corrupt_auth"] == 1 and st.tiers[1].backend["encrypted_misses"] == 1
        texts: list[object] = [repr(config), str(config), *(repr(x) for x in config.tiers), repr(t),
                               str(ring), repr(ring), t.describe(), st.model_dump_json(), to_prometheus(st)]
    with pytest.raises(TypeError):
        import pickle

        pickle.dumps(ring)
    # the CLI, with and without the key
    outs = []
    for args in (["inspect", url], ["verify", url], ["verify", url, "--key-file", str(path)],
                 ["inspect", url, "--json"], ["verify", url, "--json", "--key-file", str(path),
                                              "--old-key-file", str(other_path)]):
        await cli(*args)
        cap = capsys.readouterr()
        outs += [cap.out, cap.err]
    assert any("authenticated with the key" in o for o in outs), outs
    # errors about key files never show their contents
    bad = tmp_path / "bad"
    bad.write_text(key.hex()[:-1])
    bad.chmod(0o600)
    assert await cli("verify", url, "--key-file", str(bad)) == 2
    cap = capsys.readouterr()
    assert str(bad) in cap.err and "Traceback" not in cap.err
    _assert_no_key(key, *texts, *outs, cap.err, "\n".join(logs.lines))
    _assert_no_key(other, *outs, "\n".join(logs.lines))


# ---- tierkv verify -----------------------------------------------------------------------------------
async def test_verify_checks_authenticity_with_the_key_and_structure_without(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = key_file(tmp_path)
    url = f"file://{tmp_path}/kv"
    ks, data = keys(4), rand(4, seed=13)
    t = tier(url, encryption_key_file=str(path))
    await t.open()
    await t.put(FULL, ks, data)
    await t.close()
    # a ciphertext byte changed and the checksum fixed: only the key can tell
    rec = bytearray(Path(t.path(ks[0])).read_bytes())
    rec[read_header(rec).header_len] ^= 1
    Path(t.path(ks[0])).write_bytes(fix_checksum(rec))

    async def run(*args: str) -> tuple[int, dict[str, Any], str]:
        capsys.readouterr()
        rc = await cli("verify", url, "--json", *args)
        report = json.loads(capsys.readouterr().out)
        await cli("verify", url, *args)
        return rc, report, capsys.readouterr().out

    rc, report, text = await run()
    assert rc == 0 and report["structure_only"] == 4 and report["authenticated"] == 0
    assert not report["key_given"] and "structure and checksum only (no key given)" in text
    rc, report, text = await run("--key-file", str(path))
    assert rc == 1 and report["authenticated"] == 3 and report["structure_only"] == 0
    assert [p["reason"] for p in report["corrupt"]] == ["auth"]
    assert "3 authenticated with the key" in text
    other, _ = key_file(tmp_path, "other")
    rc, report, text = await run("--key-file", str(other))
    assert rc == 0 and report["structure_only"] == 4 and "sealed by a key not given" in text
    rc, report, _ = await run("--key-file", str(path), "--repair")
    assert rc == 0 and len(report["removed"]) == 1 and not os.path.exists(t.path(ks[0]))
    capsys.readouterr()
    assert await cli("inspect", url, "--json") == 0
    group = json.loads(capsys.readouterr().out)["namespaces"][0]["groups"][FULL]
    assert group["encrypted"] == 3 and group["key_ids"] == {key_id(load_key_file(str(path))).hex(): 3}


async def test_encrypted_records_into_shared_memory_are_read_by_threads(tmp_path: Path) -> None:
    """Reader processes verify unencrypted records only: an encrypted tier reading into a pool in
    shared memory reads in its threads, and every row holds the stored block."""
    from tierkv.blocks.pool import plan_pools, shared_pool_tensors

    path, _ = key_file(tmp_path)
    lay = STORE_LAYOUT
    context = TierContext(layout=lay, namespace=NS, fingerprint=lay.fingerprint(NS))
    cfg = FsspecTierConfig(url=f"file://{tmp_path}/kv", encryption_key_file=str(path), read_processes=2)
    ks, data = [make_key(i.to_bytes(32, "big"), 0) for i in range(8)], rand(8, seed=14)
    pool = shared_pool_tensors(str(tmp_path / "pool"), plan_pools(None, lay, 1, {0: 8}))[0]
    t = FsspecTier(cfg, context)
    await t.open()
    try:
        assert await t.put(0, ks, data) == [True] * 8
        assert await t.get(0, ks, pool) == [True] * 8
        assert torch.equal(pool, data)
        t.used_bytes()
        assert not t.counters.get("reader_reads")
    finally:
        await t.close()

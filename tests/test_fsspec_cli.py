"""``tierkv inspect`` and ``tierkv verify`` on a tier with good, corrupt and temporary files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from s3util import s3_endpoint, storage_options

from tierkv.backends.base import TierContext
from tierkv.backends.fsspec import FsspecTier, FsspecTierConfig
from tierkv.cli import build_parser, main
from tierkv.keys import make_key
from tierkv.layout import GroupSpec, Layout
from tierkv.records import encode_record
from tierkv.records.tempnames import HOST as _HOST
from tierkv.records.tempnames import TEMP_MARK

__all__ = ["s3_endpoint"]  # the fixture, imported for this module

LAYOUT = Layout(tokens_per_block=16, groups=[
    GroupSpec(kind="full", block_bytes=4096),
    GroupSpec(kind="scratch", block_bytes=256),
    GroupSpec(kind="recurrent", block_bytes=8192, states_per_request=1),
])
FULL, REC = 0, 2


def _kv(n: int, nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.cumsum(torch.randn(n, nbytes // 2, generator=g) * 0.05, dim=1)
    return x.to(torch.bfloat16).view(torch.uint8).reshape(n, nbytes).contiguous()


def _keys(n: int, group: int, salt: int) -> list[bytes]:
    return [make_key(bytes([salt]) * 8 + i.to_bytes(24, "big"), group) for i in range(n)]


async def _fill(url: str, namespace: str, codec: str, opts: dict[str, Any] | None = None) -> FsspecTier:
    ctx = TierContext(layout=LAYOUT, namespace=namespace, fingerprint=LAYOUT.fingerprint(namespace))
    tier = FsspecTier(FsspecTierConfig(url=url, codec=codec, storage_options=opts or {}), ctx)
    await tier.open()
    await tier.put(FULL, _keys(6, FULL, 1), _kv(6, 4096, 1))
    await tier.put(REC, _keys(2, REC, 2), _kv(2, 8192, 2))
    return tier


def _run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    rc = main([*args, "--json"])
    return rc, json.loads(capsys.readouterr().out)


@pytest.fixture
def tier_dir(tmp_path: Path) -> dict[str, Any]:
    """Two namespaces of good records, then damage in the first one, temp files and a stray file."""
    url = f"file://{tmp_path}"

    async def build() -> tuple[FsspecTier, FsspecTier]:
        a = await _fill(url, "model-a", "zstd-shuffle")
        b = await _fill(url, "model-b", "none")
        await a.close()
        await b.close()
        return a, b

    a, b = anyio.run(build)
    ka, krec = _keys(6, FULL, 1), _keys(2, REC, 2)
    p = [Path(a.path(k)) for k in ka]
    damaged: dict[str, str] = {}
    flipped = bytearray(p[0].read_bytes())
    flipped[-20] ^= 0x04
    p[0].write_bytes(bytes(flipped))
    damaged[p[0].name] = "checksum"
    p[1].write_bytes(p[1].read_bytes()[:30])
    damaged[p[1].name] = "truncated"
    # a record written for namespace model-b, copied into model-a's directory
    p[2].write_bytes(Path(b.path(ka[2])).read_bytes())
    damaged[p[2].name] = "fingerprint"
    # a sound record of another key under this key's name
    p[3].write_bytes(Path(a.path(ka[4])).read_bytes())
    damaged[p[3].name] = "key"
    # a record of the right key, fingerprint and checksum but of the wrong block size
    p[5].write_bytes(encode_record(key=ka[5], fingerprint=a.context.fingerprint, payload=bytes(100)))
    damaged[p[5].name] = "size"
    # a file with a record's name that is no key
    bogus = p[4].parent / ("zz" * 36 + ".tkv")
    bogus.write_bytes(b"junk")
    damaged[bogus.name] = "name"
    dead = subprocess.Popen(["true"])
    dead.wait()
    temp_dead = p[4].parent / f".{p[4].name}{TEMP_MARK}{_HOST}-{dead.pid}-00aa00aa00aa"
    temp_dead.write_bytes(b"half a record")
    temp_live = p[4].parent / f".{p[4].name}{TEMP_MARK}{_HOST}-{os.getpid()}-00bb00bb00bb"
    temp_live.write_bytes(b"being written")
    (tmp_path / "README.txt").write_text("not ours")
    return {"url": url, "root": tmp_path, "a": a, "b": b, "damaged": damaged, "records_a": ka + krec,
            "temp_dead": temp_dead, "temp_live": temp_live}


def test_parser_has_every_subcommand() -> None:
    parser = build_parser()
    for cmd in (["demo"], ["inspect", "/x"], ["verify", "/x", "--repair"]):
        assert parser.parse_args(cmd).cmd == cmd[0]


def test_inspect_json(tier_dir: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    rc, rep = _run_cli(capsys, "inspect", tier_dir["url"])
    assert rc == 0
    assert rep["url"] == tier_dir["url"]
    assert rep["temp_files"] == 2 and rep["other_files"] == ["README.txt"]
    by_name = {ns["namespace"]: ns for ns in rep["namespaces"]}
    assert set(by_name) == {"model-a", "model-b"}
    b = by_name["model-b"]
    assert b["fingerprint"] == LAYOUT.fingerprint("model-b") and b["manifest"] == "ok"
    assert b["layout"]["tokens_per_block"] == 16
    groups = {g["group"]: g for g in b["groups"]}
    assert set(groups) == {FULL, REC}  # the scratch group has no records, ever
    assert groups[FULL]["records"] == 6 and groups[FULL]["raw_bytes"] == 6 * 4096
    assert groups[REC]["records"] == 2 and groups[REC]["kind"] == "recurrent"
    assert groups[FULL]["codecs"] == {"none": 6} and groups[FULL]["codec_ratio"] == 1.0
    assert b["records"] == 8 and b["raw_bytes"] == 6 * 4096 + 2 * 8192
    ns_dir = tier_dir["root"] / b["fingerprint"]
    assert b["bytes_on_disk"] == sum(p.stat().st_size for p in ns_dir.rglob("*.tkv"))
    a = by_name["model-a"]
    assert a["records"] == 9 and a["temp_files"] == 2
    ga = {g["group"]: g for g in a["groups"]}
    assert ga[FULL]["bad_headers"] >= 2  # the truncated record and the junk file
    assert ga[REC]["codecs"] == {"zstd-shuffle": 2} and ga[REC]["codec_ratio"] > 1.2


def test_verify_lists_then_repairs(tier_dir: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    url = tier_dir["url"]
    rc, rep = _run_cli(capsys, "verify", url)
    assert rc == 1 and not rep["clean"] and not rep["repaired"]
    found = {Path(c["path"]).name: c["reason"] for c in rep["corrupt"]}
    assert found == tier_dir["damaged"]
    assert rep["checked"] == 8 + 9 and rep["ok"] == 8 + 3
    assert rep["namespaces"] == {LAYOUT.fingerprint("model-a"): "ok", LAYOUT.fingerprint("model-b"): "ok"}
    temps = {Path(t["path"]).name: t for t in rep["temp_files"]}
    assert temps[tier_dir["temp_dead"].name]["stale"] is True
    assert temps[tier_dir["temp_live"].name]["stale"] is False
    assert temps[tier_dir["temp_live"].name]["owner_alive"] is True
    assert tier_dir["temp_dead"].exists(), "verify without --repair changes nothing"

    rc, rep = _run_cli(capsys, "verify", url, "--repair")
    assert rc == 0 and rep["clean"] and rep["repaired"]
    removed = {Path(p).name for p in rep["removed"]}
    assert removed == set(tier_dir["damaged"]) | {tier_dir["temp_dead"].name}
    assert not tier_dir["temp_dead"].exists() and tier_dir["temp_live"].exists()
    assert (tier_dir["root"] / "README.txt").exists(), "files that are not ours are never touched"

    rc, rep = _run_cli(capsys, "verify", url)
    assert rc == 0 and rep["clean"] and rep["corrupt"] == [] and rep["checked"] == 11

    # the repaired tier serves what is left
    async def check() -> None:
        tier = FsspecTier(tier_dir["a"].cfg, tier_dir["a"].context)
        await tier.open()
        out = torch.zeros((2, 8192), dtype=torch.uint8)
        assert await tier.get(REC, _keys(2, REC, 2), out) == [True, True]
        assert torch.equal(out, _kv(2, 8192, 2))
        await tier.close()

    anyio.run(check)


def test_human_output_and_errors(tier_dir: dict[str, Any], capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["inspect", tier_dir["url"]]) == 0
    out = capsys.readouterr().out
    assert "model-a" in out and "recurrent" in out
    assert main(["verify", tier_dir["url"]]) == 1
    out = capsys.readouterr().out
    assert "CORRUPT" in out and "checksum" in out and "--repair" in out
    assert main(["inspect", "nosuchproto://x/y"]) == 2
    assert "no file system" in capsys.readouterr().err
    assert main(["verify", str(tier_dir["root"] / "typo")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_inspect_and_verify_on_s3(s3_endpoint: str, capsys: pytest.CaptureFixture[str]) -> None:
    from s3util import boto_client, new_bucket

    bucket = new_bucket(s3_endpoint)
    url = f"s3://{bucket}/kv"
    opts = storage_options(s3_endpoint)

    async def build() -> FsspecTier:
        t = await _fill(url, "model-s3", "zstd", opts)
        await t.close()
        return t

    tier = anyio.run(build)
    key = _keys(1, FULL, 1)[0]
    obj = tier.path(key)
    client = boto_client(s3_endpoint)
    client.put_object(Bucket=bucket, Key=obj.partition("/")[2], Body=b"\x89TKV\r\n\x1a\n\x01\x00")
    flags = ["-o", f"endpoint_url={s3_endpoint}", "-o", "key=testing", "-o", "secret=testing"]
    rc, rep = _run_cli(capsys, "inspect", url, *flags)
    assert rc == 0 and [ns["namespace"] for ns in rep["namespaces"]] == ["model-s3"]
    assert rep["namespaces"][0]["records"] == 8
    rc, rep = _run_cli(capsys, "verify", url, *flags)
    assert rc == 1 and [c["reason"] for c in rep["corrupt"]] == ["truncated"]
    rc, rep = _run_cli(capsys, "verify", url, "--repair", *flags)
    assert rc == 0 and len(rep["removed"]) == 1
    rc, rep = _run_cli(capsys, "verify", url, *flags)
    assert rc == 0 and rep["checked"] == 7


def test_console_script_entry_point(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "tierkv.cli", "verify", str(tmp_path), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, "nothing verifiable is not clean"
    rep = json.loads(res.stdout)
    assert rep["checked"] == 0 and not rep["found"] and "no tierkv namespace" in rep["hint"]


def test_the_human_summary_counts_every_other_file_the_json_lists(
        tier_dir: dict[str, Any], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    ns_dir = Path(tier_dir["a"].path(_keys(1, FULL, 1)[0])).parent
    while ns_dir.parent != tier_dir["root"]:
        ns_dir = ns_dir.parent
    (ns_dir / "stray.bin").write_bytes(b"not a record")  # inside a namespace, not at the root
    rc, rep = _run_cli(capsys, "inspect", tier_dir["url"])
    listed = len(rep["other_files"]) + sum(ns["other_files"] for ns in rep["namespaces"])
    assert rc == 0 and listed == 2
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["inspect", tier_dir["url"]]) == 0
    assert f"{listed} other file(s)" in capsys.readouterr().out


def test_unknown_storage_options_and_flags_are_usage_errors(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tmp_path), "-o", "foo=bar"]) == 2
    assert "takes no option 'foo'" in capsys.readouterr().err
    assert main(["verify", "--nosuchflag", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "usage: tierkv verify" in err and "--nosuchflag" in err

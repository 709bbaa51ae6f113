"""Defects of the second hostile review (#46, points 4 to 6), through the public API and the CLI.

4. A directory where a record should be: every other corrupt record is still removed, what could not
   be removed is said and counted, ``tierkv verify`` reports it and ``--repair`` removes it when empty.
5. A key pasted where the key *file* belongs is refused without being printed.
6. Settings pydantic would coerce (``"yes"`` for a bool, ``384.0`` for a mode) or that have no sane
   bound are refused by name; a key file holding more than a key is refused.
"""

from __future__ import annotations

import logging
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from helpers import FULL, REC, SW, blocks, config, hashes, hybrid_layout

from tierkv import ConfigError, StoreConfig, TieredStore, TierKVError, make_key
from tierkv.backends.fsspec import FsspecTierConfig
from tierkv.backends.namespace import record_path
from tierkv.cli import main
from tierkv.records.encryption import KeyRing, load_key_file

LAYOUT = hybrid_layout()
BB = LAYOUT.groups[FULL].block_bytes
SLOTS = {FULL: 16, SW: 16, REC: 4}


def file_cfg(root: Path, **tier: Any) -> dict[str, Any]:
    return config(LAYOUT, {"kind": "fsspec", "url": f"file://{root}", **tier}, slots=SLOTS)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def warnings() -> Iterator[list[str]]:
    handler = _Lines()
    log = logging.getLogger("tierkv.fsspec")
    log.addHandler(handler)
    try:
        yield handler.lines
    finally:
        log.removeHandler(handler)


def tier_with_records(root: Path, n: int) -> tuple[list[bytes], torch.Tensor, list[Path]]:
    """``n`` blocks stored on a file tier at ``root``: their hashes, data and record paths."""
    hs, data = hashes(n), blocks(n, BB)

    async def fill() -> str:
        async with TieredStore(file_cfg(root)) as store:
            await store.put(FULL, hs, data)
            await store.flush()
            return store.fingerprint

    fp = anyio.run(fill)
    return hs, data, [Path(record_path(str(root), fp, make_key(h, FULL))) for h in hs]


def damage(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def tier_stats(store: TieredStore) -> Any:
    return store.stats().tiers[1]


# ---- 4. a directory at a record's path ------------------------------------------------------------
def test_a_directory_that_cannot_go_never_stops_the_other_removals(tmp_path: Path,
                                                                    warnings: list[str]) -> None:
    hs, data, paths = tier_with_records(tmp_path, 4)
    paths[0].unlink()
    paths[0].mkdir()
    (paths[0] / "someone's file").write_text("kept")
    for p in paths[1:]:
        damage(p)

    async def run() -> None:
        async with TieredStore(file_cfg(tmp_path)) as store:
            with pytest.raises(TierKVError):
                await store.get(FULL, hs, torch.zeros_like(data))
            backend = tier_stats(store).backend
        assert [p.exists() for p in paths] == [True, False, False, False]
        assert backend["corrupt"] == 4 and backend["corrupt_removed"] == 3
        assert backend["remove_errors"] == 1
        dir_key = make_key(hs[0], FULL).hex()
        said = [line for line in warnings if dir_key in line]
        assert said and all("could not be removed" in line for line in said), warnings
        assert sum("removed" in line and "could not" not in line for line in warnings) == 3, warnings
        # the key cannot be stored while the directory stands: a failed store, never a success
        async with TieredStore(file_cfg(tmp_path)) as store:
            await store.put(FULL, hs[:1], data[:1])
            await store.flush()
            st = tier_stats(store)
            assert st.stores == 0 and st.stores_failed == 1

    anyio.run(run)


def test_an_empty_directory_at_a_record_path_is_removed_and_the_key_stored_again(tmp_path: Path) -> None:
    hs, data, paths = tier_with_records(tmp_path, 2)
    paths[0].unlink()
    paths[0].mkdir()
    damage(paths[1])

    async def run() -> None:
        async with TieredStore(file_cfg(tmp_path)) as store:
            with pytest.raises(TierKVError):
                await store.get(FULL, hs, torch.zeros_like(data))
            assert tier_stats(store).backend["corrupt_removed"] == 2
        assert not paths[0].exists() and not paths[1].exists()
        async with TieredStore(file_cfg(tmp_path)) as store:
            await store.put(FULL, hs, data)
            await store.flush()
            assert tier_stats(store).stores == 2
        async with TieredStore(file_cfg(tmp_path)) as store:
            out = torch.zeros_like(data)
            await store.get(FULL, hs, out)
            assert torch.equal(out, data)

    anyio.run(run)


def verify(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["verify", *args])
    got = capsys.readouterr()
    assert "Traceback" not in got.out + got.err
    return rc, got.out + got.err


def test_verify_reports_a_directory_at_a_record_path_and_repair_removes_it_when_empty(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, _, paths = tier_with_records(tmp_path, 3)
    paths[0].unlink()
    paths[0].mkdir()
    rc, out = verify(capsys, str(tmp_path))
    assert rc == 1, out
    assert paths[0].name in out and "directory" in out
    assert "3 records checked, 2 sound, 1 corrupt (1 remaining)" in out
    rc, out = verify(capsys, str(tmp_path), "--repair")
    assert rc == 0, out
    assert not paths[0].exists()
    rc, out = verify(capsys, str(tmp_path))
    assert rc == 0 and "2 records checked, 2 sound, 0 corrupt" in out, out


def test_verify_repair_says_when_it_cannot_remove_a_directory(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    _, _, paths = tier_with_records(tmp_path, 3)
    paths[0].unlink()
    paths[0].mkdir()
    (paths[0] / "data").write_text("not ours to delete")
    damage(paths[1])
    rc, out = verify(capsys, str(tmp_path), "--repair")
    assert rc == 1, out
    assert paths[0].is_dir() and (paths[0] / "data").exists()
    assert not paths[1].exists(), "the corrupt record beside it is removed"
    line = next(ln for ln in out.splitlines() if paths[0].name in ln and "data" not in ln.split()[-1])
    assert line.startswith("CORRUPT") and "cannot be removed" in line, out
    assert "3 records checked, 1 sound, 2 corrupt (1 remaining)" in out


# ---- 5. a key where the key file's path belongs ---------------------------------------------------
KEY = secrets.token_hex(32)
NOT_PATHS = pytest.mark.parametrize("value", [KEY, KEY.upper(), f"  {KEY}\n", "ab" * 2100],
                                    ids=["key", "upper-case", "with-white-space", "longer-than-a-path"])


@NOT_PATHS
@pytest.mark.parametrize("setting", ["encryption_key_file", "encryption_old_key_files"])
def test_a_key_given_as_the_key_file_setting_is_refused_unprinted(tmp_path: Path, setting: str,
                                                                   value: str) -> None:
    tier: dict[str, Any] = {"encryption_key_file": value}
    if setting == "encryption_old_key_files":
        good = tmp_path / "key"
        good.write_text(secrets.token_hex(32))
        good.chmod(0o600)
        tier = {"encryption_key_file": str(good), "encryption_old_key_files": [value]}
    with pytest.raises(ConfigError, match=rf"tiers\.1\.{setting}.*looks like a key, not a path") as info:
        StoreConfig.from_dict(file_cfg(tmp_path, **tier))
    assert value.strip() not in str(info.value) and value.strip()[:16].lower() not in str(info.value).lower()


@NOT_PATHS
def test_a_key_given_as_a_key_file_path_is_refused_unprinted(value: str) -> None:
    for load in (lambda: load_key_file(value), lambda: KeyRing.from_files(value)):
        with pytest.raises(ConfigError, match="looks like a key, not a path to a key file") as info:
            load()
        assert value.strip()[:16].lower() not in str(info.value).lower()


@pytest.mark.parametrize("flag", ["--key-file", "--old-key-file"])
def test_verify_with_a_key_for_its_key_file_never_prints_it(tmp_path: Path, flag: str) -> None:
    tier_with_records(tmp_path, 1)
    good = tmp_path / "good.key"
    good.write_text(secrets.token_hex(32))
    good.chmod(0o600)
    args = ["--key-file", KEY] if flag == "--key-file" else ["--key-file", str(good), "--old-key-file", KEY]
    res = subprocess.run([sys.executable, "-m", "tierkv.cli", "verify", str(tmp_path), *args],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res
    assert "Traceback" not in res.stderr
    assert "looks like a key, not a path to a key file" in res.stderr
    assert KEY[:16] not in res.stdout + res.stderr


# ---- 6. settings that must be refused -------------------------------------------------------------
@pytest.mark.parametrize(("key", "value", "says"), [
    ("required", "yes", "true or false"),
    ("required", 1, "true or false"),
    ("fsync", "yes", "true or false"),
    ("direct_io", "yes", '"auto", true or false'),
    ("direct_io", 1, '"auto", true or false'),
    ("file_mode", 384.0, "integer"),
    ("read_processes", 1000, '"auto" or an integer 0..64'),
    ("read_processes", -1, '"auto" or an integer 0..64'),
    ("read_processes", 2.0, '"auto" or an integer 0..64'),
    ("io_depth", 1_000_000, "1024"),
    ("io_threads", 1_000_000, "1024"),
    ("encryption_key_file", "", "empty"),
    ("encryption_key_file", "  ", "empty"),
])
def test_settings_pydantic_would_coerce_or_that_have_no_bound_are_refused(tmp_path: Path, key: str,
                                                                         value: Any, says: str) -> None:
    with pytest.raises(ConfigError, match=rf"tiers\.1\.{key}: ") as info:
        StoreConfig.from_dict(file_cfg(tmp_path, **{key: value}))
    assert says in str(info.value)


def test_the_bounds_and_the_usual_spellings_still_load_from_yaml_and_json(tmp_path: Path) -> None:
    import json

    import yaml

    tier = {"kind": "fsspec", "url": f"file://{tmp_path}", "required": True, "fsync": False,
            "direct_io": "auto", "read_processes": 64, "io_depth": 1024, "io_threads": 1024,
            "file_mode": "0o640"}
    base = {"layout": LAYOUT.model_dump(), "namespace": "n", "tiers": [{"kind": "cpu", "slots": SLOTS}]}
    (tmp_path / "c.json").write_text(json.dumps({**base, "tiers": [*base["tiers"], tier]}))
    yml = yaml.safe_dump({**base, "tiers": [*base["tiers"], {**tier, "direct_io": False,
                                                             "read_processes": "auto", "file_mode": 0o640}]})
    (tmp_path / "c.yaml").write_text(yml)
    for name, direct, procs in (("c.json", "auto", 64), ("c.yaml", False, "auto")):
        cfg = StoreConfig.from_file(tmp_path / name).tiers[1]
        assert isinstance(cfg, FsspecTierConfig)
        assert (cfg.required, cfg.direct_io, cfg.read_processes, cfg.io_depth, cfg.file_mode) == (
            True, direct, procs, 1024, 0o640)


def test_a_key_file_with_anything_past_its_key_is_refused_unprinted(tmp_path: Path) -> None:
    path = tmp_path / "key"
    key = secrets.token_hex(32)
    for text in (key + "\n" + " " * 5000 + "garbage-after-4096-bytes",
                 key + "\n" + "\n" * 5000,
                 key + "\n#" + "c" * 5000):
        path.write_text(text)
        path.chmod(0o600)
        with pytest.raises(ConfigError, match="64 hex characters") as info:
            load_key_file(str(path))
        assert key[:16] not in str(info.value) and "garbage" not in str(info.value)
    path.write_text(f"\n  {key}  \n\n")
    assert load_key_file(str(path)) == bytes.fromhex(key)

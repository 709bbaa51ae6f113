"""SGLang's own HiCache classes through a tierkv daemon (``daemon`` in the extra config): pages one
process backs up are served to another from the daemon's CPU pool, never read from its tier."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sgl_pools import TIERKV, restored_from_another_process

HERE = Path(__file__).parent
ROOT = HERE.parents[1]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[str]:
    """A ``tierkv serve`` process with a file tier; its socket path."""
    config, sock = tmp_path / "daemon.json", str(tmp_path / "tierkv.sock")
    config.write_text(json.dumps({"cpu_bytes_to_use": 16 << 20, "shm_dir": str(tmp_path),
                                  "tiers": [{"kind": "fsspec", "url": f"file://{tmp_path / 'tier'}"}]}))
    proc = subprocess.Popen([sys.executable, "-m", "tierkv.cli", "serve", "--config", str(config), "--socket",
                             sock], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    line = proc.stderr.readline()
    assert "serving on" in line, line + proc.stderr.read()
    yield sock
    proc.terminate()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert not list(tmp_path.glob("tierkv-daemon-*")), "a pool file outlived the daemon"


def test_pages_written_by_one_process_are_served_to_another_from_the_daemons_pool(
        tmp_path: Path, daemon: str, closing: list[Any]) -> None:
    extra = {**TIERKV, "interface_v1": 1, "daemon": daemon}
    ctl = restored_from_another_process(extra, tmp_path, closing)
    stats = ctl.storage_backend.stats()
    tier = stats.tiers[1]
    assert tier.hits == tier.bytes_read == tier.promotions == 0, "served from the daemon's pool, not its tier"
    assert len(list((tmp_path / "tier").rglob("*.tkv"))) == 5, "the daemon wrote them to its tier as well"


def test_with_the_daemon_tiers_of_its_own_are_refused_in_one_clear_error(tmp_path: Path) -> None:
    from tierkv import ConfigError
    from tierkv.adapters.sglang.config import SGLangConfig

    with pytest.raises(ConfigError, match="the lower tiers are the daemon's"):
        SGLangConfig.from_extra({"daemon": str(tmp_path / "s.sock"),
                                 "tiers": [{"kind": "fsspec", "url": f"file://{tmp_path}"}]})

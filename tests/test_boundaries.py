"""The package's front doors hold: engine adapters use only the public API (:mod:`tierkv`) and the
adapter API (:mod:`tierkv.adapter`), so the modules behind them can change without breaking them."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import tierkv
import tierkv.adapter

ROOT = Path(tierkv.__file__).parent
ALLOWED = ("tierkv", "tierkv.adapter")


def _tierkv_imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out += [(node.lineno, n) for n in names if n == "tierkv" or n.startswith("tierkv.")]
    return out


def test_adapters_import_only_the_public_and_the_adapter_api() -> None:
    wrong = [f"{p.relative_to(ROOT)}:{line}: {name}"
             for p in sorted((ROOT / "adapters").rglob("*.py"))
             for line, name in _tierkv_imports(p)
             if name not in ALLOWED and not name.startswith("tierkv.adapters")]
    assert not wrong, "adapters reach behind the front doors:\n" + "\n".join(wrong)


def test_every_adapter_name_resolves() -> None:
    assert sorted(tierkv.adapter.__all__) == sorted(tierkv.adapter._WHERE)
    for name in tierkv.adapter.__all__:
        assert getattr(tierkv.adapter, name) is not None, name


def test_the_adapter_api_loads_only_what_is_asked_for() -> None:
    """A worker process that copies blocks needs :class:`DeviceTransfer`, not the store."""
    code = ("import sys; from tierkv.adapter import DeviceTransfer; "
            "print(sorted(m for m in sys.modules if m in ('tierkv.store', 'tierkv.movement.gateway')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout

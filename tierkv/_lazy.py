"""Front doors that import their names on first use (PEP 562): ``__getattr__ = lazy(__name__, WHERE)``."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy"]


def lazy(module: str, where: Mapping[str, str | tuple[str, str]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``module``: ``where[name]`` is the module that defines ``name``
    (or ``(module, its name there)``); the value is imported on first use and kept."""

    def __getattr__(name: str) -> Any:
        target = where.get(name)
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        source, attr = (target, name) if isinstance(target, str) else target
        value = getattr(importlib.import_module(source), attr)
        setattr(sys.modules[module], name, value)
        return value

    return __getattr__

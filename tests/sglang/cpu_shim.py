"""Lets SGLang 0.5.23's HiCache modules import beside the CPU build of torch, without torchvision.

Import this before anything from ``sglang`` (tests/sglang/conftest.py does).

``sglang.srt.configs`` (pulled in by ``memory_pool`` through ``configs.mamba_utils``) imports
``torchvision.transforms`` at module level, but no CPU torchvision matching torch 2.13.0 is on PyPI:
``pip install torchvision`` replaces torch with a CUDA build and gigabytes of nvidia wheels. HiCache
never calls torchvision, so every ``torchvision[.*]`` module becomes an inert stub. transformers'
cached ``is_torchvision_available()`` is asked first, while torchvision is truly absent, so it stays
False.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import Any

import torch  # noqa: F401  (the real torch is imported before the stub exists)


class _Unavailable:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("torchvision is a stub in this CPU venv (tests/sglang/cpu_shim.py)")


class InterpolationMode(enum.Enum):
    """The one torchvision name SGLang reads at import time."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _module_getattr(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return InterpolationMode if name == "InterpolationMode" else _Unavailable


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        m = types.ModuleType(spec.name)
        m.__path__ = []
        m.__getattr__ = _module_getattr  # type: ignore[method-assign]
        m.InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
        if spec.name == "torchvision":
            m.__version__ = "0.0.0+cpu-shim"  # type: ignore[attr-defined]
        return m

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install() -> None:
    """Install the stub (idempotent)."""
    if any(isinstance(f, _StubFinder) for f in sys.meta_path):
        return
    try:
        import transformers.utils.import_utils as iu
    except ImportError:
        iu = None
    for fn in ("is_torchvision_available", "is_torchvision_v2_available"):
        if iu is not None and hasattr(iu, fn) and getattr(iu, fn)() is not False:
            raise RuntimeError("a real torchvision is installed: remove it from the SGLang test venv")
    sys.meta_path.insert(0, _StubFinder())


install()

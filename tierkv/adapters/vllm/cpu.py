"""What vLLM's CPU backend needs from tierkv on CPUs whose instructions it picks by flags.

**AMX tile permission.** Linux hands out AMX tile state per process, on request
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``); an AMX tile instruction in a process that
never asked is killed with SIGILL. vLLM 0.32's CPU attention kernel (``cpu_attn_amx.hpp``, chosen
when the CPU has ``amx_tile``, the KV cache is bf16 and blocks are multiples of 32 tokens) uses AMX
tiles without asking: it relies on an earlier AMX matrix multiply of torch or oneDNN having asked.
A model whose linear layers take no AMX path for a few tokens (small weights: vLLM's sgl kernels use
AMX only past 4 tokens) and an engine whose first step is a single token over a prefix that tierkv
restored (no prefill ran) reach that kernel first: the engine dies in its first step.
:func:`ensure_amx_permission` asks, in every process that builds tierkv's vLLM spec.

**KV bytes that depend on the CPU.** The AMX attention path keeps K and V in a tile-packed layout,
the vector path in another; on CPUs with ``avx512_bf16`` vLLM also sets the Mamba/GDN conv state
layout (``VLLM_SSM_CONV_STATE_LAYOUT``). Blocks written by an engine on one kind of CPU would be
wrong bytes to an engine on another sharing the tier, so :func:`cpu_kv_format` becomes part of the
namespace on vLLM's CPU platform.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys

__all__ = ["amx_permitted", "amx_supported", "cpu_kv_format", "ensure_amx_permission"]

log = logging.getLogger("tierkv.vllm")

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def _x86_linux() -> bool:
    return sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")


def amx_supported() -> bool:
    """Whether this CPU has AMX tiles (what vLLM's CPU backend asks before it picks AMX kernels)."""
    if not _x86_linux():
        return False
    import torch

    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if probe is not None:
        return bool(probe())
    try:
        with open("/proc/cpuinfo") as f:
            return " amx_tile" in f.read()
    except OSError:
        return False


def amx_permitted() -> bool:
    """Whether this process may use AMX tile data (``ARCH_GET_XCOMP_PERM``)."""
    if not _x86_linux():
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    mask = ctypes.c_uint64(0)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) != 0:
        return False
    return bool(mask.value & (1 << _XFEATURE_XTILEDATA))


def ensure_amx_permission() -> str:
    """Ask the kernel for AMX tile data in this process when the CPU has AMX; what happened:
    ``"granted"``, ``"not needed (no AMX on this CPU)"`` or ``"refused: ..."``. Never raises."""
    try:
        if not amx_supported():
            return "not needed (no AMX on this CPU)"
        if amx_permitted():
            return "granted"
        import torch

        init = getattr(torch.cpu, "_init_amx", None)
        if init is not None:
            init()
        else:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
        if amx_permitted():
            return "granted"
        return f"refused: {os.strerror(ctypes.get_errno()) or 'the kernel said no'}"
    except Exception as exc:  # a probe must never stop an engine
        return f"refused: {type(exc).__name__}: {exc}"


def cpu_kv_format(is_cpu_platform: bool) -> str:
    """The part of the namespace that names how this CPU lays out KV bytes ('' off the CPU
    platform): the attention kernel family and, where vLLM sets it, the conv state layout."""
    if not is_cpu_platform:
        return ""
    parts = [f"cpu-attn={'amx' if amx_supported() else 'vec'}"]
    conv = os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT")
    if conv:
        parts.append(f"conv={conv}")
    return ",".join(parts)

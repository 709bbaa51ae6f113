"""What a vLLM engine's KV bytes depend on, read from vLLM's own config objects (docs/design.md,
"What a key means").

vLLM hands an offloading spec only its ``OffloadingConfig`` (model name, KV dtype, groups, parallel
sizes). The rest (quantization, the weights' revision, the hash algorithm, head counts, the
tokenizer) is in the ``VllmConfig`` and ``KVCacheConfig`` of the connector that builds the spec:
:func:`engine_configs` finds them (the current vLLM config where vLLM set one, else the
connector's arguments on the call stack). A field neither gives is recorded as ``unknown``.

:func:`check_hashes` refuses a persistent tier when vLLM seeds its block hashes per process.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from tierkv import ConfigError
from tierkv.adapters.fingerprint import UNKNOWN, text, weights_revision

__all__ = [
    "NON_CRYPTO_HASHES",
    "attention_backends",
    "check_hashes",
    "engine_configs",
    "fingerprint_fields",
    "group_formats",
    "hash_algo",
    "hashes_per_process",
]

log = logging.getLogger("tierkv.vllm")

#: vLLM's prefix hash algorithms that seed ``NONE_HASH`` randomly in every process unless
#: ``PYTHONHASHSEED`` is set (``vllm/v1/core/kv_cache_utils.py``, ``resolve_none_hash_seed``);
#: ``sha256`` and ``sha256_cbor`` use a fixed seed (or ``PYTHONHASHSEED`` when set)
NON_CRYPTO_HASHES = frozenset({"xxhash", "xxhash_cbor"})
#: how many frames up the stack :func:`engine_configs` looks for the connector's arguments
MAX_FRAMES = 12
_SPEC_FIELDS = ("block_size", "num_kv_heads", "head_size", "head_size_v", "dtype", "kv_quant_mode",
                "sliding_window", "attention_chunk_size", "shapes", "dtypes", "mamba_type",
                "num_head_slots", "state_content_bytes", "tokens_per_state", "page_size_padded")


def engine_configs() -> tuple[Any, Any]:
    """``(VllmConfig, KVCacheConfig)`` of the engine building this spec (either may be None).

    vLLM's ``OffloadingConnector`` builds the spec in its ``__init__(vllm_config, role,
    kv_cache_config)`` and the scheduler side's manager in ``OffloadingConnectorScheduler(spec,
    vllm_config, kv_cache_config)``: both are arguments a few frames up. The current vLLM config
    (``get_current_vllm_config_or_none``) is taken first where vLLM set one.
    """
    vllm_config = kv_cache_config = None
    try:
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
    except Exception:
        vllm_config = None
    frame = sys._getframe(1)
    for _ in range(MAX_FRAMES):
        if frame is None or (vllm_config is not None and kv_cache_config is not None):
            break
        loc = frame.f_locals
        if vllm_config is None and type(loc.get("vllm_config")).__name__ == "VllmConfig":
            vllm_config = loc["vllm_config"]
        if kv_cache_config is None and type(loc.get("kv_cache_config")).__name__ == "KVCacheConfig":
            kv_cache_config = loc["kv_cache_config"]
        frame = frame.f_back  # type: ignore[assignment]
    return vllm_config, kv_cache_config


def _get(obj: Any, *path: str) -> Any:
    for name in path:
        if obj is None:
            return None
        obj = getattr(obj, name, None)
    return obj


def _call(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args) if callable(fn) else None
    except Exception:
        return None


def _spec_text(spec: Any) -> str:
    inner = getattr(spec, "kv_cache_specs", None)
    if isinstance(inner, Mapping):  # one spec per layer (UniformTypeKVCacheSpecs): the distinct ones
        return "[" + ",".join(sorted({_spec_text(s) for s in inner.values()})) + "]"
    parts = [f"{name}={text(getattr(spec, name))}" for name in _SPEC_FIELDS
             if getattr(spec, name, None) is not None]
    return f"{type(spec).__name__}({','.join(parts)})"


def group_formats(kv_cache_config: Any, group_ids: Sequence[int]) -> str:
    """Each offloaded group's KV cache spec as vLLM's KV cache config gives it (class, block size,
    heads, head size, dtype, quantization mode, window, state shapes), ``;``-separated by group."""
    groups = _get(kv_cache_config, "kv_cache_groups")
    if not groups:
        return UNKNOWN
    out = []
    for g in group_ids:
        spec = _get(groups[g], "kv_cache_spec") if 0 <= g < len(groups) else None
        out.append(f"{g}:{_spec_text(spec) if spec is not None else UNKNOWN}")
    return ";".join(out)


def attention_backends(vllm_config: Any, groups: Sequence[Any]) -> str:
    """The attention (or state) backend of each offloaded group's layers, as the worker's model
    has them (``static_forward_context``: filled where the model is loaded, i.e. in the worker;
    the worker publishes this in its manifest): ``<group>:<name>[,<name>]`` per group, ``;``-
    separated; ``unknown`` for a group none of whose layers says."""
    layers = _get(vllm_config, "compilation_config", "static_forward_context")
    if not isinstance(layers, Mapping) or not layers:
        return UNKNOWN
    out = []
    for g in groups:
        names = set()
        for layer_name in getattr(g, "layer_names", ()):
            layer = layers.get(layer_name)
            backend = getattr(layer, "attn_backend", None)
            if backend is None:
                backend = _call(getattr(layer, "get_attn_backend", None))
            name = _call(getattr(backend, "get_name", None))
            if name is not None:
                names.add(text(name))
        out.append(f"{int(g.group_id)}:{','.join(sorted(names)) or UNKNOWN}")
    return ";".join(out)


def hash_algo(vllm_config: Any) -> str:
    """``cache_config.prefix_caching_hash_algo``, or ``unknown``."""
    return text(_get(vllm_config, "cache_config", "prefix_caching_hash_algo"))


def hashes_per_process(algo: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether vLLM seeds its block hashes randomly in each process: a non-cryptographic
    algorithm (:data:`NON_CRYPTO_HASHES`) and no ``PYTHONHASHSEED`` in the environment."""
    env = os.environ if env is None else env
    return algo in NON_CRYPTO_HASHES and env.get("PYTHONHASHSEED") is None


def check_hashes(algo: str, persistent: Sequence[str], where: str,
                 env: Mapping[str, str] | None = None) -> bool:
    """Refuse (:class:`ConfigError`) persistent tiers when vLLM's block hashes are per process:
    another process (a restart, another engine) would never ask for what they hold. Returns True
    when the hashes are per process and nothing persistent is configured (the caller logs that its
    pool cannot outlive the process), else False."""
    if not hashes_per_process(algo, env):
        return False
    if persistent:
        raise ConfigError(
            f"{where}: vLLM's prefix_caching_hash_algo is {algo!r} and PYTHONHASHSEED is not set, so "
            f"vLLM seeds its block hashes randomly in every process and no other process (a restart, "
            f"another engine) could ever find what this one writes to {', '.join(persistent)}. Set "
            f"PYTHONHASHSEED to one value shared by every engine that uses the tier (for example "
            f"PYTHONHASHSEED=0 in the engine's environment), or use --prefix-caching-hash-algo sha256")
    return True


def fingerprint_fields(config: Any, vllm_config: Any, kv_cache_config: Any, group_ids: Sequence[int],
                       kv_format: str = "", backends: str | None = None) -> dict[str, str]:
    """The engine fingerprint of a vLLM engine (``config`` is vLLM's ``OffloadingConfig``): every
    field docs/design.md lists under "What a key means"; ``unknown`` where vLLM does not say.
    ``backends``: :func:`attention_backends` as the worker found them (default: from
    ``vllm_config``, which has them where the model was loaded in this process)."""
    model_config = _get(vllm_config, "model_config")
    cache_config = _get(vllm_config, "cache_config")
    parallel = _get(vllm_config, "parallel_config")
    model = _get(model_config, "model") or _get(config, "model", "name")
    revision = _get(model_config, "revision")
    tokenizer = _get(model_config, "tokenizer")
    tok_revision = _get(model_config, "tokenizer_revision")
    if tok_revision is None and tokenizer is not None:
        tok_revision = revision if tokenizer == model else None
    overrides = _get(model_config, "hf_overrides")
    if isinstance(overrides, Mapping):
        overrides = json.dumps(overrides, sort_keys=True, default=str) if overrides else "none"
    elif callable(overrides):
        overrides = f"function {getattr(overrides, '__qualname__', UNKNOWN)}"
    block_sizes = sorted({int(g.tokens_per_block) for g in getattr(config, "groups", ())})
    return {
        "engine": "vllm",
        "model": text(model),
        "revision": weights_revision(str(model) if model else None, revision),
        "dtype": text(_get(model_config, "dtype")),
        "quantization": text(_get(model_config, "quantization")
                             or ("none" if model_config is not None else None)),
        "hf_overrides": text(overrides),
        "kv_cache_dtype": text(_get(cache_config, "cache_dtype")),
        "kv_dtype": text(_get(config, "model", "dtype")),
        "block_size": ",".join(map(str, block_sizes)) or text(_get(cache_config, "block_size")),
        "kv_heads": text(_call(_get(model_config, "get_total_num_kv_heads"))),
        "kv_heads_per_rank": text(_call(_get(model_config, "get_num_kv_heads"), parallel)
                                  if parallel is not None else None),
        "head_size": text(_call(_get(model_config, "get_head_size"))),
        "kv_groups": group_formats(kv_cache_config, group_ids),
        "kv_cache_layout": text(_get(config, "kv_cache_layout") or _get(cache_config, "kv_cache_layout")),
        "attention_config": text(_get(vllm_config, "attention_config", "backend")
                                 or ("auto" if _get(vllm_config, "attention_config") is not None else None)),
        "attention_backends": backends or attention_backends(vllm_config, getattr(config, "groups", ())),
        "cpu_kv": kv_format or "none",
        "hash_algo": hash_algo(vllm_config),
        "tokenizer": text(tokenizer),
        "tokenizer_revision": text(tok_revision),
        "world_size": text(_get(config, "parallel", "world_size")),
        "tp": text(_get(config, "parallel", "tp_size")),
        "pp": text(_get(config, "parallel", "pp_size")),
    }

"""Group mapping between vLLM's KV cache groups and a tierkv :class:`~tierkv.Layout`.

Every group keeps its original index. Groups vLLM offloads (the prefix-cacheable ones) become
``full``, ``sliding_window`` or ``recurrent`` groups; every other index below the highest
offloaded one becomes a ``scratch`` group, which gets no keys, lookups, slots or files.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tierkv import ConfigError, GroupSpec, Layout

__all__ = ["GroupInfo", "build_layout", "infer_group_info", "transfer_group_sizes"]

log = logging.getLogger("tierkv.vllm")
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


@dataclass(frozen=True)
class GroupInfo:
    """What tierkv needs to know of one offloaded vLLM group."""

    group_id: int
    kind: str
    window_blocks: int | None = None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kind_from_kv_spec(spec: Any, chunk_tokens: int) -> tuple[str, int | None]:
    """tierkv kind (and window in chunks) for a vLLM ``KVCacheSpec`` instance, by class name."""
    names = {c.__name__ for c in type(spec).__mro__}
    if "MambaSpec" in names:
        return "recurrent", None
    if "SlidingWindowSpec" in names:
        return "sliding_window", max(1, _cdiv(int(spec.sliding_window), chunk_tokens))
    if "ChunkedLocalAttentionSpec" in names:
        return "sliding_window", max(1, _cdiv(int(spec.attention_chunk_size), chunk_tokens))
    return "full", None


def _kind_from_hf(hf_config: Any, layer_names: Sequence[str],
                  chunk_tokens: int) -> tuple[str, int | None] | None:
    types = getattr(hf_config, "layer_types", None)
    if not types:
        return None
    for name in layer_names:
        m = _LAYER_INDEX.search(name)
        if m is None or int(m.group(1)) >= len(types):
            continue
        t = str(types[int(m.group(1))])
        if t in ("linear_attention", "mamba", "mamba2", "gdn"):
            return "recurrent", None
        if t in ("sliding_attention", "sliding_window", "local_attention"):
            window = getattr(hf_config, "sliding_window", None) or chunk_tokens
            return "sliding_window", max(1, _cdiv(int(window), chunk_tokens))
        return "full", None
    return None


def infer_group_info(config: Any, chunk_tokens: int, kinds: Mapping[int, str] | None = None,
                     windows: Mapping[int, int] | None = None) -> list[GroupInfo]:
    """Kind and window of every offloaded group of an ``OffloadingConfig``.

    In order: explicit ``group_kinds`` / ``window_blocks`` settings; the KV cache spec of the
    group's layers (found through vLLM's current config, where the model is loaded); the model's
    ``layer_types``; ``full``.
    """
    vllm_config = None
    try:
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
    except ImportError:
        pass
    out = []
    for g in config.groups:
        gid = int(g.group_id)
        found: tuple[str, int | None] | None = None
        if kinds and gid in kinds:
            found = (kinds[gid], None)
        if found is None and vllm_config is not None:
            found = _kind_from_layers(vllm_config, list(g.layer_names), chunk_tokens)
        if found is None and vllm_config is not None:
            hf = getattr(getattr(vllm_config, "model_config", None), "hf_text_config", None)
            found = _kind_from_hf(hf, list(g.layer_names), chunk_tokens)
        kind, window = found or ("full", None)
        if windows and gid in windows:
            window = windows[gid]
        if kind == "sliding_window" and window is None:
            raise ConfigError(f"group {gid} is sliding-window: set kv_connector_extra_config.window_blocks")
        out.append(GroupInfo(gid, kind, window if kind == "sliding_window" else None))
    return out


def _kind_from_layers(vllm_config: Any, layer_names: list[str],
                      chunk_tokens: int) -> tuple[str, int | None] | None:
    try:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase,  # type: ignore[type-abstract,unused-ignore]
                                             layer_names)
    except Exception:  # the model is not loaded in this process (the scheduler)
        return None
    for layer in layers.values():
        try:
            spec = layer.get_kv_cache_spec(vllm_config)
        except Exception:
            continue
        if spec is not None:
            return kind_from_kv_spec(spec, chunk_tokens)
    return None


def build_layout(infos: Sequence[GroupInfo], chunk_tokens: int, block_bytes: Mapping[int, int],
                 states_per_request: int = 1) -> Layout:
    """The tierkv layout: offloaded groups at their indices, scratch groups in the gaps."""
    by_id = {i.group_id: i for i in infos}
    if not by_id:
        raise ConfigError("vLLM offloads no group: nothing for tierkv to store")
    groups = []
    for gid in range(max(by_id) + 1):
        info = by_id.get(gid)
        if info is None:
            groups.append(GroupSpec(kind="scratch", block_bytes=1))
        else:
            groups.append(GroupSpec(kind=info.kind, block_bytes=block_bytes[gid],
                                    window_blocks=info.window_blocks,
                                    states_per_request=states_per_request))
    return Layout(tokens_per_block=chunk_tokens, groups=groups)


def transfer_group_sizes(layout: Layout, counts: Mapping[int, int]) -> list[int]:
    """One entry per group of the engine's full list, zero for groups that are not offloaded."""
    return [counts.get(i, 0) if g.cacheable else 0 for i, g in enumerate(layout.groups)]

"""What an SGLang server's KV pages depend on, read from what SGLang tells its storage backend
(docs/design.md, "What a key means").

SGLang hands a HiCache storage backend a ``HiCacheStorageConfig`` (model name, ranks) and its host
pools (page format: dtype, layers, page size, heads, head dim). The rest (model path and revision,
quantization, KV cache dtype, attention backend, tokenizer) is in the server's arguments, which
SGLang publishes process-wide (``sglang.srt.runtime_context.get_server_args``) before it builds the
cache controller: :func:`current_server_args` reads them, and a field SGLang does not give is
``unknown``.

SGLang's page keys are SHA-256 chained over the page's token ids (seeded only by the request's
``extra_key`` / ``cache_salt``, through SHA-256 too): the same tokens give the same keys in every
process, so no configuration of SGLang needs refusing for its hashes (unlike vLLM's ``xxhash``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from tierkv.adapters.fingerprint import UNKNOWN, text, weights_revision

__all__ = ["HASH_ALGO", "current_server_args", "fingerprint_fields"]

log = logging.getLogger("tierkv.sglang")

#: how SGLang names storage pages (``get_storage_hash_str``: SHA-256 chained over token ids)
HASH_ALGO = "sha256-chain"


def current_server_args() -> Any:
    """SGLang's server arguments in this process, or None where SGLang has not published them (or
    this SGLang has no ``runtime_context``)."""
    try:
        from sglang.srt.runtime_context import get_server_args  # type: ignore[import-not-found,unused-ignore]

        return get_server_args()
    except Exception:
        return None


def _arg(server_args: Any, name: str) -> Any:
    try:
        return getattr(server_args, name, None)
    except Exception:  # a sealed or audited field SGLang refuses to hand out
        return None


def fingerprint_fields(storage_config: Any, server_args: Any, pools: str) -> dict[str, str]:
    """The engine fingerprint of an SGLang server: ``pools`` is every host pool's stored page format
    (the KV layout); the rest from ``storage_config`` (``HiCacheStorageConfig``) and
    ``server_args`` (None: those fields are ``unknown``)."""
    sa = server_args
    model_path = _arg(sa, "model_path")
    revision = _arg(sa, "revision")
    tokenizer = _arg(sa, "tokenizer_path")
    tok_revision = revision if tokenizer is not None and tokenizer == model_path else None
    overrides = _arg(sa, "json_model_override_args")
    if isinstance(overrides, Mapping):
        overrides = json.dumps(overrides, sort_keys=True, default=str)
    known = sa is not None
    if overrides in (None, "", "{}"):
        overrides = "none" if known else None
    return {
        "engine": "sglang",
        "model": text(getattr(storage_config, "model_name", None)),
        "model_path": text(model_path),
        "revision": weights_revision(str(model_path), revision) if model_path else UNKNOWN,
        "dtype": text(_arg(sa, "dtype")),
        "quantization": text(_arg(sa, "quantization") or ("none" if known else None)),
        "model_overrides": text(overrides),
        "kv_cache_dtype": text(_arg(sa, "kv_cache_dtype")),
        "page_size": text(_arg(sa, "page_size")),
        "pools": pools,
        "attention_backend": text(_arg(sa, "attention_backend") or ("auto" if known else None)),
        "hash_algo": HASH_ALGO,
        "tokenizer": text(tokenizer),
        "tokenizer_revision": text(tok_revision),
    }

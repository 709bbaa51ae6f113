"""The engine fingerprint in SGLang: the backend reads the server arguments SGLang publishes
(``runtime_context``) and names its namespace with them, so a server whose weights, quantization
or KV cache dtype differ never reads another's pages, and one with the same arguments does."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sgl_pools import TIERKV, create_backend, fill, keys_of, make_mha, scattered, tokens
from sglang.srt import runtime_context
from sglang.srt.server_args import ServerArgs

from tierkv.adapters.fingerprint import parse_engine_namespace, weights_revision


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"\0" * 256)
    return path


@pytest.fixture
def published() -> Iterator[Any]:
    """Publish server arguments as an SGLang server does at start; put back what was there."""
    ctx = runtime_context.get_context()
    before = ctx._server_args

    def publish(**kw: Any) -> ServerArgs:
        args = ServerArgs(**kw)
        ctx._server_args = args
        return args

    yield publish
    ctx._server_args = before


def test_the_server_arguments_name_the_namespace(file_tier: dict[str, Any], closing: list[Any], model: Path,
                                                 published: Any) -> None:
    extra = {**TIERKV, "interface_v1": 1, "cpu_bytes_to_use": 8 << 20, "tiers": [file_tier]}
    _, host = make_mha("page_first")
    keys = keys_of(tokens(2, seed=21))
    src = scattered(host, 2)
    fill(host, src, seed=21)

    published(model_path=str(model))
    writer = create_backend(extra, host)
    fields = parse_engine_namespace(writer.plan.namespace)
    assert fields is not None
    assert fields["model_path"] == str(model) and fields["revision"] == weights_revision(str(model))
    assert fields["quantization"] == "none" and fields["kv_cache_dtype"] == "auto"
    assert writer.batch_set_v1(keys, src) == [True, True]
    writer.close()

    def found(**kw: Any) -> int:
        published(model_path=str(model), **kw)
        b = create_backend(extra, host)
        closing.append(b)
        return int(b.batch_exists(keys))

    assert found() == 2  # the same server, restarted
    assert found(quantization="fp8") == 0
    assert found(kv_cache_dtype="fp8_e5m2") == 0
    st = (model / "model.safetensors").stat()
    with open(model / "model.safetensors", "r+b") as f:  # one weight rewritten in place
        f.write(b"\1")
    os.utime(model / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert found() == 0

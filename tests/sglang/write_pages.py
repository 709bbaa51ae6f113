"""Run as a process of its own: write pages through SGLang's controller into tierkv, then exit.

``python write_pages.py EXTRA_JSON LAYOUT SEED N_PAGES OUT.pt`` backs up ``N_PAGES`` pages of token
seed ``SEED`` from a host pool of ``LAYOUT`` through the real HybridCacheController and detaches
(the backend closes: writes to the lower tiers finish), saving the pages it wrote, as
``[k/v, layer, token, head, dim]`` tensors, to ``OUT.pt``.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cpu_shim  # noqa: F401
from sglang.srt.runtime_context import get_parallel

get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1,
                                    attn_dcp_rank=0)

import torch  # noqa: E402
from sgl_pools import (  # noqa: E402
    PAGE,
    controller,
    entry,
    fill,
    keys_of,
    logical_mha,
    make_mha,
    scattered,
    tokens,
    write_through,
)
from sglang.srt.mem_cache.hicache_storage import PoolName  # noqa: E402
from sglang.srt.mem_cache.pool_host import HostPoolGroup  # noqa: E402


def main() -> None:
    extra, layout, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[5]
    seed, n = int(sys.argv[3]), int(sys.argv[4])
    dev, host = make_mha(layout)
    ctl = controller(HostPoolGroup([entry(PoolName.KV, host, dev, anchor=True)]), dev, extra)
    toks = tokens(n, seed)
    src = scattered(host, n)
    fill(host, src, seed)
    op = write_through(ctl, src, toks, keys_of(toks))
    assert op.completed_tokens == n * PAGE, op.completed_tokens
    ctl.detach_storage_backend()
    torch.save(logical_mha(host, src), out)


if __name__ == "__main__":
    main()

"""One-row copies, as a tier's reading threads make them, against ``memmove`` in the same run.

    python bench/row_copy.py [--kib 256,1024] [--total-mib 512] [--rounds 5]

A tier's thread that has verified a block copies it into the caller's row (tierkv.blocks.rowsink). This
bench copies ``--total-mib`` of rows, one row per call, from one tensor into another, with
``Tensor.copy_`` and with ``tierkv.tensors.copy_row``, on the main thread and on 1 and 4 worker
threads, against ``ctypes.memmove`` of the same rows on the same threads (the baseline). Ratios
above 1: faster than ``memmove``; medians of the rounds.
"""

from __future__ import annotations

import benchmain  # first: Ctrl-C while the imports below load ends quietly

# isort: split

import argparse
import ctypes
import statistics
import threading
import time
from collections.abc import Callable

import torch

from tierkv.tensors import copy_row

Copy = Callable[[torch.Tensor, torch.Tensor], object]


def memmove(dst: torch.Tensor, src: torch.Tensor) -> None:
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.nbytes)


def torch_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def rate(fn: Copy, src: torch.Tensor, dst: torch.Tensor, threads: int) -> float:
    """GB/s copying every row of ``src`` into ``dst`` with ``fn``: ``threads`` 0 is the main thread."""
    n = src.shape[0]

    def work(rows: range) -> None:
        for i in rows:
            fn(dst[i], src[i])

    t0 = time.perf_counter()
    if threads == 0:
        work(range(n))
    else:
        ts = [threading.Thread(target=work, args=(range(k, n, threads),)) for k in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    return src.nbytes / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kib", type=benchmain.positive_list, default=[256, 1024], help="row sizes")
    ap.add_argument("--total-mib", type=benchmain.positive, default=512)
    ap.add_argument("--rounds", type=benchmain.positive, default=5)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, intra-op threads {torch.get_num_threads()}, {args.total_mib} MiB"
          f" of rows per pass, median of {args.rounds} rounds; ratios to memmove on the same threads")
    print(f"{'row':>8} {'threads':>12} {'memmove GB/s':>12} {'copy_':>7} {'copy_row':>9}")
    for kib in args.kib:
        n = (args.total_mib << 10) // kib
        src = torch.randint(0, 256, (n, kib << 10), dtype=torch.uint8)
        dst = torch.ones_like(src)  # touched: no page faults in the timed copies
        for threads in (0, 1, 4):
            got: dict[str, list[float]] = {"memmove": [], "copy_": [], "copy_row": []}
            for _ in range(args.rounds):
                for name, fn in (("memmove", memmove), ("copy_", torch_copy), ("copy_row", copy_row)):
                    got[name].append(rate(fn, src, dst, threads))
            assert torch.equal(dst, src)
            base = statistics.median(got["memmove"])
            where = "main" if threads == 0 else f"{threads} worker"
            print(f"{kib:>6}Ki {where:>12} {base:>12.1f} {statistics.median(got['copy_']) / base:>7.2f}"
                  f" {statistics.median(got['copy_row']) / base:>9.2f}")


if __name__ == "__main__":
    benchmain.run(main)

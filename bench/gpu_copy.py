"""GPU <-> CPU pool copies through tierkv.transfer, as ratios to plain ``Tensor.copy_``.

    python bench/gpu_copy.py [--layers 8] [--page-kib 64] [--blocks 256] [--repeats 7] [--json]

A job moves ``--blocks`` scattered engine blocks of ``--layers`` layer tensors (pages of
``--page-kib`` KiB, vLLM-like) into or out of rows of a CPU pool (pinned when CUDA is present),
the way an engine adapter's worker does. Baseline, same run, same bytes: one plain
``Tensor.copy_`` between a contiguous device tensor and a contiguous pinned host tensor per
layer (the DMA at its best: no gather, no scatter). Ratio = baseline time / tierkv time (1.0:
as fast as the plain copy). Median of ``--repeats`` rounds after a warm-up. Prints "no CUDA
device" and exits 0 where there is none.
"""

from __future__ import annotations

import benchmain  # first: Ctrl-C while the imports below load ends quietly

# isort: split

import argparse
import json
import statistics
import time

import torch

from tierkv.transfer import Copy, DeviceTransfer


def timed(fn: object, repeats: int) -> float:
    samples = []
    for r in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        torch.cuda.synchronize()
        if r:
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=benchmain.positive, default=8)
    p.add_argument("--page-kib", type=benchmain.positive, default=64)
    p.add_argument("--blocks", type=benchmain.positive, default=256)
    p.add_argument("--repeats", type=benchmain.positive, default=7)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_copy: no CUDA device: nothing to measure")
        return 0
    dev = torch.device("cuda")
    page = args.page_kib << 10
    n = args.blocks
    engine_blocks = 4 * n
    layers = [torch.randint(-128, 128, (engine_blocks, page), dtype=torch.int8, device=dev)
              for _ in range(args.layers)]
    pool = torch.zeros((2 * n, args.layers * page), dtype=torch.uint8).pin_memory()
    blocks = torch.randperm(engine_blocks)[:n]
    rows = torch.randperm(2 * n)[:n]
    copies = [Copy(t, blocks, page, pool, rows, i * page) for i, t in enumerate(layers)]
    t = DeviceTransfer(dev)
    job = [0]

    def d2h() -> None:
        job[0] += 1
        t.store(job[0], copies)
        t.wait({job[0]})
        t.finished()

    def h2d() -> None:
        job[0] += 1
        t.load(job[0], copies)
        t.wait({job[0]})
        t.finished()

    flat_dev = [torch.empty((n, page), dtype=torch.int8, device=dev) for _ in layers]
    flat_host = [torch.empty((n, page), dtype=torch.int8).pin_memory() for _ in layers]

    def plain_d2h() -> None:
        for d, h in zip(flat_dev, flat_host, strict=True):
            h.copy_(d, non_blocking=True)

    def plain_h2d() -> None:
        for d, h in zip(flat_dev, flat_host, strict=True):
            d.copy_(h, non_blocking=True)

    nbytes = args.layers * n * page
    res = {}
    for name, ours, base in (("d2h", d2h, plain_d2h), ("h2d", h2d, plain_h2d)):
        a, b = timed(ours, args.repeats), timed(base, args.repeats)
        res[name] = {"tierkv_gb_s": nbytes / a / 1e9, "copy_gb_s": nbytes / b / 1e9, "ratio": b / a}
    # the bytes must have made the round trip
    check = [torch.zeros_like(x) for x in layers]
    t.load(10**6, [Copy(c, blocks, page, pool, rows, i * page) for i, c in enumerate(check)])
    t.wait({10**6})
    t.finished()
    ok = all(torch.equal(c[blocks], x[blocks]) for c, x in zip(check, layers, strict=True))
    if args.json:
        print(json.dumps({"bytes": nbytes, "device": torch.cuda.get_device_name(), "ok": ok, **res}))
    else:
        print(f"{torch.cuda.get_device_name()}: {args.layers} layers x {n} blocks x {args.page_kib} KiB "
              f"({nbytes / 1e6:,.0f} MB per job)")
        for name, r in res.items():
            print(f"  {name}: tierkv {r['tierkv_gb_s']:.2f} GB/s, plain copy_ {r['copy_gb_s']:.2f} GB/s, "
                  f"ratio {r['ratio']:.2f}")
        print("  round trip: " + ("bytes identical" if ok else "BYTES DIFFER"))
    return 0 if ok else 1


if __name__ == "__main__":
    benchmain.run(main)

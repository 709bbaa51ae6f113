"""What naming a local model's weights costs an engine's start-up (the engine fingerprint's revision).

    python bench/fingerprint_digest.py [--total-gb 10] [--files 4] [--rounds 20] [--dir DIR]

Makes a model directory of ``--files`` sparse weight files (``model-0000i-of-0000n.safetensors``,
``--total-gb`` GB in all, 1 GB = 1e9 bytes, no block of them written), a ``config.json`` and a
safetensors index, and times :func:`tierkv.adapters.fingerprint.weights_revision` on it: the
first call (directory entries not yet looked at by this process), then the median and the
slowest of ``--rounds`` more. The digest reads only the files' names, sizes and modification times
(``stat``), never their bytes, so sizes do not change its cost; the number of files does.
The bound this must stay under: 1 s of start-up for a 10 GB model.
"""

from __future__ import annotations

import benchmain  # first: Ctrl-C while the imports below load ends quietly

# isort: split

import argparse
import json
import os
import statistics
import tempfile
import time

from tierkv.adapters.fingerprint import weights_revision

BOUND_S = 1.0


def make_model(root: str, total_bytes: int, files: int) -> str:
    """A model directory of ``files`` sparse shards totalling ``total_bytes``."""
    path = os.path.join(root, "model")
    os.makedirs(path)
    each = total_bytes // files
    weight_map = {}
    for i in range(files):
        name = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        with open(os.path.join(path, name), "wb") as f:
            f.truncate(each)
        weight_map[f"layers.{i}.weight"] = name
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"]}, f)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, f)
    return path


def main() -> int:
    p = argparse.ArgumentParser(prog="fingerprint_digest.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--total-gb", type=benchmain.positive, default=10, help="size of the model's weights")
    p.add_argument("--files", type=benchmain.positive, default=4, help="weight files (shards)")
    p.add_argument("--rounds", type=benchmain.positive, default=20, help="timed calls after the first")
    p.add_argument("--dir", type=benchmain.directory, default=None, help="where to make the model")
    args = p.parse_args()
    root = benchmain.remove_at_exit(tempfile.mkdtemp(prefix="tierkv-digest-", dir=args.dir))
    path = make_model(root, args.total_gb * 10**9, args.files)
    apparent = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    allocated = sum(os.stat(os.path.join(path, n)).st_blocks * 512 for n in os.listdir(path))
    t = time.perf_counter()
    revision = weights_revision(path)
    first = time.perf_counter() - t
    times = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        again = weights_revision(path)
        times.append(time.perf_counter() - t)
        assert again == revision
    print(f"model: {args.files} weight files, {apparent / 1e9:.1f} GB apparent ({allocated} bytes "
          f"allocated), in {path}")
    print(f"revision: {revision}")
    print(f"first call: {first * 1e3:.3f} ms; {args.rounds} more: median "
          f"{statistics.median(times) * 1e3:.3f} ms, slowest {max(times) * 1e3:.3f} ms "
          f"(bound: {BOUND_S:.0f} s)")
    return 0 if max(first, *times) < BOUND_S else 1


if __name__ == "__main__":
    benchmain.run(main)

"""Helper processes for the fsspec tier's process tests (crashes, restarts, sharing).

Modes (``python tests/crash_writer.py MODE ...``):

``write URL START``
    Write records through an ``FsspecTier`` (fsync on) in an endless loop, starting at key
    ``START``, and print ``ack <key hex>`` for each record ``put`` acknowledged (one ``os.write``
    per line, so a SIGKILL never leaves half a line). Every few batches an earlier key is written
    again (same bytes), so kills also land in overwrites.
``serve URL``
    A fork server for fast kill loops: reads ``fork START`` lines on stdin, forks a ``write``
    child, prints ``pid <pid>``, waits for it and prints ``exit <pid> <status>``. Python, torch
    and tierkv are imported once instead of once per kill.
``store-write URL NAMESPACE N`` / ``store-read URL NAMESPACE N [LAYOUT]``
    Through a ``TieredStore`` (cpu primary + fsspec tier): write ``N`` prefix blocks and exit; or,
    in a fresh process, look them up until the answers settle and read them. Prints JSON.
``share URL SEED OTHER SECONDS``
    One of two processes sharing a directory: writes its own blocks, reads its own and the other
    process's, checks every byte it gets; prints JSON counts.

Block data is derived from the key (:func:`data_of`), so any reader can check what it reads.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
from typing import Any

import anyio
import torch

from tierkv import GroupSpec, Layout
from tierkv.backends.base import TierContext
from tierkv.backends.fsspec import FsspecTier, FsspecTierConfig
from tierkv.keys import make_key

BLOCK = 64 << 10
NAMESPACE = "crash-test"
FULL, REC = 0, 1
#: keys of one writer run are START, START + 1, ...; runs use starts STRIDE apart
STRIDE = 100_000


def crash_layout() -> Layout:
    """The layout the crash writer uses: one full group of 64 KiB blocks."""
    return Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=BLOCK)])


def store_layout(variant: str = "a") -> Layout:
    """The layout of the store modes; variant ``b`` differs only in tokens_per_block."""
    return Layout(tokens_per_block=16 if variant == "a" else 32, groups=[
        GroupSpec(kind="full", block_bytes=4096),
        GroupSpec(kind="recurrent", block_bytes=8192, states_per_request=1),
    ])


def key_of(i: int, group: int = FULL) -> bytes:
    """The key of the crash writer's ``i``-th block."""
    return make_key(hashlib.sha256(b"crash-%d" % i).digest(), group)


def hash_of(seed: int, i: int) -> bytes:
    """The ``i``-th prefix hash of document ``seed``."""
    return hashlib.sha256(b"doc-%d-%d" % (seed, i)).digest()


def data_of(key: bytes, nbytes: int) -> torch.Tensor:
    """The bytes every block with ``key`` holds: a deterministic function of the key."""
    raw = hashlib.shake_256(key).digest(nbytes)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _emit(line: str) -> None:
    os.write(1, (line + "\n").encode())


def crash_tier(url: str) -> FsspecTier:
    """The fsspec tier the crash writer writes through (fsync on)."""
    layout = crash_layout()
    ctx = TierContext(layout=layout, namespace=NAMESPACE, fingerprint=layout.fingerprint(NAMESPACE))
    cfg = FsspecTierConfig(url=url, fsync=True, codec="zstd-shuffle", io_threads=4,
                           scan_on_open=False)
    return FsspecTier(cfg, ctx)


async def write_loop(url: str, start: int) -> None:
    """Write (and acknowledge) records forever, from key ``start`` on."""
    tier = crash_tier(url)
    await tier.open()
    i = start
    batch = 0
    while True:
        idx = [i, i + 1, i + 2]
        i += 3
        batch += 1
        if start >= STRIDE and batch % 2 == 0:
            idx.append(random.randrange(0, start // STRIDE) * STRIDE + random.randrange(0, 6))
        keys = [key_of(j) for j in dict.fromkeys(idx)]
        data = torch.stack([data_of(k, BLOCK) for k in keys])
        ok = await tier.put(FULL, keys, data)
        for k, good in zip(keys, ok, strict=True):
            if good:
                _emit(f"ack {k.hex()}")


def serve(url: str) -> None:
    """Fork one writer per ``fork START`` line on stdin; report its pid and exit status."""
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "quit":
            break
        if cmd[0] != "fork":
            continue
        start = int(cmd[1])
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                random.seed(os.getpid())
                anyio.run(write_loop, url, start)
            except BaseException:
                code = 3
            os._exit(code)
        _emit(f"pid {pid}")
        _, status = os.waitpid(pid, 0)
        _emit(f"exit {pid} {status}")


def store_config(url: str, namespace: str, variant: str = "a", **fs: Any) -> dict[str, Any]:
    """Config of the store modes: a cpu primary and one fsspec tier."""
    return {"layout": store_layout(variant), "namespace": namespace, "max_concurrent_requests": 2,
            "tiers": [{"kind": "cpu", "slots": {FULL: 64, REC: 4}},
                      {"kind": "fsspec", "url": url, "codec": "zstd-shuffle", **fs}]}


async def store_write(url: str, namespace: str, n: int) -> dict[str, Any]:
    """Write ``n`` full blocks and the recurrent state at the last one; flush."""
    from tierkv import TieredStore

    async with TieredStore(store_config(url, namespace)) as store:
        hs = [hash_of(0, i) for i in range(n)]
        await store.put(FULL, hs, torch.stack([data_of(make_key(h, FULL), 4096) for h in hs]))
        await store.put(REC, hs[-1:], data_of(make_key(hs[-1], REC), 8192)[None])
        await store.flush()
        st = store.stats().tiers[1]
        return {"stores": st.stores, "failed": st.stores_failed, "shed": st.stores_shed}


async def store_read(url: str, namespace: str, n: int, variant: str) -> dict[str, Any]:
    """Look up ``n`` blocks until the answers settle, then read them."""
    from tierkv import BlockMissing, TieredStore

    async with TieredStore(store_config(url, namespace, variant)) as store:
        hs = [hash_of(0, i) for i in range(n)]
        answers = []
        for _ in range(10):
            res = store.lookup(FULL, hs, request_id="r")
            answers.append(sorted({r.value for r in res}))
            if all(r.value != "pending" for r in res):
                break
            await store.idle()
        prefix = []
        for _ in range(10):
            p = store.lookup_prefix(hs, request_id="p")
            prefix.append([p.blocks, p.state.value])
            if p.state.value != "pending":
                break
            await store.idle()
        out = torch.zeros((n, 4096), dtype=torch.uint8)
        equal: bool | None = None
        missing: list[int] = []
        try:
            await store.get(FULL, hs, out, request_id="r")
            want = torch.stack([data_of(make_key(h, FULL), 4096) for h in hs])
            equal = bool(torch.equal(out, want))
        except BlockMissing as exc:
            missing = exc.missing
        rec = torch.zeros((1, 8192), dtype=torch.uint8)
        rec_equal: bool | None = None
        try:
            await store.get(REC, hs[-1:], rec, request_id="p")
            rec_equal = bool(torch.equal(rec[0], data_of(make_key(hs[-1], REC), 8192)))
        except BlockMissing:
            pass
        return {"answers": answers, "prefix": prefix, "equal": equal, "missing": missing,
                "rec_equal": rec_equal, "backend": store.stats().tiers[1].backend}


async def share(url: str, seed: int, other: int, seconds: float) -> dict[str, Any]:
    """Write own blocks, read own and the other process's; count what each read gave."""
    from tierkv import BlockMissing, TieredStore

    root = url.removeprefix("file://")
    counts = {"written": 0, "own_ok": 0, "other_ok": 0, "missing": 0, "wrong": 0, "errors": []}
    cfg = store_config(url, "shared", capacity_bytes=120 * 4200)
    cfg["tiers"][0]["slots"] = {FULL: 4, REC: 1}
    async with TieredStore(cfg) as store:
        # start together: each process says it is ready and waits for the other
        open(f"{root}/ready-{seed}", "w").close()
        t_end = time.monotonic() + 30
        while not os.path.exists(f"{root}/ready-{other}") and time.monotonic() < t_end:
            await anyio.sleep(0.01)
        rng = random.Random(seed)
        deadline = time.monotonic() + seconds
        i = 0
        while time.monotonic() < deadline:
            hs = [hash_of(seed, i + j) for j in range(4)]
            i += 4
            await store.put(FULL, hs, torch.stack([data_of(make_key(h, FULL), 4096) for h in hs]))
            await store.flush()
            counts["written"] += 4
            for _ in range(6):
                who = rng.choice((seed, other))
                h = hash_of(who, rng.randrange(0, i + 8))
                out = torch.zeros((1, 4096), dtype=torch.uint8)
                try:
                    if rng.random() < 0.3:
                        store.lookup(FULL, [h], request_id="x")
                    await store.get(FULL, [h], out, request_id="x")
                except BlockMissing:
                    counts["missing"] += 1
                    continue
                except Exception as exc:
                    counts["errors"].append(repr(exc))
                    continue
                finally:
                    store.release("x")
                if torch.equal(out[0], data_of(make_key(h, FULL), 4096)):
                    counts["own_ok" if who == seed else "other_ok"] += 1
                else:
                    counts["wrong"] += 1
        counts["backend"] = store.stats().tiers[1].backend
    return counts


def main(argv: list[str]) -> int:
    """Dispatch on the mode (see the module docstring)."""
    mode, url = argv[0], argv[1]
    if mode == "write":
        anyio.run(write_loop, url, int(argv[2]))
    elif mode == "serve":
        serve(url)
    elif mode == "store-write":
        print(json.dumps(anyio.run(store_write, url, argv[2], int(argv[3]))))
    elif mode == "store-read":
        variant = argv[4] if len(argv) > 4 else "a"
        print(json.dumps(anyio.run(store_read, url, argv[2], int(argv[3]), variant)))
    elif mode == "share":
        print(json.dumps(anyio.run(share, url, int(argv[2]), int(argv[3]), float(argv[4]))))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

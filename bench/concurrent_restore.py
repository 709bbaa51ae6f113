"""Concurrent restores through a small recurrent pool: tierkv's admission vs a naive policy.

    python bench/concurrent_restore.py [--blocks 8] [--json]

For 8, 32 and 64 concurrent restores with 2, 4 and 8 recurrent slots, documents are written to a
``file://`` tier by another store, then a new store restores them all in the same step. Printed per
point: tokens restored / tokens on disk, and mean steps waited, for tierkv's FIFO admission and for
the naive policy (a full primary is a miss), in the same run.
"""

from __future__ import annotations

import benchmain  # first: Ctrl-C while the imports below load ends quietly

# isort: split

import argparse
import json

import anyio

from tierkv.tools.simulate import Scenario, run_scenario


async def main(blocks: int, as_json: bool) -> None:
    rows = []
    for requests in (8, 32, 64):
        for slots in (2, 4, 8):
            point = {"requests": requests, "recurrent_slots": slots}
            for admission in ("queue", "naive"):
                sc = Scenario(documents=requests, requests=requests, blocks=blocks,
                              kinds=["full", "sliding_window", "recurrent"], slots={2: slots},
                              default_slots=4096, block_bytes=4096, admission=admission,
                              writer_subprocess=False, max_steps=1000)
                res = await run_scenario(sc)
                point[admission] = {"restored": res.restored_fraction,
                                    "mean_steps_waited": res.mean_steps_waited,
                                    "from_scratch": sum(r.from_scratch for r in res.requests)}
            rows.append(point)
    if as_json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'requests':>8} {'slots':>5} | {'tierkv restored':>15} {'steps':>6} | "
          f"{'naive restored':>14} {'steps':>6} {'scratch':>7}")
    for p in rows:
        q, n = p["queue"], p["naive"]
        print(f"{p['requests']:>8} {p['recurrent_slots']:>5} | {q['restored']:>15.3f} "
              f"{q['mean_steps_waited']:>6.2f} | {n['restored']:>14.3f} {n['mean_steps_waited']:>6.2f} "
              f"{n['from_scratch']:>7}")


def cli() -> None:
    """Parse the command line and run the benchmark."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=benchmain.positive, default=8)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    anyio.run(main, a.blocks, a.json)


if __name__ == "__main__":
    benchmain.run(cli)

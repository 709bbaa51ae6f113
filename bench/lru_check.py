"""An LRU of the trace accounting in 20 lines, without tierkv: the check on ``tierkv replay``'s LRU rows.

    python bench/lru_check.py TRACE [CAPACITY ...]      (CAPACITY 0: unbounded)
"""

import json
import sys
from collections import OrderedDict


def lru(path: str, capacity: int, block_tokens: int = 512) -> float:
    cache: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            ids, n = r["hash_ids"], 0
            while n < len(ids) and ids[n] in cache:
                n += 1
            hit += min(n * block_tokens, r["input_length"])
            total += r["input_length"]
            for h in ids:  # after the lookup every block is stored or touched, in order
                cache[h] = None
                cache.move_to_end(h)
                if capacity and len(cache) > capacity:
                    cache.popitem(last=False)
    return hit / total


if __name__ == "__main__":
    for cap in [int(c) for c in sys.argv[2:]] or [2000, 6000, 0]:
        print(f"{cap or 'unbounded'}: {lru(sys.argv[1], cap):.4f}")

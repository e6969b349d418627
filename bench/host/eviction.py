"""Eviction cost of the prefix cache with thousands of cached prefixes (host only).

    python -m bench.host.eviction [--prefixes 1000,4000,16000] [--policy lru]

Fills a `PrefixTree` with N cached prefixes (a shared system prompt, then distinct branches of
1-8 pages, each with a checkpoint), then evicts them one victim at a time: the heap (the
library's) against a scan of every evictable leaf per victim (the eviction before issue 32).
Both must free the same entries in the same order; prints microseconds per victim.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from inkling_jax.cache.prefix_tree import EVICT_POLICIES, PrefixTree


class ScanTree(PrefixTree):
    """Eviction by scanning the whole tree for each victim (O(n) per victim)."""

    def _pop_victim(self):
        leaves = [n for n in self._nodes() if self._is_evictable_leaf(n)]
        return min(leaves, key=self._priority) if leaves else None


def filled(cls, n: int, policy: str, page_size: int = 16, seed: int = 0) -> PrefixTree:
    rng = np.random.RandomState(seed)
    tree = cls(page_size, policy)
    system = list(rng.randint(0, 50_000, 4 * page_size))
    next_id = 1
    for _ in range(n):
        pages = int(rng.randint(1, 9))
        tokens = system + list(rng.randint(0, 50_000, pages * page_size))
        ids = list(range(next_id, next_id + 4 + pages))
        next_id += 4 + pages
        tree.insert(tokens, ids[:-1], ids[-1])
        if rng.rand() < 0.3:  # some entries hit again
            m = tree.match(tokens, max_depth=len(tokens))
            tree.lock(m.node)
            tree.record_hit(m.node)
            tree.unlock(m.node)
    return tree


def time_evictions(tree: PrefixTree, victims: int) -> tuple[float, list]:
    freed = []
    t0 = time.perf_counter()
    for _ in range(victims):
        freed.append(tree.evict(need_slots=1))
    return (time.perf_counter() - t0) / victims * 1e6, freed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefixes", default="1000,4000,16000")
    ap.add_argument("--policy", default="lru", choices=sorted(EVICT_POLICIES))
    ap.add_argument("--victims", type=int, default=200, help="victims timed per tree")
    args = ap.parse_args(argv)
    print("| cached prefixes | policy | heap us / victim | scan us / victim | scan / heap | same victims |")
    print("|---|---|---|---|---|---|")
    for n in [int(x) for x in args.prefixes.split(",")]:
        heap_us, heap_freed = time_evictions(filled(PrefixTree, n, args.policy), args.victims)
        scan_us, scan_freed = time_evictions(filled(ScanTree, n, args.policy), args.victims)
        print(f"| {n} | {args.policy} | {heap_us:.1f} | {scan_us:.1f} | {scan_us / heap_us:.0f}x | "
              f"{'yes' if heap_freed == scan_freed else 'NO'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

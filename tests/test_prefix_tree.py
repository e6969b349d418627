"""The prefix tree on its own (host only, no model): eviction policies and their heap.

The heap gives the same victims as scanning every evictable leaf for the policy's smallest
key (the O(n)-per-victim eviction it replaced), under random inserts, locks, hits and
evictions; each policy keeps what it promises."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inkling_jax.cache.prefix_tree import EVICT_POLICIES, PrefixTree

PS = 2  # page size


class ScanTree(PrefixTree):
    """The reference: every victim found by scanning the whole tree (no heap)."""

    def _pop_victim(self):
        leaves = [n for n in self._nodes() if self._is_evictable_leaf(n)]
        return min(leaves, key=self._priority) if leaves else None


class Ids:
    def __init__(self):
        self.next = 1

    def take(self, n):
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def drive(tree: PrefixTree, ops, seed: int) -> list:
    """Apply a random op sequence; returns what every eviction freed."""
    rng = np.random.RandomState(seed)
    ids, locked, log = Ids(), [], []
    for op in ops:
        if op == "insert":
            n_pages = rng.randint(1, 6)
            tokens = [int(rng.randint(0, 3)) for _ in range(n_pages * PS)]  # few symbols: shared paths
            dup_pages, dup_slots, node = tree.insert(tokens, ids.take(n_pages), ids.take(1)[0])
            if rng.rand() < 0.3:
                tree.lock(node)
                locked.append(node)
        elif op == "unlock" and locked:
            tree.unlock(locked.pop(rng.randint(len(locked))))
        elif op == "hit":
            tokens = [int(rng.randint(0, 3)) for _ in range(rng.randint(1, 6) * PS)]
            m = tree.match(tokens, max_depth=len(tokens))
            if m.depth:
                tree.lock(m.node)
                tree.record_hit(m.node)
                locked.append(m.node)
        elif op == "evict":
            log.append(tree.evict(need_slots=int(rng.randint(0, 3)), need_pages=int(rng.randint(0, 4))))
        tree.check()
    while locked:
        tree.unlock(locked.pop())
    log.append(tree.evict(need_slots=1 << 30, need_pages=1 << 30))
    assert tree.owned() == ([], [])
    return log


@settings(max_examples=60, deadline=None, derandomize=True)
@given(policy=st.sampled_from(sorted(EVICT_POLICIES)), seed=st.integers(0, 2**31 - 1),
       ops=st.lists(st.sampled_from(["insert", "insert", "unlock", "hit", "evict"]), min_size=5, max_size=120))
def test_heap_evicts_what_a_scan_of_the_tree_evicts(policy, seed, ops):
    assert drive(PrefixTree(PS, policy), ops, seed) == drive(ScanTree(PS, policy), ops, seed)


def test_policies_keep_what_they_promise():
    """lru: the oldest entry goes; lfu: an often-hit entry outlives newer ones; deepest: a
    long entry goes before the shared short prefix it extends."""
    def tree_with(policy):
        t = PrefixTree(PS, policy)
        a = t.insert([1, 1], [1], 1)[2]  # a short shared prefix
        t.insert([1, 1, 2, 2, 2, 2], [1, 2, 3], 2)  # extends it (the short one is no leaf now)
        c = t.insert([3, 3], [4], 3)[2]
        for _ in range(3):  # c is hit three times
            t.lock(c)
            t.record_hit(c)
            t.unlock(c)
        t.insert([4, 4], [5], 4)
        return t, a

    lru, _ = tree_with("lru")
    assert lru.evict(need_slots=1) == ([2, 3], [2])  # the extension: least recently used leaf
    lfu, _ = tree_with("lfu")
    order = [lfu.evict(need_slots=1)[1] for _ in range(4)]
    assert order == [[2], [1], [4], [3]]  # the hit entry outlives the newer, unhit ones
    lru2, _ = tree_with("lru")
    assert [lru2.evict(need_slots=1)[1] for _ in range(4)] == [[2], [1], [3], [4]]
    deep, a = tree_with("deepest")
    assert deep.evict(need_slots=1) == ([2, 3], [2])  # depth 6 first
    assert a.checkpoint == 1 and not a.removed


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="evict_policy must be one of"):
        PrefixTree(PS, "random")

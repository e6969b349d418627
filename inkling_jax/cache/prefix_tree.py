"""Radix tree over token ids: cached full-attention pages and conv-state checkpoints.

Edges hold whole pages of tokens. A node owns the pages of its edge and, when a checkpoint
was inserted at its depth, one checkpoint slot: the request state (conv windows, sliding
K/V ring, draft state) after exactly `depth` tokens. K/V alone cannot resume a conv model,
so a match reports the deepest node *with a checkpoint*; the request then restores that
slot into its own slot (copy-on-write inside its first step) and reads the path's pages.

All ids are virtual. Nodes on a path in use are locked (`lock_ref`); eviction removes
unlocked leaves in the order of an eviction policy (`EVICT_POLICIES`: least recently used by
default) and returns their pages and slot to the caller. Evictable leaves wait in a heap keyed
by the policy (stale entries are skipped when popped), so a victim costs O(log n), not a scan
of the tree.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable


@dataclass(eq=False)
class Node:
    tokens: tuple[int, ...]  # edge label, a whole number of pages
    pages: list[int]  # virtual page ids of the edge, one per page_size tokens
    parent: "Node | None"
    depth: int  # tokens from the root to the end of this node
    children: dict[tuple[int, ...], "Node"] = field(default_factory=dict)
    checkpoint: int | None = None  # virtual slot holding the state at `depth`
    lock_ref: int = 0
    last_used: int = 0  # clock of the last lock or insert through this node
    hits: int = 0  # requests admitted reading through this node (a prefix hit at or below it)
    version: int = 0  # bumped whenever its eviction priority may change (heap entries are checked)
    removed: bool = False


# Eviction policies: a key per evictable leaf, the smallest evicted first.
EVICT_POLICIES: dict[str, Callable[[Node], tuple]] = {
    "lru": lambda n: (n.last_used,),  # least recently used
    "lfu": lambda n: (n.hits, n.last_used),  # fewest hits, then least recently used
    "deepest": lambda n: (-n.depth, n.last_used),  # longest prefixes first: shared short ones stay
}


@dataclass
class Match:
    node: Node  # deepest node with a checkpoint (the root when none)
    depth: int  # cached tokens usable by the request (0 when none)
    pages: list[int]  # pages covering [0, depth)


class PrefixTree:
    def __init__(self, page_size: int, evict_policy: str = "lru"):
        if evict_policy not in EVICT_POLICIES:
            raise ValueError(f"evict_policy must be one of {sorted(EVICT_POLICIES)}, got {evict_policy!r}")
        self.page_size = page_size
        self.root = Node((), [], None, 0)
        self._clock = itertools.count(1)
        self._priority = EVICT_POLICIES[evict_policy]
        self._heap: list[tuple[tuple, int, int, Node]] = []  # (priority, seq, node version, node)
        self._seq = itertools.count()

    def _touched(self, node: Node) -> None:
        """node's priority or evictability may have changed: invalidate its heap entries and,
        if it is an evictable leaf now, push it with its current priority."""
        node.version += 1
        if self._is_evictable_leaf(node):
            heapq.heappush(self._heap, (self._priority(node), next(self._seq), node.version, node))

    def _is_evictable_leaf(self, node: Node) -> bool:
        return node is not self.root and not node.removed and not node.children and node.lock_ref == 0

    # ----------------------------------------------------------------- queries

    def _key(self, tokens) -> tuple[int, ...]:
        return tuple(tokens[: self.page_size])

    def match(self, tokens: list[int], max_depth: int) -> Match:
        """Deepest checkpointed prefix of `tokens` no longer than max_depth."""
        found = self.matches(tokens, max_depth)
        return found[0] if found else Match(self.root, 0, [])

    def matches(self, tokens: list[int], max_depth: int) -> list[Match]:
        """Every checkpointed prefix of `tokens` no longer than max_depth, deepest first
        (a shallower one pins fewer of the path's checkpoints while it is locked)."""
        ps = self.page_size
        node, pages, found = self.root, [], []
        pos = 0
        while True:
            child = node.children.get(self._key(tokens[pos:]))
            if child is None:
                break
            n = _common_pages(child.tokens, tokens[pos:], ps)
            if n * ps < len(child.tokens):
                break  # diverges (or ends) inside the edge: no checkpoint beyond here
            pages = pages + child.pages
            pos += len(child.tokens)
            node = child
            if node.checkpoint is not None and node.depth <= max_depth:
                found.append(Match(node, node.depth, list(pages)))
            if pos > max_depth:
                break
        return found[::-1]

    def lock(self, node: Node) -> None:
        t = next(self._clock)
        while node is not None:
            node.lock_ref += 1
            node.last_used = t
            node.version += 1  # locked: its heap entries are stale
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not None:
            assert node.lock_ref > 0, "prefix tree: unlock of an unlocked node"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._touched(node)
            node = node.parent

    def record_hit(self, node: Node) -> None:
        """A request was admitted reading the path to `node` (its prefix hit)."""
        while node is not None and node is not self.root:
            node.hits += 1
            self._touched(node)
            node = node.parent

    # ------------------------------------------------------------------ insert

    def insert(self, tokens: list[int], pages: list[int], checkpoint: int | None) -> tuple[list[int], list[int], Node]:
        """Insert tokens[:len(pages) * page_size] with their pages and a checkpoint at the end.

        The tree takes ownership of what it did not have; returns (pages, slots) the
        caller still owns and must free (duplicates of cached pages, a redundant checkpoint),
        and the node at the end of the inserted prefix."""
        ps = self.page_size
        tokens = list(tokens[: len(pages) * ps])
        assert len(tokens) == len(pages) * ps, "insert: tokens must cover the pages exactly"
        node, pos, dup_pages = self.root, 0, []
        t = next(self._clock)
        while pos < len(tokens):
            key = self._key(tokens[pos:])
            child = node.children.get(key)
            if child is None:
                new = Node(tuple(tokens[pos:]), list(pages[pos // ps:]), node, len(tokens))
                node.children[key] = new
                node = new
                pos = len(tokens)
                break
            n = _common_pages(child.tokens, tokens[pos:], ps)
            if n * ps < len(child.tokens):
                child = self._split(child, n)
            dup_pages += pages[pos // ps: pos // ps + len(child.pages)]
            pos += len(child.tokens)
            node = child
            node.last_used = t
            self._touched(node)
        node.last_used = t
        self._touched(node)
        dup_slots = []
        if checkpoint is not None:
            if node.checkpoint is None and node is not self.root:
                node.checkpoint = checkpoint
            else:
                dup_slots.append(checkpoint)
        return dup_pages, dup_slots, node

    def _split(self, node: Node, n_pages: int) -> Node:
        """Cut `node`'s edge after n_pages pages; returns the new upper node."""
        ps = self.page_size
        cut = n_pages * ps
        upper = Node(node.tokens[:cut], node.pages[:n_pages], node.parent, node.depth - len(node.tokens) + cut,
                     lock_ref=node.lock_ref, last_used=node.last_used, hits=node.hits)
        node.parent.children[self._key(node.tokens)] = upper
        node.tokens, node.pages, node.parent = node.tokens[cut:], node.pages[n_pages:], upper
        upper.children[self._key(node.tokens)] = node
        return upper

    def add_child(self, parent: Node, tokens, pages: list[int], checkpoint: int | None, hits: int = 0,
                  last_used: int = 0) -> Node:
        """Attach a node under `parent` as it was saved (`engine/persist.py` rebuilds a tree
        node by node, parents first): its edge, pages, checkpoint and eviction figures. The
        tree owns the pages and the checkpoint from here on."""
        tokens = tuple(int(t) for t in tokens)
        assert tokens and len(tokens) == len(pages) * self.page_size, "add_child: tokens must cover the pages"
        assert self._key(tokens) not in parent.children, "add_child: the parent has that edge already"
        node = Node(tokens, list(pages), parent, parent.depth + len(tokens), checkpoint=checkpoint, hits=hits,
                    last_used=last_used)
        parent.children[self._key(tokens)] = node
        self._touched(parent)  # no leaf any more: its heap entries are stale
        self._touched(node)
        return node

    def advance_clock(self, t: int) -> None:
        """Later uses are newer than `t` (after add_child with saved `last_used` values)."""
        self._clock = itertools.count(max(next(self._clock), t + 1))

    # ---------------------------------------------------------------- eviction

    def evict(self, need_slots: int = 0, need_pages: int = 0) -> tuple[list[int], list[int]]:
        """Remove unlocked leaves in the policy's order until the freed slots and pages cover
        the need (or nothing is evictable). Returns (pages, slots) to free.

        The capacity contract (`Admission.session_holdings`, `never_fits`): eviction frees only
        unlocked leaves, and the checkpoint-less parents they leave behind; whatever a lock
        pins (every node on a locked path) stays. A policy chooses *which* unlocked leaf goes
        first, never makes a pinned entry evictable: a change to what can be evicted must
        change what `session_holdings` counts as pinned, and the other way round."""
        freed_pages, freed_slots = [], []
        while len(freed_slots) < need_slots or len(freed_pages) < need_pages:
            victim = self._pop_victim()
            if victim is None:
                break
            while True:  # a parent left childless without a checkpoint is dead weight: it goes too
                freed_pages += victim.pages
                if victim.checkpoint is not None:
                    freed_slots.append(victim.checkpoint)
                parent = victim.parent
                del parent.children[self._key(victim.tokens)]
                victim.removed = True
                if parent is self.root or parent.children or parent.checkpoint is not None or parent.lock_ref:
                    break
                victim = parent
            self._merge_up(parent)
            if not parent.removed:
                self._touched(parent)  # perhaps a leaf now
        return freed_pages, freed_slots

    def _pop_victim(self) -> Node | None:
        """The evictable leaf the policy ranks first (stale heap entries are dropped)."""
        while self._heap:
            _, _, version, node = heapq.heappop(self._heap)
            if version == node.version and self._is_evictable_leaf(node):
                return node
        return None

    def _merge_up(self, node: Node) -> None:
        """A checkpoint-less, unlocked node left with one child merges into it."""
        if node is self.root or node.checkpoint is not None or len(node.children) != 1 or node.lock_ref:
            return
        (child,) = node.children.values()
        child.tokens = node.tokens + child.tokens
        child.pages = node.pages + child.pages
        child.parent = node.parent
        node.parent.children[self._key(node.tokens)] = child
        node.removed = True

    def evictable(self) -> tuple[int, int]:
        """(slots, pages) that eviction could free now (unlocked subtrees)."""
        slots = pages = 0
        for n in self._nodes():
            if n is not self.root and n.lock_ref == 0:
                slots += n.checkpoint is not None
                pages += len(n.pages)
        return slots, pages

    def pinned_by(self, nodes) -> tuple[int, int]:
        """(slots, pages) that locks on `nodes` keep from eviction: the checkpoints and pages
        of every node on their paths to the root, each node counted once however many of
        them share it."""
        seen: set[int] = set()
        slots = pages = 0
        for node in nodes:
            while node is not None and node is not self.root and id(node) not in seen:
                seen.add(id(node))
                slots += node.checkpoint is not None
                pages += len(node.pages)
                node = node.parent
        return slots, pages

    # ---------------------------------------------------------------- accounting

    def _nodes(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def owned(self) -> tuple[list[int], list[int]]:
        """(slots, pages) the tree owns."""
        slots, pages = [], []
        for n in self._nodes():
            if n.checkpoint is not None:
                slots.append(n.checkpoint)
            pages += n.pages
        return slots, pages

    def check(self) -> None:
        for n in self._nodes():
            if n is self.root:
                continue
            assert len(n.tokens) == len(n.pages) * self.page_size, "node tokens and pages disagree"
            assert n.depth == n.parent.depth + len(n.tokens), "node depth wrong"
            assert n.parent.children.get(self._key(n.tokens)) is n, "parent link broken"
            assert n.lock_ref >= 0
            assert n.children or n.checkpoint is not None or n.lock_ref > 0, "leaf without a checkpoint"
            assert not n.removed, "a removed node is still in the tree"


def _common_pages(a, b, page_size: int) -> int:
    """Number of leading whole pages on which token sequences a and b agree."""
    n = min(len(a), len(b)) // page_size
    for i in range(n):
        if tuple(a[i * page_size:(i + 1) * page_size]) != tuple(b[i * page_size:(i + 1) * page_size]):
            return i
    return n

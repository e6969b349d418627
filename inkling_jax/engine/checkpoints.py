"""The checkpoint policy: which boundaries a request checkpoints, and what the prefix tree gets.

A checkpoint is a slot holding a request's whole state (conv windows, sliding K/V rings,
draft state) after exactly `depth` tokens, `depth` a multiple of `track_interval`; the tree
needs one to resume a conv model from a cached prefix. Each request has two checkpoint slots
used in turn (ping-pong; eager: both allocated at admission, lazy: taken around a boundary).

* a step that crosses a boundary writes the state at its last boundary into the next
  checkpoint slot (the step's `track` for that row);
* a request still in its prompt hands that checkpoint (with the pages before it) to the tree
  at once (`donate`), and takes a fresh slot;
* a finishing request inserts its newest checkpoint (`insert_at_finish`).
"""

from __future__ import annotations

from ..cache.prefix_tree import PrefixTree
from .admission import Admission
from .config import EngineConfig
from .records import Request

Track = tuple[int, int]  # (index into virtual_track_slots, new tokens before the checkpoint)


class CheckpointPolicy:
    def __init__(self, config: EngineConfig, tree: PrefixTree | None, admission: Admission):
        self.config, self.tree, self.admission = config, tree, admission

    def plan(self, r: Request, n: int) -> Track | None:
        """The checkpoint a step adding n tokens to r writes, or None."""
        if self.tree is None:
            return None
        held = r.held
        interval = self.config.track_interval
        boundary = (held.committed + n) // interval * interval
        if boundary <= held.committed:
            return None
        idx = held.next_track
        if held.virtual_track_slots[idx] == -1:  # lazy: take the second slot only around a boundary
            got = self.admission.try_alloc(1, 0)
            if got is None:
                return None
            held.virtual_track_slots[idx] = got[0][0]
        return idx, boundary - held.committed

    def after(self, r: Request, track: Track) -> None:
        """The step wrote the checkpoint: make it the newest, donate it during the prompt."""
        idx, _ = track
        held = r.held
        depth = held.committed // self.config.track_interval * self.config.track_interval
        if self.config.ping_pong == "lazy":
            other = 1 - idx
            if held.virtual_track_slots[other] > 0:
                self.admission.pool.free_slot(held.virtual_track_slots[other])
                held.virtual_track_slots[other] = -1
        held.last_checkpoint = (depth, idx)
        held.next_track = 1 - idx
        if held.committed < r.prompt_len and r.session is None:
            self.donate(r)

    def donate(self, r: Request) -> None:
        """A request still in its prompt hands its newest checkpoint (and pages) to the tree."""
        held = r.held
        depth, idx = held.last_checkpoint
        slot = held.virtual_track_slots[idx]
        npages = depth // self.config.page_size
        dup_pages, dup_slots, node = self.tree.insert(r.tokens[:depth], held.virtual_pages[:npages], slot)
        held.owned_pages -= set(held.virtual_pages[:npages]) - set(dup_pages)
        # lock the new path before anything can evict: the request still reads those pages
        self.tree.lock(node)
        if held.prefix_node is not None:
            self.tree.unlock(held.prefix_node)
        held.prefix_node = node
        if not dup_slots:  # the tree took the checkpoint slot: replace it
            got = self.admission.try_alloc(1, 0) if self.config.ping_pong == "eager" else None
            held.virtual_track_slots[idx] = got[0][0] if got else -1  # -1: taken again at the next boundary
            held.last_checkpoint = None

    def insert_at_finish(self, r: Request) -> set[int]:
        """Insert a finished request's newest checkpoint; returns the slots the tree took."""
        held = r.held
        if self.tree is None or held.last_checkpoint is None:
            return set()
        depth, idx = held.last_checkpoint
        slot = held.virtual_track_slots[idx]
        npages = depth // self.config.page_size
        dup_pages, dup_slots, _ = self.tree.insert(r.tokens[:depth], held.virtual_pages[:npages], slot)
        held.owned_pages -= set(held.virtual_pages[:npages]) - set(dup_pages)
        return set() if dup_slots else {slot}

"""The checkpoint policy: which boundaries a request checkpoints, and what the prefix tree gets.

A checkpoint is a slot holding a request's whole state (conv windows, sliding K/V rings,
draft state) after exactly `depth` tokens, `depth` a multiple of `track_interval`; the tree
needs one to resume a conv model from a cached prefix, so a hit is only as deep as the
deepest checkpoint on the shared path.

* **Prompt boundaries** (depth <= prompt length, requests outside sessions): every one is
  checkpointed, however the prompt is chunked (an extend step writes up to `M` checkpoints
  per row: `EngineConfig.max_step_checkpoints`; a chunk that crosses more boundaries is cut
  at the M-th), and handed to the tree right after the step (`donate`), with the pages
  before it. Boundaries the tree already holds are skipped. So a prompt that fits in one
  chunk leaves its prompt-end checkpoint at once, and a request that branches off a cached
  path leaves checkpoints at every boundary of its own prompt, the deepest one at or below
  the branch point included: the next request with that prefix hits there.
* **n samples' fork**: sample 0 of a prompt asked for with `SamplingParams.n > 1` also
  checkpoints the last page boundary before its prompt's last token (`Request.fork_depth`,
  any multiple of page_size), where its siblings' prefix hits start.
* **Generation boundaries** (decode and verify steps cross at most one): written into the
  request's ping-pong checkpoint slots (eager: both held from admission; lazy: taken around
  the boundary), the newest kept; a finishing request inserts it (`insert_at_finish`).
  Session turns keep their checkpoints the same way and donate nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..cache.prefix_tree import PrefixTree
from .admission import Admission
from .config import EngineConfig
from .records import Request
from .stats import EngineStats


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint a step writes for a request."""

    depth: int  # tokens in the state it holds (a multiple of track_interval)
    virtual_slot: int  # where it is written
    donate: bool  # a prompt boundary: the tree takes it after the step
    track_index: int | None = None  # the ping-pong entry of virtual_track_slots it uses, if any


class CheckpointPolicy:
    def __init__(self, config: EngineConfig, tree: PrefixTree | None, admission: Admission, stats: EngineStats):
        self.config, self.tree, self.admission, self.stats = config, tree, admission, stats

    @property
    def max_per_step(self) -> int:
        """M: checkpoints one row may write in an extend step."""
        c = self.config
        return max(1, min(c.max_step_checkpoints, -(-c.chunk_size // c.track_interval)))

    # ------------------------------------------------------------------ planning

    def plan(self, r: Request, n: int, start: int | None = None) -> tuple[int, list[Checkpoint]]:
        """The checkpoints a step adding n tokens to r writes, and n (cut where a chunk
        crosses more prompt boundaries than one step writes). `start`: the step's first
        position when it is planned ahead of the commit that reaches it (default: committed)."""
        if self.tree is None:
            return n, []
        held, interval = r.held, self.config.track_interval
        start = held.committed if start is None else start
        first = (start // interval + 1) * interval
        boundaries = list(range(first, start + n + 1, interval))
        if start < r.fork_depth <= start + n and r.fork_depth not in boundaries:  # n samples' shared prompt
            boundaries = sorted(boundaries + [r.fork_depth])
        if not boundaries:
            return n, []
        if r.session is None and boundaries[-1] <= r.prompt_len:
            return self._plan_prompt(r, n, boundaries)
        depth = boundaries[-1]
        idx = held.next_track
        if held.virtual_track_slots[idx] == -1:  # lazy: take the second slot only around a boundary
            got = self.admission.try_alloc(1, 0)
            if got is None:
                self.stats.skipped_checkpoints += 1
                return n, []
            held.virtual_track_slots[idx] = got[0][0]
        return n, [Checkpoint(depth, held.virtual_track_slots[idx], donate=False, track_index=idx)]

    def _plan_prompt(self, r: Request, n: int, boundaries: list[int]) -> tuple[int, list[Checkpoint]]:
        held = r.held
        wanted = [d for d in boundaries if self.tree.match(r.tokens[:d], max_depth=d).depth < d]
        if len(wanted) > self.max_per_step:
            wanted = wanted[:self.max_per_step]
            n = wanted[-1] - held.committed
        # slots: the request's idle ping-pong slots first (no generation checkpoint lives in
        # them during the prompt), then new ones; short of slots, the deepest boundaries win
        slots: list[tuple[int, int | None]] = [(s, i) for i, s in enumerate(held.virtual_track_slots) if s > 0]
        slots = slots[:len(wanted)]
        while len(slots) < len(wanted):
            got = self.admission.try_alloc(1, 0)
            if got is None:
                break
            held.step_slots.append(got[0][0])  # the request's until the step commits or is abandoned
            slots.append((got[0][0], None))
        self.stats.skipped_checkpoints += len(wanted) - len(slots)
        wanted = wanted[len(wanted) - len(slots):]
        return n, [Checkpoint(d, s, donate=True, track_index=i) for d, (s, i) in zip(wanted, slots)]

    # ----------------------------------------------------------- after the step

    def after(self, r: Request, checkpoints: list[Checkpoint]) -> None:
        """The step committed r's tokens: record the checkpoints it wrote (those at or below
        the committed length; a verify step may commit fewer tokens than it could) and
        donate the prompt boundaries."""
        for ck in checkpoints:
            if ck.depth > r.held.committed:
                continue
            if ck.donate:
                self._donate(r, ck)
            else:
                self._rotate(r, ck)
        self.abandon(r)  # slots taken for checkpoints the step did not reach

    def refill(self, r: Request) -> None:
        """Eager ping-pong keeps both checkpoint slots at hand: take back the ones the tree
        took (before planning a step; the host commit itself never allocates)."""
        if self.tree is None or self.config.ping_pong != "eager":
            return
        held = r.held
        for i, s in enumerate(held.virtual_track_slots[:2]):
            if s == -1:
                got = self.admission.try_alloc(1, 0)
                if got is None:
                    return
                held.virtual_track_slots[i] = got[0][0]

    def abandon(self, r: Request) -> None:
        """Give back the slots taken for a step that was not committed."""
        self.admission.free(r.held.step_slots, [])
        r.held.step_slots = []

    def _rotate(self, r: Request, ck: Checkpoint) -> None:
        """A generation checkpoint is the newest: the other ping-pong slot is free for the next."""
        held, idx = r.held, ck.track_index
        if self.config.ping_pong == "lazy":
            other = 1 - idx
            if held.virtual_track_slots[other] > 0:
                self.admission.pool.free_slot(held.virtual_track_slots[other])
                held.virtual_track_slots[other] = -1
        held.last_checkpoint = (ck.depth, idx)
        held.next_track = 1 - idx

    def _donate(self, r: Request, ck: Checkpoint) -> None:
        """Hand a prompt checkpoint (and the pages before it) to the tree."""
        held = r.held
        npages = ck.depth // self.config.page_size
        dup_pages, dup_slots, node = self.tree.insert(r.tokens[:ck.depth], held.virtual_pages[:npages],
                                                      ck.virtual_slot)
        held.owned_pages -= set(held.virtual_pages[:npages]) - set(dup_pages)
        # lock the new path before anything can evict: the request still reads those pages
        self.tree.lock(node)
        if held.prefix_node is not None:
            self.tree.unlock(held.prefix_node)
        held.prefix_node = node
        if ck.track_index is None:  # a slot taken for this step: the tree's now, or back to the pool
            held.step_slots.remove(ck.virtual_slot)
            if dup_slots:
                self.admission.pool.free_slot(ck.virtual_slot)
        elif not dup_slots:  # the tree took one of the request's ping-pong slots
            held.virtual_track_slots[ck.track_index] = -1

    def insert_at_finish(self, r: Request) -> set[int]:
        """Insert a finished request's newest generation checkpoint; returns the slots the
        tree took (the request must not free them)."""
        held = r.held
        if self.tree is None or held.last_checkpoint is None or held.last_checkpoint[0] > r.output_end:
            return set()  # (none deeper than the returned output: a stop string may have cut it)
        depth, idx = held.last_checkpoint
        slot = held.virtual_track_slots[idx]
        npages = depth // self.config.page_size
        dup_pages, dup_slots, _ = self.tree.insert(r.tokens[:depth], held.virtual_pages[:npages], slot)
        held.owned_pages -= set(held.virtual_pages[:npages]) - set(dup_pages)
        return set() if dup_slots else {slot}

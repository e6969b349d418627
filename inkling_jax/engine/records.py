"""Host records of requests and sessions (every id in them is virtual), and the completions
handed back to callers."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..cache.prefix_tree import Node
from .config import SamplingParams


@dataclass
class Completion:
    tokens: list[int]
    logprobs: list[float]  # log p of each chosen token under the model
    cached_tokens: int  # prompt tokens served from the prefix cache
    finish_reason: str  # "length", "stop", "abort" or "error"
    error: str | None = None  # finish_reason "error": why the request failed (the others were not affected)


@dataclass
class Resources:
    """What one sequence holds in the pool and the prefix tree (every id virtual).

    A request holds one while it runs; a session keeps its last turn's between turns (the
    next turn takes it over)."""

    virtual_slot: int = 0  # the state's slot (holds state for positions < committed); 0: none yet
    virtual_track_slots: list[int] = field(default_factory=lambda: [-1, -1])  # checkpoint slots (-1: absent)
    next_track: int = 0  # index into virtual_track_slots of the next checkpoint's slot
    virtual_pages: list[int] = field(default_factory=list)  # page table, position order
    owned_pages: set[int] = field(default_factory=set)  # pages it owns (the rest belong to the tree)
    reserved_pages: int = 0  # pages promised at admission, not yet allocated
    committed: int = 0  # positions [0, committed) are in the state
    prefix_node: Node | None = None  # the tree node whose path it reads (locked while held)
    last_checkpoint: tuple[int, int] | None = None  # (depth, track index) of the newest checkpoint it holds
    step_slots: list[int] = field(default_factory=list)  # slots taken for the planned step's checkpoints

    def slots(self) -> list[int]:
        """Its real slots (no 0, no -1)."""
        return [s for s in [self.virtual_slot, *self.virtual_track_slots, *self.step_slots] if s > 0]


@dataclass
class Session:
    sid: int
    tokens: list[int] = field(default_factory=list)  # history; tokens[committed:] pending (the last sample)
    held: Resources | None = None  # the state kept between turns (None before the first turn)
    turn: "Request | None" = None  # the turn in flight (it holds the resources meanwhile)


@dataclass
class Request:
    rid: int
    tokens: list[int]  # everything known: prompt (after session history) + generated
    prompt_len: int  # len(tokens) when submitted
    sampling: SamplingParams
    held: Resources = field(default_factory=Resources)
    cached: int = 0  # prompt tokens served from the prefix cache
    virtual_cow_slot: int = 0  # checkpoint to restore into the slot in the next step (prefix hit)
    session: Session | None = None
    out_tokens: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None  # why it failed (finish_reason "error"), or why the engine gave up on it
    #                           (finish_reason None: it can never be admitted)
    drafts: list[int] = field(default_factory=list)  # speculative: the next round's draft tokens
    accept_lengths: list[int] = field(default_factory=list)  # speculative: drafts accepted per verify round
    seed: int = 0
    submitted: float = 0.0
    first_token_at: float | None = None

    @property
    def committed(self) -> int:
        return self.held.committed

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.held.committed

    def completion(self) -> Completion:
        return Completion(list(self.out_tokens), list(self.out_logprobs), self.cached, self.finish_reason,
                          self.error if self.finish_reason == "error" else None)

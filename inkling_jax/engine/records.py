"""Host records of requests and sessions (every id in them is virtual), and the completions
handed back to callers."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..cache.prefix_tree import Node
from .config import SamplingParams
from .text import TextState

TopLogprobs = list[tuple[int, float]]  # (token id, log-prob) pairs, most likely first


@dataclass
class Completion:
    tokens: list[int]
    logprobs: list[float]  # log p of each chosen token under the model
    cached_tokens: int  # prompt tokens served from the prefix cache
    finish_reason: str  # "length", "stop", "abort" or "error"
    error: str | None = None  # finish_reason "error": why the request failed (the others were not affected)
    text: str | None = None  # the decoded output (an engine with a tokenizer), cut at a stop string
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    top_logprobs: list[TopLogprobs] | None = None  # SamplingParams.logprobs = k > 0: k alternatives per token
    prompt_logprobs: list[float | None] | None = None  # prompt_logprobs: log p of each prompt token (None: the
    #                                                    first, and positions not asked for)
    prompt_top_logprobs: list[TopLogprobs | None] | None = None  # prompt_logprobs = k > 0: k alternatives
    index: int = 0  # the prompt it answers (its index in the call)
    sample: int = 0  # which of SamplingParams.n samples of that prompt


@dataclass
class StreamDelta:
    """What one request added since the last delta (`Engine.stream`)."""

    index: int  # the prompt it answers (its index in the call)
    sample: int  # which of SamplingParams.n samples
    tokens: list[int]  # new token ids (several after a multi-step decode or a verify round)
    logprobs: list[float]  # their log-probs under the model
    top_logprobs: list[TopLogprobs] | None  # SamplingParams.logprobs = k > 0: k alternatives per new token
    text: str  # the decoded text they add ("" without the engine's tokenizer; held back near a stop string)
    finish_reason: str | None  # set on the request's last delta: "length", "stop", "abort" or "error"
    request_id: int


@dataclass
class ScoreResult:
    """`Engine.score`: a continuation's per-token log-probs given its context."""

    tokens: list[int]  # the continuation
    logprobs: list[float]  # log p(tokens[i] | context + tokens[:i])
    top_logprobs: list[TopLogprobs] | None  # top_logprobs = k > 0: the k most likely tokens at each position
    cached_tokens: int  # context tokens served from the prefix cache
    error: str | None = None  # the request failed alone (non-finite logits): why (logprobs: None where not computed)


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
    index: int = 0  # its prompt's index in the submit call
    sample: int = 0  # which of the prompt's n samples (seed + sample)
    count_row: int = 0  # its row of the device count table while it runs (penalties; 0: none)
    fork_parent: "Request | None" = None  # n samples: sample 0, whose prefill the others wait for
    fork_depth: int = 0  # sample 0 of n: the page-aligned prompt boundary it checkpoints for its siblings
    score_from: int | None = None  # first prompt position whose log-prob is wanted (prompt_logprobs, score)
    prompt_top: int = 0  # alternatives wanted at each scored prompt position
    prompt_lps: list[float | None] = field(default_factory=list)  # [prompt_len] when scored
    prompt_tops: list[TopLogprobs | None] = field(default_factory=list)
    out_tops: list[TopLogprobs] = field(default_factory=list)  # SamplingParams.logprobs > 0
    text: TextState | None = None  # incremental detokenization and stop strings (engine with a tokenizer)
    stop_reason: int | str | None = None

    @property
    def committed(self) -> int:
        return self.held.committed

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.held.committed

    @property
    def output_end(self) -> int:
        """len(tokens) as the caller sees it: the prompt and the returned output (tokens past a
        stop string's match may follow in `tokens`: the device ran them)."""
        return self.prompt_len + len(self.out_tokens)

    def completion(self) -> Completion:
        scored = self.score_from is not None
        return Completion(list(self.out_tokens), list(self.out_logprobs), self.cached, self.finish_reason,
                          text=None if self.text is None else self.text.text, stop_reason=self.stop_reason,
                          top_logprobs=list(self.out_tops) if self.sampling.logprobs else None,
                          prompt_logprobs=list(self.prompt_lps) if scored else None,
                          prompt_top_logprobs=list(self.prompt_tops) if scored and self.prompt_top else None,
                          index=self.index, sample=self.sample,
                          error=self.error if self.finish_reason == "error" else None)

"""What one compiled step takes: its static shape, and the padded batch of numpy arrays.

`pack_batch` is the one place that lays request rows out as a `StepBatch` (the engine, the
harness, the benchmarks and the tests all call it): rows in order, their new tokens packed
back to back, every per-row array padded to the bucket's row count, padding tokens past
every new-token index and conv tap of a padded row (never read), padded rows on the sink.

Ids in a batch are virtual (`virtual_slot`, `virtual_pages`, ...); only the step translates
them (`cache/state.py`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Sequence, no_type_check

import jax
import numpy as np
from jaxtyping import Array, Bool, Int

from .sampling import GREEDY, SamplingArrays, SamplingParams

MODES = ("extend", "decode", "verify")
DEFAULT_MAX_STOP_IDS = 8  # stop-id columns of a batch unless the engine asks for more
DEFAULT_MAX_LOGIT_BIAS = 16  # logit-bias columns of a batch unless the engine asks for more
PAD_TOKEN_OFFSET = 64  # padding tokens sit this far past a row's last new-token index (and any conv tap)
NO_TOKEN_LIMIT = 1 << 30  # `SpecArrays.tokens_left` of a row without a limit (RowPlan.tokens_left None)


@dataclass(frozen=True)
class StepShape:
    """Static shape of a compiled step: mode and bucket sizes."""

    mode: str
    batch: int  # B: request rows
    tokens: int  # T: packed tokens
    query: int  # Q: max new tokens of one row (verify: spec_steps + 1)
    pages: int  # P: page-table columns (context up to P * page_size tokens)
    tracks: int = 1  # M: checkpoints one row may write in the step (boundaries inside its chunk)
    steps: int = 1  # K: model steps one dispatch runs, a loop on the device: decode steps (`decode_loop.py`)
    #                 or verify rounds (`verify_loop.py`)
    top_logprobs: int = 0  # L: top alternatives (token, log-prob) the step can report per emitted token
    score: bool = False  # extend: also the log-prob of every packed token's known next token (and its top L)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown step mode {self.mode!r}")
        if self.mode == "decode" and not (self.query == 1 and self.tokens == self.batch):
            raise ValueError("decode steps have one token per row")
        if self.mode == "verify" and self.tokens != self.batch * self.query:
            raise ValueError("verify steps have spec_steps + 1 tokens per row")
        if self.tracks < 1:
            raise ValueError("a step has at least one checkpoint column")
        if self.steps < 1 or (self.steps > 1 and self.mode == "extend"):
            raise ValueError("only decode and verify dispatches run several steps (steps >= 1)")
        if self.top_logprobs < 0:
            raise ValueError("top_logprobs must be >= 0")
        if self.score and self.mode != "extend":
            raise ValueError("only extend steps score their tokens")


# no_type_check (the tests' jaxtyping hook): a pytree node, rebuilt through __init__ by JAX with
# leaves of any kind (lowering's ArgInfo, specs, float0 cotangents; numpy on the host)
@no_type_check
@jax.tree_util.register_dataclass
@dataclass
class TokenLayout:
    """The packed tokens and which row each belongs to. T packed tokens, B rows."""

    tokens: Int[Array, " t"]
    token_row: Int[Array, " t"]  # request row of each packed token (padding: the last row)
    token_offset: Int[Array, " t"]  # index among the row's new tokens (padding: >= Q + PAD_TOKEN_OFFSET)
    query_start: Int[Array, " b"]  # packed index of the row's first new token
    num_new: Int[Array, " b"]  # new tokens this step (0: padded row); verify: 1 + spec_steps
    seq_start: Int[Array, " b"]  # position of the row's first new token
    has_state: Bool[Array, " b"]  # the slot holds state for positions < seq_start
    num_steps: Int[Array, " b"]  # multi-step decode / verify: steps (rounds) the row runs at most (1 elsewhere;
    #                              0: padded row)


# no_type_check (the tests' jaxtyping hook): a pytree node, rebuilt through __init__ by JAX with
# leaves of any kind (lowering's ArgInfo, specs, float0 cotangents; numpy on the host)
@no_type_check
@jax.tree_util.register_dataclass
@dataclass
class RowSlots:
    """Where each row's state lives (virtual ids: the step translates them). P page columns,
    M checkpoint columns."""

    virtual_slot: Int[Array, " b"]  # the row's slot (0: padded row -> sink)
    virtual_pages: Int[Array, "b p"]  # page ids covering positions [0, P * page_size)
    virtual_track_slot: Int[Array, "b m"]  # checkpoint slots (0: the column is unused)
    track_len: Int[Array, "b m"]  # new tokens before each checkpoint position (0: none); verify: the
    #                               candidate, written only if at least that many tokens commit
    virtual_cow_slot: Int[Array, " b"]  # slot to restore into `virtual_slot` first (0: none)


# no_type_check (the tests' jaxtyping hook): a pytree node, rebuilt through __init__ by JAX with
# leaves of any kind (lowering's ArgInfo, specs, float0 cotangents; numpy on the host)
@no_type_check
@jax.tree_util.register_dataclass
@dataclass
class SpecArrays:
    """Speculative decoding's row inputs (S = spec_steps)."""

    lookahead: Int[Array, "b la"]  # known tokens after the row's new ones (t_e, t_e+1, ...), spec only
    sample_next: Bool[Array, " b"]  # t_e is this step's sample (else lookahead[0]); spec only
    max_accept: Int[Array, " b"]  # verify: accept at most this many drafts (each round)
    tokens_left: Int[Array, " b"]  # verify: tokens the row may still commit (max_new_tokens less its output so
    #                                far; NO_TOKEN_LIMIT: none); a multi-round verify accepts at most
    #                                tokens_left - 1 - (tokens its earlier rounds committed) drafts in a round
    #                                and stops the row once its rounds committed tokens_left


# no_type_check (the tests' jaxtyping hook): a pytree node, rebuilt through __init__ by JAX with
# leaves of any kind (lowering's ArgInfo, specs, float0 cotangents; numpy on the host)
@no_type_check
@jax.tree_util.register_dataclass
@dataclass
class StepBatch:
    """One step's inputs (numpy on the host, device arrays inside the step), as four groups:
    the token layout, the rows' state ids, their sampling settings, speculation. Ids are virtual."""

    layout: TokenLayout
    slots: RowSlots
    sampling: SamplingArrays
    spec: SpecArrays

    @staticmethod
    def empty(shape: StepShape, spec_steps: int = 0, max_stop_ids: int = DEFAULT_MAX_STOP_IDS,
              max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS) -> "StepBatch":
        """An all-padding batch of `shape` (numpy), to fill in place or with dataclasses.replace."""
        b, t, p = shape.batch, shape.tokens, shape.pages
        i32 = lambda *n: np.zeros(n, np.int32)
        return StepBatch(
            layout=TokenLayout(tokens=i32(t), token_row=np.full(t, b - 1, np.int32),
                               token_offset=np.full(t, shape.query + PAD_TOKEN_OFFSET, np.int32), query_start=i32(b),
                               num_new=i32(b), seq_start=i32(b), has_state=np.zeros(b, bool), num_steps=i32(b)),
            slots=RowSlots(virtual_slot=i32(b), virtual_pages=i32(b, p), virtual_track_slot=i32(b, shape.tracks),
                           track_len=i32(b, shape.tracks), virtual_cow_slot=i32(b)),
            sampling=SamplingArrays.empty(b, max_stop_ids, max_logit_bias),
            spec=SpecArrays(lookahead=i32(b, spec_steps + 1), sample_next=np.zeros(b, bool), max_accept=i32(b),
                            tokens_left=i32(b)))


@functools.lru_cache(maxsize=256)
def _field_shapes(shape: StepShape, spec_steps: int, max_stop_ids: int,
                  max_logit_bias: int) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    """(group, field, shape) of every array of a `shape` batch (check_batch runs every step)."""
    want = StepBatch.empty(shape, spec_steps, max_stop_ids, max_logit_bias)
    return tuple((group, name, tuple(getattr(getattr(want, group), name).shape))
                 for group in ("layout", "slots", "sampling", "spec")
                 for name in getattr(want, group).__dataclass_fields__)


def check_batch(batch: StepBatch, shape: StepShape, spec_steps: int = 0,
                max_stop_ids: int = DEFAULT_MAX_STOP_IDS, max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS) -> None:
    """Raise ValueError naming the first field whose shape does not fit the compiled bucket
    (before anything is donated, so the state is untouched)."""
    for group, name, expected in _field_shapes(shape, spec_steps, max_stop_ids, max_logit_bias):
        got = tuple(getattr(getattr(batch, group), name).shape)
        if got != expected:
            raise ValueError(f"StepBatch.{group}.{name} has shape {got}; the compiled {shape.mode} bucket takes "
                             f"{expected} (batch {shape.batch}, tokens {shape.tokens}, pages {shape.pages})")


@dataclass
class RowPlan:
    """One request row of a step in host terms (virtual ids). `pack_batch` lays it out."""

    tokens: Sequence[int]  # the row's new tokens (verify: the last committed-to-be token, then the drafts)
    seq_start: int  # position of tokens[0]
    virtual_slot: int
    virtual_pages: Sequence[int]  # page table covering at least [0, seq_start + len(tokens))
    has_state: bool | None = None  # default: seq_start > 0
    virtual_track_slots: Sequence[int] = ()  # checkpoint slots, one per checkpoint this step
    track_lens: Sequence[int] = ()  # new tokens before each checkpoint position
    virtual_cow_slot: int = 0  # restore this slot into virtual_slot first (prefix hit)
    sampling: SamplingParams = GREEDY  # the request's sampling settings
    seed: int = 0  # the request's sampling seed
    stop_ids: Sequence[int] = field(default_factory=tuple)  # verify, multi-step decode: tokens that end the
    #                                                         generation (eos resolved)
    lookahead: Sequence[int] = ()  # spec: known tokens after the new ones
    sample_next: bool = True  # spec: the token after the new ones is this step's sample
    max_accept: int = 0  # verify: most drafts to accept (each round)
    tokens_left: int | None = None  # verify: tokens the row may still commit (None: no limit; `SpecArrays`)
    num_steps: int = 1  # multi-step decode: steps the row runs at most (its one token is the first step's);
    #                     multi-round verify: rounds the row runs at most
    out_len: int = 0  # tokens the request generated before this step (min_tokens)
    count_row: int = 0  # the request's row of the state's count table (0: none; penalties)
    prompt_top_logprobs: int = 0  # scoring steps: top alternatives wanted at its prompt positions


def pack_batch(shape: StepShape, rows: Sequence[RowPlan], spec_steps: int = 0,
               max_stop_ids: int = DEFAULT_MAX_STOP_IDS, max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS) -> StepBatch:
    """Lay `rows` out as a padded StepBatch of `shape` (numpy; see the module docstring).

    Raises ValueError when the rows do not fit the shape (too many rows, tokens, pages or
    stop ids or logit biases, or a row with more new tokens than Q)."""
    if len(rows) > shape.batch:
        raise ValueError(f"{len(rows)} rows do not fit a batch of {shape.batch}")
    total = sum(len(r.tokens) for r in rows)
    if total > shape.tokens:
        raise ValueError(f"{total} new tokens do not fit a step of {shape.tokens}")
    b = StepBatch.empty(shape, spec_steps, max_stop_ids, max_logit_bias)
    lay, ids, spec = b.layout, b.slots, b.spec
    b.sampling = SamplingArrays.pack(rows, shape.batch, max_stop_ids, max_logit_bias)
    pos = 0
    for i, r in enumerate(rows):
        n = len(r.tokens)
        if n > shape.query:
            raise ValueError(f"row {i} has {n} new tokens; the step takes at most {shape.query} per row")
        if shape.mode == "decode" and n != 1:  # the step reads row i's token at packed index i
            raise ValueError(f"row {i} has {n} new tokens; a decode step takes exactly one per row")
        if shape.mode == "verify" and n != shape.query:  # row i's tokens sit at packed i * Q
            raise ValueError(f"row {i} has {n} new tokens; a verify step takes exactly {shape.query} per row "
                             f"(its last token and spec_steps drafts)")
        if len(r.virtual_pages) > shape.pages:
            raise ValueError(f"row {i} needs {len(r.virtual_pages)} pages; the step holds {shape.pages} per row")
        if len(r.virtual_track_slots) != len(r.track_lens) or len(r.track_lens) > shape.tracks:
            raise ValueError(f"row {i} has {len(r.track_lens)} checkpoints; the step holds {shape.tracks} per row")
        if not 1 <= r.num_steps <= shape.steps:
            raise ValueError(f"row {i} runs {r.num_steps} steps; the dispatch runs 1 to {shape.steps}")
        if len(r.lookahead) > spec_steps + 1:
            raise ValueError(f"row {i} has {len(r.lookahead)} lookahead tokens; the step holds {spec_steps + 1}")
        lay.tokens[pos:pos + n] = r.tokens
        lay.token_row[pos:pos + n] = i
        lay.token_offset[pos:pos + n] = np.arange(n)
        lay.query_start[i] = pos
        lay.num_new[i] = n
        lay.seq_start[i] = r.seq_start
        lay.has_state[i] = r.seq_start > 0 if r.has_state is None else r.has_state
        lay.num_steps[i] = r.num_steps
        ids.virtual_slot[i] = r.virtual_slot
        ids.virtual_pages[i, :len(r.virtual_pages)] = r.virtual_pages
        ids.virtual_track_slot[i, :len(r.track_lens)] = r.virtual_track_slots
        ids.track_len[i, :len(r.track_lens)] = r.track_lens
        ids.virtual_cow_slot[i] = r.virtual_cow_slot
        spec.lookahead[i, :len(r.lookahead)] = r.lookahead
        spec.sample_next[i] = r.sample_next
        spec.max_accept[i] = r.max_accept
        spec.tokens_left[i] = NO_TOKEN_LIMIT if r.tokens_left is None else r.tokens_left
        pos += n
    return b

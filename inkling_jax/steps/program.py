"""Jitted serving steps: (params, state, batch) -> (outputs, new_state).

One step function serves every mode; its static `StepShape` (mode and bucket sizes) picks
the compiled program. A batch holds packed ragged tokens plus per-row arrays padded to the
bucket; every field is present in every mode (a row that does not checkpoint points at the
sink with a false mask, never a missing field), so the jit cache compiles each bucket once.

Inside the step, and only there, virtual slot and page ids become physical through the
state's tables. The state is donated: the arena is updated in place.

Data flow of one step:
  1. copy-on-write restores (prefix hits): `virtual_cow_slot` -> the row's slot, whole entries;
  2. the target layers on packed tokens [T, H]; each layer's context reads the *old* state
     (conv windows, sliding rings, pages) and writes the new one; in `verify` mode the slot
     writes wait until the accepted count is known (pages may take draft K/V: positions past
     the committed length are rewritten before any query reads them);
  3. the LM head, the logits processors and sampling (extend / decode: each row's last token;
     verify: every draft position, then acceptance with the rejection-sampling rule), the
     emitted tokens counted into the rows' count-table rows (`counts.py`), whether the row's
     logits are finite (`finite_rows`: `StepOutput.row_ok`, False fails the request on the
     host), and, where asked, each emitted token's top alternatives and (a scoring extend step,
     `StepShape.score`) the log-prob of every packed token's known next token;
  4. with speculative decoding, the draft phase: the MTP depths, one after another (below);
     depth 0's logits count in `row_ok` (they read committed tokens only; the deeper depths
     read proposals, which never enter the state).

No value of one row reaches another row's results: every masked product over the packed
tokens selects (`jnp.where`) instead of multiplying by a zero weight, so a row whose values
are NaN or inf (a poisoned embedding, an overflow) fails alone (design.md, "Isolation").

MTP state is a pure function of the committed tokens. With n committed target positions
(t_n the next token, sampled or known), depth d has committed rows [0, n - d): row j reads
the previous depth's hidden at row j and token t_{j+d+1}, which is known only for
j + d + 1 <= n. A step that commits positions [s, e) of the target runs depth d over rows
[max(0, s - d), e): the first rows commit (the same count as the target, shifted by d), the
last d read draft tokens of this round and only propose (their K/V is rewritten next round,
their conv windows never enter the state). Depth d - 1's output at row s - d, computed in
an earlier step, is carried in the slot (`hidden` field). Depth d's greedy prediction at
row e - 1 is the draft for t_{e+d+1}.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from functools import partial
from typing import Any, no_type_check

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int
from pallas_kernels import conv_ops
from pallas_kernels.conv_state.ref import PackedRows

from ..cache.layout import ArenaLayout
from ..cache.state import ServingState, translate_pages, translate_slots
from ..config import InklingConfig
from ..model import layers as L
from ..model.forward import run_trunk
from .batch import StepBatch, StepShape
from .context import RowMeta, StepContext
from .decode_loop import decode_loop
from .draft import draft_phase
from .counts import add_emitted
from .sampling import accept_drafts, sample_tokens, top_alternatives
from .verify_loop import verify_loop

Params = dict[str, Any]


# no_type_check (the tests' jaxtyping hook): a pytree node, rebuilt through __init__ by JAX with
# leaves of any kind (lowering's ArgInfo, specs, float0 cotangents; numpy on the host)
@no_type_check
@jax.tree_util.register_dataclass
@dataclass
class StepOutput:
    tokens: Int[Array, " b *k"]  # sampled next token of each row (verify: the bonus after the accepted drafts);
    #                          a K-step decode: [B, K], one column per step; an R-round verify: [B, R, S+1],
    #                          round r's committed tokens (its accepted drafts, then its bonus at column
    #                          num_accepted[:, r]; later columns not valid)
    logprobs: Float[Array, " b *k"]  # log p(token) under the model (temperature 1, no truncation); shaped as tokens
    num_accepted: Int[Array, " b *r"]  # verify: drafts accepted (they precede `tokens`); K-step decode: steps
    #                                the row ran (its valid columns); R-round verify: [B, R], drafts accepted in
    #                                each round (-1: the row did not run that round); else 0
    accepted_logprobs: Float[Array, "b s"]  # verify: log p of each draft (valid for the accepted ones); an
    #                                        R-round verify: zeros (`logprobs` holds them)
    drafts: Int[Array, "b s"]  # spec: the next round's draft tokens (valid when sample_next; R-round verify: the
    #                           last round the row ran proposed them)
    row_ok: Bool[Array, " b"]  # the row's logits were finite (`finite_rows`; every step / round it ran); False:
    #                           the request fails (padded rows: ignore)
    top_ids: Int[Array, " b *q l"]  # the L most likely tokens where `tokens` was chosen (zeros unless a row asks,
    #                             `SamplingArrays.top_logprobs`); K-step decode: [B, K, L]; verify: [B, S+1, L]
    #                             (position i: the token after the i-th draft); R-round verify: [B, R, S+1, L]
    top_logprobs: Float[Array, " b *q l"]  # their log-probs under the model, shaped as top_ids
    prompt_logprobs: Float[Array, " t"]  # scoring extend step: log p of packed token t's known next token (the
    #                                     next packed token of its row, or its lookahead[0]); else [0]
    prompt_top_ids: Int[Array, "t l"]  # scoring step: the L most likely next tokens at each packed token
    prompt_top_logprobs: Float[Array, "t l"]


def finite_rows(logits: Float[Array, "b ... v"], upto: Int[Array, " b"] | None = None) -> Bool[Array, " b"]:
    """Whether each row's logits are all finite (no NaN, no inf): one fused reduction over
    the logits the step computed anyway. Verify logits [B, S+1, V]: only positions 0..upto[b]
    (the accepted drafts and the bonus) count: the positions after a rejected draft read a
    token the sequence never takes."""
    finite = jnp.all(jnp.isfinite(logits), axis=-1)
    if upto is not None:
        finite = finite | (jnp.arange(finite.shape[1])[None, :] > upto[:, None])
        finite = jnp.all(finite, axis=1)
    return finite


def target_meta(batch: StepBatch, query: int, physical_slot: Array, physical_track_slot: Array,
                commit_len: Array, track_len: Array) -> RowMeta:
    """The target pass's rows: one row per request, its new tokens packed at query_start."""
    t = batch.layout.tokens.shape[0]
    rows = PackedRows(token_row=batch.layout.token_row, token_offset=batch.layout.token_offset,
                      row_tokens=jnp.clip(batch.layout.query_start[:, None] + jnp.arange(query)[None, :], 0, t - 1),
                      has_state=batch.layout.has_state, commit_len=commit_len, track_len=track_len)
    tracking = (track_len > 0) & (batch.layout.num_new > 0)[:, None]
    return RowMeta(rows=rows, seq_start=batch.layout.seq_start, num_new=batch.layout.num_new,
                   physical_slot=physical_slot, physical_track_slot=jnp.where(tracking, physical_track_slot, 0))


def run_layers(params: Params, cfg: InklingConfig, layout: ArenaLayout, ctx: StepContext, x: Array) -> Array:
    """The trunk's decoder layers over packed tokens through ctx, then the final norm
    (`forward.run_trunk`: on few-token steps each norm after the first runs inside the
    residual conv before it, `StepContext.conv_residual_norm`)."""
    return run_trunk(params, cfg, ctx, x, bind=lambda i: ctx.bind(layout.target[i], layout.target_page_layer[i]))


@dataclass
class Translated:
    """The batch's virtual ids through the state's tables (the step's one translation)."""

    physical_slot: Array  # [B]
    physical_track_slot: Array  # [B, M]
    physical_pages: Array  # [B, P]


@jax.named_scope("prepare")
def prepare(state: ServingState, batch: StepBatch, layout: ArenaLayout, ops: Any) -> tuple[Translated, Array]:
    """Translate the batch's ids, and apply copy-on-write restores (prefix hits) to the arena."""
    ids = Translated(translate_slots(state, batch.slots.virtual_slot),
                     translate_slots(state, batch.slots.virtual_track_slot),
                     translate_pages(state, batch.slots.virtual_pages))
    physical_cow_slot = translate_slots(state, batch.slots.virtual_cow_slot)
    # rows that restore nothing copy sink -> sink: a no-op for the Pallas copy (no lax.cond
    # here: a conditional that may return the donated arena made XLA copy it whole at B = 1)
    dst = jnp.where(physical_cow_slot > 0, ids.physical_slot, 0)
    arena = ops.copy_units(state.arena, layout.slot_row(physical_cow_slot), layout.slot_row(dst),
                           num_units=layout.slot_units, sink_rows=layout.sink_rows)
    return ids, arena


def step_logits(params: Params, state: ServingState, batch: StepBatch, *, cfg: InklingConfig, layout: ArenaLayout,
                shape: StepShape, use_pallas: bool = False, interpret: bool = False,
                context_cls: type = StepContext, parallel: Any = None) -> tuple[Float[Array, "b v"], ServingState]:
    """The target's extend / decode step without sampling: logits (fp32) of each row's last
    new token, and the new state. Differentiable in params and state (the research / harness
    entry point). It runs the target only: a layout's draft block is left as it was.

    `context_cls`: the layer context (a `StepContext` subclass, e.g. one with a planted bug
    for the harness's tests). `parallel`: as for `run_step`."""
    ops = conv_ops(use_pallas, interpret)
    ids, arena = prepare(state, batch, layout, ops)
    meta = target_meta(batch, shape.query, ids.physical_slot, ids.physical_track_slot, batch.layout.num_new,
                       batch.slots.track_len)
    # (a subclass written before the mesh hook, with its own __init__, still works without one)
    mesh_kw = {} if parallel is None else {"parallel": parallel}
    ctx = context_cls(cfg, layout, ops, arena, meta, ids.physical_pages, **mesh_kw)
    h = run_layers(params, cfg, layout, ctx,
                   L.embed(params, cfg, batch.layout.tokens, params["unembed"].dtype, parallel))
    last = jnp.clip(batch.layout.query_start + batch.layout.num_new - 1, 0, h.shape[0] - 1)
    return L.lm_head(params, cfg, h[last], parallel), state.replace(arena=ctx.arena)


def run_step(params: Params, state: ServingState, batch: StepBatch, *, cfg: InklingConfig, layout: ArenaLayout,
             shape: StepShape, use_pallas: bool = False, interpret: bool = False,
             parallel: Any = None) -> tuple[StepOutput, ServingState]:
    """One serving step (not jitted; `compile_step` wraps it). use_pallas picks the Pallas
    conv-state kernels (interpret=True runs them in interpret mode, for CPU tests).

    A decode shape with steps = K > 1 runs K decode steps in a device loop
    (`decode_loop.py`): tokens and logprobs are then [B, K] and num_accepted counts the
    steps each row ran. A verify shape with steps = R > 1 runs R verify rounds in a device
    loop (`verify_loop.py`), each checking the drafts the round before proposed: tokens and
    logprobs are then [B, R, S+1], num_accepted [B, R] (StepOutput's field comments).

    parallel: None for the single-device program. A `ParallelAxes` when the step runs as one
    shard of a mesh inside `shard_map` (`inkling_jax.parallel.serving`): params are this
    device's shards, cfg / layout the plan's local ones, state.arena this device's block
    [num_units, unit_elems_local]; the layers add their collectives, the LM head gathers the
    vocab, so sampling (and the outputs) are the same on every device."""
    kw = dict(cfg=cfg, layout=layout, use_pallas=use_pallas, interpret=interpret, parallel=parallel)
    if shape.steps == 1:
        return single_step(params, state, batch, shape=shape, **kw)
    one = dataclasses.replace(shape, steps=1)
    params = L.with_kv_conv(params)
    loop = verify_loop if shape.mode == "verify" else decode_loop
    tokens, logprobs, top_ids, top_lp, ran, drafts, ok, state = loop(
        lambda st, bt: single_step(params, st, bt, shape=one, **kw), state, batch, shape.steps, shape.query,
        shape.top_logprobs)
    return StepOutput(tokens, logprobs, ran, jnp.zeros(drafts.shape, jnp.float32), drafts, ok, top_ids, top_lp,
                      *score_tokens(params, cfg, batch, None, shape)), state


def single_step(params: Params, state: ServingState, batch: StepBatch, *, cfg: InklingConfig, layout: ArenaLayout,
                shape: StepShape, use_pallas: bool = False, interpret: bool = False,
                parallel: Any = None) -> tuple[StepOutput, ServingState]:
    """One model step of any mode (`run_step` without the decode / verify loop)."""
    ops = conv_ops(use_pallas, interpret)
    ids, arena = prepare(state, batch, layout, ops)
    spec = layout.spec_steps
    b = shape.batch
    verify = shape.mode == "verify"
    meta = target_meta(batch, shape.query, ids.physical_slot, ids.physical_track_slot, batch.layout.num_new,
                       batch.slots.track_len)
    ctx = StepContext(cfg, layout, ops, arena, meta, ids.physical_pages, deferred=verify, parallel=parallel,
                      one_token_per_row=shape.mode == "decode")
    h = run_layers(params, cfg, layout, ctx,
                   L.embed(params, cfg, batch.layout.tokens, params["unembed"].dtype, parallel))
    ctx.write_ring_checkpoints()

    counts = state.counts
    if verify:
        row_tokens = meta.rows.row_tokens
        logits = L.lm_head(params, cfg, h[row_tokens], parallel)  # [B, S+1, V]
        drafts = batch.layout.tokens[row_tokens[:, 1:]]  # [B, S]
        n_acc, bonus, bonus_logp, draft_logp = accept_drafts(logits, drafts, batch.sampling, batch.spec.max_accept,
                                                              batch.layout.seq_start + 1, counts)
        row_ok = finite_rows(logits, n_acc)
        if counts is not None:  # the accepted drafts and the bonus (rejected drafts never count)
            emitted = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
            emitted = emitted.at[jnp.arange(b), n_acc].set(bonus)
            counted = (jnp.arange(spec + 1)[None, :] <= n_acc[:, None]) & (batch.layout.num_new > 0)[:, None]
            counts = add_emitted(counts, batch.sampling.count_row, emitted, counted)
        commit = jnp.where(batch.layout.num_new > 0, n_acc + 1, 0)
        track = jnp.where(commit[:, None] >= batch.slots.track_len, batch.slots.track_len, 0)
        meta = target_meta(batch, shape.query, ids.physical_slot, ids.physical_track_slot, commit, track)
        ctx.commit(meta)
    else:
        last = jnp.clip(batch.layout.query_start + batch.layout.num_new - 1, 0, h.shape[0] - 1)
        logits = L.lm_head(params, cfg, h[last], parallel)
        row_ok = finite_rows(logits)
        bonus, bonus_logp = sample_tokens(logits, batch.sampling, batch.layout.seq_start + batch.layout.num_new, counts)
        if counts is not None:  # decode rows emit their sample; extend rows only at their prompt's end
            emits = (batch.layout.num_new > 0) & (batch.spec.sample_next | (shape.mode == "decode"))
            counts = add_emitted(counts, batch.sampling.count_row, bonus[:, None], emits[:, None])
        n_acc = jnp.zeros(b, jnp.int32)
        draft_logp = jnp.zeros((b, spec), jnp.float32)
        commit, track = batch.layout.num_new, batch.slots.track_len
    arena = ctx.arena

    new_drafts = jnp.zeros((b, spec), jnp.int32)
    if spec:
        arena, new_drafts, draft_ok = draft_phase(params, cfg, layout, ops, arena, batch, meta, ids.physical_pages,
                                                  h, commit, track, bonus, parallel)
        row_ok = row_ok & draft_ok
    top_ids, top_lp = top_alternatives(logits, batch.sampling.top_logprobs, shape.top_logprobs)
    out = StepOutput(bonus, bonus_logp, n_acc, draft_logp, new_drafts, row_ok, top_ids, top_lp,
                     *score_tokens(params, cfg, batch, h, shape, parallel))
    return out, state.replace(arena=arena, counts=counts)


def score_tokens(params: Params, cfg: InklingConfig, batch: StepBatch, h: Array, shape: StepShape,
                 parallel: Any = None) -> tuple[Array, Array, Array]:
    """A scoring extend step's (`StepShape.score`) prompt outputs: the log-prob (under the
    model) of each packed token's known next token (the row's next packed token, or after its
    last one `lookahead[0]`; meaningless where none is known: the host reads only known ones),
    and the top L next tokens (computed when a row asks, `SamplingArrays.prompt_top_logprobs`).
    Other steps: zero-size arrays. The LM head runs on every packed token: [T, V] fp32 logits."""
    k = shape.top_logprobs
    if not shape.score:
        return jnp.zeros((0,), jnp.float32), jnp.zeros((0, k), jnp.int32), jnp.zeros((0, k), jnp.float32)
    lay = batch.layout
    t = lay.tokens.shape[0]
    logits = L.lm_head(params, cfg, h, parallel).astype(jnp.float32)  # [T, V]
    logp = jax.nn.log_softmax(logits, axis=-1)
    after_last = lay.token_offset + 1 >= lay.num_new[lay.token_row]
    nxt = jnp.where(after_last, batch.spec.lookahead[lay.token_row, 0],
                    lay.tokens[jnp.minimum(jnp.arange(t) + 1, t - 1)])
    top_ids, top_lp = top_alternatives(logits, batch.sampling.prompt_top_logprobs, k)
    return jnp.take_along_axis(logp, nxt[:, None], axis=-1)[:, 0], top_ids, top_lp


def compile_step(cfg: InklingConfig, layout: ArenaLayout, shape: StepShape, use_pallas: bool = False,
                 interpret: bool = False):
    """The jitted step for one (mode, bucket); the state argument is donated."""
    return jax.jit(partial(run_step, cfg=cfg, layout=layout, shape=shape, use_pallas=use_pallas, interpret=interpret),
                   donate_argnums=(1,))


# XLA's GPU compiler sorts a single row (top-p sampling at batch 1) with CUB, which cannot be
# captured in a command buffer (CUDA graph); the sampling `lax.cond` around it then runs on
# the host, which copies its predicate back and waits for the whole step so far: a pipeline
# drain in the middle of every batch-1 decode. XLA's own sort kernel keeps the step one graph.
#
# Command buffers scheduled CONCURRENT: the CUDA graph's nodes depend on the nodes whose
# buffers they use, not each on the one before (XLA's default, SERIALIZE), so independent
# kernels overlap and the graph launches without a serial chain of ~470 small kernels. On the
# H200 (bench model, Engine.generate, K = 8, set as the XLA flag; BENCHMARKS.md, 2026-12-05) decode went 1.384 ->
# 1.124 ms per token step at batch 1 and 2.528 -> 2.320 at batch 32.
GPU_STEP_OPTIONS = {"xla_gpu_enable_cub_radix_sort": False,
                    "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}


def gpu_step_options() -> dict:
    """GPU_STEP_OPTIONS less any option the user sets in XLA_FLAGS (theirs wins: a per-compile
    option would override the flag)."""
    flags = os.environ.get("XLA_FLAGS", "")
    return {k: v for k, v in GPU_STEP_OPTIONS.items() if f"--{k}=" not in flags}


def compile_lowered(lowered):
    """Compile a lowered step with `gpu_step_options()` on a GPU (plain compile elsewhere, or
    where this XLA does not know an option)."""
    if jax.default_backend() == "gpu":
        options = gpu_step_options()
        try:
            return lowered.compile(compiler_options=options)
        except Exception as exc:  # noqa: BLE001 - an XLA without the option: compile as is
            import warnings

            warnings.warn(f"compiling without {options}: {type(exc).__name__}: {exc}")
    return lowered.compile()

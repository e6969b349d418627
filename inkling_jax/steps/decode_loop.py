"""Several decode steps in one dispatch: a loop on the device over the single decode step.

The host hands over K = `StepShape.steps` steps at once, so it reads the sampled tokens and
plans the next batch once per K tokens instead of once per token (the host round trip and
the launch gaps between steps are paid once per dispatch). Each iteration is exactly the
single decode step (`program.single_step`), so the tokens, state and checkpoints are those
of K separate steps (log-probs and state up to float rounding where XLA fuses the loop body
otherwise than the lone step):

    iteration j (0 <= j < K), row i active:
        token      = row i's input: the batch's token at j = 0, else iteration j-1's sample
        seq_start  = batch.layout.seq_start + j           (sampling keys fold in the position)
        has_state  = batch.layout.has_state or j > 0
        cow slot   = batch.slots.virtual_cow_slot at j = 0 only (a prefix hit restores once)
        checkpoint = batch.slots.track_len == j + 1      (the boundary after this step's token)
        out_len    = batch.sampling.out_len + j           (min_tokens; the counts follow in the state)

A row is active while j < num_steps[i] and no earlier iteration sampled one of its stop ids
(`batch.sampling.stop_ids`, its eos included) or had non-finite logits (`StepOutput.row_ok`).
An inactive row is a padded row (sink slot and pages, no new token): the state past a stop is
never written, as when the host stops feeding it.

Outputs: tokens / logprobs [B, K] (iteration j's sample in column j; columns at and past
`num_accepted` are not valid), top_ids / top_logprobs [B, K, L] likewise, num_accepted [B] =
the iterations the row ran, row_ok [B] = every iteration it ran had finite logits. A while loop
with a static trip count (fori_loop over constants) runs on the device without reading a
predicate back to the host.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from .batch import PAD_TOKEN_OFFSET, StepBatch


def decode_loop(single_step: Callable, state, batch: StepBatch, steps: int, query: int, top_logprobs: int = 0):
    """Run `single_step(state, batch_j) -> (StepOutput, state)` for j = 0..steps-1 with the
    batch of each iteration as the module docstring says (`top_logprobs`: the step's L).
    Returns (tokens [B, K], logprobs [B, K], top_ids [B, K, L], top_logprobs [B, K, L], steps
    run [B], the last iteration's drafts [B, S], row_ok [B], state); `run_step` makes the
    StepOutput of them."""
    b = batch.layout.num_new.shape[0]
    pad_offset = query + PAD_TOKEN_OFFSET
    stops = batch.sampling.stop_ids

    def body(j, carry):
        state, token, active, tokens, logprobs, top_ids, top_lps, ran, drafts, ok = carry
        col = lambda x: jnp.where(active[:, None], x, 0)
        lay, ids = batch.layout, batch.slots
        step_batch = dataclasses.replace(
            batch,
            layout=dataclasses.replace(lay, tokens=token, token_offset=jnp.where(active, 0, pad_offset),
                                       has_state=active & (lay.has_state | (j > 0)), seq_start=lay.seq_start + j,
                                       num_new=active.astype(jnp.int32), num_steps=active.astype(jnp.int32)),
            slots=dataclasses.replace(ids, virtual_slot=jnp.where(active, ids.virtual_slot, 0),
                                      virtual_pages=col(ids.virtual_pages),
                                      virtual_track_slot=col(ids.virtual_track_slot),
                                      track_len=jnp.where(ids.track_len == j + 1, 1, 0).astype(jnp.int32),
                                      virtual_cow_slot=jnp.where((j == 0) & active, ids.virtual_cow_slot, 0)),
            sampling=dataclasses.replace(batch.sampling, out_len=batch.sampling.out_len + j))
        out, state = single_step(state, step_batch)
        tokens = tokens.at[:, j].set(out.tokens)
        logprobs = logprobs.at[:, j].set(out.logprobs)
        top_ids = top_ids.at[:, j].set(out.top_ids)
        top_lps = top_lps.at[:, j].set(out.top_logprobs)
        ran = ran + active.astype(jnp.int32)
        stopped = jnp.any((out.tokens[:, None] == stops) & (stops >= 0), axis=1)
        ok = ok & (out.row_ok | ~active)
        active = active & ~stopped & (j + 1 < batch.layout.num_steps) & out.row_ok
        return (state, jnp.where(active, out.tokens, token), active, tokens, logprobs, top_ids, top_lps, ran,
                out.drafts, ok)

    spec = batch.spec.lookahead.shape[1] - 1
    k = top_logprobs
    carry = (state, batch.layout.tokens, batch.layout.num_new > 0, jnp.zeros((b, steps), jnp.int32),
             jnp.zeros((b, steps), jnp.float32), jnp.zeros((b, steps, k), jnp.int32),
             jnp.zeros((b, steps, k), jnp.float32), jnp.zeros(b, jnp.int32), jnp.zeros((b, spec), jnp.int32),
             jnp.ones(b, bool))
    state, _, _, tokens, logprobs, top_ids, top_lps, ran, drafts, ok = jax.lax.fori_loop(0, steps, body, carry)
    return tokens, logprobs, top_ids, top_lps, ran, drafts, ok, state

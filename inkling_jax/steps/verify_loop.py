"""Several speculative verify rounds in one dispatch: a loop on the device over the verify step.

With speculative decoding (MTP drafts) each verify round needs the drafts the previous round
proposed; the host round trip between rounds left the device idle. The host hands over
R = `StepShape.steps` rounds at once instead: round j > 0 checks the drafts round j - 1's
MTP depths proposed, on the device. Each round is exactly the single verify step
(`program.single_step`), so the tokens, state and checkpoints are those of R separate
dispatches fed the engine's own drafts (log-probs and state up to float rounding where XLA
fuses the loop body otherwise than the lone step). With `done` = the tokens row i's earlier
rounds committed (their accepted drafts and bonus tokens; 0 at j = 0):

    round j (0 <= j < R), row i active:
        row tokens = [last committed token, S drafts]: the batch's packed row at j = 0, else
                     [round j-1's bonus, round j-1's new drafts] (packed at the same query_start)
        seq_start  = batch.layout.seq_start + done          (sampling keys fold in the position)
        has_state  = batch.layout.has_state or j > 0
        cow slot   = batch.slots.virtual_cow_slot at j = 0 only (a prefix hit restores once)
        max_accept = min(batch.spec.max_accept, batch.spec.tokens_left - done - 1)
        out_len    = batch.sampling.out_len + done          (min_tokens; the counts follow in the state)
        checkpoint = track_len - done where that is >= 1, else none (round-relative: the step
                     writes it only if this round commits at least that many tokens, so the one
                     round whose commits cross the boundary writes it)

A row is active while j < num_steps[i], no earlier round committed one of its stop ids
(`batch.sampling.stop_ids`, its eos included: acceptance stops after an accepted stop token,
which becomes the round's bonus, so only the bonus needs a look), its rounds committed fewer
than `tokens_left` tokens, and no earlier round had non-finite logits (`StepOutput.row_ok`).
An inactive row is a padded row, as in `decode_loop.py` (sink slot and pages, no new token):
the state past a stop is never written. (Stop strings are the host's: it truncates there.)

The scheduler gives a row only as many rounds as cannot reach a second checkpoint boundary
(a dispatch writes one checkpoint per row, as a multi-step decode does), and page tables
covering every position a round may write.

Outputs (R rounds, S drafts, Q = S + 1, L top alternatives): tokens / logprobs [B, R, Q]
(round r's committed tokens: its accepted drafts, then its bonus at column num_accepted[:, r];
later columns are not valid), num_accepted [B, R] (drafts accepted in round r; -1: the row did
not run round r), top_ids / top_logprobs [B, R, Q, L] (column c: where tokens[:, r, c] was
chosen), drafts [B, S] (the last round the row ran proposed them: the next dispatch's),
row_ok [B] = every round it ran had finite logits. A fori_loop over constants (a static trip
count) runs on the device without reading a predicate back to the host.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from .batch import PAD_TOKEN_OFFSET, StepBatch


def verify_loop(single_step: Callable, state, batch: StepBatch, rounds: int, query: int, top_logprobs: int = 0):
    """Run `single_step(state, batch_j) -> (StepOutput, state)` (a verify step) for rounds
    j = 0..rounds-1 with the batch of each round as the module docstring says (`query`: Q =
    S + 1; `top_logprobs`: the step's L). Returns (tokens [B, R, Q], logprobs [B, R, Q],
    top_ids [B, R, Q, L], top_logprobs [B, R, Q, L], num_accepted [B, R], drafts [B, S],
    row_ok [B], state); `run_step` makes the StepOutput of them."""
    lay, ids, spec = batch.layout, batch.slots, batch.spec
    b = lay.num_new.shape[0]
    t = lay.tokens.shape[0]
    rows = jnp.arange(b)
    pad_offset = query + PAD_TOKEN_OFFSET
    stops = batch.sampling.stop_ids
    # packed token p is column `col` of row `token_row[p]` (padding tokens: a padded row's)
    col = jnp.clip(lay.token_offset, 0, query - 1)
    first_row = lay.tokens[jnp.clip(lay.query_start[:, None] + jnp.arange(query)[None, :], 0, t - 1)]  # [B, Q]

    def body(j, carry):
        state, row_in, active, done, tokens, logprobs, top_ids, top_lps, accepted, drafts, ok = carry
        live = active[lay.token_row]  # [T]
        masked = lambda x: jnp.where(active[:, None], x, 0)
        rel = ids.track_len - done[:, None]
        step_batch = dataclasses.replace(
            batch,
            layout=dataclasses.replace(lay, tokens=jnp.where(live, row_in[lay.token_row, col], lay.tokens),
                                       token_offset=jnp.where(live, lay.token_offset, pad_offset),
                                       has_state=active & (lay.has_state | (j > 0)), seq_start=lay.seq_start + done,
                                       num_new=jnp.where(active, lay.num_new, 0), num_steps=active.astype(jnp.int32)),
            slots=dataclasses.replace(ids, virtual_slot=jnp.where(active, ids.virtual_slot, 0),
                                      virtual_pages=masked(ids.virtual_pages),
                                      virtual_track_slot=masked(ids.virtual_track_slot),
                                      track_len=jnp.where((ids.track_len > 0) & (rel > 0), rel, 0).astype(jnp.int32),
                                      virtual_cow_slot=jnp.where((j == 0) & active, ids.virtual_cow_slot, 0)),
            sampling=dataclasses.replace(batch.sampling, out_len=batch.sampling.out_len + done),
            spec=dataclasses.replace(spec, max_accept=jnp.clip(jnp.minimum(spec.max_accept,
                                                                           spec.tokens_left - done - 1), 0)))
        out, state = single_step(state, step_batch)
        n_acc = out.num_accepted
        # the round's committed tokens: its accepted drafts, then the bonus at column n_acc
        emitted = jnp.concatenate([row_in[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1).at[rows, n_acc].set(out.tokens)
        lps = jnp.concatenate([out.accepted_logprobs, jnp.zeros((b, 1), jnp.float32)], axis=1)
        lps = lps.at[rows, n_acc].set(out.logprobs)
        tokens = tokens.at[:, j].set(masked(emitted))
        logprobs = logprobs.at[:, j].set(jnp.where(active[:, None], lps, 0))
        top_ids = top_ids.at[:, j].set(out.top_ids)
        top_lps = top_lps.at[:, j].set(out.top_logprobs)
        accepted = accepted.at[:, j].set(jnp.where(active, n_acc, -1))
        done = done + jnp.where(active, n_acc + 1, 0)
        drafts = jnp.where(active[:, None], out.drafts, drafts)
        stopped = jnp.any((out.tokens[:, None] == stops) & (stops >= 0), axis=1)
        ok = ok & (out.row_ok | ~active)
        active = active & ~stopped & (j + 1 < lay.num_steps) & (done < spec.tokens_left) & out.row_ok
        row_in = jnp.concatenate([out.tokens[:, None], out.drafts], axis=1)
        return state, row_in, active, done, tokens, logprobs, top_ids, top_lps, accepted, drafts, ok

    s, k = query - 1, top_logprobs
    carry = (state, first_row, lay.num_new > 0, jnp.zeros(b, jnp.int32), jnp.zeros((b, rounds, query), jnp.int32),
             jnp.zeros((b, rounds, query), jnp.float32), jnp.zeros((b, rounds, query, k), jnp.int32),
             jnp.zeros((b, rounds, query, k), jnp.float32), jnp.full((b, rounds), -1, jnp.int32),
             jnp.zeros((b, s), jnp.int32), jnp.ones(b, bool))
    state, _, _, _, tokens, logprobs, top_ids, top_lps, accepted, drafts, ok = jax.lax.fori_loop(0, rounds, body, carry)
    return tokens, logprobs, top_ids, top_lps, accepted, drafts, ok, state

"""A decode dispatch fed by the one before it, on the device: the engine's overlap.

With overlap the engine dispatches decode dispatch N+1 before it has read dispatch N's
outputs (the host plans N+1 while the device runs N, and commits N while the device runs
N+1). N+1's plan assumes every row of N ran all its planned steps; what the host does not
know yet comes from N's outputs, which stay on the device:

    row i of N+1 continues row feed_row[i] of N, which was planned for feed_steps[i] steps
    token_i  = N.tokens[feed_row[i], feed_steps[i] - 1]      (N's last sample of that row)
    active_i = N.num_accepted[feed_row[i]] == feed_steps[i]  (the row ran every planned step)
               and token_i is not one of the row's stop ids  (so it did not stop at the last)
               and N.row_ok[feed_row[i]]                     (its logits stayed finite: a row that
                                                              fails on the host writes nothing more)

An inactive row becomes a padded row (num_new = num_steps = 0): the decode loop
(`decode_loop.py`) then sends all of it to the sink, so a row that stopped in N leaves no
trace in N+1, and the host, which learns of the stop when it commits N, drops the row's
results of N+1. Multi-step decode only (StepShape.steps > 1: the loop masks every field of
an inactive row; a lone decode step would need the batch re-padded).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int


@jax.jit
def feed_decode(tokens: Int[Array, " b"], num_new: Int[Array, " b"], num_steps: Int[Array, " b"],
                stop_ids: Int[Array, "b ns"], prev_tokens: Int[Array, "bp k"], prev_ran: Int[Array, " bp"],
                feed_row: Int[Array, " b"], feed_steps: Int[Array, " b"], prev_ok: Bool[Array, " bp"]
                ) -> tuple[Int[Array, " b"], Int[Array, " b"], Int[Array, " b"]]:
    """A decode batch's (tokens, num_new, num_steps) with each fed row's token and activity
    from the previous dispatch's device outputs (see the module docstring). Decode batches
    hold one token per row, row i's at packed index i. Rows with feed_row < 0 keep theirs."""
    fed = feed_row >= 0
    src = jnp.maximum(feed_row, 0)
    token = prev_tokens[src, jnp.clip(feed_steps - 1, 0, prev_tokens.shape[1] - 1)]
    stopped = jnp.any((token[:, None] == stop_ids) & (stop_ids >= 0), axis=1)
    ran_all = (prev_ran[src] == feed_steps) & prev_ok[src]
    active = jnp.where(fed, ran_all & ~stopped, True)
    tokens = jnp.where(fed, token, tokens)
    return tokens, jnp.where(active, num_new, 0), jnp.where(active, num_steps, 0)

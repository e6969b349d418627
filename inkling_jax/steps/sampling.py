"""Sampling inside the step: plain sampling and speculative acceptance.

Keys are `fold_in(key(seed), position)`: a request's draws depend on its seed and positions
only, never on what it is batched with.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .batch import StepBatch


@jax.named_scope("sample")
def sample_tokens(logits: Float[Array, "b v"], temperature: Array, top_k: Array, top_p: Array,
                  seed: Array, position: Array) -> tuple[Array, Array]:
    """Greedy where temperature == 0, else temperature / top-k / top-p sampling with the key
    fold_in(key(seed), position): reproducible for a request whatever it is batched with."""
    logits = logits.astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sample(_):
        filt = filtered_logits(logits, temperature, top_k, top_p)

        def draw(s, p, row):
            key = jax.random.fold_in(jax.random.key(s.astype(jnp.uint32)), p)
            return jax.random.categorical(key, row)

        sampled = jax.vmap(draw)(seed, position, filt).astype(jnp.int32)
        return jnp.where(temperature > 0, sampled, greedy)

    # an all-greedy batch (the common case) skips the sort and the draws
    tokens = jax.lax.cond(jnp.any(temperature > 0), sample, lambda _: greedy, None)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


@jax.named_scope("accept")
def accept_drafts(logits: Float[Array, "b s1 v"], drafts: Int[Array, "b s"], batch: StepBatch,
                  position: Int[Array, "b"]) -> tuple[Array, Array, Array, Array]:
    """Speculative acceptance for one verify step.

    logits[:, i] is the target at the row holding t_{p+i} (it predicts t_{p+i+1}); drafts[:, i]
    proposes t_{p+i+1}. Greedy rows accept the longest prefix equal to the target's argmax
    and take the argmax after it (so the output is exactly greedy decoding). Sampled rows use
    the rejection rule with a greedy (point-mass) proposal: accept draft i with probability
    p_i(d_i); at the first rejection sample from p_i with d_i removed, renormalised; after S
    acceptances sample from p_S. The emitted tokens are distributed exactly as the target's
    samples. Acceptance stops at `max_accept` and after an accepted stop token (which then
    becomes the last token). Returns (num_accepted, bonus, bonus logprob, draft logprobs)."""
    b, s1, v = logits.shape
    s = s1 - 1
    logits = logits.astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    draft_logp = jnp.take_along_axis(logp[:, :s], drafts[:, :, None], axis=-1)[..., 0]  # [B, S]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, S+1]

    temp = batch.temperature
    filt = jax.vmap(lambda l, t, k, p: filtered_logits(l, t, k, p), in_axes=(1, None, None, None), out_axes=1)(
        logits, temp, batch.top_k, batch.top_p)  # [B, S+1, V] filtered, temperature-scaled logits
    probs = jax.nn.softmax(filt, axis=-1)
    p_draft = jnp.take_along_axis(probs[:, :s], drafts[:, :, None], axis=-1)[..., 0]  # [B, S]
    keys = jax.vmap(lambda sd, pos: jax.random.fold_in(jax.random.key(sd.astype(jnp.uint32)), pos))(batch.seed, position)
    u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1 << 20), (s,)))(keys)  # [B, S]
    ok = jnp.where((temp > 0)[:, None], u < p_draft, drafts == greedy[:, :s])
    n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    n_acc = jnp.minimum(n_acc, batch.max_accept)

    # the token after the accepted drafts
    rows = jnp.arange(b)
    row_filt = filt[rows, n_acc]  # [B, V]
    rejected = jnp.where(n_acc < s, drafts[rows, jnp.minimum(n_acc, s - 1)], -1)
    residual = jnp.where(jnp.arange(v)[None, :] == rejected[:, None], -jnp.inf, row_filt)
    # a rejected draft held all the mass (p = 1): nothing left; fall back to the filtered row
    residual = jnp.where(jnp.any(jnp.isfinite(residual), axis=-1, keepdims=True), residual, row_filt)
    sampled = jax.vmap(lambda k, a, l: jax.random.categorical(jax.random.fold_in(k, a), l))(keys, n_acc, residual)
    bonus = jnp.where(temp > 0, sampled.astype(jnp.int32), greedy[rows, n_acc])

    # an accepted stop token ends the row: it becomes the last token
    is_stop = jnp.any(drafts[:, :, None] == batch.stop_ids[:, None, :], axis=-1) & (batch.stop_ids >= 0).any(-1)[:, None]
    first_stop = jnp.argmax(is_stop, axis=1)
    stop_hit = jnp.any(is_stop, axis=1) & (first_stop < n_acc)
    bonus = jnp.where(stop_hit, drafts[rows, first_stop], bonus)
    n_acc = jnp.where(stop_hit, first_stop, n_acc)
    bonus_logp = logp[rows, n_acc, bonus]
    return n_acc.astype(jnp.int32), bonus, bonus_logp, draft_logp


def filtered_logits(logits: Array, temperature: Array, top_k: Array, top_p: Array) -> Array:
    """Temperature-scaled logits with top-k / top-p truncation (-inf outside), per row."""
    v = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    rank = jnp.arange(v)[None, :]
    keep_sorted = (rank < jnp.where(top_k > 0, top_k, v)[:, None]) & (cum_before < top_p[:, None])
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
    return jnp.where(keep, scaled, -jnp.inf)

"""Sampling: a request's settings (`SamplingParams`), the per-row arrays a step takes
(`SamplingArrays`, packed from them in one place), and sampling and speculative acceptance
inside the step.

Keys are `fold_in(key(seed), position)`: a request's draws depend on its seed and positions
only, never on what it is batched with.

Adding a sampling option: a field of `SamplingParams` (validated in `validate`), its array in
`SamplingArrays` (`empty` and `pack`), and its use below; values are arrays, so a new value
compiles nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ..validate import is_int, is_real

@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int = 0
    stop_at_eos: bool = True  # stop after the model's eos token
    stop_token_ids: tuple[int, ...] = ()  # further tokens that end a generation (kept in the output)

    def __post_init__(self):
        stops = self.stop_token_ids
        if isinstance(stops, np.ndarray):
            stops = stops.tolist()
        if not isinstance(stops, (list, tuple)) or not all(is_int(t) for t in stops):
            raise ValueError(f"SamplingParams: stop_token_ids must be a sequence of int token ids, got {stops!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field that is not usable."""
        def need(cond, msg):
            if not cond:
                raise ValueError(f"SamplingParams: {msg}")

        need(is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
             f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        need(is_real(self.temperature) and self.temperature >= 0,
             f"temperature must be a finite number >= 0, got {self.temperature!r}")
        need(is_int(self.top_k) and self.top_k >= 0, f"top_k must be an int >= 0 (0: off), got {self.top_k!r}")
        need(is_real(self.top_p) and 0 < self.top_p <= 1, f"top_p must be a number in (0, 1], got {self.top_p!r}")
        need(is_int(self.seed), f"seed must be an int, got {self.seed!r}")
        need(isinstance(self.stop_at_eos, bool), f"stop_at_eos must be True or False, got {self.stop_at_eos!r}")
        need(all(t >= 0 for t in self.stop_token_ids), f"stop_token_ids must be >= 0, got {self.stop_token_ids}")


GREEDY = SamplingParams()  # RowPlan's default: greedy, no stop ids


@jax.tree_util.register_dataclass
@dataclass
class SamplingArrays:
    """Each row's sampling settings in a step (numpy on the host, device arrays inside the
    step): B rows, NS stop-id columns. Padded rows are greedy with no stop ids."""

    temperature: Float[Array, "b"]
    top_k: Int[Array, "b"]  # 0: off
    top_p: Float[Array, "b"]  # 1: off
    seed: Int[Array, "b"]  # per-request sampling seed (keys fold in the position)
    stop_ids: Int[Array, "b ns"]  # verify, multi-step decode: tokens that end the row's generation (-1: none)

    @staticmethod
    def empty(b: int, max_stop_ids: int) -> "SamplingArrays":
        return SamplingArrays(temperature=np.zeros(b, np.float32), top_k=np.zeros(b, np.int32),
                              top_p=np.ones(b, np.float32), seed=np.zeros(b, np.int32),
                              stop_ids=np.full((b, max_stop_ids), -1, np.int32))

    @staticmethod
    def pack(rows: Sequence[tuple[SamplingParams, int, Sequence[int]]], b: int, max_stop_ids: int) -> "SamplingArrays":
        """The arrays of `rows` (each: its SamplingParams, its request seed, its stop ids with
        eos resolved), padded to b rows. ValueError when a row has more than max_stop_ids stop ids."""
        out = SamplingArrays.empty(b, max_stop_ids)
        for i, (sp, seed, stop_ids) in enumerate(rows):
            if len(stop_ids) > max_stop_ids:
                raise ValueError(f"row {i} has {len(stop_ids)} stop ids; the step holds {max_stop_ids}")
            out.temperature[i] = sp.temperature
            out.top_k[i] = sp.top_k
            out.top_p[i] = sp.top_p
            out.seed[i] = seed
            out.stop_ids[i, :len(stop_ids)] = stop_ids
        return out


@jax.named_scope("sample")
def sample_tokens(logits: Float[Array, "b v"], sampling: SamplingArrays, position: Array) -> tuple[Array, Array]:
    """Greedy where temperature == 0, else temperature / top-k / top-p sampling with the key
    fold_in(key(seed), position): reproducible for a request whatever it is batched with."""
    temperature, top_k, top_p, seed = sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed
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
def accept_drafts(logits: Float[Array, "b s1 v"], drafts: Int[Array, "b s"], sampling: SamplingArrays,
                  max_accept: Int[Array, "b"], position: Int[Array, "b"]) -> tuple[Array, Array, Array, Array]:
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

    temp = sampling.temperature
    filt = jax.vmap(lambda l, t, k, p: filtered_logits(l, t, k, p), in_axes=(1, None, None, None), out_axes=1)(
        logits, temp, sampling.top_k, sampling.top_p)  # [B, S+1, V] filtered, temperature-scaled logits
    probs = jax.nn.softmax(filt, axis=-1)
    p_draft = jnp.take_along_axis(probs[:, :s], drafts[:, :, None], axis=-1)[..., 0]  # [B, S]
    keys = jax.vmap(lambda sd, pos: jax.random.fold_in(jax.random.key(sd.astype(jnp.uint32)), pos))(sampling.seed, position)
    u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1 << 20), (s,)))(keys)  # [B, S]
    ok = jnp.where((temp > 0)[:, None], u < p_draft, drafts == greedy[:, :s])
    n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    n_acc = jnp.minimum(n_acc, max_accept)

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
    stop_ids = sampling.stop_ids
    is_stop = jnp.any(drafts[:, :, None] == stop_ids[:, None, :], axis=-1) & (stop_ids >= 0).any(-1)[:, None]
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

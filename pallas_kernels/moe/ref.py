"""jnp references for the routed-expert kernels of `pallas.py`.

    grouped_matvec(x, idx, w, x_repeat=1) -> y
        y[i] = x[i // x_repeat] @ w[clip(idx[i], 0, E - 1)] (x's dtype, fp32 accumulation)
    moe_experts(x, idx, weight, w13, w2) -> out
        routed top-k experts of n tokens: x [n, h], idx / weight [n, k], w13 [E, h, 2f]
        (gate | up halves), w2 [E, f, h]; out[t] = sum_j weight[t, j] * y[t, j] with
        y[t, j] = w2[e]^T (silu(gate) * up), e = idx[t, j] (the semantics of
        `inkling_jax.model.layers.moe_experts_slices`, rounded the same way: act and y in x's
        dtype, the weighted sum in fp32 in choice order)
    grouped_matvec_extra(x, idx, w, w_extra, x_repeat, group) -> y
        rows of k routed ids then S experts of w_extra per token (`pallas.moe_experts_with_shared`'s
        products)
    moe_experts_with_shared(x, idx, weight, w13, w2, shared_w13, shared_w2, gamma, gated) -> out
        moe_experts plus the shared experts, as `layers.moe_mlp` adds `layers.shared_experts`
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def grouped_matvec(x: Float[Array, "mx h"], idx: Int[Array, "m"], w: Float[Array, "E h F"],
                   x_repeat: int = 1) -> Float[Array, "m F"]:
    """y[i] = x[i // x_repeat] @ w[clip(idx[i], 0, E - 1)] in x's dtype with fp32 accumulation
    (repeats x's rows and gathers the experts)."""
    if x_repeat > 1:
        x = jnp.repeat(x, x_repeat, axis=0)
    ids = jnp.clip(idx, 0, w.shape[0] - 1)
    return jnp.einsum("mh,mhf->mf", x, w[ids].astype(x.dtype), preferred_element_type=jnp.float32)


def combine_choices(x: Array, idx: Array, weight: Array, w13: Array, w2: Array, matvec) -> Array:
    """The routed experts through a grouped mat-vec `matvec(x_rows, expert_ids, w, x_repeat) -> fp32`
    (`grouped_matvec`'s semantics: row i reads x_rows[i // x_repeat], ids clamped to [0, E)).

    Choices flattened to m = n * k rows (row t * k + j: token t, choice j; x_repeat = k)."""
    n, k = idx.shape
    flat = idx.reshape(n * k).astype(jnp.int32)
    gu = matvec(x, flat, w13, k)
    half = gu.shape[-1] // 2
    act = (jax.nn.silu(gu[:, :half]) * gu[:, half:]).astype(x.dtype)
    y = matvec(act, flat, w2, 1).astype(x.dtype).astype(jnp.float32).reshape(n, k, -1)
    wt = weight.astype(jnp.float32)
    acc = jnp.zeros((n, y.shape[-1]), jnp.float32)
    for j in range(k):  # choice order, as the layer's reference sums
        acc = acc + wt[:, j:j + 1] * y[:, j]
    return acc.astype(x.dtype)


def moe_experts(x: Float[Array, "n h"], idx: Int[Array, "n k"], weight: Float[Array, "n k"], w13: Array,
                w2: Array) -> Float[Array, "n h"]:
    """The routed experts of a few tokens (module docstring)."""
    return combine_choices(x, idx, weight, w13, w2, grouped_matvec)


def grouped_matvec_extra(x: Float[Array, "mx h"], idx: Int[Array, "nk"], w: Float[Array, "E h F"],
                         w_extra: Float[Array, "S h F"], x_repeat: int, group: int) -> Float[Array, "m F"]:
    """Rows of `group` = k + S per token (m = n * group = mx * x_repeat, idx [n * k]): row
    t * group + q is x_rows[t * group + q] @ w[clip(idx[t * k + q], 0, E - 1)] for q < k and
    @ w_extra[q - k] after, with x_rows = x's rows each repeated x_repeat times (x's dtype, fp32
    accumulation)."""
    s = w_extra.shape[0]
    k = group - s
    n = idx.shape[0] // k
    xr = (jnp.repeat(x, x_repeat, axis=0) if x_repeat > 1 else x).reshape(n, group, -1)
    ids = jnp.clip(idx.reshape(n, k), 0, w.shape[0] - 1)
    routed = jnp.einsum("nkh,nkhf->nkf", xr[:, :k], w[ids].astype(x.dtype), preferred_element_type=jnp.float32)
    extra = jnp.einsum("nsh,shf->nsf", xr[:, k:], w_extra.astype(x.dtype), preferred_element_type=jnp.float32)
    return jnp.concatenate([routed, extra], axis=1).reshape(n * group, -1)


def moe_experts_with_shared(x: Float[Array, "n h"], idx: Int[Array, "n k"], weight: Float[Array, "n k"],
                            w13: Array, w2: Array, shared_w13: Array, shared_w2: Array, gamma: Float[Array, "n S"],
                            gated: bool = True) -> Float[Array, "n h"]:
    """The routed experts (`moe_experts`) plus the S shared experts of a few tokens, exactly as
    `layers.moe_mlp` adds `layers.shared_experts` (its mat-vec path) to them today: shared row
    t * S + s is token t through shared expert s, act = silu(gate) * up (x gamma[t, s] when
    `gated`: the sink weights) rounded to x's dtype, each shared expert's output rounded to x's
    dtype and summed in fp32; out = (routed in x's dtype -> fp32 + that sum) -> x's dtype.
    shared_w13 [S, h, 2f], shared_w2 [S, f, h], gamma [n, S] (unused unless gated)."""
    routed = moe_experts(x, idx, weight, w13, w2)
    n, s = x.shape[0], shared_w13.shape[0]
    sid = jnp.tile(jnp.arange(s, dtype=jnp.int32), n)  # [n * S]: token-major
    gu = grouped_matvec(x, sid, shared_w13, s)
    half = gu.shape[-1] // 2
    act = jax.nn.silu(gu[:, :half]) * gu[:, half:]
    if gated:
        act = act * gamma.astype(jnp.float32).reshape(n * s, 1)
    y = grouped_matvec(act.astype(x.dtype), sid, shared_w2)
    shared = y.astype(x.dtype).astype(jnp.float32).reshape(n, s, -1).sum(axis=1)
    return (routed.astype(jnp.float32) + shared).astype(x.dtype)

"""jnp references for the routed-expert kernels of `pallas.py`.

    grouped_matvec(x, idx, w, x_repeat=1) -> y
        y[i] = x[i // x_repeat] @ w[clip(idx[i], 0, E - 1)] (x's dtype, fp32 accumulation)
    moe_experts(x, idx, weight, w13, w2) -> out
        routed top-k experts of n tokens: x [n, h], idx / weight [n, k], w13 [E, h, 2f]
        (gate | up halves), w2 [E, f, h]; out[t] = sum_j weight[t, j] * y[t, j] with
        y[t, j] = w2[e]^T (silu(gate) * up), e = idx[t, j] (the semantics of
        `inkling_jax.model.layers.moe_experts_slices`, rounded the same way: act and y in x's
        dtype, the weighted sum in fp32 in choice order)
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

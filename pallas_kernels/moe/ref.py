"""The experts of a MoE layer in jnp: what the CPU serves (`pallas_kernels.REFERENCE_OPS.experts`),
and the oracle, the fallback and the backward of the kernels in `pallas.py` and `grouped.py`.

    experts(x, idx, weight, w13, w2, shared_w13=None, shared_w2=None, gamma=None, *, gated=False,
            num_experts=None, shared_mask=None) -> [n, h] in x's dtype
        the MoE block's experts: `moe_experts` plus, where shared_w13 is given, `shared_experts`,
        added in fp32 and rounded once (shared_mask, on a mesh: applied to the shared experts'
        sum before the add; num_experts: the Pallas op's size choice only)
    moe_experts(x, idx, weight, w13, w2) -> [n, h] in x's dtype
        the routed top-k experts of n tokens: x [n, h], idx / weight [n, k], w13 [E, h, 2f]
        (gate | up halves), w2 [E, f, h]; out[t] = sum_j weight[t, j] * y[t, j] with
        y[t, j] = w2[e]^T (silu(gate) * up), e = idx[t, j] (clamped to [0, E)): act and y
        rounded to x's dtype, the weighted sum in fp32 in choice order. One slice per choice
        up to 3 n k <= E (`moe_experts_slices`), past that every expert once (`moe_experts_dense`)
    shared_experts(x, gamma, shared_w13, shared_w2, *, gated, matvec=None) -> [n, h] fp32
        every token through each of the S shared experts (shared_w13 [S, h, 2f], shared_w2
        [S, f, h]), act times its sink weight gamma [n, S] when `gated`, each expert's output
        rounded to x's dtype, summed in fp32; `matvec`: the same through a grouped mat-vec
    swiglu(x, w13, w2) -> [.., h] in x's dtype
        a dense SwiGLU MLP: down(silu(gate) * up) with w13 [h, 2f] (gate | up halves) and w2
        [f, h]; both products accumulated in fp32, the activation in fp32 rounded to x's dtype,
        the output rounded to x's dtype (the dense layers and the MTP blocks)
    moe_experts_dense / _gather / _slices / _ragged, MOE_IMPLS: the routed experts' jnp
        implementations (the same math; `python -m bench.kernels.moe_micro` times them)
    grouped_matvec(x, idx, w, x_repeat=1) -> y
        y[i] = x[i // x_repeat] @ w[clip(idx[i], 0, E - 1)] (x's dtype, fp32 accumulation): the
        grouped mat-vec kernel's product
    grouped_matvec_extra(x, idx, w, w_extra, x_repeat, group) -> y
        rows of k routed ids then S experts of w_extra per token (`pallas.moe_experts_with_shared`'s
        products)
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._common import matmul, pad_lone_row


def grouped_matvec(x: Float[Array, "mx h"], idx: Int[Array, " m"], w: Float[Array, "E h F"],
                   x_repeat: int = 1) -> Float[Array, "m F"]:
    """y[i] = x[i // x_repeat] @ w[clip(idx[i], 0, E - 1)] in x's dtype with fp32 accumulation
    (repeats x's rows and gathers the experts)."""
    if x_repeat > 1:
        x = jnp.repeat(x, x_repeat, axis=0)
    ids = jnp.clip(idx, 0, w.shape[0] - 1)
    return jnp.einsum("mh,mhf->mf", x, w[ids].astype(x.dtype), preferred_element_type=jnp.float32)


def grouped_matvec_extra(x: Float[Array, "mx h"], idx: Int[Array, " nk"], w: Float[Array, "E h F"],
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


# ------------------------------------------------------------------ a dense SwiGLU


def swiglu(x: Float[Array, "... h"], w13: Float[Array, "h two_f"], w2: Float[Array, "f h"]) -> Float[Array, "... h"]:
    """down(silu(gate) * up) with the gate | up halves of w13 (module docstring)."""
    gu = matmul(x, w13)
    half = gu.shape[-1] // 2
    act = (jax.nn.silu(gu[..., :half]) * gu[..., half:]).astype(x.dtype)
    return matmul(act, w2).astype(x.dtype)


# ------------------------------------------------------------------ the routed experts


def moe_experts_dense(x: Float[Array, "n h"], idx: Array, weight: Array, w13: Array, w2: Array) -> Array:
    """Routed experts by evaluating every expert and weighting (exact; cost ~ all experts).

    The activations are kept expert-feature-major, [E, 2F, n] with the tokens minor: that is
    the layout XLA's GPU GEMM writes for a few tokens (the tokens are the narrow dimension),
    where an [E, n, 2F] result cost a transpose of the fp32 products in every layer."""
    gu = jnp.einsum("nh,ehf->efn", x, w13.astype(x.dtype), preferred_element_type=jnp.float32)
    half = gu.shape[1] // 2
    act = (jax.nn.silu(gu[:, :half]) * gu[:, half:]).astype(x.dtype)  # [E, F, n]
    y = jnp.einsum("efn,efh->enh", act, w2.astype(x.dtype), preferred_element_type=jnp.float32)
    # each token's k chosen outputs gathered from y and summed in choice order (as
    # moe_experts_slices does): elementwise work XLA fuses into one kernel, where a combine
    # matrix (a scatter) and a dot over e cost a scatter, a transpose of y and a reduction on the
    # GPU, and rounded differently per batch size on the CPU
    y = y.astype(x.dtype).astype(jnp.float32)
    rows = jnp.arange(x.shape[0])
    out = jnp.zeros((x.shape[0], y.shape[-1]), jnp.float32)
    for j in range(idx.shape[1]):
        out = out + weight[:, j, None].astype(jnp.float32) * y[idx[:, j], rows]
    return out.astype(x.dtype)


def moe_experts_gather(x: Float[Array, "n h"], idx: Array, weight: Array, w13: Array, w2: Array) -> Array:
    """Routed experts by gathering each token's k expert matrices (reads only selected experts)."""
    g13 = w13[idx].astype(x.dtype)  # [n, k, h, 2f]
    gu = jnp.einsum("nh,nkhf->nkf", x, g13, preferred_element_type=jnp.float32)
    half = gu.shape[-1] // 2
    act = (jax.nn.silu(gu[..., :half]) * gu[..., half:]).astype(x.dtype)
    y = jnp.einsum("nkf,nkfh->nkh", act, w2[idx].astype(x.dtype), preferred_element_type=jnp.float32)
    y = y.astype(x.dtype).astype(jnp.float32)
    return jnp.einsum("nk,nkh->nh", weight.astype(jnp.float32), y).astype(x.dtype)


def moe_experts_slices(x: Float[Array, "n h"], idx: Array, weight: Array, w13: Array, w2: Array) -> Array:
    """Routed experts for a handful of tokens: one dynamic slice of each selected expert's
    matrices per (token, choice), a static loop of n * k matrix-vector products."""
    n, k = idx.shape
    rows = []
    for t in range(n):
        acc = jnp.zeros((x.shape[-1],), jnp.float32)
        for j in range(k):
            e = idx[t, j]
            g13 = jax.lax.dynamic_index_in_dim(w13, e, keepdims=False)  # [h, 2f]
            gu = matmul(x[t], g13)
            half = gu.shape[-1] // 2
            act = (jax.nn.silu(gu[:half]) * gu[half:]).astype(x.dtype)
            g2 = jax.lax.dynamic_index_in_dim(w2, e, keepdims=False)  # [f, h]
            y = matmul(act, g2).astype(x.dtype).astype(jnp.float32)
            acc = acc + weight[t, j].astype(jnp.float32) * y
        rows.append(acc)
    return jnp.stack(rows).astype(x.dtype)


def moe_experts_ragged(x: Float[Array, "n h"], idx: Array, weight: Array, w13: Array, w2: Array) -> Array:
    """Routed experts of many tokens through `jax.lax.ragged_dot`: the m = n * k choices
    sorted by expert (stable; ids clipped to [0, E)), each projection one grouped product over
    the experts' contiguous runs, so only chosen experts are computed (where XLA's lowering
    computes groups as groups). The roundings are moe_experts_dense's (act and y in x's
    dtype, fp32 products, the k outputs summed in choice order), the products' fp32 sums may
    run in another order: equal to dense within fp32 rounding, bf16 within an ulp of act / y.

    A candidate for the many-token routed experts against the Pallas sorted-block GEMMs
    (`python -m bench.kernels.moe_micro --many` times both on the GPU)."""
    n, k = idx.shape
    e = w13.shape[0]
    expert = jnp.clip(idx.reshape(n * k), 0, e - 1).astype(jnp.int32)
    order = jnp.argsort(expert, stable=True)  # sorted position -> choice t * k + j
    group_sizes = jnp.zeros((e,), jnp.int32).at[expert].add(1)
    xs = x[order // k]  # [m, h]: each choice's token row, by expert
    gu = jax.lax.ragged_dot(xs, w13.astype(x.dtype), group_sizes, preferred_element_type=jnp.float32)
    half = gu.shape[-1] // 2
    act = (jax.nn.silu(gu[:, :half]) * gu[:, half:]).astype(x.dtype)  # [m, F]
    y = jax.lax.ragged_dot(act, w2.astype(x.dtype), group_sizes, preferred_element_type=jnp.float32)
    position = jnp.zeros((n * k,), jnp.int32).at[order].set(jnp.arange(n * k, dtype=jnp.int32))
    y = y.astype(x.dtype).astype(jnp.float32)[position].reshape(n, k, -1)  # back to choice order
    out = jnp.zeros((n, y.shape[-1]), jnp.float32)
    for j in range(k):
        out = out + weight[:, j, None].astype(jnp.float32) * y[:, j]
    return out.astype(x.dtype)


MOE_IMPLS = {"dense": lambda *a: moe_experts_dense(*a), "gather": lambda *a: moe_experts_gather(*a),
             "slices": lambda *a: moe_experts_slices(*a), "ragged": lambda *a: moe_experts_ragged(*a)}


def moe_experts(x: Float[Array, "n h"], idx: Int[Array, "n k"], weight: Float[Array, "n k"], w13: Array,
                w2: Array) -> Float[Array, "n h"]:
    """The routed experts of n tokens (module docstring): a few tokens read only their
    experts, one slice per choice (up to 3 n k <= E); past that reading every expert once is
    cheaper ("dense")."""
    n, k = idx.shape
    impl = "slices" if 3 * n * k <= w13.shape[0] else "dense"
    return MOE_IMPLS[impl](x, idx, weight, w13, w2)


# ------------------------------------------------------------------ the shared experts


@jax.named_scope("shared_experts")
def shared_experts(x: Float[Array, "n h"], gamma: Float[Array, "n s"] | None, shared_w13: Array, shared_w2: Array,
                   *, gated: bool, matvec: Callable | None = None) -> Float[Array, "n h"]:
    """The shared experts' summed output (fp32), each weighted by its sink gamma (the router's
    renormalised weight) when `gated`.

    matvec: a `pallas.grouped_matvec`-like function (y[i] = x[i // x_repeat] @ w[idx[i]],
    fp32) for a few tokens: row t * S + s is token t through expert s (x_repeat = S: the
    kernel reads each token's row in place, no repeated copy), reading each expert's [h, 2f] /
    [f, h] matrix in place (the batched einsum below made XLA's GPU layout copy the whole
    shared_w13 to [h, S, 2f] in every decode step). Same math and roundings either way."""
    n = x.shape[0]
    if matvec is not None:
        s = shared_w13.shape[0]
        idx = jnp.tile(jnp.arange(s, dtype=jnp.int32), n)  # [n * S]: token-major
        gu = matvec(x, idx, shared_w13, x_repeat=s)  # [n * S, 2f] fp32; row i reads x[i // S]
        half = gu.shape[-1] // 2
        act = jax.nn.silu(gu[:, :half]) * gu[:, half:]
        if gated:
            act = act * gamma.reshape(n * s, 1)
        y = matvec(act.astype(x.dtype), idx, shared_w2)  # [n * S, h] fp32
        return y.astype(x.dtype).astype(jnp.float32).reshape(n, s, -1).sum(axis=1)
    xs, gs = x, gamma
    if n == 1 and pad_lone_row():  # keep the batched products GEMMs (see _common.PAD_LONE_ROW)
        xs = jnp.pad(x, ((0, 1), (0, 0)))
        gs = jnp.pad(gamma, ((0, 1), (0, 0))) if gated else gamma
    # [S, 2F, n], tokens minor, as moe_experts_dense (XLA merges the two products' GEMMs)
    gu = jnp.einsum("nh,shf->sfn", xs, shared_w13.astype(x.dtype), preferred_element_type=jnp.float32)
    half = gu.shape[1] // 2
    act = jax.nn.silu(gu[:, :half]) * gu[:, half:]
    if gated:
        act = act * gs.T[:, None, :]
    act = act.astype(x.dtype)
    shared = jnp.einsum("sfn,sfh->snh", act, shared_w2.astype(x.dtype), preferred_element_type=jnp.float32)
    return shared[:, :n].astype(x.dtype).astype(jnp.float32).sum(axis=0)


# ------------------------------------------------------------------ routed + shared


def experts(x: Float[Array, "n h"], idx: Int[Array, "n k"], weight: Float[Array, "n k"], w13: Array, w2: Array,
            shared_w13: Array | None = None, shared_w2: Array | None = None, gamma: Float[Array, "n s"] | None = None,
            *, gated: bool = False, num_experts: int | None = None, shared_mask: Callable | None = None
            ) -> Float[Array, "n h"]:
    """The MoE block's experts (module docstring): the routed experts in fp32, plus the shared
    experts' fp32 sum (through `shared_mask` first, where given), rounded to x's dtype once.
    num_experts (the experts the router chose among, every ep shard's on a mesh) only steers
    the Pallas op's choice of kernel; the jnp result does not depend on it."""
    del num_experts
    return add_shared(moe_experts, None, x, idx, weight, w13, w2, shared_w13, shared_w2, gamma, gated, shared_mask)


def add_shared(routed: Callable, matvec: Callable | None, x: Array, idx: Array, weight: Array, w13: Array,
               w2: Array, shared_w13: Array | None, shared_w2: Array | None, gamma: Array | None, gated: bool,
               shared_mask: Callable | None) -> Array:
    """`experts` with the routed experts through `routed` (moe_experts' signature: a kernel) and
    the shared experts through `matvec` (see shared_experts; None: the einsums)."""
    with jax.named_scope("routed_experts"):
        out = routed(x, idx, weight, w13, w2).astype(jnp.float32)
    if shared_w13 is not None:
        shared = shared_experts(x, gamma, shared_w13, shared_w2, gated=gated, matvec=matvec)
        out = out + (shared if shared_mask is None else shared_mask(shared))
    return out.astype(x.dtype)


__all__ = ["MOE_IMPLS", "add_shared", "experts", "grouped_matvec", "grouped_matvec_extra", "moe_experts",
           "moe_experts_dense", "moe_experts_gather", "moe_experts_ragged", "moe_experts_slices", "shared_experts",
           "swiglu"]

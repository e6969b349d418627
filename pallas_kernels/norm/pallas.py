"""Pallas kernel for the per-head q / k RMSNorms of the attention block, in one launch.

    qk_norm(q, kv, q_weight, k_weight, *, num_heads, num_kv_heads, head_dim, eps)
        -> (q_normed [T, nh, hd], k_normed [T, nkv, hd])

Same signature and result as `ref.qk_norm` (read its docstring for the layouts) plus
`interpret` and `num_warps`. q and kv are read in place: q may be the whole fused q|k|v|r
projection (its first nh * hd columns are q) and kv the k|v conv output (k is its first
nkv * hd columns), so no slice of either is materialised. The backward is the reference's
VJP (`jax.custom_vjp`, as the conv-state kernels').

Why. `layers.attention_block` normalises each q head and each k head (`rms_norm` over
head_dim). XLA's GPU code runs the two norms as ~4 launches per layer (the reductions and the
multiplies, with the slices of q and k) where a decode step has a token or a few: launch
latency, not work. This kernel is one launch per layer.

Work split. One program per token row (grid T): it loads the row's q heads as one
[P_q * hd] vector (P_q = the next power of two >= nh: Triton blocks are powers of two; heads
past nh are masked off, read as 0 and never stored), reshapes it to [P_q, hd], and computes
`ref.rms_norm` on that tile, op for op (x.astype(f32); x * rsqrt(mean(x * x) + eps); cast to
x's dtype; times weight.astype(dtype) in x's dtype); then the same for the k heads. The weights
are loaded once per program as [hd] rows. The bench model's row is 16 q heads + 2 or 4 k heads
of 128: 2304 / 2560 values, 4 warps.

Exactness. The only op whose result depends on an order is the mean's sum over head_dim: in
interpret mode XLA reduces each [hd] head row of the tile as it reduces the reference's rows
(bit for bit, fp32 and bf16: tests/test_qk_norm_kernel.py); compiled, Triton's reduction order
is its layout's choice, within a few fp32 ulps of XLA's mean (see that test's GPU-order check),
so the normed values within an ulp of their dtype.

Fallback to the reference (never a silently different result): head_dim not a power of two,
malformed shapes (q / kv narrower than their heads, weights not [hd], T == 0, rows of
different counts), rows wider than MAX_ROW_ELEMS, or offsets past int32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float

from .._common import INT32_MAX, pallas_call, pow2_ceil, with_ref_vjp
from . import ref

MAX_ROW_ELEMS = 32768  # (P_q + P_k) * hd values of one program at most (registers)


def default_num_warps(row_elems: int) -> int:
    """Warps per program for a row of (P_q + P_k) * hd values: 1 up to 512, 2 up to 1024, 4 up
    to 4096, then 8 (about 16 values per thread at most below 8 warps; untuned)."""
    return 1 if row_elems <= 512 else 2 if row_elems <= 1024 else 4 if row_elems <= 4096 else 8


def _norm_heads(x_ref, w_ref, o_ref, t, n: int, hd: int, eps: float) -> None:
    """Row t's first n heads of x_ref [T, W] normed into o_ref [T, n * hd] (one [P, hd] tile)."""
    p = pow2_ceil(n)
    if p == n:
        x = x_ref[t, pl.ds(0, n * hd)]
    else:
        lane = lax.broadcasted_iota(jnp.int32, (p * hd,), 0)
        x = plt.load(x_ref.at[t, pl.ds(0, p * hd)], mask=lane < n * hd, other=0)
    w = w_ref[...]
    normed = ref.rms_norm(x.reshape(p, hd), w, eps).reshape(p * hd)  # padded heads: 0 * rsqrt(eps) = 0
    if p == n:
        o_ref[t, :] = normed
    else:
        plt.store(o_ref.at[t, pl.ds(0, p * hd)], normed, mask=lane < n * hd)


def _kernel(q_ref, kv_ref, qw_ref, kw_ref, qo_ref, ko_ref, *, nh: int, nkv: int, hd: int, eps: float):
    t = pl.program_id(0)
    _norm_heads(q_ref, qw_ref, qo_ref, t, nh, hd, eps)
    _norm_heads(kv_ref, kw_ref, ko_ref, t, nkv, hd, eps)


def _qk_norm_pallas(q, kv, q_weight, k_weight, nh: int, nkv: int, hd: int, eps: float, interpret: bool,
                    num_warps: int):
    t = q.shape[0]
    kernel = lambda *refs: _kernel(*refs, nh=nh, nkv=nkv, hd=hd, eps=eps)
    qn, kn = pallas_call(kernel, out_shape=(jax.ShapeDtypeStruct((t, nh * hd), q.dtype),
                                            jax.ShapeDtypeStruct((t, nkv * hd), kv.dtype)),
                         grid=(t,), aliases={}, interpret=interpret, num_warps=num_warps,
                         name="qk_norm")(q, kv, q_weight, k_weight)
    return qn.reshape(t, nh, hd), kn.reshape(t, nkv, hd)


def qk_norm(q: Float[Array, "t wq"], kv: Float[Array, "t wk"], q_weight: Float[Array, " hd"],
            k_weight: Float[Array, " hd"], *, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
            interpret: bool = False, num_warps: int | None = None
            ) -> tuple[Float[Array, "t nh hd"], Float[Array, "t nkv hd"]]:
    """(q_normed [T, nh, hd], k_normed [T, nkv, hd]): `ref.qk_norm` in one Pallas launch, one
    program per token row. num_heads, num_kv_heads, head_dim, eps and num_warps are static.
    See the module docstring (layouts, exactness, fallback)."""
    nh, nkv, hd, eps = int(num_heads), int(num_kv_heads), int(head_dim), float(eps)
    kw = dict(num_heads=nh, num_kv_heads=nkv, head_dim=hd, eps=eps)
    row_elems = (pow2_ceil(nh) + pow2_ceil(nkv)) * hd
    ok = (q.ndim == 2 and kv.ndim == 2 and q.shape[0] == kv.shape[0] > 0 and nh > 0 and nkv > 0
          and hd > 0 and hd & (hd - 1) == 0 and q.shape[1] >= nh * hd and kv.shape[1] >= nkv * hd
          and q_weight.shape == (hd,) and k_weight.shape == (hd,) and row_elems <= MAX_ROW_ELEMS
          and q.shape[0] * max(q.shape[1], kv.shape[1], pow2_ceil(nh) * hd, pow2_ceil(nkv) * hd) <= INT32_MAX)
    if not ok:
        return ref.qk_norm(q, kv, q_weight, k_weight, **kw)
    if num_warps is None:
        num_warps = default_num_warps(row_elems)
    ref_fn = lambda a, b, wq, wk: ref.qk_norm(a, b, wq, wk, **kw)
    kernel_fn = lambda a, b, wq, wk: _qk_norm_pallas(a, b, wq, wk, nh, nkv, hd, eps, interpret, num_warps)
    return with_ref_vjp(kernel_fn, ref_fn)(q, kv, q_weight, k_weight)


__all__ = ["MAX_ROW_ELEMS", "default_num_warps", "qk_norm"]

"""Routed experts of many tokens (prefill, extend steps): the choices sorted by expert into
blocks, then grouped GEMMs that read only the chosen experts.

    moe_experts_grouped(x, idx, weight, w13, w2) -> [n, h] in x's dtype
        `ref.moe_experts`' signature and semantics (x [n, h], idx / weight [n, k],
        w13 [E, h, 2f] gate | up halves, w2 [E, f, h])
    dispatch(idx, num_experts, bm) -> Dispatch      the sorted block layout (jnp)
    grouped_swiglu(x_blocks, block_expert, w13) -> act [P, f]   silu(x @ gate) * (x @ up)
    grouped_matmul(x_blocks, block_expert, w) -> y [P, F]        x @ w[expert of the block]

Why. With hundreds of tokens every expert is chosen by many of them, and the model's jnp
MoE for many tokens (`ref.moe_experts_dense`) evaluates all E experts for every token:
E / k = 8 times the useful work of the bench model (on the H200 it was 71 ms of a 135 ms
8 x 1024-token extend step). `jax.lax.ragged_dot` would be the library's answer, but XLA's
GPU lowering of it computes every group densely too.

Layout (`dispatch`). The m = n * k choices (row t * k + j: token t, choice j) are sorted by
expert (stable), and each expert's run is padded to a multiple of `bm` rows, so every block
of bm rows belongs to one expert: `block_expert[b]` (-1 for the blocks past the last one
used). The padded length P = NB * bm is static: sum_e ceil(c_e / bm) <= m / bm + E, so
NB = (m + E * (bm - 1)) // bm blocks always suffice. `row_of_choice[t * k + j]` is the
choice's row in the padded layout; `choice_of_row[r]` the token whose activation fills row
r (n, an all-zero row, for padding rows).

Kernels (Triton via Pallas). Grid (NB, columns / bn): the program of block b reads its
expert e = block_expert[b] (a scalar load: the Triton lowering has no scalar prefetch, so w
is passed whole and addressed by a dynamic index), then walks the contracting axis in steps
of bk: x[b rows, kk] [bm, bk] @ w[e, kk, cols] [bk, bn] accumulated in fp32 (tensor-core
dots; `num_stages` pipelines the loads). `grouped_swiglu` keeps two accumulators, the gate
columns j and the up columns f + j of w13, and writes silu(gate) * up rounded to x's dtype
(the reference's `act`), so the [P, 2f] fp32 products never reach HBM. Blocks with
block_expert < 0 skip the loop and write zeros.

Deviations from the reference: the fp32 accumulation order of the tensor-core dots differs
from XLA's, so results match `ref.moe_experts` within floating-point tolerance (bf16: an
act or y rounding may land one ulp apart), not bit for bit. The combine (the weighted sum of
a token's k choices in fp32, in choice order) is the reference's. A token's result does not
depend on the other tokens of the batch (each output row is one row of a dot).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import no_type_check

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from .._common import pallas_call, pow2_factor, with_ref_vjp
from . import ref

BM, BN, BK = 64, 128, 64  # rows per block, output columns per program, contracting step
NUM_WARPS, NUM_STAGES = 4, 3
# bm=None picks by the choices per expert: from LARGE_BLOCK_CHOICES per expert, blocks of
# LARGE_BM rows with LARGE_WARPS warps (H200, bench shapes: 1.10x the 64-row blocks at 8192
# tokens, 1.17x at 32768; 0.81x at 2048)
LARGE_BLOCK_CHOICES, LARGE_BM, LARGE_WARPS = 512, 128, 8
MIN_TILE = 16  # bn' or bk' below this (a dimension with a small power-of-two factor): the reference


# no_type_check (the tests' jaxtyping hook): a pytree node, rebuilt through __init__ by JAX with
# leaves of any kind (lowering's ArgInfo, specs, float0 cotangents; numpy on the host)
@no_type_check
@jax.tree_util.register_dataclass
@dataclass
class Dispatch:
    """The m = n * k choices sorted by expert into blocks of bm rows (module docstring)."""

    block_expert: Int[Array, " nb"]  # expert of each block of bm padded rows; -1: unused block
    row_of_choice: Int[Array, " m"]  # padded row of choice t * k + j
    choice_of_row: Int[Array, " p"]  # token feeding each padded row (n: a padding row)


def num_blocks(m: int, num_experts: int, bm: int) -> int:
    """Blocks of bm rows that hold m choices over num_experts experts, whatever the routing."""
    return (m + num_experts * (bm - 1)) // bm


def dispatch(idx: Int[Array, "n k"], num_experts: int, bm: int) -> Dispatch:
    """Sort the choices by expert into blocks of bm rows (ids clipped to [0, E))."""
    n, k = idx.shape
    m = n * k
    nb = num_blocks(m, num_experts, bm)
    expert = jnp.clip(idx.reshape(m).astype(jnp.int32), 0, num_experts - 1)
    order = jnp.argsort(expert, stable=True)  # choices by expert
    counts = jnp.zeros((num_experts,), jnp.int32).at[expert].add(1)
    start = jnp.cumsum(counts) - counts  # first sorted position of each expert
    padded = (counts + bm - 1) // bm * bm
    padded_end = jnp.cumsum(padded)
    padded_start = padded_end - padded
    sorted_expert = expert[order]
    rank = jnp.arange(m, dtype=jnp.int32) - start[sorted_expert]
    row_sorted = padded_start[sorted_expert] + rank  # padded row of each sorted choice
    row_of_choice = jnp.zeros((m,), jnp.int32).at[order].set(row_sorted)
    choice_of_row = jnp.full((nb * bm,), n, jnp.int32).at[row_sorted].set((order // k).astype(jnp.int32))
    block_row = jnp.arange(nb, dtype=jnp.int32) * bm
    block_expert = jnp.searchsorted(padded_end, block_row, side="right").astype(jnp.int32)
    block_expert = jnp.where(block_row < padded_end[-1], block_expert, -1)
    return Dispatch(block_expert, row_of_choice, choice_of_row)


def _tiles(rows: int, cols: int, bm: int, bn: int, bk: int) -> tuple[int, int] | None:
    """(bn', bk') dividing the output columns and the contracting rows, or None (reference)."""
    bn, bk = min(bn, pow2_factor(cols)), min(bk, pow2_factor(rows))
    return None if bn < MIN_TILE or bk < MIN_TILE or bm < MIN_TILE else (bn, bk)


def _grouped(x, block_expert, w, *, swiglu: bool, out_dtype, bm: int, bn: int, bk: int, num_warps: int,
             num_stages: int, interpret: bool) -> Array:
    """The grouped GEMM kernel: [P, K] x w[E, K, F] -> [P, F] (or silu(gate) * up: [P, F / 2])."""
    p, kdim = x.shape
    f = w.shape[-1] // 2 if swiglu else w.shape[-1]
    nb = p // bm
    steps = kdim // bk
    dtype = x.dtype

    def kernel(be_ref, x_ref, w_ref, o_ref):
        b, j = pl.program_id(0), pl.program_id(1)
        e = be_ref[b]
        rows = pl.ds(pl.multiple_of(b * bm, bm), bm)
        cols = pl.ds(pl.multiple_of(j * bn, bn), bn)

        def weight(kk, c):
            wb = w_ref[jnp.maximum(e, 0), kk, c]
            return wb if wb.dtype == dtype else wb.astype(dtype)  # the reference's w.astype(x.dtype)

        def step(s, accs):
            kk = pl.ds(pl.multiple_of(s * bk, bk), bk)
            xb = x_ref[rows, kk]
            if swiglu:
                up_cols = pl.ds(pl.multiple_of(f + j * bn, bn), bn)
                return (accs[0] + jnp.dot(xb, weight(kk, cols), preferred_element_type=jnp.float32),
                        accs[1] + jnp.dot(xb, weight(kk, up_cols), preferred_element_type=jnp.float32))
            return (accs[0] + jnp.dot(xb, weight(kk, cols), preferred_element_type=jnp.float32),)

        zero = jnp.zeros((bm, bn), jnp.float32)
        init = (zero, zero) if swiglu else (zero,)
        # unused blocks (past the last expert's run) do no work: a zero trip count
        trip = jnp.where(e >= 0, jnp.int32(steps), jnp.int32(0))
        accs = jax.lax.fori_loop(jnp.int32(0), trip, step, init)
        out = jax.nn.silu(accs[0]) * accs[1] if swiglu else accs[0]
        o_ref[rows, cols] = out.astype(o_ref.dtype)

    return pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((p, f), out_dtype), grid=(nb, f // bn), aliases={},
                       interpret=interpret, num_warps=num_warps, num_stages=num_stages,
                       name="moe_grouped_swiglu" if swiglu else "moe_grouped_matmul")(block_expert, x, w)


def grouped_swiglu(x: Float[Array, "p h"], block_expert: Int[Array, " nb"], w13: Float[Array, "E h two_f"], *,
                   bm: int = BM, bn: int = BN, bk: int = BK, num_warps: int = NUM_WARPS,
                   num_stages: int = NUM_STAGES, interpret: bool = False) -> Float[Array, "p f"]:
    """act[r] = silu(x[r] @ gate) * (x[r] @ up), gate | up = w13[e] of r's block, in x's dtype
    (products in fp32). Rows of unused blocks are zero. p must be a multiple of bm."""
    tiles = _tiles(x.shape[1], w13.shape[-1] // 2, bm, bn, bk)
    assert tiles is not None and x.shape[0] % bm == 0, (x.shape, w13.shape, bm)
    return _grouped(x, block_expert, w13, swiglu=True, out_dtype=x.dtype, bm=bm, bn=tiles[0], bk=tiles[1],
                    num_warps=num_warps, num_stages=num_stages, interpret=interpret)


def grouped_matmul(x: Float[Array, "p K"], block_expert: Int[Array, " nb"], w: Float[Array, "E K F"], *,
                   bm: int = BM, bn: int = BN, bk: int = BK, num_warps: int = NUM_WARPS,
                   num_stages: int = NUM_STAGES, interpret: bool = False) -> Float[Array, "p F"]:
    """y[r] = x[r] @ w[e] for e the expert of r's block, fp32 accumulation, rounded to x's
    dtype. Rows of unused blocks are zero. p must be a multiple of bm."""
    tiles = _tiles(x.shape[1], w.shape[-1], bm, bn, bk)
    assert tiles is not None and x.shape[0] % bm == 0, (x.shape, w.shape, bm)
    return _grouped(x, block_expert, w, swiglu=False, out_dtype=x.dtype, bm=bm, bn=tiles[0], bk=tiles[1],
                    num_warps=num_warps, num_stages=num_stages, interpret=interpret)


def _experts(x, idx, weight, w13, w2, kw) -> Array:
    n, k = idx.shape
    d = dispatch(idx, w13.shape[0], kw["bm"])
    x_rows = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[d.choice_of_row]  # [P, h]
    act = grouped_swiglu(x_rows, d.block_expert, w13, **kw)
    y = grouped_matmul(act, d.block_expert, w2, **kw)
    y = y[d.row_of_choice].astype(jnp.float32).reshape(n, k, -1)
    wt = weight.astype(jnp.float32)
    acc = jnp.zeros((n, y.shape[-1]), jnp.float32)
    for j in range(k):  # choice order, as the reference sums
        acc = acc + wt[:, j:j + 1] * y[:, j]
    return acc.astype(x.dtype)


def moe_experts_grouped(x: Float[Array, "n h"], idx: Int[Array, "n k"], weight: Float[Array, "n k"], w13: Array,
                        w2: Array, *, bm: int | None = None, bn: int = BN, bk: int = BK, num_warps: int | None = None,
                        num_stages: int = NUM_STAGES, interpret: bool = False) -> Float[Array, "n h"]:
    """`ref.moe_experts` (same signature and semantics) through the sorted blocks and the two
    grouped GEMMs; backward: the reference's VJP. Shapes the tiles cannot divide (or bm not a
    power of two >= 16) fall back to the reference. bm / num_warps None: by the number of
    choices per expert (LARGE_BLOCK_CHOICES)."""
    large = idx.size >= LARGE_BLOCK_CHOICES * w13.shape[0]
    bm = bm or (LARGE_BM if large else BM)
    num_warps = num_warps or (LARGE_WARPS if large and bm == LARGE_BM else NUM_WARPS)
    if bm & (bm - 1) or bn & (bn - 1) or bk & (bk - 1):
        raise ValueError(f"bm, bn and bk must be powers of two, not {bm}, {bn}, {bk}")
    n, k = idx.shape
    h = x.shape[-1]
    two_f = w13.shape[-1]
    ok = (x.ndim == 2 and w13.ndim == 3 and w2.ndim == 3 and n > 0 and k > 0 and two_f % 2 == 0
          and weight.shape == idx.shape and w13.shape[1] == h and w2.shape[1:] == (two_f // 2, h)
          and w2.shape[0] == w13.shape[0]
          and _tiles(h, two_f // 2, bm, bn, bk) is not None and _tiles(two_f // 2, h, bm, bn, bk) is not None)
    if not ok:
        return ref.moe_experts(x, idx, weight, w13, w2)
    kw = dict(bm=bm, bn=bn, bk=bk, num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    kernel_fn = lambda x, idx, weight, w13, w2: _experts(x, idx, weight, w13, w2, kw)
    return with_ref_vjp(kernel_fn, ref.moe_experts)(x, idx, weight, w13, w2)


__all__ = ["BM", "BK", "BN", "Dispatch", "dispatch", "grouped_matmul", "grouped_swiglu", "moe_experts_grouped",
           "num_blocks"]

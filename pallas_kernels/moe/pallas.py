"""Pallas kernel for the routed experts of a MoE layer when a handful of tokens decode.

    grouped_matvec(x, idx, w, *, x_repeat=1) -> y      y[i] = x[i // x_repeat] @ w[idx[i]], fp32
        x [m / x_repeat, h] (bf16 or fp32), idx [m] int32 expert ids (clamped to [0, E) in the
        kernel), w [E, h, F] (any float dtype, cast to x's dtype as the reference does),
        y [m, F] float32
    moe_experts(x, idx, weight, w13, w2) -> [n, h] in x's dtype
        `ref.moe_experts`' signature and semantics (x [n, h], idx / weight [n, k],
        w13 [E, h, 2f] gate | up halves, w2 [E, f, h])
    moe_experts_with_shared(x, idx, weight, w13, w2, shared_w13, shared_w2, gamma, *, gated)
        -> [n, h] in x's dtype: `ref.experts` with shared experts (moe_experts plus the S shared
        experts, shared_w13 [S, h, 2f], shared_w2 [S, f, h], gamma [n, S] the sink weights
        applied when `gated`), the routed and shared rows of each product in one launch

    matvec(x, w) -> x @ w fp32 (`_common.matmul`): the same kernel with every row through one
        matrix and no expert ids (a lone token's projections: `pallas_kernels.ops`' matmul)

All take `interpret` (CPU tests: `interpret=True`), and each has a `jax.custom_vjp` whose
backward is its reference's VJP (`ref.py`).

Why. With batch 1-4 every expert product is a matrix-vector product: the time is reading the
selected experts' weights from HBM once, nothing else. XLA's GPU code for these gemvs (one
`dynamic_slice` + dot per choice, or the gather form) turns them into multiply + reduce
fusions that use few SMs and at times materialise the fp32 products; this kernel reads each
selected expert's [h, F] matrix exactly once per row, with hundreds of programs in flight.

Work split. `grouped_matvec` runs one program per (row i, column tile j of `tf` columns,
contracting split s of `S`): the h axis is cut into S chunks of h/S rows, each walked in
blocks of `bh` rows. The program reads its row's expert id e = clip(idx[i], 0, E - 1) (the Triton lowering
has no scalar prefetch: idx is an ordinary whole-array input, and w is passed whole so the
kernel can address any expert by a dynamic index), then for each block loads x[i // x_repeat, rows]
[bh] and w[e, rows, cols] [bh, tf], and accumulates x[:, None] * w in an fp32 [bh, tf]
register tile; one reduction over its rows at the end gives the partial sums it writes to
part[i, s, cols] (fp32 [m, S, F]). The wrapper sums part over S in fp32 (jnp; XLA can
fuse it with the activation that follows). S is the smallest power of two giving
m * (F / tf) * S >= 512 programs (132 SMs, a few programs each), at most h / bh. With the
defaults (tf=128, bh=64, num_warps=2):

    m=4, h=2048, F=2048 (bench w13): grid (4, 16, 8) = 512 programs, 256 rows each, 4 blocks
    m=4, h=1024, F=2048 (bench w2):  grid (4, 16, 8) = 512 programs, 128 rows each, 2 blocks

The block loop is unrolled in Python up to `MAX_UNROLL` blocks (so the independent weight
loads of a program are issued back to back), a `fori_loop` past that. Offsets into w are
64-bit in the Triton lowering once w passes 4 GiB; expert ids are clamped to [0, E) by the
kernel (a scalar min / max per program, where an XLA clip before the launch was one more
launch; the reference clamps too), so no id can address outside w. x_repeat > 1 reads one row
of x for x_repeat consecutive output rows (a token through several experts) in place, where a
`jnp.repeat` copy of x was one more launch.

Shapes. tf and bh are powers of two (Triton's block shapes must be): the kernel uses
tf' = min(tf, largest power of two dividing F) and bh' = min(bh, largest power of two
dividing h). Where tf' or bh' would fall below `MIN_TILE` (F or h with a small power-of-two
factor), or for empty / malformed inputs, the functions fall back to the references
(`ref.grouped_matvec`, `ref.moe_experts`, `ref.experts`); there is no masking.

`moe_experts` flattens the choices to m = n * k rows (row t * k + j is token t, choice j; x
read per choice with x_repeat = k) and computes gu = grouped_matvec(x, idx, w13), act = (silu(gate) *
up) in x's dtype, y = grouped_matvec(act, idx, w2) rounded to x's dtype, then
out[t] = sum_j weight[t, j] * y[t, j] in fp32 (the reference's order, j = 0 .. k-1), cast to
x's dtype. The down product computes act itself as it loads it (the act prologue of
`_partials`: the gate|up split partials summed in order, SwiGLU, the rounding), so no launch
sits between the two products.

`moe_experts_with_shared` (batch-1 to few-token decode, single device) runs both products over
n * G rows, G = k + S per token, token-major: row t * G + q is token t's routed choice q for
q < k, its shared expert q - k after. The kernel takes the routed ids idx [n * k] and a second
weight array w_extra (shared_w13 / shared_w2, expert ids E .. E + S - 1 in effect): a program
of a routed row clamps its id and walks w, one of a shared row walks w_extra[q - k], under a
`pl.when` per branch, so each program loads from one array only and neither is concatenated
to the other (a 100+ MB copy per step at the bench shapes). gate|up: one launch (x read in
place, x_repeat = G) writing its split partials [n * G, S_up, 2f]; down: one launch whose
loads compute its rows of act themselves (the act prologue of `_partials`: the partials'
sum over S_up in order, SwiGLU, the shared rows times their gamma read in place from [n, S],
rounded to x's dtype), so no launch sits between the two products; the combine
(routed weighted sum in choice order, rounded to x's dtype, + the fp32 sum of the shared rows
rounded to x's dtype, -> x's dtype, as `ref.experts` adds `ref.shared_experts`): one
fusion. Where today's engine took clip + repeat + routed gate|up + shared repeat + shared
gate|up + two activations + two downs + two combines, this is 2 launches + 1 fusion. The
split count S of each product is moe_experts' for the n * k routed rows, so the routed rows'
products are moe_experts'; the shared rows' fp32 sums may split differently from the separate
shared kernel's (n * S rows pick more splits), and XLA's sum over the splits may order an
[m, S, F] reduction differently for another m. Measured against the separate kernels (n 1-4,
k 2-4, S 1-3, h 256, f 128, tf = bh = 32, jit on CPU, the activation still an XLA fusion
then): bf16 bit-equal in 36 / 36 with --xla_allow_excess_precision=false; fp32 within 1e-6
(max abs 9.5e-7 at outputs ~1-8). The act prologue against that fusion (n 1-4, k 2-4, S 1-3,
splits auto and 2, interpret mode, excess precision off): bf16 bit-equal in 12 / 12, fp32
within 7.2e-7 (XLA contracts the fp32 activation into the products differently). With XLA's
default excess precision, XLA may drop a bf16 round trip (convert f32 -> bf16 -> f32) in
either program, differently in each (interpret mode shows the kernels' bodies to XLA too):
25 / 36 equal there, the rest up to one bf16 rounding of a term apart.

Deviations from the reference: the fp32 summation order of the contractions differs from
XLA's (per-lane partial sums over row blocks, a tree reduction in the tile, then S partials),
so results equal the reference's within floating-point tolerance, not bit for bit (in bf16 a
rounding of act or y may land one ulp apart). Products are exact either way (bf16 x bf16
and fp32 x fp32 products are formed in fp32 from the same operands). Rows whose tokens chose
the same expert read that expert once per row (the L2 cache may serve the repeat).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from .._common import matmul, pallas_call, pow2_factor, with_ref_vjp
from . import ref

TF = 128  # output columns per program
BH = 64  # contracting rows per block of the loop
NUM_WARPS = 2  # 2 against 4: batch-1 decode in the engine loop 2.2 % faster on an H100 (1.277 / 1.280 against
# 1.309 / 1.305 ms per token step, alternating runs) and 3-4 % on an H200 (BENCHMARKS.md, 2026-12-07)
TARGET_PROGRAMS = 512  # ~4 programs per SM on an H100 / H200 (132 SMs)
MIN_TILE = 16  # tf' or bh' below this: the reference
MAX_UNROLL = 8  # blocks per program unrolled in Python; a fori_loop past this
NUM_STAGES = 1  # Triton's software pipelining of that fori_loop (1: none)


def _plan(m: int, h: int, f: int, tf: int, bh: int, splits: int | None,
          target_programs: int) -> tuple[int, int, int] | None:
    """(tf', bh', S) for the kernel, or None when the shape needs the reference."""
    if tf < 1 or bh < 1 or tf & (tf - 1) or bh & (bh - 1):
        raise ValueError(f"tf and bh must be powers of two, not {tf}, {bh}")
    if m == 0 or h == 0 or f == 0:
        return None
    tf, bh = min(tf, pow2_factor(f)), min(bh, pow2_factor(h))
    if tf < MIN_TILE or bh < MIN_TILE:
        return None
    blocks = h // bh
    if splits is None:
        s, cap = 1, pow2_factor(blocks)
        while s < cap and m * (f // tf) * s < target_programs:
            s *= 2
    else:
        s = int(splits)
        if s < 1 or blocks % s:
            raise ValueError(f"splits={s} must divide h / bh = {blocks}")
    return tf, bh, s


def grid_for(m: int, h: int, f: int, *, tf: int = TF, bh: int = BH, splits: int | None = None,
             target_programs: int = TARGET_PROGRAMS) -> tuple[int, int, int] | None:
    """The launch grid (rows, column tiles, splits) grouped_matvec uses, or None (reference)."""
    plan = _plan(m, h, f, tf, bh, splits, target_programs)
    return None if plan is None else (m, f // plan[0], plan[2])


def _partials(x, idx, w, tf: int, bh: int, s: int, num_warps: int, interpret: bool, x_repeat: int = 1,
              w_extra=None, group: int = 1, act_dtype=None, gamma=None, num_stages: int = NUM_STAGES,
              max_unroll: int = MAX_UNROLL) -> Array:
    """part[i, s, :] = x[i // x_repeat, chunk s] @ W_i[chunk s], fp32 [m, S, F].

    Without w_extra: m = len(idx) and W_i = w[clip(idx[i], 0, E - 1)]; idx None: every row
    through w[0] (m = len(x) * x_repeat; no id array, so no constant ids for XLA to
    materialise before each launch). With w_extra [S', h, F]:
    rows come in groups of `group` = k + S' per token (m = n * group, idx [n * k]); row
    i = t * group + q reads W_i = w[clip(idx[t * k + q], 0, E - 1)] for q < k, w_extra[q - k]
    after (the expert id E + q - k): one branch per program loads from one of the two arrays,
    so neither is copied into the other.

    act_dtype (the SwiGLU prologue): x is then the previous product's partials [m_x, S_x, 2h]
    fp32 (gate | up halves), and the row x[r] this product reads is
    act = silu(sum_s x[r, s, :h]) * sum_s x[r, s, h:], rounded to act_dtype: what the activation
    between the two products computed in a launch of its own (the sums over S_x in order
    s = 0, 1, ...). gamma [n, S'] fp32 (with w_extra and act_dtype): the act of row t * group + q,
    q >= k, times gamma[t, q - k] before the rounding (the shared experts' sink weights, read in
    place: a multiplier per row, ones for the routed rows, was one more launch); routed rows
    unscaled."""
    h = x.shape[1] if act_dtype is None else x.shape[2] // 2
    n_experts, f = w.shape[0], w.shape[-1]
    k = group - (0 if w_extra is None else w_extra.shape[0])
    if idx is None:
        m = x.shape[0] * x_repeat
    else:
        m = idx.shape[0] if w_extra is None else idx.shape[0] // k * group
    chunk = h // s
    nb = chunk // bh
    dtype = x.dtype if act_dtype is None else jnp.dtype(act_dtype)
    n_extra = 0 if w_extra is None else 1

    def kernel(*all_refs):
        idx_ref, (x_ref, w_ref, *refs) = (None, all_refs) if idx is None else (all_refs[0], all_refs[1:])
        o_ref = refs[-1]
        i, j, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        r = i // x_repeat if x_repeat > 1 else i  # x's row read in place (no repeated copy of x)
        cols = pl.ds(pl.multiple_of(j * tf, tf), tf)
        base = c * chunk

        def x_block(start, scale):
            rows = pl.ds(pl.multiple_of(start, bh), bh)
            if act_dtype is None:
                return x_ref[r, rows].astype(jnp.float32)
            gate = jnp.sum(x_ref[r, :, rows], axis=0)  # [bh]: the gate partials' sum over S_x
            up = jnp.sum(x_ref[r, :, pl.ds(pl.multiple_of(h + start, bh), bh)], axis=0)
            a = jax.nn.silu(gate) * up
            if scale is not None:
                a = a * scale
            return a.astype(dtype).astype(jnp.float32)

        def matvec(wt_ref, e, scale=None):
            def block(b, acc):
                rows = pl.ds(pl.multiple_of(base + b * bh, bh), bh)
                xb = x_block(base + b * bh, scale)
                wb = wt_ref[e, rows, cols]
                if wb.dtype != dtype:
                    wb = wb.astype(dtype)  # the reference's w.astype(x.dtype)
                return acc + xb[:, None] * wb.astype(jnp.float32)

            acc = jnp.zeros((bh, tf), jnp.float32)
            if nb <= max_unroll:
                for b in range(nb):
                    acc = block(b, acc)
            else:
                acc = jax.lax.fori_loop(0, nb, block, acc)
            o_ref[i, c, cols] = jnp.sum(acc, axis=0)

        def clamped(pos):
            # the id clamped here, not by an XLA op before the launch: no id can address outside w
            return jnp.minimum(jnp.maximum(idx_ref[pos], 0), n_experts - 1)

        if idx is None:
            matvec(w_ref, 0)
        elif w_extra is None:
            matvec(w_ref, clamped(i))
        else:
            t, q = i // group, i % group

            @pl.when(q < k)
            def _():
                matvec(w_ref, clamped(t * k + q))

            @pl.when(q >= k)
            def _():
                matvec(refs[0], q - k, None if gamma is None else refs[n_extra][t, q - k])

    extra = (() if w_extra is None else (w_extra,)) + (() if gamma is None else (gamma.astype(jnp.float32),))
    return pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((m, s, f), jnp.float32), grid=(m, f // tf, s),
                       aliases={}, interpret=interpret, num_warps=num_warps, num_stages=num_stages,
                       name="moe_grouped_matvec")(
        *(() if idx is None else (idx.astype(jnp.int32),)), x, w, *extra)


def _grouped_matvec_fwd(x, idx, w, *, x_repeat: int = 1, tf: int, bh: int, splits: int | None, num_warps: int,
                        target_programs: int, interpret: bool, num_stages: int = NUM_STAGES,
                        max_unroll: int = MAX_UNROLL) -> Array:
    """grouped_matvec without its custom VJP: the kernel, or the reference where the shapes need it."""
    if (x.ndim != 2 or w.ndim != 3 or idx.ndim != 1 or x_repeat < 1 or idx.shape[0] != x.shape[0] * x_repeat
            or w.shape[1] != x.shape[1]):
        return ref.grouped_matvec(x, idx, w, x_repeat)
    m, h = idx.shape[0], x.shape[1]
    plan = _plan(m, h, w.shape[2], tf, bh, splits, target_programs)
    if plan is None:
        return ref.grouped_matvec(x, idx, w, x_repeat)
    tf_, bh_, s = plan
    part = _partials(x, idx, w, tf_, bh_, s, num_warps, interpret, x_repeat, num_stages=num_stages,
                     max_unroll=max_unroll)
    return _summed(part)


def _summed(part: Array) -> Array:
    """The partials [m, S, F] of `_partials` summed over the S splits in fp32 (no sum for one)."""
    return part[:, 0] if part.shape[1] == 1 else jnp.sum(part, axis=1)


def grouped_matvec(x: Float[Array, "mx h"], idx: Int[Array, " m"], w: Float[Array, "E h F"], *, x_repeat: int = 1,
                   tf: int = TF, bh: int = BH, splits: int | None = None, num_warps: int = NUM_WARPS,
                   target_programs: int = TARGET_PROGRAMS, interpret: bool = False, num_stages: int = NUM_STAGES,
                   max_unroll: int = MAX_UNROLL) -> Float[Array, "m F"]:
    """y[i] = x[i // x_repeat] @ w[clip(idx[i], 0, E - 1)].astype(x.dtype), accumulated and
    returned in fp32 (m = x_repeat * mx rows: x_repeat > 1 reads each row of x for x_repeat
    consecutive rows of y in place, instead of a `jnp.repeat` copy).

    tf / bh: column tile and row block (powers of two, shrunk to divide F / h); splits: the
    number S of contracting chunks (default: the smallest power of two reaching
    `target_programs` programs); max_unroll: blocks per program unrolled in Python (a fori_loop
    past it, software-pipelined by Triton over num_stages). See the module docstring."""
    kw = dict(x_repeat=x_repeat, tf=tf, bh=bh, splits=splits, num_warps=num_warps, target_programs=target_programs,
              interpret=interpret, num_stages=num_stages, max_unroll=max_unroll)
    kernel_fn = lambda x, idx, w: _grouped_matvec_fwd(x, idx, w, **kw)
    return with_ref_vjp(kernel_fn, lambda x, idx, w: ref.grouped_matvec(x, idx, w, x_repeat))(x, idx, w)


def _matvec_fwd(x, w, *, tf: int, bh: int, num_warps: int, target_programs: int, interpret: bool) -> Array:
    plan = _plan(x.shape[0], x.shape[1], w.shape[1], tf, bh, None, target_programs)
    if plan is None:
        return matmul(x, w)
    return _summed(_partials(x, None, w[None], *plan, num_warps, interpret))


def matvec(x: Float[Array, "m h"], w: Float[Array, "h F"], *, tf: int = TF, bh: int = BH, num_warps: int = NUM_WARPS,
           target_programs: int = TARGET_PROGRAMS, interpret: bool = False) -> Float[Array, "m F"]:
    """y = x @ w.astype(x.dtype), fp32 (`_common.matmul`, its reference): grouped_matvec's kernel
    with every row through the one matrix w and no expert-id input (a lone token's projections:
    no constant id array for XLA to build before each launch). Backward: the reference's VJP."""
    if x.ndim != 2 or w.ndim != 2 or w.shape[0] != x.shape[1]:
        return matmul(x, w)
    kw = dict(tf=tf, bh=bh, num_warps=num_warps, target_programs=target_programs, interpret=interpret)
    return with_ref_vjp(lambda x, w: _matvec_fwd(x, w, **kw), matmul)(x, w)


def _expert_outputs(y_part: Array, dtype, n: int) -> Array:
    """The down product's split partials [n * G, S, h] -> each row's output rounded to the
    tokens' dtype, fp32 [n, G, h] (G rows per token)."""
    return _summed(y_part).astype(dtype).astype(jnp.float32).reshape(n, -1, y_part.shape[-1])


def _routed_sum(y: Array, weight: Array) -> Array:
    """sum_j weight[t, j] * y[t, j] over a token's k routed rows (the first k of its G), fp32,
    in choice order (as ref.moe_experts sums)."""
    wt = weight.astype(jnp.float32)
    acc = jnp.zeros((y.shape[0], y.shape[-1]), jnp.float32)
    for j in range(weight.shape[1]):
        acc = acc + wt[:, j:j + 1] * y[:, j]
    return acc


def _moe_kernel(x, idx, weight, w13, w2, up, down, num_warps: int, interpret: bool) -> Array:
    """moe_experts' forward (its own VJP covers both products): the choices flattened to
    n * k rows, both products through `_partials`, the activation in the down product's loads
    (its act prologue) instead of a launch of its own between the two, the weighted sum in
    choice order. up / down: the products' plans (tf', bh', splits)."""
    n, k = idx.shape
    flat = idx.reshape(n * k).astype(jnp.int32)
    gu_part = _partials(x, flat, w13, *up, num_warps, interpret, x_repeat=k)  # [n * k, S_up, 2f] fp32
    y_part = _partials(gu_part, flat, w2, *down, num_warps, interpret, act_dtype=x.dtype)
    return _routed_sum(_expert_outputs(y_part, x.dtype, n), weight).astype(x.dtype)


def moe_experts(x: Float[Array, "n h"], idx: Int[Array, "n k"], weight: Float[Array, "n k"], w13: Array,
                w2: Array, *, tf: int = TF, bh: int = BH, splits: int | None = None,
                num_warps: int = NUM_WARPS, target_programs: int = TARGET_PROGRAMS,
                interpret: bool = False) -> Float[Array, "n h"]:
    """`ref.moe_experts` (same signature and semantics) with both expert products in the
    grouped mat-vec kernel; backward: the reference's VJP. The tiling keywords apply to both
    products (each shrinks them to its own shape)."""
    n, k = idx.shape
    h = x.shape[-1]
    two_f = w13.shape[-1]
    plans_ok = (x.ndim == 2 and w13.ndim == 3 and w2.ndim == 3 and n > 0 and k > 0 and two_f % 2 == 0
                and x.shape[0] == n and weight.shape == idx.shape and w13.shape[1] == h
                and w2.shape[1:] == (two_f // 2, h) and w2.shape[0] == w13.shape[0])
    up = down = None
    if plans_ok:
        sizes = dict(tf=tf, bh=bh, splits=splits, target_programs=target_programs)
        up, down = _plan(n * k, h, two_f, **sizes), _plan(n * k, two_f // 2, h, **sizes)
    if up is None or down is None:
        return ref.moe_experts(x, idx, weight, w13, w2)
    kernel_fn = lambda x, idx, weight, w13, w2: _moe_kernel(x, idx, weight, w13, w2, up, down, num_warps, interpret)
    return with_ref_vjp(kernel_fn, ref.moe_experts)(x, idx, weight, w13, w2)


def _joined_kernel(x, idx, weight, w13, w2, shared_w13, shared_w2, gamma, gated: bool, up, down, num_warps: int,
                   interpret: bool) -> Array:
    """moe_experts_with_shared's forward: token t's rows t * G .. t * G + G - 1 (G = k + S) are
    its k routed choices then its S shared experts (module docstring). up / down: the two
    products' plans (tf', bh', splits)."""
    n, k = idx.shape
    s_sh = shared_w13.shape[0]
    g = k + s_sh
    flat = idx.reshape(n * k)
    # gate|up partials [n * G, S_up, 2f] fp32, x read in place for its G rows; their sum over
    # S_up, SwiGLU, the shared rows' sink gamma (before the rounding, shared_experts' order;
    # read in place, routed rows unscaled) and the rounding to x's dtype happen in the down product's
    # loads (the act prologue): no launch between the two products
    gu_part = _partials(x, flat, w13, *up, num_warps, interpret, x_repeat=g, w_extra=shared_w13, group=g)
    y_part = _partials(gu_part, flat, w2, *down, num_warps, interpret, w_extra=shared_w2, group=g,
                       act_dtype=x.dtype, gamma=gamma if gated else None)
    y = _expert_outputs(y_part, x.dtype, n)  # [n, G, h] fp32
    routed = _routed_sum(y, weight).astype(x.dtype).astype(jnp.float32)  # moe_experts' dtype, then experts' add
    return (routed + jnp.sum(y[:, k:], axis=1)).astype(x.dtype)


def moe_experts_with_shared(x: Float[Array, "n h"], idx: Int[Array, "n k"], weight: Float[Array, "n k"],
                            w13: Array, w2: Array, shared_w13: Array, shared_w2: Array, gamma: Float[Array, "n S"],
                            *, gated: bool, tf: int = TF, bh: int = BH, splits: int | None = None,
                            num_warps: int = NUM_WARPS, target_programs: int = TARGET_PROGRAMS,
                            interpret: bool = False) -> Float[Array, "n h"]:
    """`ref.experts` with shared experts (the same math: moe_experts plus the shared experts,
    added in fp32 and rounded once) with the routed AND shared rows of each
    product in one grouped mat-vec launch; backward: the reference's VJP. The contracting
    splits default to moe_experts' own for the n * k routed rows (routed rows bit for bit
    moe_experts'); see the module docstring."""
    n, k = idx.shape
    h = x.shape[-1]
    two_f = w13.shape[-1]
    ok = (x.ndim == 2 and w13.ndim == 3 and w2.ndim == 3 and shared_w13.ndim == 3 and shared_w2.ndim == 3
          and n > 0 and k > 0 and two_f % 2 == 0 and x.shape[0] == n and weight.shape == idx.shape
          and w13.shape[1] == h and w2.shape[1:] == (two_f // 2, h) and w2.shape[0] == w13.shape[0]
          and shared_w13.shape[1:] == w13.shape[1:] and shared_w2.shape[1:] == w2.shape[1:]
          and shared_w13.shape[0] == shared_w2.shape[0] > 0 and (not gated or gamma.shape == (n, shared_w13.shape[0])))
    ref_fn = lambda *a: ref.experts(*a, gated=gated)
    args = (x, idx, weight, w13, w2, shared_w13, shared_w2, gamma)
    sizes = dict(tf=tf, bh=bh, splits=splits, target_programs=target_programs)
    up = _plan(n * k, h, two_f, **sizes) if ok else None
    down = _plan(n * k, two_f // 2, h, **sizes) if ok else None
    if up is None or down is None:
        return ref_fn(*args)
    # one split count per product for every row: the one moe_experts picks for its n * k rows

    def kernel_fn(*a):
        return _joined_kernel(*a, gated=gated, up=up, down=down, num_warps=num_warps, interpret=interpret)

    return with_ref_vjp(kernel_fn, ref_fn)(*args)


__all__ = ["grid_for", "grouped_matvec", "matvec", "moe_experts", "moe_experts_with_shared"]

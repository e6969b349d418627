"""Pallas kernels for decode / verify attention (Q <= 16 queries per row) that read the cached
context K/V in place from the serving arena.

    ring_attention(q, r, rel_proj, tau, k_new, v_new, q_pos, q_valid, arena, ring_unit_row,
                   seq_start, has_state, *, ring, window, num_splits=None, bk=64, num_warps=4,
                   num_stages=2, interpret=False) -> out [B, Q, H, hd] in q's dtype   (sliding layers)
    paged_attention(q, r, rel_proj, tau, k_new, v_new, q_pos, q_valid, arena, page_unit_row,
                    seq_start, *, page_size, window=None, num_splits=None, num_warps=4,
                    num_stages=2, interpret=False) -> out [B, Q, H, hd] in q's dtype  (full layers)
    combine_splits_kernel(acc, m, l, *, out_dtype, num_warps=4, interpret=False)
                    -> out [B, Q, H, hd] in out_dtype   (the split-K merge; `combine_splits` in jnp)

Arguments, layouts and semantics: `decode_ref.py` (the jnp reference and oracle), i.e. the
context keys of `steps/context.py` (`_ring_keys` / `_page_keys`) followed by the step's own
new keys, scored as `ref.attention` does: q.k / hd + rel[b, i, h, q_pos - k_pos] (zero outside
[0, E)), causal (+ window) and validity masks, softmax in fp32, zeros for a query without any
allowed key, with q and rel the log-scaled query and bias table of `layers.attention_tables`
(`decode_ref.tables`: rel = r @ rel_proj, E = rel_proj's columns, both times tau).

Why. The step used to gather each row's whole ring or all its pages out of the arena into a
fresh [B, K, 2, nkv, hd] array (an XLA gather, ~40 us a layer at batch 32 on an H200), then
`layers.attention_core` materialised scores and a gathered bias in ~10 small kernels: ~0.85
ms of a 3.4 ms batch-32 decode step, ~0.28 ms of a 1.55 ms batch-1 step. Here one kernel per
layer (plus a small combine kernel when the keys are split) reads every live key once, from the
arena, and keeps the scores in registers.

Addressing. The arena [U, unit_elems] is viewed as token rows [U * unit_elems / Wt, Wt] with
Wt = 2 * nkv * hd (a free reshape; unit_elems must be a multiple of Wt): one row is one
token's K | V, K of kv head g in columns [g*hd, (g+1)*hd), V in [(nkv+g)*hd, ...). Ring row i
of row b is token row ring_unit_row[b] * (unit_elems / Wt) + i; page p offset o is token row
page_unit_row[b, p] * ps + o. Row indices are int32 (the wrapper falls back to the reference
when the token-row count reaches 2^31); the Triton lowering multiplies them by Wt in 64 bits
once the arena passes 4 GiB, so arenas beyond 2^31 elements are addressed correctly.

Work split. One program per (split s, kv head g, row b): grid (S, nkv, B). All H / nkv query
heads of kv group g and all Q queries are the M = group * Q rows of one tile (row m: query
m // group, head g * group + m % group; padded to Mp, a power of two >= 16 for the tensor-core
dots, padded rows repeat row M-1), so each K/V tile is read once per kv group, not once per
query head. A program walks key blocks with the online softmax (running max m, sum l,
accumulator acc [Mp, hd], fp32): s = q @ k^T / hd (fp32 accumulation; fp32 inputs at IEEE
precision), d = q_pos - k_pos, the bias of just the block's keys (below), the masks, then
m' = max(m, rowmax(s)), p = exp(s - m'), l = l exp(m - m') + rowsum(p), acc = acc exp(m - m')
+ p.astype(v) @ v, the values of invalid keys selected away first (a stale arena row may
hold NaN or inf: p = 0 would not cancel it).

Bias and log scaling in the kernel. The step passes r [B, Q, H, dr], rel_proj [dr, E] and tau
[B, Q] (fp32, 1.0 on layers without log scaling) instead of q * tau and a [B, Q, H, E] table:
the table was one GEMM plus two or three fusions per layer, and a query needs at most
window + Q (ring) or its context's (pages) entries of its E. A program loads its rows' tau and
r (dr columns of [Mp]) once and scales its query tile, q * tau in fp32 rounded to q's dtype;
per key block it computes bias[m, k] = sum_j r[m, j] rel_proj[j, clip(d, 0, E-1)] (fp32, j in
order, rel_proj gather-loaded: a 16 x 1024 bench matrix stays in cache), rounded to q's dtype,
times tau, rounded again, zeroed for d >= E: `attention_tables`' roundings, so the bias is the
table's entry (bf16: products of bf16 are exact in fp32, equal but for a sum of dr terms that
rounds differently in another order).

Key blocks. Ring: blocks of `bk` consecutive ring rows (bk a power of two >= 16; the last
block of a ring whose length is not a multiple of bk is clamped to row R-1 and masked).
Pages: one block per page (page_size a power of two >= 16). The live context of a row is one
range of positions [lo, hi]: hi = min(s - 1, max q_pos), lo = max(0, s - R) (ring) or 0
(pages), and with a window lo >= min q_pos - window + 1. Its blocks are computed in the
kernel from seq_start / has_state / q_pos (a cyclic run of ring blocks, wrapping at R; a run
of pages), and only those are visited: a dynamic-bound fori_loop (scf.for) over them, no
dead block read, no branch in the loop body. Everything inside a visited block is masked
exactly, so block skipping does not change the result.

Split-K ("flash decoding"). At batch 1 the (row, kv head) grid has 2-4 programs for 132 SMs,
so a row's live context blocks are cut into S contiguous chunks of ceil(n / S) blocks (n per
row, known only in the kernel); split s takes chunk s (possibly empty). The step's new keys
(Q keys, one block of 16, own causal mask, validity q_valid) are scored by the last split
only (the other splits mask them out). With S > 1 each split writes its unnormalised
(m, l, acc) in fp32 and a second kernel (`combine_splits_kernel`, one program per (head,
query, row)) merges them into the output in q's dtype: w_s = exp(m_s - max_s m_s), out =
sum_s w_s acc_s / sum_s w_s l_s (zero where that sum is 0); `combine_splits` is its jnp
reference (XLA made 2-3 fusions and a cast of it: launches of every decode layer). With S == 1 the kernel writes
the normalised output directly, no combine. Default S: enough splits that B * nkv * S >=
`TARGET_PROGRAMS` (512: ~4 small programs per SM of an H200), capped by the most live blocks
a row can have (pages: half of them, >= 2 pages a split); bench shapes: pages S = 8 at
batch 32 and 64 (2-page chunks) at batch 1 with 128 pages, ring S = 4 at batch 32, 9 at 1.
Outputs (and partials) are stored with the rows' (query, head) index vectors straight into
the [B, (S,) Q, H, ...] layout, so no transpose kernel follows.

Backward: the reference's VJP (`_common.with_ref_vjp`), as for the other kernels.

Fallback to the reference (`decode_ref`), never a different result: hd not a power of two
>= 16, Q > 16 or 0, group * Q > 128, dr > 64 (the bias sum is unrolled), r / rel_proj / tau
shapes that do not fit q, q / k_new / v_new / arena dtypes not all equal, an
arena unit not a multiple of a token row (pages: not exactly one page), page_size not a
power of two >= 16, too many token rows for int32 indices, empty inputs.

Numerics: as `pallas.py`. Against the same kernel gathering the bias from the table
(measured on the test cases): bf16 bit-equal, fp32 within 2.4e-7 absolute on O(1) outputs
(the fp32 bias sums in another order than XLA's einsum). The combine kernel: fp32 within 5e-7
absolute (a few ulps) of the jnp `combine_splits` on O(1) outputs (sum order over splits), bf16
equal after the cast (tested). fp32: the summation orders differ from the reference (per block,
rescaled; splits merged at the end): ~1e-6 relative. bf16: the kernel rounds the unnormalised p
(in [0, 1]) to bf16 before p @ v, the reference the normalised probabilities; agreement within a
few bf16 ulps of the output scale (tests: atol 2e-2 on O(1) outputs).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Bool, Float, Int

from .._common import INT32_MAX, pallas_call, pow2_ceil, with_ref_vjp
from . import decode_ref

BK = 64  # ring rows per key block
NUM_WARPS = 4
NUM_STAGES = 2
# default splits: B * nkv * S >= this, each split >= `min_blocks` key blocks. H200, bench shapes
# (bf16, hd 128, pages of 64 at up to 8k context, ring 515): paged B=32 ran 135 us at S=2
# (128 programs), 84-88 us at S=4..16; B=1 24 us at S=64 (2 pages a split), 28 at 32, 282 at 1
TARGET_PROGRAMS = 512
MIN_BLOCK = 16  # Triton dots need every dimension >= 16
MAX_QUERIES = 16  # Q per row at most (the new keys are one block of 16)
MAX_ROWS = 128  # group * Q at most (rows of the query tile)
MAX_REL_RANK = 64  # dr at most: the bias sum is unrolled over dr


def _is_pow2(n: int) -> bool:
    return n > 0 and not n & (n - 1)


def default_splits(batch: int, nkv: int, max_blocks: int, min_blocks: int = 1) -> int:
    """Splits per (row, kv head): enough programs to fill the GPU (`TARGET_PROGRAMS`), each
    with at least `min_blocks` of the row's `max_blocks` possible live blocks."""
    want = -(-TARGET_PROGRAMS // max(batch * nkv, 1))
    return max(1, min(want, max_blocks // min_blocks))


def _max_live(window: int | None, span: int, block: int, nblocks: int) -> int:
    """The most key blocks a row's live context range can touch: a range of at most
    min(span, window) positions, unaligned (one more block), wrapping (ring: one more)."""
    length = span if window is None else min(span, window)
    return max(1, min(nblocks, -(-length // block) + 1))


def _use_kernel(q, r, rel_proj, tau, k_new, v_new, q_pos, q_valid, arena, seq_start) -> bool:
    if q.ndim != 4 or r.ndim != 4 or k_new.ndim != 4 or v_new.shape != k_new.shape or arena.ndim != 2:
        return False
    if not (rel_proj.ndim == 2 and r.shape[:3] == q.shape[:3] and 0 < r.shape[3] <= MAX_REL_RANK
            and rel_proj.shape[0] == r.shape[3] and rel_proj.shape[1] > 0 and tau.shape == q.shape[:2]):
        return False
    b, nq, h, hd = q.shape
    nkv = k_new.shape[2]
    if not (b > 0 and 0 < nq <= MAX_QUERIES and nkv > 0 and h % nkv == 0 and (h // nkv) * nq <= MAX_ROWS):
        return False
    if not (hd >= MIN_BLOCK and _is_pow2(hd) and k_new.shape == (b, nq, nkv, hd) and q_pos.shape == (b, nq)
            and q_valid.shape == (b, nq) and seq_start.shape == (b,)):
        return False
    if not (k_new.dtype == q.dtype and v_new.dtype == q.dtype and arena.dtype == q.dtype):
        return False
    wt = 2 * nkv * hd
    units, unit_elems = arena.shape
    return units > 0 and unit_elems > 0 and unit_elems % wt == 0 and units * (unit_elems // wt) <= INT32_MAX


def _decode_call(q, r, rel_proj, tau, k_new, v_new, q_pos, q_valid, arena, unit_row, seq_start, has_state, *,
                 ring: int | None, page_size: int | None, window: int | None, num_splits: int | None, bk: int,
                 num_warps: int, num_stages: int, interpret: bool) -> Array:
    """The kernel (ring when `ring` is set, else pages) and the split combine."""
    b, nq, h, hd = q.shape
    nkv = k_new.shape[2]
    group = h // nkv
    dr, e = rel_proj.shape
    dtype, r_dtype = q.dtype, r.dtype
    wt = 2 * nkv * hd
    per_unit = arena.shape[1] // wt
    rows_m = group * nq
    mp = max(MIN_BLOCK, pow2_ceil(rows_m))
    nk_new = MIN_BLOCK  # the new keys: one block (Q <= 16)
    paged = ring is None
    if paged:
        blk = page_size
        nblocks = unit_row.shape[1]
        max_blocks = _max_live(window, nblocks * page_size, blk, nblocks)
    else:
        blk = max(MIN_BLOCK, min(bk, pow2_ceil(ring)))
        nblocks = -(-ring // blk)
        max_blocks = _max_live(window, ring, blk, nblocks) + (1 if window is not None else 0)
        max_blocks = min(max_blocks, nblocks)
    splits = default_splits(b, nkv, max_blocks, 2 if paged else 1) if num_splits is None else int(num_splits)
    if splits < 1:
        raise ValueError(f"num_splits must be >= 1, not {num_splits}")
    scale = 1.0 / hd
    hi_prec = jax.lax.Precision.HIGHEST  # fp32 inputs: IEEE, not the lowering's default TF32
    div, rem = jax.lax.div, jax.lax.rem  # C semantics: every operand below is >= 0

    view = arena.reshape(-1, wt)  # token rows: free
    seq_start = seq_start.astype(jnp.int32)
    q_pos = q_pos.astype(jnp.int32)
    q_ok = q_valid.astype(jnp.int32)  # int32, not i1, in the kernel
    tau = tau.astype(jnp.float32)
    unit_row = unit_row.astype(jnp.int32)
    scalars = [seq_start, unit_row] + ([] if paged else [has_state.astype(jnp.int32)])

    def kernel(*refs):
        if paged:
            seq_ref, urow_ref, *refs = refs
            hs_ref = None
        else:
            seq_ref, urow_ref, hs_ref, *refs = refs
        q_ref, r_ref, rp_ref, tau_ref, kn_ref, vn_ref, qpos_ref, qok_ref, kv_ref, *out_refs = refs
        sp = pl.program_id(0)
        g = pl.program_id(1)
        bi = pl.program_id(2)

        # tile rows: m -> (query qi, head hh); padded rows repeat row M-1
        m_idx = jnp.minimum(jax.lax.broadcasted_iota(jnp.int32, (mp,), 0), rows_m - 1)
        qi = div(m_idx, group)
        hh = g * group + rem(m_idx, group)
        dcols = pl.ds(0, hd)
        kcols = pl.ds(pl.multiple_of(g * hd, hd), hd)
        vcols = pl.ds(pl.multiple_of((nkv + g) * hd, hd), hd)
        qp = qpos_ref[bi, qi]  # [Mp]
        tq = tau_ref[bi, qi]  # [Mp] fp32
        # log scaling, rounded as `layers.attention_tables` rounds it (tau = 1: q unchanged)
        qt = (q_ref[bi, qi, hh, dcols].astype(jnp.float32) * tq[:, None]).astype(dtype)  # [Mp, hd]
        # the rows' bias inputs, one column each (dr need not be a power of two)
        r_cols = [r_ref[bi, qi, hh, j].astype(jnp.float32) for j in range(dr)]  # dr x [Mp]
        qmin, qmax = jnp.min(qp), jnp.max(qp)
        s = seq_ref[bi]

        # the live context positions [lo, hi] and their key blocks first, first+1, ... (n blocks)
        hi = jnp.minimum(s - 1, qmax)
        lo = jnp.maximum(s - ring, 0) if not paged else jnp.zeros((), jnp.int32)
        if window is not None:
            lo = jnp.maximum(lo, qmin - (window - 1))
        length = hi - lo + 1
        if paged:
            live = length > 0
            first = div(jnp.maximum(lo, 0), blk)
            last = jnp.minimum(div(jnp.maximum(hi, 0), blk), nblocks - 1)
            n = jnp.where(live, jnp.maximum(last - first + 1, 0), 0)
        else:
            live = (length > 0) & (hs_ref[bi] != 0)
            r_lo = rem(lo, ring)  # lo >= 0
            first = div(r_lo, blk)
            last_row = r_lo + jnp.maximum(length, 1) - 1  # < 2 R
            wraps = last_row >= ring
            n = jnp.where(wraps, nblocks - first + div(jnp.maximum(last_row - ring, 0), blk) + 1,
                          div(jnp.minimum(last_row, ring - 1), blk) - first + 1)
            n = jnp.where(live, jnp.minimum(n, nblocks), 0)  # all blocks: each once
            # ring row r holds position top + r - (R if r > r0 else 0): top = R floor((s-1)/R),
            # r0 = (s-1) mod R, written for s >= 0 without negative operands
            q_r = div(s + ring - 1, ring)
            top = ring * (q_r - 1)
            r0 = s + ring - 1 - ring * q_r
            base = urow_ref[bi] * per_unit
        chunk = div(n + splits - 1, splits)
        t0 = jnp.minimum(sp * chunk, n)
        t1 = jnp.minimum(t0 + chunk, n)

        def update(carry, kt, vt, kpos, kok):
            m_i, l_i, acc = carry
            # invalid keys (stale page / ring rows past the row's context, the new-key block's
            # padding) are selected away before p @ v: p = 0 times NaN or inf is NaN
            vt = jnp.where(kok[:, None], vt, jnp.zeros((), vt.dtype))
            sc = jax.lax.dot_general(qt, kt, (((1,), (1,)), ((), ())), precision=hi_prec,
                                     preferred_element_type=jnp.float32) * scale  # [Mp, bk]
            d = qp[:, None] - kpos[None, :]
            allowed = kok[None, :] & (d >= 0)
            if window is not None:
                allowed = allowed & (d < window)
            # the bias of just these keys: rel[m, d] = sum_j r[m, j] rel_proj[j, d] (fp32, j in
            # order), rounded to q's dtype, times tau, rounded again (`attention_tables`)
            col = jnp.clip(d, 0, e - 1)
            bias = jnp.zeros(d.shape, jnp.float32)
            for j in range(dr):
                pj = rp_ref[j, col].astype(r_dtype).astype(jnp.float32)  # gather [Mp, bk]
                bias = bias + r_cols[j][:, None] * pj
            bias = (bias.astype(dtype).astype(jnp.float32) * tq[:, None]).astype(dtype)
            bias = jnp.where(d < e, bias.astype(jnp.float32), 0.0)  # d < 0 is masked below
            sc = jnp.where(allowed, sc + bias, -jnp.inf)
            m_new = jnp.maximum(m_i, jnp.max(sc, axis=1))
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no allowed key yet: exp(-inf - 0) = 0
            alpha = jnp.exp(m_i - m_use)
            p = jnp.exp(sc - m_use[:, None])
            l_new = l_i * alpha + jnp.sum(p, axis=1)
            pv = jax.lax.dot_general(p.astype(vt.dtype), vt, (((1,), (0,)), ((), ())), precision=hi_prec,
                                     preferred_element_type=jnp.float32)  # [Mp, hd]
            return m_new, l_new, acc * alpha[:, None] + pv

        def body(t, carry):
            j = first + t
            if paged:
                rows = pl.ds(urow_ref[bi, j] * blk, blk)  # the page's token rows
                kpos = j * blk + jax.lax.broadcasted_iota(jnp.int32, (blk,), 0)
                kok = kpos < s
            else:
                j = jnp.where(j >= nblocks, j - nblocks, j)  # cyclic: first + t < 2 nblocks
                r = j * blk + jax.lax.broadcasted_iota(jnp.int32, (blk,), 0)
                rc = jnp.minimum(r, ring - 1)  # the tail block of a ring not a multiple of bk
                rows = base + rc
                kpos = top + rc - jnp.where(rc > r0, ring, 0)
                kok = (r < ring) & (kpos >= 0)
            kt = kv_ref[rows, kcols]  # [blk, hd]
            vt = kv_ref[rows, vcols]
            return update(carry, kt, vt, kpos, kok)

        init = (jnp.full((mp,), -jnp.inf, jnp.float32), jnp.zeros((mp,), jnp.float32),
                jnp.zeros((mp, hd), jnp.float32))
        carry = jax.lax.fori_loop(t0, t1, body, init)

        # the step's own keys: scored by the last split only
        kk = jax.lax.broadcasted_iota(jnp.int32, (nk_new,), 0)
        kc = jnp.minimum(kk, nq - 1)
        kt = kn_ref[bi, kc, g, dcols]  # [16, hd]
        vt = vn_ref[bi, kc, g, dcols]
        kok = (kk < nq) & (qok_ref[bi, kc] != 0)
        if splits > 1:
            kok = kok & (sp == splits - 1)
        m_i, l_i, acc = update(carry, kt, vt, qpos_ref[bi, kc], kok)

        if splits == 1:
            (o_ref,) = out_refs
            out = jnp.where(l_i[:, None] > 0, acc / jnp.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
            o_ref[bi, qi, hh, dcols] = out.astype(o_ref.dtype)
        else:
            acc_ref, m_ref, l_ref = out_refs
            acc_ref[bi, sp, qi, hh, dcols] = acc
            m_ref[bi, sp, qi, hh] = m_i
            l_ref[bi, sp, qi, hh] = l_i

    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((b, nq, h, hd), q.dtype)
    else:
        out_shape = (jax.ShapeDtypeStruct((b, splits, nq, h, hd), jnp.float32),
                     jax.ShapeDtypeStruct((b, splits, nq, h), jnp.float32),
                     jax.ShapeDtypeStruct((b, splits, nq, h), jnp.float32))
    name = "inkling_paged_decode_attention" if paged else "inkling_ring_decode_attention"
    res = pallas_call(kernel, out_shape=out_shape, grid=(splits, nkv, b), aliases={}, interpret=interpret,
                      num_warps=num_warps, num_stages=num_stages, name=name)(
        *scalars, q, r, rel_proj, tau, k_new, v_new, q_pos, q_ok, view)
    if splits == 1:
        return res
    return combine_splits_kernel(*res, out_dtype=q.dtype, num_warps=num_warps, interpret=interpret)


def combine_splits_kernel(acc: Float[Array, "B S Q H D"], m: Float[Array, "B S Q H"], l: Float[Array, "B S Q H"],
                          *, out_dtype, num_warps: int = NUM_WARPS, interpret: bool = False
                          ) -> Float[Array, "B Q H D"]:
    """`combine_splits` as one Pallas kernel, its result cast to `out_dtype` in the kernel
    (the jnp merge is 2-3 XLA fusions plus a cast on the GPU). One program per (head h,
    query i, row b): grid (H, Q, B); it loads the S splits' (m, l) [Sp] and acc [Sp, D] of
    (b, i, h) with an index vector over the splits (Sp = S padded to a power of two >= 16 for
    the Triton tile, padded entries weigh 0) and writes out[b, i, h, :].

    Same operations as `combine_splits` (fp32; the padded entries add exact zeros): ~1e-6
    relative in fp32 (the sum order over splits may differ), equal after the cast to bf16 but
    for rare rounding-boundary ties. Falls back to `combine_splits` for D not a power of two."""
    b, ns, nq, h, hd = acc.shape
    if not (_is_pow2(hd) and ns > 0 and b * nq * h > 0):
        return combine_splits(acc, m, l).astype(out_dtype)
    sp_pad = max(MIN_BLOCK, pow2_ceil(ns))

    def kernel(acc_ref, m_ref, l_ref, o_ref):
        hh, qi, bi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        s_idx = jax.lax.broadcasted_iota(jnp.int32, (sp_pad,), 0)
        s_ok = s_idx < ns
        sc = jnp.minimum(s_idx, ns - 1)  # padded entries re-read split S-1, weighted 0
        m_s = jnp.where(s_ok, m_ref[bi, sc, qi, hh], -jnp.inf)  # [Sp]
        l_s = l_ref[bi, sc, qi, hh]
        acc_s = acc_ref[bi, sc, qi, hh, pl.ds(0, hd)]  # [Sp, D]
        m_max = jnp.max(m_s)
        m_max = jnp.where(m_max == -jnp.inf, 0.0, m_max)
        w = jnp.exp(m_s - m_max)  # an empty split (m = -inf) and the padding weigh 0
        den = jnp.sum(w * l_s)
        num = jnp.sum(w[:, None] * acc_s, axis=0)  # [D]
        out = jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)
        o_ref[bi, qi, hh, pl.ds(0, hd)] = out.astype(o_ref.dtype)

    return pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((b, nq, h, hd), out_dtype), grid=(h, nq, b),
                       aliases={}, interpret=interpret, num_warps=num_warps,
                       name="inkling_decode_combine_splits")(acc, m, l)


def combine_splits(acc: Float[Array, "B S Q H D"], m: Float[Array, "B S Q H"],
                   l: Float[Array, "B S Q H"]) -> Float[Array, "B Q H D"]:
    """Merge the splits' partial softmax states (fp32): sum_s w_s acc_s / sum_s w_s l_s with
    w_s = exp(m_s - max_s m_s); zero where no split saw an allowed key."""
    m_max = jnp.max(m, axis=1, keepdims=True)
    m_max = jnp.where(m_max == -jnp.inf, 0.0, m_max)
    w = jnp.exp(m - m_max)  # [B, S, Q, H]; an empty split (m = -inf) weighs 0
    den = jnp.sum(w * l, axis=1)
    num = jnp.sum(w[..., None] * acc, axis=1)
    return jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)


def ring_attention(q: Float[Array, "B Q H D"], r: Float[Array, "B Q H R"], rel_proj: Float[Array, "R E"],
                   tau: Float[Array, "B Q"], k_new: Float[Array, "B Q Hkv D"],
                   v_new: Float[Array, "B Q Hkv D"], q_pos: Int[Array, "B Q"], q_valid: Bool[Array, "B Q"],
                   arena: Array, ring_unit_row: Int[Array, " B"], seq_start: Int[Array, " B"],
                   has_state: Bool[Array, " B"], *, ring: int, window: int | None, num_splits: int | None = None,
                   bk: int = BK, num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES,
                   interpret: bool = False) -> Float[Array, "B Q H D"]:
    """Sliding layers: `decode_ref.ring_attention` (same arguments and result) reading each
    row's ring [ring, 2, nkv, hd] in place from the arena. bk: ring rows per key block (a
    power of two >= 16, shrunk for short rings); num_splits: programs per (row, kv head)
    (None: `default_splits`). See the module docstring."""
    if bk < MIN_BLOCK or not _is_pow2(bk):
        raise ValueError(f"bk must be a power of two >= {MIN_BLOCK}, not {bk}")
    if (ring < 1 or not _use_kernel(q, r, rel_proj, tau, k_new, v_new, q_pos, q_valid, arena, seq_start)
            or ring_unit_row.shape != seq_start.shape or has_state.shape != seq_start.shape):
        return decode_ref.ring_attention(q, r, rel_proj, tau, k_new, v_new, q_pos, q_valid, arena, ring_unit_row,
                                         seq_start, has_state, ring=ring, window=window)
    kernel_fn = partial(_decode_call, ring=ring, page_size=None, window=window, num_splits=num_splits, bk=bk,
                        num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    ref_fn = partial(decode_ref.ring_attention, ring=ring, window=window)
    return with_ref_vjp(kernel_fn, ref_fn)(q, r, rel_proj, tau, k_new, v_new, q_pos, q_valid, arena, ring_unit_row,
                                           seq_start, has_state)


def paged_attention(q: Float[Array, "B Q H D"], r: Float[Array, "B Q H R"], rel_proj: Float[Array, "R E"],
                    tau: Float[Array, "B Q"], k_new: Float[Array, "B Q Hkv D"],
                    v_new: Float[Array, "B Q Hkv D"], q_pos: Int[Array, "B Q"], q_valid: Bool[Array, "B Q"],
                    arena: Array, page_unit_row: Int[Array, "B P"], seq_start: Int[Array, " B"], *,
                    page_size: int, window: int | None = None, num_splits: int | None = None,
                    num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES,
                    interpret: bool = False) -> Float[Array, "B Q H D"]:
    """Full layers: `decode_ref.paged_attention` (same arguments and result) reading each row's
    pages in place from the arena, one key block per page. num_splits: programs per (row, kv
    head) (None: `default_splits`). See the module docstring."""
    ok = (_use_kernel(q, r, rel_proj, tau, k_new, v_new, q_pos, q_valid, arena, seq_start) and page_size >= MIN_BLOCK
          and _is_pow2(page_size) and page_unit_row.ndim == 2 and page_unit_row.shape[0] == q.shape[0]
          and page_unit_row.shape[1] > 0 and arena.shape[1] == page_size * 2 * k_new.shape[2] * k_new.shape[3])
    if not ok:
        return decode_ref.paged_attention(q, r, rel_proj, tau, k_new, v_new, q_pos, q_valid, arena, page_unit_row,
                                          seq_start, page_size=page_size, window=window)
    kernel_fn = partial(_decode_call, has_state=None, ring=None, page_size=page_size, window=window,
                        num_splits=num_splits, bk=page_size, num_warps=num_warps, num_stages=num_stages,
                        interpret=interpret)
    ref_fn = partial(decode_ref.paged_attention, page_size=page_size, window=window)
    return with_ref_vjp(kernel_fn, ref_fn)(q, r, rel_proj, tau, k_new, v_new, q_pos, q_valid, arena, page_unit_row,
                                           seq_start)


__all__ = ["combine_splits", "combine_splits_kernel", "default_splits", "paged_attention", "ring_attention"]

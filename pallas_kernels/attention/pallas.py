"""Pallas kernel for Inkling attention in prefill / extend steps: flash-style (online softmax),
the scores and the gathered relative bias never in HBM.

    attention(q, k, v, rel, q_pos, k_pos, k_valid, *, window, bq=128, bk=128, num_warps=8,
              num_stages=2, interpret=False) -> out [B, Q, H, D] in q's dtype

    q [B, Q, H, D], k / v [B, K, Hkv, D] (H % Hkv == 0, head h reads kv head h // (H // Hkv)),
    rel [B, Q, H, E], q_pos [B, Q] int32, k_pos [B, K] int32 (any order), k_valid [B, K] bool:
    `ref.attention`'s signature and semantics (see there). Backward: the reference's VJP.

Why. XLA materialises the fp32 scores [B, H, Q, K] and the gathered bias [B, Q, H, K] in HBM
(on an H200 ~35 ms of a 135 ms 8 x 1024-token step, ~90 ms of a 134 ms 4096-token step at
context 8k); here each score tile lives in registers only.

Work split. One program per (query block i of `bq` queries, query head h, row b): grid
(nq, H, B), the query-block axis first and walked from the last block to the first (under a
causal mask the late blocks have the most keys: the heaviest programs start first; programs
launched together share (b, h) and so their K / V tiles in L2; the query heads of one kv
group are separate programs, each reading the group's K / V tiles, mostly from L2). A
program loads its q tile [bq, D] (times 1/D: a power of two, exact) and query positions
[bq] once, then walks its *live* key blocks of `bk` keys with the online softmax: running
max m [bq], running sum l [bq] and accumulator acc [bq, D], all fp32. The live blocks come
in two classes (see Block skipping), walked in that order by consecutive loops that carry
(m, l, acc) across:
  FAR blocks, every (query, key) pair of the tile at distance d = q_pos - k_pos >= E (and,
    windowed, < window): no bias (it is 0 at d >= E), no causal or window mask, so no
    positions and no gather; only invalid keys are masked, and not even that in a block
    whose keys are all valid (a loop of its own: far blocks with invalid keys come after);
  NEAR blocks, all the other live ones: d [bq, bk], the bias tile (Bias gather) and the
    full mask (validity, d >= 0, d < window).
Per key block: s = (q / D) @ k^T (lax.dot_general, fp32 accumulation; fp32 inputs at IEEE
precision, not TF32), plus the bias and the mask (near), then
m' = max(m, rowmax(s)), p = exp(s - m'), l = l * exp(m - m') + rowsum(p),
acc = acc * exp(m - m') + p.astype(v.dtype) @ v, every exp taken as exp2(x * log2 e) (on the
GPU one fma and one ex2 per score: jnp.exp lowers to libdevice's accurate expf). At the end
out = acc / l (0 where l = 0: a query with no allowed key), cast to q's dtype. A far block
has a valid key, allowed for every query of the block, so the far loops need no -inf
guard; in the near loop rows whose allowed set is still empty keep m = -inf, and the
exponent is then taken against 0, not -inf, so no NaN arises (a query may still have no
allowed key at all). Invalid keys' values are zeroed (a select) before p @ v: they may be
another row's tokens or stale arena rows, and p = 0 times NaN or inf is NaN.

Bias gather (near blocks only). The bias tile is a gather load straight from rel in HBM
(L2): rel_ref[b, row, h, clip(d, 0, E-1)] with row = min(q index, Q-1) [bq, 1] and the
clipped distance [bq, bk] (integer-array indexers; the Triton lowering turns them into one
pointer tensor, 64-bit offsets once rel passes 4 GiB), then zeroed where d >= E. Each query
row reads at most bk elements of its own [E] row of rel; with keys in position order they
are consecutive. At long context most live blocks are far (8k tokens, E = 1024, causal,
128-key blocks: ~3/4 of them, ~7/8 of the pairs) and skip it.

Block skipping and classes. Outside the kernel (cheap jnp on [B, nk] / [B, nq, nk] arrays,
`live_blocks`): per key block the min / max position of its valid keys (kmin, kmax) and
whether all its keys are valid, per query block the min / max query position (qmin, qmax).
Key block j is live for query block i iff it has a valid key, kmin <= qmax and (window)
qmin - kmax < window; it is FAR iff live and qmin - kmax >= E and (window) qmax - kmin <
window (so with window <= E no block is far), else NEAR. Positions, not indices, decide:
keys may be in any position order (a ring), a block whose positions are spread out is just
near. The block ids of each (b, i) are sorted by class (far with all keys valid, other far,
near, dead; ascending inside each class) into a [B, nq, nk] int32 list, with the class ends
[B, nq, 3] int32; the kernel's three loops run from one end to the next (dynamic-bound
fori_loops with int32 bounds, lowered to scf.for) reading the block id from that list. So
dead blocks cost nothing, not even a branch, and no loop body has a conditional (the
Triton pipeliner can overlap the next block's K / V loads, `num_stages`). Each block is
masked exactly for its class, so skipping and classing change nothing in the result.

Padding. Q and K are padded to multiples of bq / bk in the wrapper (padded keys invalid,
padded queries repeat the last query position and are dropped from the output; rel is not
padded: padded rows read rel row Q-1). bq and bk are powers of two >= 16 (Triton block
shapes; its dots need >= 16), shrunk to the smallest power of two >= Q / K when those are
smaller. D must be a power of two >= 16 and q, k, v one dtype; other shapes, and empty
inputs, fall back to the reference.

Deviations from the reference: the fp32 summation orders differ (the q.k contraction inside
a Triton dot; the softmax sum and p @ v accumulated block by block with rescaling instead of
one pass over all keys after the global max), so fp32 results agree to ~1e-6 relative, not
bit for bit (on the GPU ex2 is an approximation within 2 ulp). In bf16 the reference rounds
the *normalised* probabilities to bf16 before p @ v, the kernel rounds the unnormalised p =
exp(s - m_running) (in [0, 1]) and divides by l in fp32 at the end; the output's rounding to
bf16 then dominates: expect agreement within a few bf16 ulps of the output scale (tests:
atol 2e-2 on O(1) values).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Bool, Float, Int

from .._common import INT32_MAX, pallas_call, pow2_ceil, with_ref_vjp
from . import ref

# H200, bench prefill shapes (bench/kernels/attention_micro.py): 128 x 128 tiles with 8 warps ran
# 1.18-1.35x the 64 x 64 / 4-warp tiles on full and sliding layers at 8 x 1024 and 1 x 8192
BQ = 128  # queries per program
BK = 128  # keys per block of the loop
NUM_WARPS = 8
NUM_STAGES = 2
MIN_BLOCK = 16  # Triton dots need every dimension >= 16
INT32_MIN = -(2**31)
LOG2E = 1.4426950408889634  # exp(x) = exp2(x * LOG2E): ex2 on the GPU (expf is a libdevice call)
# with the far-block loops, sliding layers of long rows ran faster with 64-key blocks (H200,
# 1 x 8192, window 512: 0.531 vs 0.634 ms in two runs; not at 8 x 1024): `default_bk`
SLIDING_LONG_QUERIES = 4096  # query rows per row from which a sliding layer takes SLIDING_LONG_BK
SLIDING_LONG_BK = 64


def default_bk(nq_tok: int, window: int | None) -> int:
    """Keys per block when the caller gives none: SLIDING_LONG_BK for sliding layers of long
    rows (a query tile's live keys span ~window + bq there, so smaller blocks waste less on the
    masked edges), BK otherwise."""
    return SLIDING_LONG_BK if window is not None and nq_tok >= SLIDING_LONG_QUERIES else BK


def _block(size: int, block: int) -> int:
    if block < MIN_BLOCK or block & (block - 1):
        raise ValueError(f"block sizes must be powers of two >= {MIN_BLOCK}, not {block}")
    return max(MIN_BLOCK, min(block, pow2_ceil(size)))


def live_blocks(q_pos: Int[Array, "B Qp"], k_pos: Int[Array, "B Kp"], k_valid: Bool[Array, "B Kp"],
                window: int | None, rel_extent: int, bq: int, bk: int,
                ) -> tuple[Int[Array, "B nq nk"], Int[Array, "B nq 3"]]:
    """(order, ends): the live key blocks of each query block, by class. For query block i of
    row b, with n0, n1, n2 = ends[b, i]: order[b, i, :n0] are its FAR blocks whose keys are all
    valid, order[b, i, n0:n1] its other FAR blocks, order[b, i, n1:n2] its NEAR blocks, each
    segment ascending; the rest of order lists the dead blocks. A block is live when it may
    hold an allowed key for some query of the block; FAR when it has a valid key and every
    (query, valid key) pair of the tile is allowed and has distance >= rel_extent (no bias, no
    causal / window mask: qmin - kmax >= rel_extent and, windowed, qmax - kmin < window);
    NEAR when live and not FAR. Qp and Kp must be multiples of bq and bk (the wrapper's
    padded arrays); ends is int32 (the kernel's loop bounds)."""
    b, qp_len = q_pos.shape
    kp_len = k_pos.shape[1]
    nq, nk = qp_len // bq, kp_len // bk
    qb = q_pos.astype(jnp.int32).reshape(b, nq, bq)
    kb = k_pos.astype(jnp.int32).reshape(b, nk, bk)
    vb = k_valid.astype(bool).reshape(b, nk, bk)
    qmin, qmax = jnp.min(qb, axis=-1)[:, :, None], jnp.max(qb, axis=-1)[:, :, None]  # [B, nq, 1]
    kmin = jnp.min(jnp.where(vb, kb, INT32_MAX), axis=-1)[:, None, :]  # [B, 1, nk]
    kmax = jnp.max(jnp.where(vb, kb, INT32_MIN), axis=-1)[:, None, :]
    any_valid = jnp.any(vb, axis=-1)[:, None, :]
    all_valid = jnp.all(vb, axis=-1)[:, None, :]
    # positions of valid keys and queries are token positions (|p| < 2**30): no difference wraps
    live = any_valid & (kmin <= qmax)
    far = any_valid & (qmin - kmax >= rel_extent)
    if window is not None:
        live = live & (qmin - kmax < window)
        far = far & (qmax - kmin < window)
    far = far & live
    cls = jnp.where(far, jnp.where(all_valid, 0, 1), jnp.where(live, 2, 3)).astype(jnp.int32)  # [B, nq, nk]
    order = jnp.argsort(cls, axis=-1, stable=True).astype(jnp.int32)
    ends = jnp.stack([jnp.sum(cls <= c, axis=-1, dtype=jnp.int32) for c in range(3)], axis=-1)
    return order, ends


def _use_kernel(q, k, v, rel, q_pos, k_pos, k_valid) -> bool:
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape or rel.ndim != 4:
        return False
    b, nq, h, d = q.shape
    _, nk, hkv, dk = k.shape
    return (nq > 0 and nk > 0 and b > 0 and hkv > 0 and h % hkv == 0 and dk == d and d >= MIN_BLOCK
            and not d & (d - 1) and k.dtype == q.dtype and v.dtype == q.dtype and rel.shape[:3] == q.shape[:3]
            and rel.shape[3] > 0 and q_pos.shape == (b, nq) and k_pos.shape == (b, nk) and k_valid.shape == (b, nk)
            and k.shape[0] == b)


def _forward(q, k, v, rel, q_pos, k_pos, k_valid, *, window: int | None, bq: int, bk: int | None, num_warps: int,
             num_stages: int, interpret: bool) -> Array:
    """attention without its custom VJP: the kernel, or the reference where the shapes need it."""
    if not _use_kernel(q, k, v, rel, q_pos, k_pos, k_valid):
        return ref.attention(q, k, v, rel, q_pos, k_pos, k_valid, window=window)
    b, nq_tok, h, dh = q.shape
    nk_tok, hkv = k.shape[1], k.shape[2]
    e = rel.shape[3]
    g = h // hkv
    bq, bk = _block(nq_tok, bq), _block(nk_tok, default_bk(nq_tok, window) if bk is None else bk)
    nq, nk = -(-nq_tok // bq), -(-nk_tok // bk)
    pq, pk = nq * bq - nq_tok, nk * bk - nk_tok

    q_pos = q_pos.astype(jnp.int32)
    k_pos = k_pos.astype(jnp.int32)
    k_valid = k_valid.astype(bool)
    if pq:
        q = jnp.pad(q, ((0, 0), (0, pq), (0, 0), (0, 0)))
        q_pos = jnp.pad(q_pos, ((0, 0), (0, pq)), mode="edge")
    if pk:
        k = jnp.pad(k, ((0, 0), (0, pk), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, pk), (0, 0), (0, 0)))
        k_pos = jnp.pad(k_pos, ((0, 0), (0, pk)))
        k_valid = jnp.pad(k_valid, ((0, 0), (0, pk)))
    order, ends = live_blocks(q_pos, k_pos, k_valid, window, e, bq, bk)
    k_ok = k_valid.astype(jnp.int32)  # int32, not i1, in the kernel
    scale = 1.0 / dh  # a power of two: q * scale is exact, so dot(q * scale, k) = dot(q, k) * scale
    hi = jax.lax.Precision.HIGHEST  # fp32 inputs: IEEE, not the lowering's default TF32

    def kernel(ends_ref, order_ref, q_ref, k_ref, v_ref, rel_ref, qpos_ref, kpos_ref, kok_ref, o_ref):
        i = nq - 1 - pl.program_id(0)  # last query block first
        hq = pl.program_id(1)
        bi = pl.program_id(2)
        kvh = hq // g
        q0 = pl.multiple_of(i * bq, bq)
        rows = pl.ds(q0, bq)
        qt = q_ref[bi, rows, hq, :] * jnp.asarray(scale, q_ref.dtype)  # [bq, D], exact
        qp = qpos_ref[bi, rows]  # [bq]
        rel_rows = jnp.minimum(q0 + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0), nq_tok - 1)  # [bq, 1]

        def body(t, carry, *, cls):
            """One key block of class cls: 0 far, all keys valid (no mask), 1 far (validity
            mask only), 2 near (bias gather; validity, causal and window masks)."""
            m_i, l_i, acc = carry
            j = order_ref[bi, i, t]
            cols = pl.ds(pl.multiple_of(j * bk, bk), bk)
            kt = k_ref[bi, cols, kvh, :]  # [bk, D]
            vt = v_ref[bi, cols, kvh, :]
            s = jax.lax.dot_general(qt, kt, (((1,), (1,)), ((), ())), precision=hi,
                                    preferred_element_type=jnp.float32)  # [bq, bk], scaled
            if cls == 1:
                ok = kok_ref[bi, cols] != 0
                s = jnp.where(ok[None, :], s, -jnp.inf)
                vt = jnp.where(ok[:, None], vt, jnp.zeros((), vt.dtype))  # see below
            elif cls == 2:
                kp = kpos_ref[bi, cols]  # [bk]
                ok = kok_ref[bi, cols] != 0
                d = qp[:, None] - kp[None, :]  # [bq, bk]
                allowed = ok[None, :] & (d >= 0)
                if window is not None:
                    allowed = allowed & (d < window)
                bias = rel_ref[bi, rel_rows, hq, jnp.clip(d, 0, e - 1)]  # gather [bq, bk], rel's dtype
                bias = jnp.where(d < e, bias.astype(jnp.float32), 0.0)  # d < 0 is masked below
                s = jnp.where(allowed, s + bias, -jnp.inf)
                # invalid keys' values are selected away, not multiplied by p = 0: they may be
                # another row's tokens or stale arena rows, and 0 * NaN is NaN
                vt = jnp.where(ok[:, None], vt, jnp.zeros((), vt.dtype))
            m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
            if cls == 2:  # no allowed key yet: m_new = -inf, take exponents against 0 (exp(-inf) = 0)
                m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            else:  # a far block has a valid key, allowed for every query: m_new is finite
                m_use = m_new
            m2 = m_use * LOG2E
            alpha = jnp.exp2(m_i * LOG2E - m2)  # exp(m_i - m_use); 0 while m_i = -inf
            p = jnp.exp2(s * LOG2E - m2[:, None])  # exp(s - m_use): one fma + ex2 per score
            l_new = l_i * alpha + jnp.sum(p, axis=1)
            pv = jax.lax.dot_general(p.astype(vt.dtype), vt, (((1,), (0,)), ((), ())), precision=hi,
                                     preferred_element_type=jnp.float32)  # [bq, D]
            return m_new, l_new, acc * alpha[:, None] + pv

        carry = (jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32),
                 jnp.zeros((bq, dh), jnp.float32))
        start = jnp.int32(0)
        for cls in range(3):  # far blocks first (their rows' maxima are then finite), then near
            end = ends_ref[bi, i, cls]
            carry = jax.lax.fori_loop(start, end, partial(body, cls=cls), carry)
            start = end
        _, l_i, acc = carry
        out = jnp.where(l_i[:, None] > 0, acc / jnp.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
        o_ref[bi, rows, hq, :] = out.astype(o_ref.dtype)

    out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((b, nq * bq, h, dh), q.dtype), grid=(nq, h, b),
                      aliases={}, interpret=interpret, num_warps=num_warps, num_stages=num_stages,
                      name="inkling_flash_attention")(ends, order, q, k, v, rel, q_pos, k_pos, k_ok)
    return out[:, :nq_tok] if pq else out


def attention(q: Float[Array, "B Q H D"], k: Float[Array, "B K Hkv D"], v: Float[Array, "B K Hkv D"],
              rel: Float[Array, "B Q H E"], q_pos: Int[Array, "B Q"], k_pos: Int[Array, "B K"],
              k_valid: Bool[Array, "B K"], *, window: int | None, bq: int = BQ, bk: int | None = None,
              num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES,
              interpret: bool = False) -> Float[Array, "B Q H D"]:
    """`ref.attention` (same signature and semantics) as a flash-style Pallas kernel; backward:
    the reference's VJP. bq / bk: queries per program and keys per loop block (powers of two
    >= 16; bk None: `default_bk`). See the module docstring."""
    kernel_fn = partial(_forward, window=window, bq=bq, bk=bk, num_warps=num_warps, num_stages=num_stages,
                        interpret=interpret)
    return with_ref_vjp(kernel_fn, partial(ref.attention, window=window))(q, k, v, rel, q_pos, k_pos, k_valid)


__all__ = ["attention", "live_blocks"]

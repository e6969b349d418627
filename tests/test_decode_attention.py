"""Decode / verify attention against the serving arena (`pallas_kernels.attention.decode`):
the jnp reference (`decode_ref`) against the model's `attention_core` over independently
listed context keys, the kernels (interpret mode on CPU) against the reference, dead key
blocks never read, and the CUDA lowering at the bench shapes through the MLIR verifier.

Small shapes: hd 16, a ring of 40 or 72 rows with bk = 16 (the last block partial), pages of
16 tokens, units of 16 token rows (so a 40-row ring spans 3 units with a padded tail)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import device_array, has_cuda_device

from inkling_jax.config import AttentionGeometry, InklingConfig
from inkling_jax.model import layers
from pallas_kernels.attention import decode, decode_ref

INTERPRET = jax.default_backend() != "gpu"
TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}
HD, NKV, H, E, DR = 16, 2, 8, 24, 3  # DR: the bias inputs per head (d_rel), not a power of two
UNIT_TOKENS = 16  # token rows per arena unit (pages: the page size)
GARBAGE = 3.0  # scale of arena contents no valid key may read (finite: masked p * v must be 0)


def rand(rng, shape, dtype=jnp.float32, scale=1.0):
    return device_array(np.asarray(scale * rng.standard_normal(shape), np.float32), dtype)


# The kernels (with their glue) and the references under jax.jit: one XLA compile per function
# and shape, not one per jnp op as when called eagerly.
KERNEL = {"ring": jax.jit(partial(decode.ring_attention, interpret=INTERPRET),
                          static_argnames=("ring", "window", "num_splits", "bk")),
          "pages": jax.jit(partial(decode.paged_attention, interpret=INTERPRET),
                           static_argnames=("page_size", "window", "num_splits"))}
REF = {"ring": jax.jit(decode_ref.ring_attention, static_argnames=("ring", "window")),
       "pages": jax.jit(decode_ref.paged_attention, static_argnames=("page_size", "window"))}


def close(a, b, rtol, atol):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=rtol, atol=atol)


@pytest.fixture(autouse=True)
def true_float32_references():
    """The jnp references' float32 matmuls at full precision: on Hopper JAX's default float32
    dot is TF32 (~1e-3 relative), the kernel's products are exact float32."""
    with jax.default_matmul_precision("highest"):
        yield


class Case:
    """A random arena holding each row's context K/V at the layout's places, the step's new
    tokens, and (for attention_core) each row's context listed directly: positions, K, V."""

    def __init__(self, rng, *, kind, seq_start, q_valid, has_state=None, ring=40, pages=4, dtype=jnp.float32,
                 nkv=NKV, h=H, hd=HD, e=E, log_scaling=True):
        b, nq = np.asarray(q_valid).shape
        self.kind, self.ring, self.b, self.nq = kind, ring, b, nq
        wt = 2 * nkv * hd
        unit = UNIT_TOKENS * wt
        seq = np.asarray(seq_start, np.int64)
        has_state = np.ones(b, bool) if has_state is None else np.asarray(has_state, bool)
        hist = rng.standard_normal((b, int(seq.max()) + 1, 2, nkv, hd)).astype(np.float32)  # K/V of each position
        if kind == "ring":
            fu = -(-ring * wt // unit)  # units of one ring field
            units = 2 + b * fu
            arena = GARBAGE * rng.standard_normal((units, unit)).astype(np.float32)
            first = 1 + fu * rng.permutation(b)  # rows' ring fields in shuffled order
            tok = arena.reshape(-1, wt)
            ctx = []
            for i in range(b):
                live = range(max(0, seq[i] - ring), seq[i]) if has_state[i] else range(0)
                for p in live:
                    tok[first[i] * UNIT_TOKENS + p % ring] = hist[i, p].reshape(-1)
                ctx.append(list(live))
            self.unit_row = device_array(first, np.int32)
        else:
            units = 2 + b * pages
            arena = GARBAGE * rng.standard_normal((units, unit)).astype(np.float32)
            table = 1 + rng.permutation(b * pages).reshape(b, pages)  # physical unit rows; sink: row 0
            tok = arena.reshape(-1, wt)
            ctx = []
            for i in range(b):
                used = -(-seq[i] // UNIT_TOKENS)
                assert used <= pages
                table[i, used:] = 0  # unused columns: the sink
                for p in range(seq[i]):
                    tok[table[i, p // UNIT_TOKENS] * UNIT_TOKENS + p % UNIT_TOKENS] = hist[i, p].reshape(-1)
                ctx.append(list(range(seq[i])))
            self.unit_row = device_array(table, np.int32)
        self.arena_np = arena
        self.arena = device_array(arena, dtype)
        self.seq_start = device_array(seq, np.int32)
        self.has_state = device_array(has_state)
        self.q_pos = device_array(seq[:, None] + np.arange(nq)[None, :], np.int32)
        self.q_valid = device_array(q_valid, bool)
        self.q = rand(rng, (b, nq, h, hd), dtype)
        self.k_new = rand(rng, (b, nq, nkv, hd), dtype)
        self.v_new = rand(rng, (b, nq, nkv, hd), dtype)
        self.r = rand(rng, (b, nq, h, DR), dtype)
        self.rel_proj = rand(rng, (DR, e), dtype, scale=0.5)
        # log scaling (tau > 1, as for positions past n_floor) or none (tau = 1)
        tau = 1.0 + 0.4 * rng.random((b, nq)) if log_scaling else np.ones((b, nq))
        self.tau = device_array(tau, np.float32)
        # the context as an explicit key list (padded with invalid keys)
        n = max(1, max(len(c) for c in ctx))
        pos = np.zeros((b, n), np.int32)
        valid = np.zeros((b, n), bool)
        kv = np.zeros((b, n, 2, nkv, hd), np.float32)
        for i, c in enumerate(ctx):
            pos[i, :len(c)], valid[i, :len(c)], kv[i, :len(c)] = c, True, hist[i, c]
        self.ctx = (device_array(kv[:, :, 0], dtype), device_array(kv[:, :, 1], dtype), device_array(pos),
                    device_array(valid))

    def args(self, arena=None):
        head = (self.q, self.r, self.rel_proj, self.tau, self.k_new, self.v_new, self.q_pos, self.q_valid,
                self.arena if arena is None else arena, self.unit_row, self.seq_start)
        return head + (self.has_state,) if self.kind == "ring" else head

    def static(self, window):
        if self.kind == "ring":
            return dict(ring=self.ring, window=window)
        return dict(page_size=UNIT_TOKENS, window=window)

    def reference(self, window, **kw):
        return REF[self.kind](*self.args(**kw), **self.static(window))

    def kernel(self, window, **kw):
        tune = dict(bk=16) if self.kind == "ring" else {}
        arena = kw.pop("arena", None)
        return KERNEL[self.kind](*self.args(arena=arena), **self.static(window), **tune, **kw)


# rows: a ring that has wrapped (s > R), one without state, one shorter than the ring / a
# partial last page, rows of different lengths; Q = 1 (decode) and 3 (verify, one draft invalid)
RING_ROWS = dict(seq_start=[57, 9, 13], has_state=[True, False, True])
PAGE_ROWS = dict(seq_start=[37, 0, 61])
Q_VALID = {1: [[True], [True], [True]], 2: [[True, True], [True, False], [True, True]],
           3: [[True, True, False], [True, False, False], [True, True, True]],
           4: [[True, True, True, False], [True, False, False, False], [True, True, True, True]]}


def core_case(kind, nq, seed):
    rows = RING_ROWS if kind == "ring" else PAGE_ROWS
    return Case(np.random.default_rng(seed), kind=kind, q_valid=Q_VALID[nq], **rows)


@pytest.mark.parametrize("nq", [1, 3])
@pytest.mark.parametrize("kind,window", [("ring", 20), ("ring", None), ("pages", None), ("pages", 24)])
def test_reference_matches_attention_core(kind, window, nq):
    """decode_ref (reading the context from the arena; r, rel_proj and tau as context.py
    passes them) equals attention_core called as context.py calls it, over the rows' context
    keys listed position by position (fp32)."""
    c = core_case(kind, nq, seed=nq * 10 + len(kind) + (window or 0))
    cfg = InklingConfig.tiny(log_scaling_n_floor=8, log_scaling_alpha=0.3, d_rel=4)
    geom = AttentionGeometry(kind == "ring", H, NKV, HD, rel_extent=E, window=window, log_scaling=kind == "pages")
    rng = np.random.default_rng(99)
    r = rand(rng, (c.b, nq, H, cfg.d_rel))
    rel_proj = rand(rng, (cfg.d_rel, E), scale=0.5)
    fn = decode_ref.ring_attention if kind == "ring" else decode_ref.paged_attention

    @jax.jit  # everything compared, as one program: one compile, not one per op
    def run(args, r, rel_proj, ctx):
        q, k_new, v_new, q_pos, q_valid = (args[i] for i in (0, 4, 5, 6, 7))
        ctx_k, ctx_v, ctx_pos, ctx_valid = ctx
        want = layers.attention_core(q, (ctx_k, k_new), (ctx_v, v_new), r, rel_proj, q_pos, (ctx_pos, q_pos),
                                     (ctx_valid, q_valid), geom, cfg)
        tau = layers.log_scaling_tau(q_pos, cfg) if geom.log_scaling else jnp.ones(q_pos.shape, jnp.float32)
        args = list(args)
        args[1:4] = r, rel_proj, tau
        got = fn(*args, **c.static(window))
        # the context matters: without it (new keys only) rows with context differ
        no_ctx = layers.attention_core(q, k_new, v_new, r, rel_proj, q_pos, q_pos, q_valid, geom, cfg)
        return want, got, no_ctx

    want, got, no_ctx = run(c.args(), r, rel_proj, c.ctx)
    close(got, want, rtol=1e-5, atol=1e-5)
    diff = np.abs(np.asarray(no_ctx) - np.asarray(want)).max(axis=(1, 2, 3))
    has_ctx = np.asarray(c.ctx[3]).any(-1)
    assert has_ctx.sum() == 2 and (diff[has_ctx] > 1e-2).all() and (diff[~has_ctx] < 1e-6).all()


@pytest.mark.parametrize("log_scaling", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reference_tables_are_attention_tables(dtype, log_scaling):
    """decode_ref.tables (what the kernels compute from r, rel_proj and tau) rounds as
    layers.attention_tables does: bit-equal q and bias table, tau = 1.0 where the layer has no
    log scaling."""
    rng = np.random.default_rng(11)
    cfg = InklingConfig.tiny(log_scaling_n_floor=8, log_scaling_alpha=0.3, d_rel=DR)
    geom = AttentionGeometry(False, H, NKV, HD, rel_extent=E, window=None, log_scaling=log_scaling)
    q, r, rel_proj = rand(rng, (2, 3, H, HD), dtype), rand(rng, (2, 3, H, DR), dtype), rand(rng, (DR, E), dtype)
    q_pos = device_array([[5, 6, 7], [40, 41, 42]], np.int32)
    # eager on purpose (few ops): a jitted bf16 program may keep excess precision between ops,
    # which could hide the rounding difference this bit-equality checks
    tau = layers.log_scaling_tau(q_pos, cfg) if log_scaling else jnp.ones(q_pos.shape, jnp.float32)
    for got, want in zip(decode_ref.tables(q, r, rel_proj, tau), layers.attention_tables(q, r, rel_proj, q_pos, geom,
                                                                                         cfg)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


KERNEL_CASES = {
    # name: (kind, dtype, Q, window, num_splits values, log scaling (tau != 1))
    "ring_f32_verify_window": ("ring", jnp.float32, 3, 20, (1, 3, 9), False),  # 9 > the 3 ring blocks
    "ring_f32_decode_full": ("ring", jnp.float32, 1, None, (None, 2), True),
    "ring_bf16_verify": ("ring", jnp.bfloat16, 3, 20, (1, 2), False),
    "ring_bf16_verify4_log": ("ring", jnp.bfloat16, 4, 20, (2,), True),
    "pages_f32_verify": ("pages", jnp.float32, 3, None, (1, 3, 16), True),  # 16 > the 4 pages
    "pages_f32_decode_window": ("pages", jnp.float32, 1, 24, (None, 2), False),
    "pages_bf16_verify": ("pages", jnp.bfloat16, 3, None, (1, 4), True),
    "pages_bf16_verify2": ("pages", jnp.bfloat16, 2, None, (2,), False),
}


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_kernel_matches_reference(name):
    """The kernels (bias and log scaling computed in the kernel from r, rel_proj, tau) against
    the reference (the tables of `attention_tables`), Q 1-4, fp32 and bf16, tau = 1 or not."""
    kind, dtype, nq, window, splits, log_scaling = KERNEL_CASES[name]
    rows = RING_ROWS if kind == "ring" else PAGE_ROWS
    c = Case(np.random.default_rng(sum(map(ord, name))), kind=kind, q_valid=Q_VALID[nq], dtype=dtype,
             log_scaling=log_scaling, **rows)
    want = c.reference(window)
    assert (np.abs(np.asarray(want, np.float32)).sum(axis=(2, 3)) > 0.1).all()  # every query has keys
    for s in splits:
        out = c.kernel(window, num_splits=s)
        assert out.shape == c.q.shape and out.dtype == dtype
        close(out, want, **TOL[dtype])


@pytest.mark.parametrize("kind", ["ring", "pages"])
def test_dead_blocks_are_not_read(kind):
    """Key blocks without a live context position (ring rows never written, older than the
    window, or a row without state; the ring field's padding; pages before the window, the
    sink page) hold NaN: the
    kernel's output stays finite and equals the reference on the arena with them zeroed.
    Ring of 72 rows (5 blocks of 16, the last partial) with a wrapped live range."""
    rng = np.random.default_rng(5 if kind == "ring" else 6)
    window = 20
    if kind == "ring":
        ring, bk = 72, 16
        c = Case(rng, kind="ring", seq_start=[100, 30, 80, 50], has_state=[True, True, True, False], ring=ring,
                 q_valid=[[True, True, False]] * 4)
        tok = c.arena_np.reshape(-1, 2 * NKV * HD).copy()
        poisoned = 0
        seq_start, has_state, unit_row = (np.asarray(x) for x in (c.seq_start, c.has_state, c.unit_row))
        for i in range(c.b):
            s = int(seq_start[i])
            lo, hi = max(0, s - ring, s - window + 1), s - 1
            live_blocks = {(p % ring) // bk for p in range(lo, hi + 1)} if has_state[i] else set()
            for blk in set(range(-(-ring // bk))) - live_blocks:
                start = int(unit_row[i]) * UNIT_TOKENS + blk * bk
                tok[start:start + min(bk, ring - blk * bk)] = np.nan
                poisoned += 1
            end = int(unit_row[i]) * UNIT_TOKENS + ring  # the field's padding after row R-1: the
            tok[end:-(-end // UNIT_TOKENS) * UNIT_TOKENS] = np.nan  # tail block must not read past the ring
        assert poisoned >= 8 and ring % UNIT_TOKENS  # (so the field has padding)
    else:
        c = Case(rng, kind="pages", seq_start=[85, 0, 30], pages=6, q_valid=[[True, True, True]] * 3)
        tok = c.arena_np.reshape(-1, 2 * NKV * HD).copy()
        table, seq_start = np.asarray(c.unit_row), np.asarray(c.seq_start)
        for i in range(c.b):
            s = int(seq_start[i])
            for p in range(table.shape[1]):
                if s == 0 or not max(0, s - window + 1) // UNIT_TOKENS <= p <= (s - 1) // UNIT_TOKENS:
                    tok[table[i, p] * UNIT_TOKENS:(table[i, p] + 1) * UNIT_TOKENS] = np.nan
        assert np.isnan(tok[:UNIT_TOKENS]).all()  # the sink
    poisoned_arena = device_array(tok.reshape(c.arena_np.shape))
    want = c.reference(window, arena=device_array(np.nan_to_num(tok.reshape(c.arena_np.shape), nan=0.0)))
    for s in (1, 3):
        out = c.kernel(window, num_splits=s, arena=poisoned_arena)
        assert np.isfinite(np.asarray(out)).all()
        close(out, want, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(want)).max() > 0.1


def test_fallbacks_are_the_reference():
    """Shapes the kernel cannot take (head dim not a power of two; a page size below 16) give
    the reference's result."""
    rng = np.random.default_rng(3)
    c = Case(rng, kind="ring", q_valid=Q_VALID[3], hd=12, **RING_ROWS)
    close(c.kernel(20), c.reference(20), rtol=1e-6, atol=1e-6)
    c = Case(rng, kind="pages", q_valid=Q_VALID[1], **PAGE_ROWS)
    small = device_array(c.arena_np.reshape(-1, UNIT_TOKENS // 2 * 2 * NKV * HD))  # 8-token units: pages of 8
    table = np.asarray(c.unit_row)
    rows = device_array(np.stack([table * 2, table * 2 + 1], axis=-1).reshape(c.b, -1))  # page p -> 2p, 2p+1
    args = c.args(arena=small)[:-2] + (rows, c.seq_start)
    out = KERNEL["pages"](*args, page_size=8)
    close(out, REF["pages"](*args, page_size=8), rtol=0, atol=0)
    close(out, c.reference(None), rtol=1e-5, atol=1e-5)  # the same keys in pages of 16


@pytest.mark.parametrize("splits", [2, 9])
def test_combine_kernel_matches_jnp_combine(splits):
    """The split merge as one kernel (`combine_splits_kernel`) against the jnp
    `combine_splits`: fp32 within 1e-6 of the O(1) output scale (the sum order over splits
    differs), bf16 equal after the cast; empty splits (m = -inf, l = 0) and a query no split
    saw (zeros) included."""
    rng = np.random.default_rng(splits)
    b, nq, h = 2, 3, 4
    acc = rand(rng, (b, splits, nq, h, HD))
    m = np.array(rand(rng, (b, splits, nq, h)))
    l = (rng.random((b, splits, nq, h)) + 0.1).astype(np.float32)
    m[0, 1], m[1, :, 0], l[0, 1], l[1, :, 0] = -np.inf, -np.inf, 0.0, 0.0
    m, l = device_array(m), device_array(l)
    want = np.asarray(jax.jit(decode.combine_splits)(acc, m, l))  # one compile, not one per op
    assert np.abs(want[1, 0]).max() == 0.0 and np.abs(want).max() > 0.1
    for dtype, tol in ((jnp.float32, 1e-6), (jnp.bfloat16, 0.0)):
        got = jax.jit(partial(decode.combine_splits_kernel, out_dtype=dtype, interpret=INTERPRET))(acc, m, l)
        assert got.shape == want.shape and got.dtype == dtype
        close(got, want.astype(dtype), rtol=0, atol=tol)


def test_default_splits():
    """B * nkv * S reaches ~512 programs, never more splits than live blocks (pages: >= 2 a split)."""
    assert decode.default_splits(1, 2, 130, 2) == 65
    assert decode.default_splits(32, 2, 130, 2) == 8
    assert decode.default_splits(32, 4, 9) == 4
    assert decode.default_splits(1, 4, 9) == 9
    assert decode.default_splits(512, 4, 9) == 1


@pytest.mark.skipif(has_cuda_device(), reason="abstract CUDA lowering is for machines without a GPU")
def test_kernels_lower_for_gpu(verify_triton_modules):
    """Both kernels pass the Triton lowering for CUDA at the bench model's decode / verify
    shapes (bf16, hd 128, 16 heads; sliding: 4 kv heads, ring 515, window 512; full: 2 kv
    heads, pages of 64, 130 page columns) at batch 1 and 32, several splits (so the split
    combine kernel too), with an arena past 4 GiB (64-bit offsets), and the modules pass the
    MLIR verifier."""
    sds, bf, i32, bl = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32, jnp.bool_
    hd, h, e, dr, units = 128, 16, 1024, 16, 70000
    for b, nq in ((1, 1), (32, 3)):
        head = lambda nkv: (sds((b, nq, h, hd), bf), sds((b, nq, h, dr), bf), sds((dr, e), bf),
                            sds((b, nq), jnp.float32), sds((b, nq, nkv, hd), bf),
                            sds((b, nq, nkv, hd), bf), sds((b, nq), i32), sds((b, nq), bl),
                            sds((units, 64 * 2 * 2 * hd), bf))
        ring_args = head(4) + (sds((b,), i32), sds((b,), i32), sds((b,), bl))
        page_args = head(2) + (sds((b, 130), i32), sds((b,), i32))
        try:
            texts = [jax.jit(lambda *a: decode.ring_attention(*a, ring=515, window=512)).trace(*ring_args).lower(
                         lowering_platforms=("cuda",)).as_text(),
                     jax.jit(lambda *a: decode.paged_attention(*a, page_size=64)).trace(*page_args).lower(
                         lowering_platforms=("cuda",)).as_text()]
        except (ImportError, NotImplementedError) as exc:
            pytest.skip(f"no Triton lowering here: {exc}")
        assert all("xla.gpu.triton" in t for t in texts)
        # several splits by default at both batches: merged by the combine kernel, a second module
        assert [t.count("xla.gpu.triton") for t in texts] == [2, 2]
    assert len(verify_triton_modules) == 8


@pytest.mark.parametrize("kind", ["ring", "pages"])
def test_gradient_is_the_references(kind):
    """The kernels' backward is the reference's VJP (`_common.with_ref_vjp`): d/d(q, r,
    rel_proj, tau, arena) of a weighted sum of the output equals the reference's (fp32), and
    reaches the arena's context."""
    rows = RING_ROWS if kind == "ring" else PAGE_ROWS
    c = Case(np.random.default_rng(7), kind=kind, q_valid=Q_VALID[1], **rows)
    args = list(c.args())
    weights = rand(np.random.default_rng(8), c.q.shape)

    def loss(fn, q, r, rel_proj, tau, arena):
        a = list(args)
        a[:4], a[8] = (q, r, rel_proj, tau), arena
        return jnp.sum(fn(*a) * weights)

    kernel = partial(decode.ring_attention if kind == "ring" else decode.paged_attention, **c.static(None),
                     interpret=INTERPRET)
    ref = partial(decode_ref.ring_attention if kind == "ring" else decode_ref.paged_attention, **c.static(None))
    diff = (0, 1, 2, 3, 4)

    @jax.jit  # both gradients as one program: one compile, not one per op
    def grads(*x):
        return [jax.grad(partial(loss, fn), argnums=diff)(*x) for fn in (kernel, ref)]

    got, want = grads(*args[:4], args[8])
    for g, w in zip(got, want):
        close(g, w, rtol=1e-5, atol=1e-5)
    assert min(np.abs(np.asarray(g)).max() for g in got) > 1e-3  # the context rows of the arena too

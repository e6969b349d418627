"""The flash-style attention kernel (`pallas_kernels.attention`) against its jnp reference (the
model's attention math: `layers.attention_core` is `attention_tables` + `ref.attention`), and the
kernel's glue (`attention_tables`, one key block) against `attention_core`: interpret mode on CPU, the compiled Triton
kernel
on a GPU. fp32 results match within 1e-5 (only summation orders differ); bf16 within 2e-2 on
O(1) outputs (the kernel rounds the unnormalised probabilities to bf16 before p @ v, the
reference the normalised ones; see `pallas_kernels/attention/pallas.py`). Small blocks
(bq = bk = 16) so the test shapes span several query and key blocks."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import device_array, has_cuda_device

from inkling_jax.config import AttentionGeometry, InklingConfig
from inkling_jax.model import layers
from pallas_kernels.attention import pallas as attn
from pallas_kernels.attention import ref as attn_ref

INTERPRET = jax.default_backend() != "gpu"
SMALL = dict(bq=16, bk=16)
TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def rand(rng, shape, dtype=jnp.float32, scale=1.0):
    return device_array(np.asarray(scale * rng.standard_normal(shape), np.float32), dtype)


def close(a, b, rtol, atol):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=rtol, atol=atol)


@pytest.fixture(autouse=True)
def true_float32_references():
    """The jnp references' float32 matmuls at full precision: on Hopper JAX's default float32
    dot is TF32 (~1e-3 relative), the kernel's products are exact float32."""
    with jax.default_matmul_precision("highest"):
        yield


# The kernel (its glue: padding, live_blocks), the reference and live_blocks under jax.jit: one
# XLA compile per function and shape, not one per jnp op as when called eagerly.
attention = jax.jit(partial(attn.attention, interpret=INTERPRET), static_argnames=("window", "bq", "bk"))
ref_attention = jax.jit(attn_ref.attention, static_argnames="window")
live_blocks = jax.jit(attn.live_blocks, static_argnames=("window", "rel_extent", "bq", "bk"))


def kernel(*args, window, **kw):
    return attention(*args, window=window, **{**SMALL, **kw})


def allowed_np(q_pos, k_pos, k_valid, window):
    d = np.asarray(q_pos)[:, :, None].astype(np.int64) - np.asarray(k_pos)[:, None, :]
    ok = np.asarray(k_valid)[:, None, :] & (d >= 0)
    return ok & (d < window) if window is not None else ok


def make_case(rng, *, b, nq, nk, h, hkv, d, e, dtype, layout, q_start, invalid_frac=0.0):
    """Inputs with keys in `layout` order: "sorted" positions 0..nk-1, or "ring" (a sliding-window
    ring: a shuffled permutation of the positions, some slots invalid with position -1)."""
    q = rand(rng, (b, nq, h, d), dtype)
    k = rand(rng, (b, nk, hkv, d), dtype)
    v = rand(rng, (b, nk, hkv, d), dtype)
    rel = rand(rng, (b, nq, h, e), dtype, scale=0.5)
    q_pos = np.broadcast_to(q_start + np.arange(nq), (b, nq)).astype(np.int32)
    k_pos = np.stack([np.arange(nk) if layout == "sorted" else rng.permutation(nk) for _ in range(b)]).astype(np.int32)
    k_valid = rng.random((b, nk)) >= invalid_frac
    if layout == "ring":
        k_pos = np.where(k_valid, k_pos, -1).astype(np.int32)  # empty ring slots: negative positions
    return q, k, v, rel, device_array(q_pos), device_array(k_pos), device_array(k_valid)


CASES = {
    # name: (dtype, H, Hkv, window, Q, K, E, key layout, first query position, invalid fraction)
    "f32_mha_causal": (jnp.float32, 2, 2, None, 37, 83, 64, "sorted", 46, 0.0),  # extend: queries = last keys
    "f32_gqa4_ring_window": (jnp.float32, 4, 1, 20, 29, 50, 20, "ring", 30, 0.25),
    "f32_gqa8_beyond_E": (jnp.float32, 8, 1, None, 21, 70, 12, "sorted", 49, 0.1),  # most distances >= E
    "bf16_gqa4_ring_window": (jnp.bfloat16, 8, 2, 24, 40, 64, 24, "ring", 40, 0.2),
    "bf16_gqa8_causal": (jnp.bfloat16, 8, 1, None, 33, 48, 32, "sorted", 15, 0.0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(name):
    dtype, h, hkv, window, nq, nk, e, layout, q_start, invalid = CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    args = make_case(rng, b=2, nq=nq, nk=nk, h=h, hkv=hkv, d=16, e=e, dtype=dtype, layout=layout, q_start=q_start,
                     invalid_frac=invalid)
    out = kernel(*args, window=window)
    want = ref_attention(*args, window=window)
    assert out.shape == args[0].shape and out.dtype == dtype
    close(out, want, **TOL[dtype])
    # rows with an allowed key are not zero; the others are exactly zero
    has_key = allowed_np(args[4], args[5], args[6], window).any(-1)  # [B, Q]
    norms = np.abs(np.asarray(out, np.float32)).sum(axis=(2, 3))
    assert has_key.any() and (norms[has_key] > 0).all()
    assert (norms[~has_key] == 0).all()
    if name == "f32_gqa8_beyond_E":  # the bias matters where it applies: without it the result differs
        zero_rel = device_array(np.zeros(args[3].shape, args[3].dtype))
        no_bias = ref_attention(*args[:3], zero_rel, *args[4:], window=window)
        assert np.abs(np.asarray(no_bias) - np.asarray(want)).max() > 1e-3


def test_queries_without_allowed_keys_give_zeros():
    """Queries before every key, a batch row whose keys are all invalid, and (window) queries whose
    keys are all too old: zeros, exactly; the other queries are not."""
    rng = np.random.default_rng(7)
    q, k, v, rel, _, k_pos, k_valid = make_case(rng, b=3, nq=20, nk=40, h=4, hkv=2, d=16, e=16, dtype=jnp.float32,
                                                layout="sorted", q_start=0)
    k_pos = device_array(np.asarray(k_pos) + 10)  # keys at 10..49
    q_pos = device_array(np.stack([np.arange(20),  # queries 0..9 precede every key
                          np.arange(20) + 30,  # row 1: all keys invalid below
                          np.arange(20) * 5]), np.int32)  # row 2: late queries outrun the window
    k_valid = device_array(np.asarray(k_valid) & np.asarray([[True], [False], [True]]))  # row 1: none valid
    window = 12
    out = kernel(q, k, v, rel, q_pos, k_pos, k_valid, window=window)
    close(out, ref_attention(q, k, v, rel, q_pos, k_pos, k_valid, window=window), rtol=1e-5, atol=1e-5)
    has_key = allowed_np(q_pos, k_pos, k_valid, window).any(-1)
    assert not has_key[0, :10].any() and has_key[0, 10:].all() and not has_key[1].any()
    assert has_key[2].any() and not has_key[2].all()
    o = np.asarray(out)
    assert (o[~has_key] == 0).all()
    assert (np.abs(o[has_key]).sum(-1) > 0).all()


@pytest.mark.parametrize("window", [None, 16])
def test_dead_key_blocks_are_skipped(window):
    """Whole key blocks in the future (and, windowed, too old; and all-invalid) are never read:
    NaN in their keys and values does not reach the output, which equals the reference's with
    those blocks zeroed. The live-block lists are the blocks with an allowed pair."""
    rng = np.random.default_rng(11 + (window or 0))
    bq, bk = SMALL["bq"], SMALL["bk"]
    q, k, v, rel, q_pos, k_pos, k_valid = make_case(rng, b=2, nq=40, nk=96, h=4, hkv=1, d=16, e=32,
                                                    dtype=jnp.float32, layout="sorted", q_start=20)
    k_valid = np.array(k_valid)
    k_valid[0, 32:48] = False  # row 0: key block 2 has no valid key
    k_valid = device_array(k_valid)
    nk_blocks = 96 // bk
    q_pad = device_array(np.pad(np.asarray(q_pos), ((0, 0), (0, 48 - 40)), mode="edge"))
    order, ends = live_blocks(q_pad, k_pos, k_valid, window, 32, bq, bk)
    assert order.dtype == ends.dtype == jnp.int32
    allowed = allowed_np(q_pad, k_pos, k_valid, window)  # [B, Qp, K]
    pair = allowed.reshape(2, 3, bq, nk_blocks, bk).any(axis=(2, 4))  # [B, nq, nk]: block holds an allowed pair
    order, count = np.asarray(order), np.asarray(ends)[..., 2]
    for bi in range(2):
        for i in range(3):
            live = set(order[bi, i, :count[bi, i]].tolist())
            assert set(np.nonzero(pair[bi, i])[0].tolist()) <= live  # conservative
            assert sorted(order[bi, i].tolist()) == list(range(nk_blocks))  # a permutation
    assert (count < nk_blocks).all()
    dead = ~pair.any(axis=1)  # [B, nk]: key blocks no query block uses
    assert dead.sum() >= 3  # the future blocks (keys >= 68), row 0's invalid block, (window) the old ones
    dead_keys = np.repeat(dead, bk, axis=1)[:, :, None, None]
    poisoned_k, poisoned_v = (device_array(np.where(dead_keys, np.nan, x), np.float32) for x in (k, v))
    zeroed_k, zeroed_v = (device_array(np.where(dead_keys, 0.0, x), np.float32) for x in (k, v))
    out = kernel(q, poisoned_k, poisoned_v, rel, q_pos, k_pos, k_valid, window=window)
    want = ref_attention(q, zeroed_k, zeroed_v, rel, q_pos, k_pos, k_valid, window=window)
    assert np.isfinite(np.asarray(out)).all()
    close(out, want, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(out)).max() > 0.1


def far_case(rng, *, dtype, layout, window, e=16, invalid_frac=0.15):
    """2 rows of 96 queries (positions 64..159) over 160 keys (positions 0..159) in `layout`
    order: "sorted", "blocks" (the 16-key blocks permuted and each shuffled inside: position
    ranges stay compact, so far blocks exist) or "shuffled" (a random permutation: far blocks
    are rare). Row 1's keys at positions 24..79 and past 120 are invalid: its first query
    block's (positions 64..79) only allowed keys are at distance >= 41 (far, unless a window
    cuts the block)."""
    b, nq, nk, h, hkv, d = 2, 96, 160, 2, 1, 16
    q = rand(rng, (b, nq, h, d), dtype)
    k = rand(rng, (b, nk, hkv, d), dtype)
    v = rand(rng, (b, nk, hkv, d), dtype)
    rel = rand(rng, (b, nq, h, e), dtype, scale=0.5)
    q_pos = np.broadcast_to(64 + np.arange(nq), (b, nq)).astype(np.int32)
    rows = []
    for _ in range(b):
        if layout == "sorted":
            rows.append(np.arange(nk))
        elif layout == "blocks":
            rows.append(np.concatenate([rng.permutation(16) + 16 * j for j in rng.permutation(nk // 16)]))
        else:
            rows.append(rng.permutation(nk))
    k_pos = np.stack(rows).astype(np.int32)
    k_valid = rng.random((b, nk)) >= invalid_frac
    k_valid[1] &= (k_pos[1] < 24) | ((k_pos[1] >= 80) & (k_pos[1] <= 120))
    k_pos = np.where(k_valid, k_pos, -7 if layout == "shuffled" else k_pos).astype(np.int32)
    return q, k, v, rel, device_array(q_pos), device_array(k_pos), device_array(k_valid)


FAR_CASES = {
    # name: (dtype, window, key layout)
    "f32_causal_sorted": (jnp.float32, None, "sorted"),
    "bf16_causal_blocks": (jnp.bfloat16, None, "blocks"),
    "f32_window_blocks": (jnp.float32, 72, "blocks"),  # window > E: far blocks must also be inside it
    "bf16_window_shuffled": (jnp.bfloat16, 100, "shuffled"),
}


def check_block_classes(q_pos, k_pos, k_valid, window, e, bq, bk):
    """live_blocks' classes against brute force over every (query, key) pair: each live list
    is a permutation split into (far all-valid, far, near, dead) segments, ascending inside;
    a far block has a valid key and every (query, valid key) pair allowed at distance >= e
    (class 0: every key valid); every block holding an allowed pair is live. Returns the
    number of blocks of each class."""
    order, ends = live_blocks(q_pos, k_pos, k_valid, window, e, bq, bk)
    assert order.dtype == ends.dtype == jnp.int32
    order, ends = np.asarray(order), np.asarray(ends)
    b, nq, nk = order.shape
    d = np.asarray(q_pos)[:, :, None].astype(np.int64) - np.asarray(k_pos)[:, None, :]
    d = d.reshape(b, nq, bq, nk, bk)
    ok = np.broadcast_to(np.asarray(k_valid).reshape(b, 1, 1, nk, bk), d.shape)
    allowed = allowed_np(q_pos, k_pos, k_valid, window).reshape(d.shape)
    counts = np.zeros(4, int)
    for bi in range(b):
        for i in range(nq):
            n0, n1, n2 = ends[bi, i]
            segs = [order[bi, i, :n0], order[bi, i, n0:n1], order[bi, i, n1:n2], order[bi, i, n2:]]
            assert sorted(order[bi, i].tolist()) == list(range(nk))
            for c, seg in enumerate(segs):
                counts[c] += len(seg)
                assert (np.diff(seg) > 0).all()
                for j in seg:
                    okj, dj, aj = ok[bi, i, :, j], d[bi, i, :, j], allowed[bi, i, :, j]
                    if c < 2:
                        assert okj.any() and (aj == okj).all() and (dj[okj] >= e).all()
                        assert (c == 1) or okj.all()
                    if c == 3:
                        assert not aj.any()
    return counts


@pytest.mark.parametrize("name", list(FAR_CASES))
def test_far_blocks(name):
    """Key blocks at distance >= E from every query of the block skip the bias gather and the
    causal / window masks (the far loops): the kernel still equals the reference, with far
    blocks of both kinds (every key valid; some invalid) and near blocks, keys in any position
    order, and a query block whose only allowed keys are far."""
    dtype, window, layout = FAR_CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    args = far_case(rng, dtype=dtype, layout=layout, window=window)
    q_pos, k_pos, k_valid = args[4:]
    counts = check_block_classes(q_pos, k_pos, k_valid, window, 16, 16, 16)
    if layout != "shuffled":
        assert counts[0] > 0 and counts[1] > 0 and counts[2] > 0, counts
    # row 1, query block 0 (positions 64..79): every allowed key is at distance >= 41
    if window is None:  # ... so its key blocks are all far
        ends = np.asarray(live_blocks(q_pos, k_pos, k_valid, window, 16, 16, 16)[1])
        assert ends[1, 0, 1] == ends[1, 0, 2] > 0
    allowed = allowed_np(q_pos, k_pos, k_valid, window)[1, :16]
    dist = np.asarray(q_pos)[1, :16, None] - np.asarray(k_pos)[1][None, :]
    assert allowed.any(-1).all() and (dist[allowed] >= 40).all()
    out = kernel(*args, window=window)
    want = ref_attention(*args, window=window)
    close(out, want, **TOL[dtype])
    has_key = allowed_np(q_pos, k_pos, k_valid, window).any(-1)
    norms = np.abs(np.asarray(out, np.float32)).sum(axis=(2, 3))
    assert (norms[has_key] > 0).all() and (norms[~has_key] == 0).all()


def test_default_blocks_and_fallback():
    """Default tiling (blocks shrunk to the small shape), and a head dim Triton cannot tile (not a
    power of two): the reference."""
    rng = np.random.default_rng(3)
    args = make_case(rng, b=1, nq=9, nk=30, h=4, hkv=2, d=32, e=16, dtype=jnp.float32, layout="sorted", q_start=21)
    out = attention(*args, window=None)
    close(out, ref_attention(*args, window=None), rtol=1e-5, atol=1e-5)
    args = make_case(rng, b=1, nq=9, nk=30, h=4, hkv=2, d=12, e=16, dtype=jnp.float32, layout="sorted", q_start=21)
    out = attention(*args, window=8)
    close(out, ref_attention(*args, window=8), rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(out)).max() > 0.1


def test_gradient_is_the_reference_vjp():
    rng = np.random.default_rng(5)
    q, k, v, rel, q_pos, k_pos, k_valid = make_case(rng, b=1, nq=17, nk=24, h=4, hkv=2, d=16, e=16,
                                                    dtype=jnp.float32, layout="ring", q_start=8, invalid_frac=0.2)
    w = rand(rng, q.shape)

    def loss(fn, q, k, v, rel):
        return jnp.sum(fn(q, k, v, rel, q_pos, k_pos, k_valid, window=12) * w)

    def grads(q, k, v, rel):  # both gradients in one jitted program: one compile, not one per op
        kern = partial(attn.attention, **SMALL, interpret=INTERPRET)
        return [jax.grad(partial(loss, fn), argnums=(0, 1, 2, 3))(q, k, v, rel) for fn in (kern, attn_ref.attention)]

    got, want = jax.jit(grads)(q, k, v, rel)
    for g, gw in zip(got, want):
        close(g, gw, rtol=1e-5, atol=1e-5)
        assert np.abs(np.asarray(gw)).max() > 0


# ------------------------------------------------------------------ reference vs attention_core


GEOMS = {
    "full_log_scaling": AttentionGeometry(False, 8, 2, 16, rel_extent=24, window=None, log_scaling=True),
    "sliding_window": AttentionGeometry(True, 4, 1, 16, rel_extent=12, window=12, log_scaling=False),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("geom_name", list(GEOMS))
def test_reference_matches_attention_core(geom_name, dtype):
    """ref.attention with the caller's rel = r @ rel_proj and tau applied by layers.attention_tables
    equals attention_core with a single key block (fp32: 1e-5; bf16: the same roundings, only
    the einsum summation orders may differ: 2e-2)."""
    geom = GEOMS[geom_name]
    cfg = InklingConfig.tiny(log_scaling_n_floor=8, log_scaling_alpha=0.3, d_rel=4)
    rng = np.random.default_rng(17 + len(geom_name))
    b, nq, nk, nh, nkv, hd = 2, 20, 48, geom.num_heads, geom.num_kv_heads, geom.head_dim
    q, k, v = rand(rng, (b, nq, nh, hd), dtype), rand(rng, (b, nk, nkv, hd), dtype), rand(rng, (b, nk, nkv, hd), dtype)
    r = rand(rng, (b, nq, nh, cfg.d_rel), dtype)
    rel_proj = rand(rng, (cfg.d_rel, geom.rel_extent), jnp.float32, scale=0.5)
    q_pos = device_array(np.broadcast_to(np.arange(nq) + 40, (b, nq)), np.int32)  # tau > 1 from pos 8 on
    if geom.window is None:
        k_pos = np.broadcast_to(np.arange(nk) + 12, (b, nk))
        k_valid = rng.random((b, nk)) > 0.15
    else:  # ring order, empty slots at -1
        k_pos = np.stack([rng.permutation(nk) + 12 for _ in range(b)])
        k_valid = rng.random((b, nk)) > 0.25
        k_pos = np.where(k_valid, k_pos, -1)
    k_pos, k_valid = device_array(k_pos, np.int32), device_array(k_valid)

    @jax.jit  # everything compared, as one program: one compile, not one per op
    def run(q, k, v, r, rel_proj, q_pos, k_pos, k_valid):
        want = layers.attention_core(q, k, v, r, rel_proj, q_pos, k_pos, k_valid, geom, cfg)
        qs, rel = layers.attention_tables(q, r, rel_proj, q_pos, geom, cfg)  # the engine's glue to the kernel
        got = attn_ref.attention(qs, k, v, rel, q_pos, k_pos, k_valid, window=geom.window)
        out = None
        if dtype == jnp.float32:  # and the kernel against attention_core directly
            out = attn.attention(qs, k, v, rel, q_pos, k_pos, k_valid, window=geom.window, **SMALL,
                                 interpret=INTERPRET)
        return want, qs, got, out, layers.log_scaling_tau(q_pos, cfg)

    want, qs, got, out, tau = run(q, k, v, r, rel_proj, q_pos, k_pos, k_valid)
    if geom.log_scaling:
        assert float(np.asarray(tau).max()) > 1.2
        assert not np.array_equal(np.asarray(qs, np.float32), np.asarray(q, np.float32))
    assert got.dtype == want.dtype == dtype
    close(got, want, **TOL[dtype])
    assert np.abs(np.asarray(want, np.float32)).max() > 0.1
    if out is not None:
        close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(has_cuda_device(), reason="abstract CUDA lowering is for machines without a GPU")
def test_kernel_lowers_for_gpu(verify_triton_modules):
    """The kernel passes the Triton lowering for CUDA at the bench model's prefill shapes
    (default tiles, full and sliding layers) and its modules pass the MLIR verifier."""
    sds, bf, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    for window, hkv in ((None, 2), (512, 4)):
        args = (sds((8, 1024, 16, 128), bf), sds((8, 2048, hkv, 128), bf), sds((8, 2048, hkv, 128), bf),
                sds((8, 1024, 16, 1024), bf), sds((8, 1024), i32), sds((8, 2048), i32), sds((8, 2048), jnp.bool_))
        try:
            text = jax.jit(lambda *a, w=window: attn.attention(*a, window=w)).trace(*args).lower(
                lowering_platforms=("cuda",)).as_text()
        except (ImportError, NotImplementedError) as exc:
            pytest.skip(f"no Triton lowering here: {exc}")
        assert "xla.gpu.triton" in text
    assert len(verify_triton_modules) == 2

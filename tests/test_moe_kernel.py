"""The MoE kernels (`pallas_kernels.moe`) against their jnp references (`moe.ref`: what the CPU
serves), and the experts op of the Pallas `KernelOps` choosing among them: interpret mode on
CPU, the compiled Triton kernel on a GPU. Results match within float tolerance (the fp32
summation order differs from XLA's); gradients are the reference's VJP.

XLA:CPU compiles every jnp op called outside jit as its own program, so each test computes what
it compares (kernel, references, gradients) in one `jax.jit` (one compile per case, not one per
op), and builds its inputs with numpy."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import device_array, has_cuda_device

import inkling_jax as ik
import pallas_kernels as pk
from inkling_jax.model import moe as model_moe
from pallas_kernels.moe import grouped
from pallas_kernels.moe import pallas as moe
from pallas_kernels.moe import ref as moe_ref

INTERPRET = jax.default_backend() != "gpu"
E = 8
SMALL = dict(tf=32, bh=32)  # small tiles: several column tiles and splits on test shapes
GROUPED_SMALL = dict(bm=16, bn=16, bk=16)  # grouped GEMMs: several blocks, column tiles and k steps


def rand(rng, shape, dtype=jnp.float32, scale=1.0):
    return device_array(np.asarray(scale * rng.standard_normal(shape), np.float32), dtype)


def ref_matvec(x, idx, w):
    """y[i] = x[i] @ w[idx[i]] (w cast to x's dtype) in numpy: fp32 products and sums."""
    wi = np.asarray(w)[np.asarray(idx)].astype(x.dtype)
    return np.einsum("mh,mhf->mf", np.asarray(x, np.float32), np.asarray(wi, np.float32))


def with_id(idx, where, value):
    """idx with idx[where] = value, set in numpy (an eager .at[].set() is a scatter program)."""
    idx = np.array(idx)
    idx[where] = value
    return device_array(idx)


def close(a, b, rtol, atol):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=rtol, atol=atol)


# --------------------------------------------------------------------- grouped_matvec


@pytest.mark.parametrize("case", [
    # (x dtype, w dtype, h, F, idx, splits: None = auto, else h / 32 / splits blocks per program)
    (jnp.float32, jnp.float32, 256, 128, [0, E - 1, 0, E - 1], None),  # repeats, extreme ids
    (jnp.float32, jnp.float32, 256, 128, [0, E - 1, 0, E - 1], 2),
    (jnp.float32, jnp.float32, 128, 256, [3], 1),
    (jnp.bfloat16, jnp.bfloat16, 256, 128, [E - 1, 2, 0], 4),
    (jnp.bfloat16, jnp.float32, 128, 128, [5, 5, 0, E - 1], None),  # w cast to x's dtype in the kernel
])
def test_grouped_matvec(case):
    xd, wd, h, f, ids, splits = case
    rng = np.random.default_rng(len(ids) * 1000 + h + f + (splits or 0))
    m = len(ids)
    x, w = rand(rng, (m, h), xd), rand(rng, (E, h, f), wd)
    idx = device_array(ids, np.int32)
    y, want = jax.jit(lambda x, idx, w: (moe.grouped_matvec(x, idx, w, **SMALL, splits=splits, interpret=INTERPRET),
                                         moe_ref.grouped_matvec(x, idx, w)))(x, idx, w)
    assert y.shape == (m, f) and y.dtype == jnp.float32
    # bf16 x bf16 products are exact in fp32: only the fp32 summation order differs
    close(y, ref_matvec(x, idx, w), rtol=1e-5, atol=1e-4)
    close(y, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("x_repeat", [1, 3])
def test_grouped_matvec_x_repeat_and_clamp(dtype, x_repeat):
    """Row i reads x[i // x_repeat] in place and the kernel clamps the ids to [0, E) itself:
    bit for bit the kernel on jnp.repeat(x) with pre-clipped ids (the same products and sums),
    and the reference within the summation-order tolerance; out-of-range ids (-3, E, E + 5)
    read the clamped expert."""
    rng = np.random.default_rng(50 + x_repeat)
    mx, h, f = 2, 128, 64
    x, w = rand(rng, (mx, h), dtype), rand(rng, (E, h, f), dtype)
    ids = [-3, E, 2, E + 5, 0, E - 1][:mx * x_repeat] if x_repeat > 1 else [E + 5, -1]
    idx = device_array(ids, np.int32)
    x_rep = device_array(np.repeat(np.asarray(x), x_repeat, axis=0))
    clipped = device_array(np.clip(ids, 0, E - 1), np.int32)
    mv = lambda x, i, w, **kw: moe.grouped_matvec(x, i, w, **kw, **SMALL, interpret=INTERPRET)
    y, base, want = jax.jit(lambda x, idx, w, x_rep, clipped: (
        mv(x, idx, w, x_repeat=x_repeat), mv(x_rep, clipped, w), moe_ref.grouped_matvec(x, idx, w, x_repeat)))(
        x, idx, w, x_rep, clipped)
    assert y.shape == (mx * x_repeat, f) and y.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(y), np.asarray(base))
    close(y, ref_matvec(x_rep, clipped, w), rtol=1e-5, atol=1e-4)
    close(y, want, rtol=1e-5, atol=1e-4)
    # the jaxpr outside the kernel: no clamp of the ids, no repeat (broadcast) of x
    jaxpr = jax.make_jaxpr(lambda x, i, w: moe.grouped_matvec(x, i, w, x_repeat=x_repeat, **SMALL,
                                                               interpret=INTERPRET))(x, idx, w)
    outside = [e.primitive.name for e in jaxpr.jaxpr.eqns]
    assert "pallas_call" in str(jaxpr) and not {"clamp", "max", "min", "broadcast_in_dim"} & set(outside), outside


def test_grouped_matvec_defaults_and_loop():
    """The default tiling once (tf=128, bh=64: grid (2, 2, 4)), and the fori_loop block walk
    (h / bh / S = 32 blocks per program)."""
    rng = np.random.default_rng(7)
    x, w = rand(rng, (2, 256), jnp.bfloat16), rand(rng, (E, 256, 256), jnp.bfloat16)
    idx = device_array([E - 1, 0], np.int32)
    assert moe.grid_for(2, 256, 256) == (2, 2, 4)
    y = jax.jit(lambda *a: moe.grouped_matvec(*a, interpret=INTERPRET))(x, idx, w)
    close(y, ref_matvec(x, idx, w), rtol=1e-5, atol=1e-4)

    x, w = rand(rng, (2, 512)), rand(rng, (E, 512, 64))
    idx = device_array([1, 6], np.int32)
    assert moe.grid_for(2, 512, 64, tf=64, bh=16, splits=1) == (2, 1, 1)
    y = jax.jit(lambda *a: moe.grouped_matvec(*a, tf=64, bh=16, splits=1, interpret=INTERPRET))(x, idx, w)
    close(y, ref_matvec(x, idx, w), rtol=1e-5, atol=1e-4)


def test_partials_all_written():
    """Every (row, split, column) of the partial sums is written: interpret mode starts outputs
    as NaN, and m * F covers every tile of every program."""
    rng = np.random.default_rng(11)
    m, h, f = 3, 256, 256
    x, w = rand(rng, (m, h)), rand(rng, (E, h, f))
    idx = device_array([E - 1, 4, 0], np.int32)
    tf, bh, s = 32, 32, 4
    part = np.asarray(moe._partials(x, idx, w, tf, bh, s, 4, INTERPRET))
    assert part.shape == (m, s, f) and np.isfinite(part).all()
    xs, ws = np.asarray(x).reshape(m, s, h // s), np.asarray(w)[np.asarray(idx)].reshape(m, s, h // s, f)
    close(part, np.einsum("msh,mshf->msf", xs, ws), rtol=1e-5, atol=1e-4)


def test_plan_and_fallback():
    # the GPU shapes of the bench model (h 2048, expert width 1024, top-4): 512 programs each
    assert moe.grid_for(4, 2048, 2048) == (4, 16, 8)
    assert moe.grid_for(4, 1024, 2048) == (4, 16, 8)
    assert moe.grid_for(16, 2048, 2048) == (16, 16, 2)
    assert moe.grid_for(4, 2048, 24) is None  # F's power-of-two factor (8) below MIN_TILE
    with pytest.raises(ValueError):
        moe.grid_for(4, 256, 256, bh=32, splits=3)
    rng = np.random.default_rng(3)
    x, w = rand(rng, (2, 64)), rand(rng, (E, 64, 24))
    idx = device_array([0, E - 1], np.int32)
    y = jax.jit(lambda *a: moe.grouped_matvec(*a, interpret=INTERPRET))(x, idx, w)
    close(y, ref_matvec(x, idx, w), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------ moe_experts


def moe_inputs(rng, n, k, dtype, h=128, f=64):
    x = rand(rng, (n, h), dtype)
    idx = np.asarray(rng.choice(E, size=(n, k), replace=False) if n * k <= E else rng.integers(0, E, (n, k)),
                     np.int32).reshape(n, k)
    idx[0, 0] = E - 1
    if n * k > 1:
        idx[-1, -1] = 0
    idx = device_array(idx)
    weight = device_array(rng.uniform(0.1, 1.0, (n, k)), np.float32)
    w13 = rand(rng, (E, h, 2 * f), dtype, scale=h ** -0.5)
    w2 = rand(rng, (E, f, h), dtype, scale=f ** -0.5)
    return x, idx, weight, w13, w2


@pytest.fixture(autouse=True)
def true_float32_references():
    """The jnp references' float32 matmuls at full precision: on Hopper JAX's default float32
    dot is TF32 (~1e-3 relative), the kernel's products are exact float32."""
    with jax.default_matmul_precision("highest"):
        yield


@pytest.mark.parametrize("n,k", [(1, 1), (2, 2), (3, 4)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_moe_experts(n, k, dtype):
    rng = np.random.default_rng(100 * n + k + (dtype == jnp.bfloat16))
    args = moe_inputs(rng, n, k, dtype)
    # the kernel, the oracle (slices or dense, as the CPU serves it) and each jnp impl
    out, ref, *impls = jax.jit(lambda *a: (moe.moe_experts(*a, **SMALL, interpret=INTERPRET), moe_ref.moe_experts(*a),
                                           *(moe_ref.MOE_IMPLS[i](*a) for i in ("slices", "dense", "gather"))))(*args)
    assert out.shape == args[0].shape and out.dtype == dtype
    scale = float(np.abs(np.asarray(ref, np.float32)).max())
    if dtype == jnp.float32:
        tol = dict(rtol=1e-5, atol=1e-5 * scale)
    else:  # act / y / out are rounded to bf16: a rounding may land an ulp (2^-8) apart
        tol = dict(rtol=1e-2, atol=4e-3 * scale)
    close(out, ref, **tol)
    for impl in impls:
        close(out, impl, **tol)


def test_moe_experts_defaults_jit():
    """Default tiling, under jit with traced routing."""
    rng = np.random.default_rng(5)
    args = moe_inputs(rng, 2, 2, jnp.bfloat16, h=256, f=128)
    out, ref = jax.jit(lambda *a: (moe.moe_experts(*a, interpret=INTERPRET), moe_ref.moe_experts(*a)))(*args)
    scale = float(np.abs(np.asarray(ref, np.float32)).max())
    close(out, ref, rtol=1e-2, atol=4e-3 * scale)


@pytest.mark.parametrize("which", ["matvec", "grouped"])
def test_moe_experts_grad(which):
    """jax.grad through either MoE kernel is the reference's gradient (its VJP runs backward)."""
    rng = np.random.default_rng(9 if which == "matvec" else 29)
    if which == "matvec":
        x, idx, weight, w13, w2 = moe_inputs(rng, 2, 2, jnp.float32)
        kern = lambda *a: moe.moe_experts(*a, **SMALL, interpret=INTERPRET)
    else:
        x, idx, weight, w13, w2 = moe_inputs(rng, 9, 2, jnp.float32, h=64, f=32)
        kern = lambda *a: grouped.moe_experts_grouped(*a, **GROUPED_SMALL, interpret=INTERPRET)
    r = rand(rng, x.shape)

    def loss(fn):
        return lambda x, weight, w13, w2: jnp.sum(fn(x, idx, weight, w13, w2) * r)

    g, g_ref = jax.jit(lambda *a: (jax.grad(loss(kern), argnums=(0, 1, 2, 3))(*a),
                                   jax.grad(loss(moe_ref.moe_experts), argnums=(0, 1, 2, 3))(*a)))(x, weight, w13, w2)
    for a, b, name in zip(g, g_ref, ["x", "weight", "w13", "w2"]):
        assert np.abs(np.asarray(b)).max() > 0, name
        close(a, b, rtol=1e-6, atol=1e-6)


# ------------------------------------------------- routed + shared experts in one launch


def ulps(a, b, dtype):
    """|a - b| in units of the last place of b in `dtype` (bf16: 8 significant bits, fp32: 24)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    bits = 8 if dtype == jnp.bfloat16 else 24
    ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(b), 1e-30))) - (bits - 1))
    return float((np.abs(a - b) / ulp).max())


def extra_rows(x, idx, w, wx, x_repeat: int, group: int):
    """The joined kernel's product (`moe._partials` with w_extra, default plan at tf = bh = 32)
    summed over its splits: fp32 [n * group, F]."""
    tf, bh, s = moe._plan(x.shape[0] * x_repeat, x.shape[1], w.shape[2], 32, 32, None, 512)
    return jnp.sum(moe._partials(x, idx, w, tf, bh, s, 4, INTERPRET, x_repeat, wx, group), axis=1)


def test_grouped_matvec_extra_rows():
    """The joined kernel's rows (token t: its k routed choices, then the S experts of w_extra),
    x read in place for the group and out-of-range routed ids clamped into w (never into
    w_extra): the reference within the summation-order tolerance."""
    rng = np.random.default_rng(60)
    n, k, s_, h, f = 2, 3, 2, 128, 64
    g = k + s_
    x, w, wx = rand(rng, (n, h)), rand(rng, (E, h, f)), rand(rng, (s_, h, f))
    idx = device_array([E + 2, -1, 4, 0, E - 1, 7], np.int32)
    # the kernel's rows and the reference's, one program per x_repeat
    both = jax.jit(lambda x, idx, w, wx, x_repeat: (extra_rows(x, idx, w, wx, x_repeat, g),
                                                    moe_ref.grouped_matvec_extra(x, idx, w, wx, x_repeat, g)),
                   static_argnums=4)
    y, want = both(x, idx, w, wx, g)
    assert y.shape == (n * g, f)
    close(y, want, rtol=1e-5, atol=1e-4)
    ids = np.clip(np.asarray(idx).reshape(n, k), 0, E - 1)
    xn, wn, want = np.asarray(x), np.asarray(w), np.asarray(want)
    rows = [xn[t] @ wn[e] for t in range(n) for e in ids[t]]
    close(want.reshape(n, g, f)[:, :k].reshape(-1, f), np.stack(rows), rtol=1e-5, atol=1e-4)
    close(want.reshape(n, g, f)[:, k:], np.einsum("nh,shf->nsf", xn, np.asarray(wx)), rtol=1e-5, atol=1e-4)
    # x_repeat = 1 (the down product): one row of x per row
    xa = rand(rng, (n * g, h))
    y, want = both(xa, idx, w, wx, 1)
    close(y, want, rtol=1e-5, atol=1e-4)


# (tokens, top-k, shared experts, gated, dtype): each shape once, both dtypes gated and not
@pytest.mark.parametrize("n,k,s_,gated,dtype", [
    (1, 2, 1, True, jnp.float32), (3, 4, 3, True, jnp.float32), (2, 3, 2, False, jnp.float32),
    (4, 2, 2, True, jnp.bfloat16), (1, 4, 2, False, jnp.bfloat16)], ids=["f32-1", "f32-3", "f32-2", "bf16-4", "bf16-1"])
def test_moe_experts_with_shared(n, k, s_, gated, dtype):
    """The joined routed + shared experts against the separate kernels (moe_experts, the shared
    experts' grouped mat-vec, the add): the routed rows take moe_experts' own splits (bit for
    bit); the shared rows' fp32 sums may split differently, so bf16 within 1 ulp, fp32 within
    1e-5 relative (measured here: bf16 within 1 ulp of the largest term, mostly equal; fp32 max
    abs ~1e-6); and against the jnp experts (`ref.experts`, what the CPU serves) within the
    routed kernel's tolerance."""
    rng = np.random.default_rng(1000 * n + 100 * k + 10 * s_ + gated + (dtype == jnp.bfloat16))
    x, idx, weight, w13, w2 = moe_inputs(rng, n, k, dtype)
    if k > 2:  # out of range: clamped to E - 1 (as moe_experts)
        idx = with_id(idx, (0, -1), E + 3)
    sw13 = rand(rng, (s_,) + w13.shape[1:], dtype, scale=w13.shape[1] ** -0.5)
    sw2 = rand(rng, (s_,) + w2.shape[1:], dtype, scale=w2.shape[1] ** -0.5)
    gamma = device_array(rng.uniform(0.1, 1.0, (n, s_)), np.float32)

    def run(x, idx, weight, w13, w2, sw13, sw2, gamma):  # the joined kernel, the oracle, the separate kernels
        args = (x, idx, weight, w13, w2, sw13, sw2, gamma)
        out = moe.moe_experts_with_shared(*args, gated=gated, **SMALL, interpret=INTERPRET)
        want = moe_ref.experts(*args, gated=gated)
        # the separate kernels: the routed kernel, the shared experts through the grouped mat-vec, the add
        routed = moe.moe_experts(x, idx, weight, w13, w2, **SMALL, interpret=INTERPRET)
        sid = jnp.tile(jnp.arange(s_, dtype=jnp.int32), n)
        mv = lambda *a, **kw: moe.grouped_matvec(*a, **kw, **SMALL, interpret=INTERPRET)
        gu = mv(x, sid, sw13, x_repeat=s_)
        act = jax.nn.silu(gu[:, :gu.shape[1] // 2]) * gu[:, gu.shape[1] // 2:]
        act = act * gamma.reshape(-1, 1) if gated else act
        y = mv(act.astype(dtype), sid, sw2).astype(dtype).astype(jnp.float32).reshape(n, s_, -1).sum(axis=1)
        return out, want, (routed.astype(jnp.float32) + y).astype(dtype)

    out, want, today = jax.jit(run)(x, idx, weight, w13, w2, sw13, sw2, gamma)
    assert out.shape == x.shape and out.dtype == dtype
    scale = float(np.abs(np.asarray(want, np.float32)).max())
    if dtype == jnp.bfloat16:
        assert ulps(out, today, dtype) <= 1
        close(out, want, rtol=1e-2, atol=4e-3 * scale)
    else:
        for other in (want, today):
            close(out, other, rtol=1e-5, atol=1e-5 * scale)


def test_moe_experts_with_shared_grad_and_fallback():
    """Backward: the reference's VJP; shapes the kernel cannot tile: the reference itself."""
    rng = np.random.default_rng(70)
    x, idx, weight, w13, w2 = moe_inputs(rng, 2, 2, jnp.float32)
    sw13, sw2 = rand(rng, (2,) + w13.shape[1:], scale=0.1), rand(rng, (2,) + w2.shape[1:], scale=0.1)
    gamma = device_array(rng.uniform(0.1, 1.0, (2, 2)), np.float32)
    r = rand(rng, x.shape)
    kern = lambda *a: moe.moe_experts_with_shared(*a, gated=True, **SMALL, interpret=INTERPRET)
    refn = lambda *a: moe_ref.experts(*a, gated=True)
    loss = lambda fn: lambda x, weight, sw13, gamma: jnp.sum(fn(x, idx, weight, w13, w2, sw13, sw2, gamma) * r)
    g, g_ref = jax.jit(lambda *a: (jax.grad(loss(kern), argnums=(0, 1, 2, 3))(*a),
                                   jax.grad(loss(refn), argnums=(0, 1, 2, 3))(*a)))(x, weight, sw13, gamma)
    for a, b in zip(g, g_ref):
        assert np.abs(np.asarray(b)).max() > 0
        close(a, b, rtol=1e-6, atol=1e-6)
    x, idx, weight, w13, w2, sw13, sw2, gamma = map(np.asarray, (x, idx, weight, w13, w2, sw13, sw2, gamma))
    narrow = (x, idx, weight, w13[:, :, :24], w2[:, :12], sw13[:, :, :24], sw2[:, :12], gamma)
    # each its own program, as eager calls were: bit for bit
    np.testing.assert_array_equal(np.asarray(jax.jit(kern)(*narrow)), np.asarray(jax.jit(refn)(*narrow)))


def spied_ops(monkeypatch, calls: list, **kernels):
    """The Pallas ops (interpret mode on CPU) with each named `pallas_kernels.moe.pallas` kernel
    recording (name, its first argument's rows) when a call traces it."""
    for name, module in kernels.items():
        real = getattr(module, name)

        def spy(*a, real=real, name=name, **kw):
            calls.append((name, a[0].shape[0]))
            return real(*a, **kw)
        monkeypatch.setattr(module, name, spy)
    return pk.ops.pallas_ops(INTERPRET)


def moe_layer(cfg, seed, dtype):
    p = ik.init_params(cfg, jax.random.key(seed))["layers"][cfg.dense_layer_ids[-1] + 1]["mlp"]
    return jax.tree.map(lambda a: device_array(a, dtype) if a.dtype == jnp.bfloat16 else a, p)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_experts_op_joins_the_few_token_kernels(monkeypatch, dtype):
    """The Pallas experts op hands a few tokens' routed and shared experts to the joined kernel
    (one call) on a single device: the separate kernels' result (what a mesh, shared_mask
    given, runs; bf16 within 1 ulp); 8 tokens: neither (dense routed experts, einsum shared)."""
    cfg = ik.InklingConfig.tiny(n_routed_experts=16)
    p = moe_layer(cfg, 2, dtype)
    x = rand(np.random.default_rng(80), (2, cfg.hidden_size), dtype)
    calls = []
    ops = spied_ops(monkeypatch, calls, moe_experts_with_shared=moe, moe_experts=moe)

    # the route and the experts op in one program (jitted afresh: its trace calls the spies)
    def experts(p, x, **kw):
        idx, w, gamma = model_moe.route(p, cfg, x, ops)
        args = (x, idx, w, p["w13"], p["w2"], p["shared_w13"], p["shared_w2"], gamma)
        return ops.experts(*args, gated=True, num_experts=16, **kw)

    got = jax.jit(experts)(p, x)
    assert calls == [("moe_experts_with_shared", 2)]
    want = jax.jit(partial(experts, shared_mask=lambda s: s))(p, x)
    assert calls[1:] == [("moe_experts", 2)]
    if dtype == jnp.bfloat16:
        assert ulps(got, want, dtype) <= 1
    else:
        close(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(np.asarray(want)).max()))
    mlp = jax.jit(lambda p, x: model_moe.moe_mlp(p, cfg, x, ops))
    np.testing.assert_array_equal(np.asarray(mlp(p, x)), np.asarray(got))
    calls.clear()
    mlp(p, np.ones((8, cfg.hidden_size), dtype))
    assert calls == []


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_lone_row_matmul_takes_the_matvec_kernel_without_ids(monkeypatch, dtype):
    """The Pallas matmul op (the attention projections) runs a lone row, whatever its leading
    shape, through `moe.matvec` (the mat-vec kernel with no expert-id input): grouped_matvec
    with id 0 bit for bit (the same plan and sums). Two rows or more: the jnp product itself,
    bit for bit."""
    rng = np.random.default_rng(81)
    h, f = 64, 192
    w = rand(rng, (h, f), dtype, 0.2)
    calls = []
    spied_ops(monkeypatch, calls, matvec=moe)
    zero = jnp.zeros((1,), jnp.int32)
    for shape in [(1, h), (1, 1, h)]:
        ops = pk.ops.pallas_ops(INTERPRET)  # fresh jits: each shape traces the spied kernel again
        x = rand(rng, shape, dtype)
        mm, grouped = jax.jit(lambda x, w: (
            ops.matmul(x, w), moe.grouped_matvec(x.reshape(1, -1), zero, w[None], interpret=INTERPRET)))(x, w)
        assert calls == [("matvec", 1)] and mm.shape == (*shape[:-1], f) and mm.dtype == jnp.float32
        calls.clear()
        np.testing.assert_array_equal(np.asarray(mm.reshape(1, -1)), np.asarray(grouped))
    x = rand(rng, (2, 1, h), dtype)
    mm = jax.jit(ops.matmul)(x, w)
    assert calls == []
    np.testing.assert_array_equal(np.asarray(mm), np.asarray(pk._common.matmul(x, w)))


def test_matvec_kernel_falls_back_and_differentiates():
    """matvec on a shape the kernel cannot tile (a 24-wide output: pow2 factor 8 < MIN_TILE)
    returns the reference's values; on one it tiles, its gradients are the reference's VJP."""
    rng = np.random.default_rng(82)
    x, w, w64 = (rand(rng, s, jnp.float32, 0.3) for s in [(1, 64), (64, 24), (64, 64)])
    got, want = jax.jit(lambda x, w: (moe.matvec(x, w, interpret=INTERPRET), pk._common.matmul(x, w)))(x, w)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    loss = lambda fn: (lambda x, w: jnp.sum(fn(x, w) ** 2))  # noqa: E731
    kernel = partial(moe.matvec, interpret=INTERPRET)
    g_kernel, g_ref = jax.jit(lambda *a: (jax.grad(loss(kernel), (0, 1))(*a),
                                          jax.grad(loss(pk._common.matmul), (0, 1))(*a)))(x, w64)
    for a, b in zip(g_kernel, g_ref):
        close(a, b, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------- GPU lowering


@pytest.mark.skipif(has_cuda_device(),
                    reason="abstract CUDA lowering is for machines without a GPU; the compiled tests cover a GPU")
def test_moe_lowers_for_gpu(verify_triton_modules):
    """The kernel passes the Triton lowering for CUDA at the bench model's shapes (bf16 and
    fp32 weights, the unrolled and the fori_loop block walk, a w over 4 GiB with 64-bit
    offsets); runs on CPU and compiles nothing."""
    sds = jax.ShapeDtypeStruct
    bf, i32 = jnp.bfloat16, jnp.int32

    def lower(fn, *args):
        try:
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        except (ImportError, NotImplementedError) as exc:  # a jaxlib without the Triton dialect
            pytest.skip(f"no Triton lowering here: {exc}")
        assert "xla.gpu.triton" in text

    for n, wd in [(1, bf), (4, jnp.float32)]:
        lower(lambda *a: moe.moe_experts(*a), sds((n, 2048), bf), sds((n, 4), i32), sds((n, 4), jnp.float32),
              sds((32, 2048, 2048), wd), sds((32, 1024, 2048), bf))
    lower(lambda x, i, w: moe.grouped_matvec(x, i, w, splits=1), sds((4, 6144), bf), sds((4,), i32),
          sds((256, 6144, 2048), bf))
    # the bench model's routed + shared experts in one launch per product (1 and 4 tokens; the
    # down product's act prologue with and without the sink gamma)
    for n, gated in ((1, True), (4, True), (1, False)):
        lower(lambda *a: moe.moe_experts_with_shared(*a, gated=gated), sds((n, 2048), bf), sds((n, 4), i32),
              sds((n, 4), jnp.float32), sds((32, 2048, 2048), bf), sds((32, 1024, 2048), bf),
              sds((2, 2048, 2048), bf), sds((2, 1024, 2048), bf), sds((n, 2), jnp.float32))
    # the bench model's shared experts: one token's row read for its S = 2 experts in place
    lower(lambda x, i, w: moe.grouped_matvec(x, i, w, x_repeat=2), sds((1, 2048), bf), sds((2,), i32),
          sds((2, 2048, 2048), bf))
    # one token's wqkvr projection (`ops.matmul`): no expert ids
    lower(lambda x, w: moe.matvec(x, w), sds((1, 2048), bf), sds((2048, 3328), bf))


# ------------------------------------------------------------ many tokens: grouped GEMMs


def test_dispatch_layout():
    """Every choice gets its own padded row; a block's rows all belong to its expert; the
    static block count bounds any routing (all choices on one expert, every expert used)."""
    rng = np.random.default_rng(11)
    dispatch = jax.jit(grouped.dispatch, static_argnums=(1, 2))  # one compile per shape, not per op
    for n, k, e, bm in [(37, 4, 8, 16), (5, 2, 8, 16), (64, 1, 4, 16), (9, 3, 8, 4)]:
        for idx in [rng.integers(0, e, (n, k)), np.zeros((n, k), int), np.arange(n * k).reshape(n, k) % e]:
            d = dispatch(device_array(idx, np.int32), e, bm)
            rows = np.asarray(d.row_of_choice)
            be = np.asarray(d.block_expert)
            cor = np.asarray(d.choice_of_row)
            assert len(be) == grouped.num_blocks(n * k, e, bm) and len(cor) == len(be) * bm
            assert len(set(rows.tolist())) == n * k  # distinct rows
            flat = idx.reshape(-1)
            assert (be[rows // bm] == flat).all()  # the row's block is its expert's
            assert (cor[rows] == np.arange(n * k) // k).all()  # the row reads its token
            assert (cor[np.setdiff1d(np.arange(len(cor)), rows)] == n).all()  # others: the zero row
            live = int((be >= 0).sum())  # blocks of the experts' runs, then the unused ones (-1)
            assert (be[:live] >= 0).all() and (be[live:] == -1).all() and (np.diff(be[:live]) >= 0).all()
            assert live == sum(-(-c // bm) for c in np.bincount(flat, minlength=e))  # each run padded to bm


@pytest.mark.parametrize("n,k", [(1, 1), (7, 2), (40, 4)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_moe_experts_grouped(n, k, dtype):
    rng = np.random.default_rng(300 + 10 * n + k + (dtype == jnp.bfloat16))
    args = moe_inputs(rng, n, k, dtype, h=64, f=32)
    out, ref, ref_served = jax.jit(lambda *a: (grouped.moe_experts_grouped(*a, **GROUPED_SMALL, interpret=INTERPRET),
                                               moe_ref.moe_experts_dense(*a), moe_ref.moe_experts(*a)))(*args)
    assert out.shape == args[0].shape and out.dtype == dtype
    scale = float(np.abs(np.asarray(ref, np.float32)).max())
    assert scale > 0
    tol = dict(rtol=1e-5, atol=1e-5 * scale) if dtype == jnp.float32 else dict(rtol=1e-2, atol=4e-3 * scale)
    close(out, ref, **tol)
    close(out, ref_served, **tol)


def test_moe_experts_grouped_one_expert_and_defaults():
    """Every token on one expert (the longest run), under jit, default tiles falling back to
    the reference where the test shapes are too narrow; w in fp32 cast to x's dtype."""
    rng = np.random.default_rng(21)
    x, idx, weight, w13, w2 = moe_inputs(rng, 33, 2, jnp.bfloat16, h=64, f=32)
    idx = device_array(np.full(idx.shape, 3, np.int32))
    w13f, w2f = device_array(w13, np.float32), device_array(w2, np.float32)
    fn = jax.jit(lambda *a: (grouped.moe_experts_grouped(*a, **GROUPED_SMALL, interpret=INTERPRET),
                             moe_ref.moe_experts_dense(*a)))
    out, ref = fn(x, idx, weight, w13f, w2f)
    scale = float(np.abs(np.asarray(ref, np.float32)).max())
    close(out, ref, rtol=1e-2, atol=4e-3 * scale)
    xn, idxn, weightn, w13n, w2n = map(np.asarray, (x, idx, weight, w13, w2))
    narrow = (xn, idxn, weightn, w13n[:, :, :24], w2n[:, :12])
    # each its own program, as eager calls were: bit for bit
    got = jax.jit(lambda *a: grouped.moe_experts_grouped(*a, interpret=INTERPRET))(*narrow)
    close(got, jax.jit(moe_ref.moe_experts)(*narrow), rtol=0, atol=0)
    with pytest.raises(ValueError):
        grouped.moe_experts_grouped(x, idx, weight, w13, w2, bm=24)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_moe_experts_ragged(dtype):
    """moe.ref.moe_experts_ragged (jax.lax.ragged_dot over the choices sorted by expert, an
    experts impl that computes only the chosen experts) is moe_experts_dense within the fp32
    products' summation order: fp32 1e-5 relative, bf16 within an ulp; an out-of-range id is
    clipped as dense clips it; jax.grad through it is dense's gradient (fp32, ids in range:
    dense's gather drops an out-of-range id's gradient)."""
    rng = np.random.default_rng(40 + (dtype == jnp.bfloat16))
    x, idx, weight, w13, w2 = moe_inputs(rng, 40, 4, dtype, h=64, f=32)
    ragged, dense = jax.jit(moe_ref.moe_experts_ragged), jax.jit(moe_ref.moe_experts_dense)
    out_of_range = with_id(idx, (1, 2), E + 2)
    out, ref = ragged(x, out_of_range, weight, w13, w2), dense(x, out_of_range, weight, w13, w2)
    assert out.shape == x.shape and out.dtype == dtype
    scale = float(np.abs(np.asarray(ref, np.float32)).max())
    if dtype == jnp.bfloat16:
        assert ulps(out, ref, dtype) <= 1
        return
    close(out, ref, rtol=1e-5, atol=1e-5 * scale)
    r = rand(rng, x.shape)
    loss = lambda fn: lambda *a: jnp.sum(fn(*a) * r)
    g = jax.jit(jax.grad(loss(moe_ref.moe_experts_ragged), argnums=(0, 2, 3, 4)))(x, idx, weight, w13, w2)
    g_ref = jax.jit(jax.grad(loss(moe_ref.moe_experts_dense), argnums=(0, 2, 3, 4)))(x, idx, weight, w13, w2)
    for a, b in zip(g, g_ref):
        assert np.abs(np.asarray(b)).max() > 0
        close(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(np.asarray(b)).max()))


def routing(n, k, e, seed=0):
    rng = np.random.default_rng(seed)
    return (device_array(rng.integers(0, e, (n, k)), np.int32), device_array(rng.uniform(0.1, 1.0, (n, k)), np.float32))


def test_experts_op_picks_grouped_for_many_tokens():
    """The Pallas experts op hands many tokens (n * k >= GROUPED_MIN_CHOICES_PER_EXPERT * E,
    E the router's: `num_experts`) to the many-token kernel, fewer to dense."""
    calls = []

    def spy(*a):
        calls.append(a[0].shape[0])
        return moe_ref.moe_experts_dense(*a)

    ops = pk.ops.pallas_ops(INTERPRET, many_token_experts=spy)
    e, k, h, f = 4, 2, 16, 8
    w13, w2 = np.zeros((e, h, 2 * f), np.float32), np.zeros((e, f, h), np.float32)
    need = pk.ops.GROUPED_MIN_CHOICES_PER_EXPERT * e // k

    def experts(n, **kw):  # one program per call (jitted afresh: its trace calls the spy)
        return jax.jit(lambda *a: ops.experts(*a, **kw))(np.ones((n, h), np.float32), *routing(n, k, e), w13, w2)

    for n in (need - 1, need):
        experts(n)
    assert calls == [need]
    calls.clear()
    experts(need, num_experts=2 * e)  # a mesh of 2 ep shards
    experts(2 * need, num_experts=2 * e)
    assert calls == [2 * need]


def test_experts_op_picks_the_few_token_kernel_up_to_a_third_of_the_experts(monkeypatch):
    """The Pallas experts op hands n * k <= E / 3 choices to the grouped mat-vec kernel (it reads
    one expert per choice), more to dense (every expert once); the jnp experts keep their own
    bound for one slice per choice (3 n k <= E)."""
    e, k, h, f = 16, 2, 64, 32  # wide enough for the kernel's tiles (narrower: it runs the reference)
    calls = []

    def spy(name, fn):
        def call(*a):
            calls.append((name, a[0].shape[0]))
            return fn(*a)
        return call

    monkeypatch.setattr(moe_ref, "MOE_IMPLS", {"slices": spy("slices", moe_ref.moe_experts_slices),
                                               "dense": spy("dense", moe_ref.moe_experts_dense)})
    ops = spied_ops(monkeypatch, calls, moe_experts=moe)
    w13, w2 = np.zeros((e, h, 2 * f), np.float32), np.zeros((e, f, h), np.float32)
    for n in (1, 2, 3, 4, 5):
        x, idx_w = np.ones((n, h), np.float32), routing(n, k, e)
        # one program per n, jitted afresh: its trace calls the spies, the op's first
        jax.jit(lambda *a: (ops.experts(*a), pk.REFERENCE_OPS.experts(*a)))(x, *idx_w, w13, w2)
    assert calls == [("moe_experts", 1), ("slices", 1), ("moe_experts", 2), ("slices", 2), ("dense", 3),
                     ("dense", 3), ("dense", 4), ("dense", 4), ("dense", 5), ("dense", 5)]


@pytest.mark.skipif(has_cuda_device(), reason="abstract CUDA lowering is for machines without a GPU")
def test_grouped_lowers_for_gpu(verify_triton_modules):
    """The grouped GEMMs pass the Triton lowering for CUDA at the bench model's shapes, and
    their modules pass the MLIR verifier."""
    sds = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    try:
        text = jax.jit(grouped.moe_experts_grouped).trace(
            sds((4096, 2048), bf), sds((4096, 4), jnp.int32), sds((4096, 4), jnp.float32),
            sds((32, 2048, 2048), bf), sds((32, 1024, 2048), bf)).lower(lowering_platforms=("cuda",)).as_text()
    except (ImportError, NotImplementedError) as exc:
        pytest.skip(f"no Triton lowering here: {exc}")
    assert text.count("xla.gpu.triton") >= 2 and len(verify_triton_modules) >= 2


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_shared_experts_through_the_matvec_kernel(monkeypatch, n, dtype):
    """ref.shared_experts with the grouped mat-vec kernel (token t through shared expert s as
    row t * S + s, gamma applied before the down projection, each expert's output rounded before
    the fp32 sum) equals the batched-einsum path; where the routed experts take separate calls
    (a mesh: shared_mask given) the experts op hands it the kernel exactly when the routed
    experts take the few-token kernel."""
    cfg = ik.InklingConfig.tiny(n_routed_experts=16)  # few-token experts (n k <= E / 3) up to n = 2
    assert cfg.shared_expert_sink and cfg.norm_after_topk
    p = moe_layer(cfg, 1, dtype)
    rng = np.random.default_rng(40 + n)
    x = rand(rng, (n, cfg.hidden_size), dtype)
    gamma = device_array(rng.uniform(0.1, 1.0, (n, cfg.n_shared_experts)), np.float32)
    matvec = lambda *a, **kw: moe.grouped_matvec(*a, **kw, **SMALL, interpret=INTERPRET)
    shared = (p["shared_w13"], p["shared_w2"])
    got, want = jax.jit(lambda *a: (moe_ref.shared_experts(*a, gated=True, matvec=matvec),
                                    moe_ref.shared_experts(*a, gated=True)))(x, gamma, *shared)
    assert got.shape == (n, cfg.hidden_size) and got.dtype == jnp.float32
    scale = float(np.abs(np.asarray(want)).max())
    tol = dict(rtol=1e-5, atol=1e-5 * scale) if dtype == jnp.float32 else dict(rtol=1e-2, atol=1e-2 * scale)
    close(got, want, **tol)

    calls = []
    ops = spied_ops(monkeypatch, calls, grouped_matvec=moe)
    mesh = dict(gated=True, shared_mask=lambda s: s)
    idx_w = routing(n, cfg.num_experts_per_tok, cfg.n_routed_experts)
    # the op and the jnp experts in one program (jitted afresh: its trace calls the spies)
    got_op, want_op = jax.jit(lambda *a: (ops.experts(*a, **mesh), pk.REFERENCE_OPS.experts(*a, **mesh)))(
        x, *idx_w, p["w13"], p["w2"], *shared, gamma)
    s_ = cfg.n_shared_experts  # w13 (x's n rows read in place for their S experts each) and w2
    assert calls == [("grouped_matvec", n), ("grouped_matvec", n * s_)]
    close(got_op, want_op, **tol)
    calls.clear()
    jax.jit(lambda *a: ops.experts(*a, **mesh))(np.ones((8, cfg.hidden_size), dtype), *routing(8, 2, 16), p["w13"],
                                                p["w2"], *shared, np.ones((8, 2), np.float32))
    assert calls == []  # 8 tokens: the dense routed experts, the einsum shared experts

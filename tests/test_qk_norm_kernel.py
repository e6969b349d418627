"""`pallas_kernels.norm.pallas.qk_norm` (the attention block's per-head q and k RMSNorms in one
launch) against its reference, `norm.ref.qk_norm` (= `layers.rms_norm` per head).

Interpret mode (CPU): bit for bit in fp32 and bf16, head counts that are powers of two or not
(masked heads), q read in place from a wider fused row. Compiled on a GPU the mean's sum over
head_dim runs in Triton's order: the formula with GPU-like sum orders is checked on CPU within
4 fp32 ulps / 1 bf16 ulp (`test_gpu_sum_order`), and the compiled kernel within the same bound.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.extend  # jax.extend.core below: a submodule `import jax` does not load
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import device_array, has_cuda_device, rms_norm_with_gpu_sum
from conftest import row_ulps as ulps

import inkling_jax as ik
import pallas_kernels as pk
from inkling_jax.config import InklingConfig
from inkling_jax.model import layers
from pallas_kernels.norm import pallas as pnorm
from pallas_kernels.norm import ref as rnorm

INTERPRET = jax.default_backend() != "gpu"
EPS = 1e-6
MAX_ULPS = {jnp.float32: 4.0, jnp.bfloat16: 1.0}  # compiled (GPU) bound: see test_gpu_sum_order


def inputs(rng, t: int, nh: int, nkv: int, hd: int, dtype, q_extra: int = 0):
    q = device_array(3 * rng.standard_normal((t, nh * hd + q_extra)), dtype)
    kv = device_array(rng.standard_normal((t, 2 * nkv * hd)), dtype)
    wq = device_array(1 + 0.2 * rng.standard_normal((hd,)), dtype)
    wk = device_array(1 + 0.2 * rng.standard_normal((hd,)), dtype)
    return q, kv, wq, wk


@partial(jax.jit, static_argnames=("op", "nh", "nkv", "hd", "kw"))
def _qk_norm(q, kv, wq, wk, *, op, nh, nkv, hd, kw=()):
    return op(q, kv, wq, wk, num_heads=nh, num_kv_heads=nkv, head_dim=hd, eps=EPS, **dict(kw))


def call(op, nh, nkv, hd, **kw):
    """op jitted at these heads: one module-level jax.jit, so one compile per op, heads and shapes."""
    return partial(_qk_norm, op=op, nh=nh, nkv=nkv, hd=hd, kw=tuple(sorted(kw.items())))


rms_norm = jax.jit(layers.rms_norm, static_argnums=2)


def kernel_names(fn, *args) -> list:
    """The names of the pallas_calls fn traces (sub-jaxprs included: the custom_vjp, the jits)."""
    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "pallas_call":
                yield e.params.get("name")
                continue
            for v in e.params.values():
                for sub in v if isinstance(v, (list, tuple)) else [v]:
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        yield from walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        yield from walk(sub)
    return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


def assert_close(got, want, dtype, what: str) -> None:
    """Bit for bit in interpret mode; compiled, within MAX_ULPS."""
    assert got.dtype == want.dtype == dtype and got.shape == want.shape, what
    if INTERPRET:
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32), err_msg=what)
    else:
        assert ulps(got, want) <= MAX_ULPS[dtype], what


def test_ref_is_the_layers_norm():
    """The reference is `layers.rms_norm` per head, as attention_block applies it."""
    rng = np.random.RandomState(0)
    for dt in (jnp.float32, jnp.bfloat16):
        q, kv, wq, wk = inputs(rng, 3, 4, 2, 16, dt)
        qn, kn = call(rnorm.qk_norm, 4, 2, 16)(q, kv, wq, wk)
        # the heads split on the host (reshaping or slicing a device array compiles)
        want_q = rms_norm(device_array(np.asarray(q).reshape(3, 4, 16)), wq, EPS)
        want_k = rms_norm(device_array(np.asarray(kv)[:, :32].reshape(3, 2, 16)), wk, EPS)
        np.testing.assert_array_equal(np.asarray(qn, np.float32), np.asarray(want_q, np.float32))
        np.testing.assert_array_equal(np.asarray(kn, np.float32), np.asarray(want_k, np.float32))


# (tokens T, q heads, k heads, head_dim, extra q columns: q read in place from a wider row)
SHAPES = {
    "decode-1": (1, 4, 2, 16, 0),
    "bench-heads-1": (1, 16, 4, 128, 0),
    "fused-row-3": (3, 4, 2, 16, 40),  # q = the first 64 columns of a fused q|k|v|r row
    "odd-heads-2": (2, 3, 1, 16, 8),  # 3 q heads: a [4, hd] tile with the 4th head masked
    "verify-5": (5, 8, 2, 32, 0),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", list(SHAPES))
def test_matches_reference(case, dtype):
    t, nh, nkv, hd, extra = SHAPES[case]
    rng = np.random.RandomState(sum(map(ord, case)))
    q, kv, wq, wk = inputs(rng, t, nh, nkv, hd, dtype, extra)
    kern = call(pnorm.qk_norm, nh, nkv, hd, interpret=INTERPRET)
    assert kernel_names(kern, q, kv, wq, wk) == ["qk_norm"]
    got = kern(q, kv, wq, wk)
    want = call(rnorm.qk_norm, nh, nkv, hd)(q, kv, wq, wk)
    assert_close(got[0], want[0], dtype, f"{case} q")
    assert_close(got[1], want[1], dtype, f"{case} k")


def test_fallback_is_the_reference():
    """head_dim 24 (not a power of two: no Triton block) runs the reference: same result, no kernel."""
    rng = np.random.RandomState(3)
    q, kv, wq, wk = inputs(rng, 3, 2, 1, 24, jnp.float32)
    kern = call(pnorm.qk_norm, 2, 1, 24, interpret=INTERPRET)
    assert kernel_names(kern, q, kv, wq, wk) == []
    got, want = kern(q, kv, wq, wk), call(rnorm.qk_norm, 2, 1, 24)(q, kv, wq, wk)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gpu_sum_order(dtype):
    """The compiled kernel's only difference: the mean's sum over head_dim in Triton's order.
    The formula with that sum taken in GPU-like orders (`sum_in_gpu_order`: a pairwise tree, or
    32 / 8 strided partial sums then a tree) against the reference on 128-wide heads at three
    scales: within 4 fp32 ulps / 1 bf16 ulp of each head's largest |value|."""
    rng = np.random.RandomState(9)
    worst = 0.0
    for scale in (1e-3, 1.0, 300.0):
        x = device_array(scale * rng.standard_normal((64, 128)), dtype)
        w = device_array(1 + 0.2 * rng.standard_normal((128,)), dtype)
        # eager, not jitted: op by op each intermediate is rounded to dtype, as the formulas ask
        # (a jitted program may keep bf16 intermediates in fp32); few compiles, shared by shape
        want = rnorm.rms_norm(x, w, EPS)
        for threads in (128, 32, 8):
            worst = max(worst, ulps(rms_norm_with_gpu_sum(x, w, EPS, threads), want))
    assert worst <= MAX_ULPS[dtype], worst


def test_gradients_match_reference():
    """The backward pass is the reference's VJP (custom_vjp): zeros for q's columns past its heads."""
    rng = np.random.RandomState(5)
    q, kv, wq, wk = inputs(rng, 2, 4, 2, 16, jnp.float32, q_extra=16)
    probes = [device_array(rng.standard_normal(s), np.float32) for s in ((2, 4, 16), (2, 2, 16))]

    def grads(op, **kw):
        def loss(*args):
            outs = op(*args, num_heads=4, num_kv_heads=2, head_dim=16, eps=EPS, **kw)
            return sum(jnp.sum(o * p) for o, p in zip(outs, probes))
        return jax.grad(loss, argnums=(0, 1, 2, 3))

    # both gradients in one jitted program: one compile, not two
    got, want = jax.jit(lambda *a: (grads(pnorm.qk_norm, interpret=INTERPRET)(*a), grads(rnorm.qk_norm)(*a)))(
        q, kv, wq, wk)
    for i, (g, r) in enumerate(zip(got, want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6, atol=1e-6, err_msg=f"grad {i}")


def test_ops_wiring():
    assert pk.REFERENCE_OPS.qk_norm is rnorm.qk_norm
    assert pk.conv_ops(True, interpret=True).qk_norm is not rnorm.qk_norm


@pytest.mark.skipif(has_cuda_device(), reason="abstract CUDA lowering is for machines without a GPU")
def test_lowers_for_gpu(verify_triton_modules):
    """The kernel passes the Triton lowering for CUDA at the bench model's heads (16 q heads of
    128 read from the fused q|k|v|r row; 2 or 4 k heads from the k|v conv output), bf16, at 1
    and 32 tokens, and with padded heads (3 q heads)."""
    cfg = InklingConfig.bench()
    sds = jax.ShapeDtypeStruct
    hd = cfg.head_dim
    for nh, nkv in [(cfg.num_heads, cfg.num_kv_heads), (cfg.swa_num_heads, cfg.swa_num_kv_heads), (3, 1)]:
        for t in (1, 32):
            args = (sds((t, nh * hd + 2 * nkv * hd + nh * cfg.d_rel), jnp.bfloat16),
                    sds((t, 2 * nkv * hd), jnp.bfloat16), sds((hd,), jnp.bfloat16), sds((hd,), jnp.bfloat16))
            fn = lambda q, kv, wq, wk: pnorm.qk_norm(q, kv, wq, wk, num_heads=nh, num_kv_heads=nkv, head_dim=hd,
                                                     eps=cfg.rms_norm_eps)
            try:
                text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            except (ImportError, NotImplementedError) as exc:
                pytest.skip(f"no Triton lowering here: {exc}")
            assert "xla.gpu.triton" in text and "qk_norm" in text
    assert len(verify_triton_modules) >= 1


class _Ctx(layers.LayerContext):
    """A layer context whose conv is the identity and whose attention returns q plus the
    broadcast k and v sums (so the result depends on q, k and v): enough to run attention_block.
    qk_norm: its ops' qk_norm (default: the jnp one)."""

    def __init__(self, qk_norm=None):
        if qk_norm is not None:
            self.ops = dataclasses.replace(pk.REFERENCE_OPS, qk_norm=qk_norm)

    def conv(self, stream, x, weight):
        return x

    def attend(self, q, k, v, r, rel_proj, geom):
        return q + (k.sum(-2, keepdims=True) + v.sum(-2, keepdims=True)).astype(q.dtype) + 0 * r[..., :1]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_attention_block_uses_it_up_to_the_bound(monkeypatch, dtype):
    """attention_block with the Pallas `ops.qk_norm` (q read from the fused projection) equals
    the block with the jnp one bit for bit, and takes the kernel for at most
    `pallas_kernels.ops.QK_NORM_MAX_TOKENS` tokens.

    Both compiled without XLA's excess precision: by default XLA may keep the jnp norm's bf16
    result in fp32 for the ops it fuses it with (skipping a rounding that rms_norm asks for),
    which no kernel output can match; with the rounding kept the two agree bit for bit. And
    with XLA:CPU's default fusion emitters (the suite turns them off to compile faster,
    tests/cpu_flags.py): the older emitters compute the jnp norm 1 ulp apart in f32."""
    cfg = InklingConfig.tiny()
    geom = cfg.layer_geometry(0)
    # cast and shifted on the host (numpy: round to nearest even, as XLA; on the device each op
    # compiles a program per shape)
    params = jax.tree.map(lambda a: np.asarray(a).astype(dtype),
                          layers.with_kv_conv(ik.init_params(cfg, jax.random.PRNGKey(0)))["layers"][0]["attn"])
    shift = np.asarray(0.1, dtype)  # (a Python 0.1 would promote numpy's bf16 to fp32)
    params = {**params, "q_norm": params["q_norm"] + shift, "k_norm": params["k_norm"] - shift}
    params = jax.tree.map(device_array, params)
    x = device_array(np.random.RandomState(1).standard_normal((5, cfg.hidden_size)), dtype)
    monkeypatch.setattr(pk.ops, "QK_NORM_MAX_TOKENS", 5)
    kernel = pk.conv_ops(True, interpret=INTERPRET).qk_norm
    block = lambda ctx: jax.jit(lambda p, x: layers.attention_block(p, cfg, geom, x, ctx))
    exact = lambda fn: fn.lower(params, x).compile(compiler_options={"xla_allow_excess_precision": False,
                                                                     "xla_cpu_use_fusion_emitters": True})
    want = exact(block(_Ctx()))(params, x)
    got = exact(block(_Ctx(kernel)))(params, x)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert "qk_norm" in kernel_names(block(_Ctx(kernel)), params, x)
    monkeypatch.setattr(pk.ops, "QK_NORM_MAX_TOKENS", 4)
    assert "qk_norm" not in kernel_names(block(_Ctx(kernel)), params, x)

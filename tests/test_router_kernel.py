"""The router epilogue kernel (`pallas_kernels.moe.router`) against its jnp reference and against
`inkling_jax.model.moe.route` itself: interpret mode on CPU, the compiled Triton kernel on a
GPU. Expert ids match exactly (ties to the lower index); weights within a few fp32 ulp.

XLA:CPU compiles every jnp op called outside jit as its own program, so the kernel and its
oracle run as one `jax.jit` per case (one compile per case, not one per op)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import device_array, has_cuda_device

import inkling_jax as ik
from inkling_jax.model import moe
from pallas_kernels.moe import router

INTERPRET = jax.default_backend() != "gpu"
TOL = dict(rtol=1e-6, atol=1e-7)  # a few ulp: exp / log1p / the logsumexp sum order differ


def rand(rng, shape, scale=1.0):
    # cast and placed from the host: jnp.asarray compiles a program per shape and dtype
    return device_array(scale * rng.standard_normal(shape))


def kernel_and_ref(logits, bias, scale, *, block_rows=None, **kw):
    """router_epilogue and router_epilogue_ref on the same inputs, in one jitted program."""
    return jax.jit(lambda lg, b, sc: (router.router_epilogue(lg, b, sc, **kw, interpret=INTERPRET,
                                                             block_rows=block_rows),
                                      router.router_epilogue_ref(lg, b, sc, **kw)))(logits, bias, scale)


def check(got, want):
    """idx equal, weights within TOL, shapes and dtypes equal."""
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **TOL)


@pytest.mark.parametrize("n,e,s,k,block_rows,with_bias,with_scale", [
    (1, 32, 2, 4, None, True, True),
    (1, 32, 2, 4, None, False, False),
    (3, 32, 2, 4, None, True, True),
    (32, 32, 2, 4, None, True, True),  # two programs of 16 rows
    (32, 32, 2, 4, None, False, False),
    (37, 8, 2, 2, 8, True, True),  # 5 programs, the last one 5 rows of 8
    (37, 8, 2, 2, 8, False, False),
    (37, 8, 2, 2, 1, True, False),
    (5, 8, 1, 2, None, False, True),
    (5, 8, 1, 2, None, True, True),
    (6, 6, 3, 3, 4, True, True),  # E + S = 9
    (9, 8, 0, 3, 4, True, True),  # no sink: gamma [n, 0], weights over the k selected experts
    (4, 256, 2, 6, None, True, True),  # the full model's router: E + S = 258, P = 512
    (3, 8, 2, 8, None, False, True),  # k = E
])
def test_matches_reference(n, e, s, k, block_rows, with_bias, with_scale):
    rng = np.random.default_rng(n * 1000 + e * 10 + s + k)
    logits = rand(rng, (n, e + s), 3.0)
    bias = rand(rng, (e,), 0.3) if with_bias else None
    scale = device_array([1.7], np.float32) if with_scale else None
    got, want = kernel_and_ref(logits, bias, scale, k=k, route_scale=2.5, num_experts=e, block_rows=block_rows)
    assert got[0].shape == (n, k) and got[2].shape == (n, s)
    check(got, want)
    # the weights of a row sum to route_scale * scale (routed and sink together)
    total = np.asarray(got[1]).sum(-1) + np.asarray(got[2]).sum(-1)
    np.testing.assert_allclose(total, 2.5 * (1.7 if with_scale else 1.0), rtol=1e-5)


def test_under_jit():
    rng = np.random.default_rng(3)
    logits, bias, scale = rand(rng, (7, 34), 2.0), rand(rng, (32,), 0.2), device_array([0.9], np.float32)
    check(*kernel_and_ref(logits, bias, scale, k=4, route_scale=8.0, block_rows=4))


def test_ties_go_to_the_lower_index():
    """Equal choices (equal logits and bias, or sigmoids that round to 1.0) pick the lower expert
    first, as lax.top_k does; ids come out in descending choice."""
    e, s, k = 8, 2, 4
    logits = np.zeros((4, e + s), np.float32)
    logits[0, :e] = [0.5, 2.0, 1.0, 2.0, -1.0, 2.0, 0.3, 2.0]  # four-way tie at 2.0
    logits[1, :e] = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # all tied
    logits[2, :e] = [20.0, 30.0, 3.0, 40.0, 25.0, 0.0, 50.0, 1.0]  # sigmoid == 1.0 for >= ~17: tied
    logits[3, :e] = [-3.0, 5.0, -3.0, -3.0, 5.0, 4.0, 4.0, -3.0]
    logits[:, e:] = [[0.1, -0.2]] * 4
    logits = device_array(logits)
    expected = [[1, 3, 5, 7], [0, 1, 2, 3], [0, 1, 3, 4], [1, 4, 5, 6]]
    kw = dict(k=k, route_scale=8.0, num_experts=e)
    assert float(jax.nn.sigmoid(jnp.float32(20.0))) == 1.0
    got, want = kernel_and_ref(logits, None, None, **kw, block_rows=2)
    np.testing.assert_array_equal(np.asarray(want[0]), expected)
    check(got, want)

    # ties made by the bias: equal scores, bias equal on 2 / 6 and 1 / 5; -inf bias last
    bias = device_array([0.0, 0.25, 0.5, 0.0, -np.inf, 0.25, 0.5, -np.inf], np.float32)
    flat = device_array(np.zeros((2, e + s), np.float32))
    got, want = kernel_and_ref(flat, bias, None, **kw)
    np.testing.assert_array_equal(np.asarray(want[0]), [[2, 6, 1, 5]] * 2)
    check(got, want)
    # k past the finite choices: the -inf ones are taken too, lower index first
    got, want = kernel_and_ref(flat, bias, None, **dict(kw, k=8))
    np.testing.assert_array_equal(np.asarray(want[0]), [[2, 6, 1, 5, 0, 3, 4, 7]] * 2)
    check(got, want)


ROUTE_CONFIGS = [
    ik.InklingConfig.tiny(),  # top-2 of 8 + 2 sink, route_scale 8
    ik.InklingConfig.tiny(n_routed_experts=6, n_shared_experts=3, num_experts_per_tok=3, route_scale=2.5),
    ik.InklingConfig.tiny(n_shared_experts=1, num_experts_per_tok=1),
    ik.InklingConfig.small(n_routed_experts=32, n_shared_experts=2, num_experts_per_tok=4),  # the bench's router
]


@pytest.mark.parametrize("cfg", ROUTE_CONFIGS, ids=lambda c: f"E{c.n_routed_experts}S{c.n_shared_experts}"
                         f"k{c.num_experts_per_tok}")
@pytest.mark.parametrize("n", [1, 19])
@pytest.mark.parametrize("keys", [("router_bias", "router_scale"), ()])
def test_matches_route(cfg, n, keys):
    """route(p, cfg, x) == router_epilogue(x.f32 @ router.f32, bias, scale): the model's router."""
    assert cfg.gate_activation == "sigmoid" and cfg.norm_after_topk and cfg.shared_expert_sink
    e, s, k, h = cfg.n_routed_experts, cfg.n_shared_experts, cfg.num_experts_per_tok, cfg.hidden_size
    rng = np.random.default_rng(n + e + s + k)
    p = {"router": rand(rng, (h, e + s), 0.3)}
    if keys:
        p["router_bias"] = rand(rng, (e,), 0.1)
        p["router_scale"] = device_array([1.25], np.float32)
    x = device_array(rand(rng, (n, h)), jnp.bfloat16)

    def route_and_kernel(p, x):  # one program
        logits = jnp.matmul(x.astype(jnp.float32), p["router"].astype(jnp.float32))
        return moe.route(p, cfg, x), router.router_epilogue(
            logits, p.get("router_bias"), p.get("router_scale"), k=k, route_scale=cfg.route_scale, num_experts=e,
            interpret=INTERPRET)

    want, got = jax.jit(route_and_kernel)(p, x)
    check(got, want)


def test_fallbacks_and_defaults():
    kw = dict(k=2, route_scale=8.0, num_experts=8)
    zeros = lambda *shape: device_array(np.zeros(shape, np.float32))  # noqa: E731 (jnp.zeros: a broadcast program)
    idx, w, gamma = jax.jit(lambda lg: router.router_epilogue(lg, None, None, **kw, interpret=INTERPRET))(zeros(0, 10))
    assert idx.shape == (0, 2) and idx.dtype == jnp.int32 and w.shape == (0, 2) and gamma.shape == (0, 2)
    with pytest.raises(ValueError):
        router.router_epilogue(zeros(3, 10), None, None, k=2, route_scale=8.0)  # E unknown
    with pytest.raises(ValueError):
        router.router_epilogue(zeros(3, 10), None, None, **kw, block_rows=3, interpret=INTERPRET)
    # one row per program (bench/kernels/router_micro.py on the H200: 16-row tiles were 5-6x slower at 32-256 rows)
    assert {router.default_block_rows(n, w) for n in (1, 4, 4096) for w in (10, 34, 258)} == {1}
    assert [router.default_num_warps(1, w) for w in (34, 258, 1000, 3000)] == [1, 1, 2, 4]


@pytest.mark.skipif(has_cuda_device(), reason="abstract CUDA lowering is for machines without a GPU")
def test_kernel_lowers_for_gpu(verify_triton_modules):
    """The kernel passes the Triton lowering for CUDA (power-of-two blocks, supported ops) and
    the MLIR verifier, and the jitted function is that one custom call: nothing pads or
    slices the logits around it."""
    sds, f32 = jax.ShapeDtypeStruct, jnp.float32
    cases = [(4, 32, 2, 4, True, True), (4096, 32, 2, 4, True, True), (3, 8, 2, 2, False, False),
             (64, 256, 2, 6, True, True), (5, 8, 0, 2, True, False), (1, 6, 3, 1, False, True)]
    for n, e, s, k, with_bias, with_scale in cases:
        args = (sds((n, e + s), f32), sds((e,), f32) if with_bias else None, sds((1,), f32) if with_scale else None)
        fn = lambda lg, b, sc, k=k, e=e: router.router_epilogue(lg, b, sc, k=k, route_scale=8.0, num_experts=e)
        try:
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        except (ImportError, NotImplementedError) as exc:
            pytest.skip(f"no Triton lowering here: {exc}")
        assert text.count("xla.gpu.triton") == 1, text
        for op in ("stablehlo.pad", "stablehlo.slice", "stablehlo.concatenate", "stablehlo.sort"):
            assert op not in text, (op, text)
    assert len(verify_triton_modules) == len(cases)

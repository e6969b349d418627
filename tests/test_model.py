"""Reference forward properties that need no oracle: bf16 vs fp32, gradients vs finite
differences, causality, and the MTP chain semantics."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import inkling_jax as ik
import pallas_kernels as pk
from inkling_jax.model import layers as L
from inkling_jax.model import moe as model_moe
from pallas_kernels.moe import ref as moe_ref
from conftest import random_tokens

# The model's entry points jitted: one compile per config and shape, where the eager calls
# compiled each op on its own (~200 programs per forward of the tiny preset)
forward = jax.jit(ik.forward, static_argnums=1)
forward_hidden = jax.jit(ik.forward_hidden, static_argnums=1)
mtp_forward = jax.jit(ik.mtp_forward, static_argnums=1)


@pytest.fixture(scope="module")
def tiny():
    cfg = ik.InklingConfig.tiny()
    return cfg, ik.init_params(cfg, jax.random.key(0), std=0.1)


@pytest.mark.parametrize("dense", [True, False])
def test_bf16_close_to_fp32(dense):
    """bf16 params and activations stay within bf16 tolerance of the fp32 logits.

    Tolerance: 4 bf16 epsilons (2^-8 each) of the logit scale (1.6 %) at every position,
    for a 4-layer stack at the default init scale. (At larger init scales the bf16 rounding of
    a router input can flip a near-tied top-k choice: a discontinuity, not a precision loss.)"""
    cfg = ik.InklingConfig.tiny()
    if dense:
        cfg = cfg.replace(dense_layer_ids=tuple(range(cfg.num_layers)))
    params = ik.init_params(cfg, jax.random.key(0))
    tokens = random_tokens(cfg, (2, 24))
    ref = np.asarray(forward(params, cfg, tokens))
    low = np.asarray(forward(ik.cast_params(params, jnp.bfloat16), cfg, tokens))
    scale = np.abs(ref).max()
    err = np.abs(low - ref).max()
    assert err < 4 * 2.0 ** -8 * scale, (err, scale)
    assert err > 0  # the bf16 path really ran in bf16
    # and the leaves that must stay fp32 do
    bf = ik.cast_params(params, jnp.bfloat16)
    assert bf["layers"][0]["attn"]["k_conv"].dtype == jnp.float32
    assert bf["layers"][0]["attn"]["wqkvr"].dtype == jnp.bfloat16


def next_token_loss(params, cfg, tokens):
    logits = ik.forward(params, cfg, tokens[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def test_grad_matches_finite_difference(tiny):
    """jax.grad of the next-token loss is finite everywhere, and for a few parameter tensors
    its directional derivative along the tensor's own gradient direction u (= |g_leaf|)
    equals a central finite difference (L(p + eps u) - L(p - eps u)) / 2 eps within 2 % + 1e-4
    (f32, eps 3e-3: the loss roundoff over 2 eps is ~6e-5 absolute; eps 1e-2 can flip a
    MoE top-k choice, a discontinuity the gradient cannot see)."""
    cfg, params = tiny
    tokens = jnp.asarray(random_tokens(cfg, (2, 20), seed=5))
    loss = jax.jit(lambda p: next_token_loss(p, cfg, tokens))
    grads = jax.jit(jax.grad(lambda p: next_token_loss(p, cfg, tokens)))(params)
    grads = jax.device_get(grads)  # numpy from here: eager jnp ops would compile one program each
    assert all(np.isfinite(g).all() for g in jax.tree_util.tree_leaves(grads))
    probes = [  # attention projection, k conv taps, branch conv, router, routed experts, relative bias, norm
        ("layers", 2, "attn", "wqkvr"),
        ("layers", 1, "attn", "k_conv"),
        ("layers", 1, "attn_conv"),
        ("layers", 2, "mlp", "router"),
        ("layers", 3, "mlp", "w13"),
        ("layers", 0, "attn", "rel_proj"),
        ("final_norm",),
    ]
    eps = 3e-3
    for path in probes:
        g, leaf = grads, params
        for k in path:
            g, leaf = g[k], leaf[k]
        norm = float(np.linalg.norm(g))
        assert norm > 1e-6, f"{path}: gradient vanished"
        u = g / norm
        leaf = np.asarray(leaf)
        fd = (loss(_replace(params, path, leaf + eps * u)) - loss(_replace(params, path, leaf - eps * u))) / (2 * eps)
        np.testing.assert_allclose(float(fd), norm, rtol=2e-2, atol=1e-4, err_msg=str(path))


def _replace(tree, path, value):
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(tree, list):
        out = list(tree)
        out[head] = _replace(tree[head], rest, value)
        return out
    return {**tree, head: _replace(tree[head], rest, value)}


def test_causal(tiny):
    """Changing token t changes no logit before t."""
    cfg, params = tiny
    tokens = random_tokens(cfg, (1, 20), seed=7)
    changed = tokens.copy()
    changed[0, 12] = (changed[0, 12] + 1) % cfg.unpadded_vocab_size
    a, b = np.asarray(forward(params, cfg, tokens)), np.asarray(forward(params, cfg, changed))
    np.testing.assert_array_equal(a[:, :12], b[:, :12])
    assert np.abs(a[:, 12:] - b[:, 12:]).max() > 0


def test_causal_conv_window_carries_state():
    """Splitting a sequence and carrying the K-1 window gives the unsplit conv exactly."""
    rng = np.random.RandomState(0)
    x = jnp.asarray(rng.randn(2, 11, 6), jnp.float32)
    w = jnp.asarray(rng.randn(4, 6), jnp.float32)
    y, win = L.causal_conv(x, w)
    y1, w1 = L.causal_conv(x[:, :2], w)  # shorter than K-1: old rows shift in
    y2, w2 = L.causal_conv(x[:, 2:], w, w1)
    np.testing.assert_array_equal(np.concatenate([y1, y2], 1), y)
    np.testing.assert_array_equal(w2, win)
    np.testing.assert_array_equal(win, x[:, -3:])


def test_mtp_chain_semantics(tiny):
    """Depth d at row j reads t_{j+d+1}: its logits at row j change with t_{j+d+1} and not
    with any later token; tokens past the prompt are the previous predictor's greedy picks."""
    cfg, params = tiny
    tokens = random_tokens(cfg, (1, 12), seed=9)
    hidden = forward_hidden(params, cfg, tokens)
    logits, hs = mtp_forward(params, cfg, hidden, tokens)
    assert logits.shape == (cfg.num_mtp_layers, 1, 12, cfg.unpadded_vocab_size)
    assert hs.shape == (cfg.num_mtp_layers, 1, 12, cfg.hidden_size)
    # changing t_9 (keeping the target hidden fixed): depth d rows j < 9 - d - 1 unchanged
    changed = tokens.copy()
    changed[0, 9] = (changed[0, 9] + 3) % cfg.unpadded_vocab_size
    logits2, _ = mtp_forward(params, cfg, hidden, changed)
    for d in range(cfg.num_mtp_layers):
        first = 9 - d - 1  # the row that reads t_9
        np.testing.assert_array_equal(logits[d, :, :first], logits2[d, :, :first])
        assert np.abs(logits[d, :, first] - logits2[d, :, first]).max() > 0

    # the chain fill: depth 1 at row T-1 reads depth 0's greedy prediction at row T-1
    target_next = int(jnp.argmax(forward(params, cfg, tokens)[0, -1]))
    d0_next = int(jnp.argmax(logits[0, 0, -1]))
    ext = np.concatenate([tokens, [[target_next, d0_next]]], axis=1)
    hidden_ext = jnp.concatenate([hidden, jnp.zeros((1, 2, cfg.hidden_size), hidden.dtype)], axis=1)
    logits_ext, _ = mtp_forward(params, cfg, hidden_ext, ext)
    np.testing.assert_allclose(logits_ext[1, :, :12], logits[1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("impl", ["auto", "slices", "dense", "gather"])
def test_lone_row_padding_keeps_results(tiny, impl, monkeypatch):
    """The one-token GPU workaround (`pallas_kernels._common.PAD_LONE_ROW`: a single row padded
    to two before weight products) computes the same function: a one-token forward and MoE
    agree with the unpadded path within f32 rounding (1e-5 of the logit scale), on every
    routed experts impl (the layer's own choice: "auto")."""
    cfg, params = tiny
    tokens = jnp.asarray(random_tokens(cfg, (1, 1), seed=3))
    x = jax.random.normal(jax.random.key(1), (1, cfg.hidden_size), jnp.float32)
    moe = next(l["mlp"] for i, l in enumerate(params["layers"]) if i not in cfg.dense_layer_ids)
    if impl != "auto":  # the jnp experts' own choice (slices or dense) replaced by this impl
        fn = moe_ref.MOE_IMPLS[impl]
        monkeypatch.setattr(moe_ref, "MOE_IMPLS", {**moe_ref.MOE_IMPLS, "slices": fn, "dense": fn})
    out = {}
    for pad in (False, True):
        monkeypatch.setattr(pk._common, "PAD_LONE_ROW", pad)
        out[pad] = (np.asarray(ik.forward(params, cfg, tokens)), np.asarray(model_moe.moe_mlp(moe, cfg, x)))
    for a, b in zip(out[False], out[True]):
        assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max(), np.abs(a - b).max()


@partial(jax.jit, static_argnums=(3, 4))  # one compile per leaf shape and dtype
def _fold_in_normal(key, i, scale, shape, dtype):
    return (scale * jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)).astype(dtype)


def test_device_drawn_leaves_are_their_fold_in_normals(monkeypatch):
    """init_params draws its large leaves on the device through samplers compiled concurrently
    in the pool: each is scale * N(0, 1) from fold_in(key, its position), cast, placed where the
    host-drawn leaves were (two leaves of one shape share a program, not a draw)."""
    from inkling_jax.model import params as model_params
    cfg = ik.InklingConfig.tiny()
    monkeypatch.setattr(model_params, "DEVICE_INIT_ELEMS", 512)
    key = jax.random.key(3)
    params = ik.init_params(cfg, key, dtype=jnp.bfloat16, std=0.05, executable_cache=None)
    paths, _ = jax.tree_util.tree_flatten_with_path(model_params.param_shapes(cfg), is_leaf=model_params.is_shape)
    leaves = jax.tree_util.tree_leaves(params)
    drawn = 0
    for i, ((path, shape), leaf) in enumerate(zip(paths, leaves)):
        assert leaf.shape == shape, path
        name = model_params._leaf_name(path)
        if np.prod(shape) < 512 or name.endswith("norm") or name in ("global_scale", "router_scale", "router_bias"):
            continue
        scale = 0.3 if name.endswith("conv") else 0.05
        # jitted as the sampler is (eager ops round one element in ~10^4 differently in bf16)
        want = _fold_in_normal(key, np.int32(i), np.float32(scale), shape, leaf.dtype)
        np.testing.assert_array_equal(np.asarray(leaf, np.float32), np.asarray(want, np.float32), err_msg=str(path))
        drawn += 1
    assert drawn >= 4

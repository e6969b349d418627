"""`conv_update_residual_norm` (conv_update + the decoder layer's residual add + the next
RMSNorm in one kernel) against its reference, `ref.conv_update_residual_norm`.

Interpret mode (CPU): bit for bit, new residual, normed rows and arena (the sink left alone,
as for conv_update: tests/test_kernels.py), in fp32 and bf16, decode and extend, rows that
checkpoint, padded rows on the sink. Compiled on a GPU the mean's sum runs in Triton's order:
`rms_norm_tile` (that formula) is checked on CPU against the reference within a stated
tolerance, and the compiled kernel within the same one.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import has_cuda_device, rms_norm_with_gpu_sum
from conftest import row_ulps as ulps
from test_kernels import (EXTRA_UNITS, NUM_SLOTS, Meta, assert_arena, assert_bits, attn_stream_case, conv_fields,
                          odd_layout, random_arena, random_meta, tiny_layout)

import pallas_kernels as pk
from inkling_jax.cache.layout import ArenaLayout, Field
from inkling_jax.config import InklingConfig
from inkling_jax.model import layers
from inkling_jax.steps import context as step_context
from pallas_kernels.conv_state import pallas as pconv
from pallas_kernels.conv_state import ref as ref_conv
from pallas_kernels.conv_state.ref import PackedRows

INTERPRET = jax.default_backend() != "gpu"
EPS = 1e-6


def norm_call(op, lay: ArenaLayout, f: Field, ch: tuple[int, int], **kw):
    def call(arena, x, w, residual, norm_w, meta: Meta):
        return op(arena, x, w, meta.rows, lay.slot_row(meta.active, f), lay.slot_row(meta.track_dest, f), residual,
                  norm_w, eps=EPS, window_shape=f.shape, channels=ch, sink_rows=lay.sink_rows, **kw)
    return call


def assert_rows(got, want, what: str, max_ulps: float = 2.0) -> None:
    """Bit for bit in interpret mode; compiled, within max_ulps (see `test_tile_formula`)."""
    if INTERPRET:
        return assert_bits(got, want, what)
    err = ulps(got, want)
    assert err <= max_ulps, f"{what}: {err:.2f} ulps"


def random_inputs(rng, t: int, width: int, k: int, xdt, rdt):
    x = jnp.asarray(rng.standard_normal((t, width)), xdt)
    w = jnp.asarray(0.5 * rng.standard_normal((k, width)), xdt)
    res = jnp.asarray(3 * rng.standard_normal((t, width)), rdt)
    nw = jnp.asarray(1 + 0.2 * rng.standard_normal((width,)), rdt)
    return x, w, res, nw


def test_ref_rms_norm_is_the_layers_norm():
    """The reference's norm is the model's: one function (`pallas_kernels._common.rms_norm`)."""
    assert ref_conv.rms_norm is layers.rms_norm is pk._common.rms_norm


# (K, arena dtype, x dtype, residual dtype, layer, stream, decode, rows B, tokens T, Q, checkpoints M)
CASES = {
    "k4-f32-decode": (4, jnp.float32, jnp.float32, jnp.float32, 2, "attn", True, 4, 4, 1, 1),
    "k4-bf16-decode-2tracks": (4, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, 1, "mlp", True, 5, 5, 1, 2),
    "k4-bf16-extend": (4, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, 0, "attn", False, 3, 12, 6, 2),
    "k3-f32arena-bf16-extend-T<B": (3, jnp.float32, jnp.bfloat16, jnp.bfloat16, 2, "mlp", False, 6, 5, 3, 1),
    "k2-bf16x-f32residual-decode": (2, jnp.float32, jnp.bfloat16, jnp.float32, 1, "attn", True, 3, 3, 1, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case):
    k, adt, xdt, rdt, layer, stream, decode, num_rows, num_tokens, q, tracks = CASES[case]
    rng = np.random.RandomState(sum(map(ord, case)))
    lay = tiny_layout(k)
    f = lay.target[layer].conv
    ch = lay.target[layer].channels(stream)
    width = ch[1] - ch[0]
    plan = pconv.conv_plan((NUM_SLOTS * lay.slot_units + EXTRA_UNITS, lay.unit_elems), f.shape, ch, width, k,
                           max(num_rows, num_tokens), block=width)
    assert plan is not None and plan.nblocks == 1  # the kernel runs, one row per program
    ops = pk.conv_ops(True, interpret=INTERPRET)
    kern = jax.jit(norm_call(ops.conv_residual_norm, lay, f, ch))
    want_fn = jax.jit(norm_call(ref_conv.conv_update_residual_norm, lay, f, ch))
    for trial in range(2):
        arena = random_arena(rng, lay, conv_fields(lay), adt)
        x, w, res, nw = random_inputs(rng, num_tokens, width, k, xdt, rdt)
        meta = random_meta(rng, num_rows, num_tokens, k - 1, decode, q, tracks=tracks)
        new, normed, got = kern(arena, x, w, res, nw, meta)
        new_ref, normed_ref, want = want_fn(arena, x, w, res, nw, meta)
        assert new.dtype == normed.dtype == rdt
        assert_rows(new, new_ref, f"{case} {trial} residual")
        assert_rows(normed, normed_ref, f"{case} {trial} normed")
        assert_arena(got, want, arena, lay, f"{case} {trial}")


def test_bench_width():
    """A 2048-channel stream (the bench model's hidden size) in bf16: one program holds a whole
    row; the interpret-mode norm reduces it as XLA reduces the reference's rows (bit for bit)."""
    base = tiny_layout(4)
    lay = dataclasses.replace(base, unit_elems=2048, slot_units=4)
    f = Field(1, 3, (3, 2048))
    ch = (0, 2048)
    rng = np.random.RandomState(7)
    arena = random_arena(rng, lay, [f], jnp.bfloat16)
    x, w, res, nw = random_inputs(rng, 2, 2048, 4, jnp.bfloat16, jnp.bfloat16)
    meta = random_meta(rng, 2, 2, 3, decode=True)
    new, normed, got = jax.jit(norm_call(pconv.conv_update_residual_norm, lay, f, ch, interpret=INTERPRET))(
        arena, x, w, res, nw, meta)
    new_ref, normed_ref, want = jax.jit(norm_call(ref_conv.conv_update_residual_norm, lay, f, ch))(
        arena, x, w, res, nw, meta)
    assert_rows(new, new_ref, "residual")
    assert_rows(normed, normed_ref, "normed")
    assert_arena(got, want, arena, lay, "arena")


@pytest.mark.parametrize("dtype,max_ulps", [(jnp.float32, 4.0), (jnp.bfloat16, 1.0)])
def test_tile_formula(dtype, max_ulps):
    """The compiled kernel's norm: `rms_norm_tile` (the row as a [nb, g] block) and the same
    formula with the mean's sum taken in GPU-like orders (`sum_in_gpu_order`: Triton's order is its
    layout's choice, XLA's its own) against the reference on rows of 2048: within 4 fp32 ulps /
    1 bf16 ulp of the row's largest |value|. On this CPU rms_norm_tile itself matches bit for
    bit; the sum order is the only difference the GPU adds (rsqrt is libdevice's in both)."""
    rng = np.random.RandomState(9)
    worst = 0.0
    for scale in (1e-3, 1.0, 300.0):
        x = jnp.asarray(scale * rng.standard_normal((8, 2048)), dtype)
        w = jnp.asarray(1 + 0.2 * rng.standard_normal((2048,)), dtype)
        want = ref_conv.rms_norm(x, w, EPS)
        for g in (8, 64):
            got = jax.vmap(lambda row: pconv.rms_norm_tile(row.reshape(-1, g), w.reshape(-1, g), EPS))(x)
            worst = max(worst, ulps(got.reshape(x.shape), want))
        for threads in (2048, 256):  # a pairwise tree; 256 threads' strided sums, then a tree
            worst = max(worst, ulps(rms_norm_with_gpu_sum(x, w, EPS, threads), want))
    assert worst <= max_ulps, worst


def test_fallback_is_the_composition():
    """A stream width that is not a power of two (24 channels of an odd field) cannot be one
    Triton block: conv_update (its own kernel) then the reference's add and norm, same result."""
    lay, f = odd_layout()
    ch = (8, 32)
    width = ch[1] - ch[0]
    rng = np.random.RandomState(4)
    arena = random_arena(rng, lay, [f], jnp.float32)
    x, w, res, nw = random_inputs(rng, 10, width, 4, jnp.float32, jnp.float32)
    meta = random_meta(rng, 3, 10, 3, decode=False, q=6)
    traced = jax.make_jaxpr(norm_call(pconv.conv_update_residual_norm, lay, f, ch, interpret=INTERPRET))(
        arena, x, w, res, nw, meta)
    names = [e.params.get("name") for e in traced.jaxpr.eqns if e.primitive.name == "pallas_call"]
    assert "conv_update_residual_norm" not in str(traced) and names == []  # conv_update sits inside a custom_vjp
    got = jax.jit(norm_call(pconv.conv_update_residual_norm, lay, f, ch, interpret=INTERPRET))(arena, x, w, res, nw,
                                                                                               meta)
    want = jax.jit(norm_call(ref_conv.conv_update_residual_norm, lay, f, ch))(arena, x, w, res, nw, meta)
    assert_rows(got[0], want[0], "residual")
    assert_rows(got[1], want[1], "normed")
    assert_arena(got[2], want[2], arena, lay, "arena")


def test_gradients_match_reference():
    """The backward pass is the reference's VJP (custom_vjp, as conv_update's)."""
    rng = np.random.RandomState(5)
    lay, f, ch, width, arena = attn_stream_case(rng)
    x, w, res, nw = random_inputs(rng, 3, width, 4, jnp.float32, jnp.float32)
    meta = random_meta(rng, 3, 3, 3, decode=True)
    probes = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in (res.shape, res.shape, arena.shape)]
    probes[2] = probes[2].at[:lay.slot_units].set(0.0)  # the sink's contents are arbitrary

    def loss(op):
        def fn(a, xx, ww, rr, nn):
            outs = norm_call(op, lay, f, ch)(a, xx, ww, rr, nn, meta)
            return sum(jnp.sum(o * p) for o, p in zip(outs, probes))
        return jax.jit(jax.grad(fn, argnums=(0, 1, 2, 3, 4)))

    got = loss(pk.conv_ops(True, interpret=INTERPRET).conv_residual_norm)(arena, x, w, res, nw)
    want = loss(ref_conv.conv_update_residual_norm)(arena, x, w, res, nw)
    for i, (g, r) in enumerate(zip(got, want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5, err_msg=f"grad {i}")


def test_ops_wiring():
    assert pk.REFERENCE_OPS.conv_residual_norm is ref_conv.conv_update_residual_norm
    assert pk.conv_ops(True, interpret=True).conv_residual_norm is not ref_conv.conv_update_residual_norm


@pytest.mark.skipif(has_cuda_device(), reason="abstract CUDA lowering is for machines without a GPU")
def test_lowers_for_gpu(verify_triton_modules):
    """The kernel passes the Triton lowering for CUDA at the bench config's layout (a 2048-wide
    row per program, int64 offsets past 4 GiB), decode at B = 1 and 32 and a few-token extend."""
    cfg = InklingConfig.bench()
    lay = ArenaLayout.build(cfg, 64)
    sds = jax.ShapeDtypeStruct
    arena = sds((lay.slot_units * 600, lay.unit_elems), jnp.bfloat16)
    i32 = lambda *s: sds(s, jnp.int32)
    f = lay.target[0].conv
    for stream in ("attn", "mlp"):
        ch = lay.target[0].channels(stream)
        w = ch[1] - ch[0]
        assert w == cfg.hidden_size
        for b, t, q in [(1, 1, 1), (32, 32, 1), (2, 8, 4)]:
            rows = PackedRows(token_row=i32(t), token_offset=i32(t), row_tokens=i32(b, q),
                              has_state=sds((b,), jnp.bool_), commit_len=i32(b), track_len=i32(b, 1))
            meta = Meta(rows, i32(b), i32(b, 1))
            x = sds((t, w), jnp.bfloat16)
            fn = norm_call(pconv.conv_update_residual_norm, lay, f, ch)
            try:
                text = jax.jit(fn, donate_argnums=0).trace(arena, x, sds((4, w), jnp.bfloat16), x,
                                                           sds((w,), jnp.bfloat16), meta).lower(
                    lowering_platforms=("cuda",)).as_text()
            except (ImportError, NotImplementedError) as exc:
                pytest.skip(f"no Triton lowering here: {exc}")
            assert "xla.gpu.triton" in text and "conv_update_residual_norm" in text
    assert verify_triton_modules


def test_spec_engine_with_fused_norms_matches_jnp(monkeypatch):
    """A speculative engine on the Pallas ops (interpret mode) generates what the jnp engine
    generates, with chain_hidden_post_norm (the MTP depths' chain norm is their block's
    next_norm, fused into its last conv): prefill chunks of <= 16 tokens, the MTP depths and,
    with `context.FUSED_DEFERRED_CONVS` (switched on here: off by default, its jnp convs are the
    jnp engine's), verify's deferred target pass (computing only, its window writes queued
    until the acceptance is known) run the fused kernel. Tokens and drafts equal."""
    from conftest import ENGINE_KW

    import inkling_jax as ik

    cfg = InklingConfig.tiny(num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,), num_mtp_layers=2,
                             mtp_local_layer_ids=(1,), chain_hidden_post_norm=True)
    params = ik.init_params(cfg, jax.random.key(3), std=0.1)
    prompt = list(np.random.RandomState(2).randint(3, cfg.unpadded_vocab_size, 11))
    traced = []

    def spy(*a, **k):
        traced.append(a[1].shape)
        return real(*a, **k)

    real = pconv.conv_update_residual_norm
    monkeypatch.setattr(pconv, "conv_update_residual_norm", spy)
    monkeypatch.setattr(step_context, "FUSED_DEFERRED_CONVS", True)
    pk._pallas_ops.cache_clear()
    out = {}
    try:
        for pallas in (False, True):
            engine = ik.Engine(cfg, params, ik.EngineConfig(**{**ENGINE_KW, "max_running": 1, "spec_steps": 2},
                                                            use_pallas=pallas, pallas_interpret=pallas))
            (req,) = engine.submit([prompt], ik.SamplingParams(max_new_tokens=6, stop_at_eos=False))
            drafts = []
            while engine.running or engine.waiting:
                engine.step()
                drafts.append(list(req.drafts or []))
            out[pallas] = (list(req.out_tokens), drafts)
    finally:
        monkeypatch.undo()
        pk._pallas_ops.cache_clear()
    assert (1 + 2, cfg.hidden_size) in traced  # the verify step's target pass: 1 row x (1 + 2 drafts)
    assert traced and out[True] == out[False]

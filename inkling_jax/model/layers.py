"""Inkling's layer math as pure functions over parameter dicts.

Everything here is independent of how tokens are laid out (dense `[B, T]` for the
reference forward, packed ragged `[T]` for the serving steps): the two places where the
layout matters, the short convolutions and the attention over past keys, are delegated to a
*context* object (`LayerContext`) with two methods,

    ctx.conv(stream, x, weight) -> y          # stream in {"k", "v", "kv", "attn", "mlp"}
    ctx.attend(q, k, v, r, rel_proj, geom) -> o

so one copy of the layer math serves the reference path (`forward.py`) and the cached steps.
Every other attribute has a default on `LayerContext`, which contexts subclass:

    ctx.ops                 the kernel seam, a `pallas_kernels.KernelOps` (default: the jnp
                            `REFERENCE_OPS`): the layers call `ops.matmul` (the attention
                            projections), `ops.qk_norm`, and through `moe.py`
                            `ops.router_epilogue` and `ops.experts`; the Pallas ops pick their
                            kernels by size themselves
    ctx.conv_residual_norm(stream, a, weight, x, norm_weight, eps) -> (x + conv(a), its rms_norm):
                            a residual conv and the norm after it (default: the conv, the add
                            and the norm; the serving steps: `ops.conv_residual_norm`, one
                            kernel on few-token steps)
    ctx.parallel            None, or a `inkling_jax.parallel.ParallelAxes`: the layer runs as
                            one shard of a mesh-sharded model, inside `shard_map`, on the
                            plan's *local* params (see `inkling_jax/parallel/plan.py`)

With `ctx.parallel` set the residual stream [.., H] stays replicated and the layer adds the
collectives of the tensor / expert parallel design, at exactly these points:

    attention   after the output projection: psum over tp (each shard holds its heads)
    dense MLP   after the down projection, before global_scale: psum over tp
    MoE         (`moe.py`) the router runs replicated on the full router weights (the global
                config); choices of experts held by other ep shards get weight 0; routed +
                shared partial outputs: one psum over (ep, tp) (shared experts counted on ep
                rank 0)
    embed       vocab rows sharded over tp: out-of-shard tokens read zeros, psum over tp
    lm_head     vocab columns sharded over tp: all_gather over tp, then the unpadded slice
    MTP input   `row_parallel_linear`: input_proj rows sharded over tp, psum over tp

Partial outputs are cast to the activation dtype before the psum (as the single-device
layer casts its output). Without `ctx.parallel` none of this is traced: the program is the
single-device one.

The jnp arithmetic shared with the kernels lives in `pallas_kernels` and is imported here:
`rms_norm` and `matmul` (`pallas_kernels._common`), `conv_from_taps` (`conv_state.ref`), the
attention's scores and softmax (`attention.ref`); so is the dense MLP's `swiglu` (`moe.ref`).
Numerics follow `reference/inkling-model.md` §7: matmuls accumulate in fp32 and return the activation dtype;
norms, the router, SwiGLU, conv accumulation, softmax and log scaling run in fp32.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int
from pallas_kernels import REFERENCE_OPS, KernelOps
from pallas_kernels._common import matmul, rms_norm
from pallas_kernels.attention import ref as attention_ref
from pallas_kernels.conv_state.ref import conv_from_taps
from pallas_kernels.moe.ref import swiglu

from ..config import AttentionGeometry, InklingConfig
from . import moe

if TYPE_CHECKING:  # the parallel package imports this module; only the type is needed here
    from ..parallel.axes import ParallelAxes

Params = dict[str, Any]

CONV_STREAMS = ("k", "v", "attn", "mlp")

__all__ = ["CONV_STREAMS", "LayerContext", "attention_block", "attention_core", "attention_tables", "causal_conv",
           "conv_from_taps", "decoder_layer", "dense_mlp", "embed", "kv_conv_weight", "linear", "lm_head",
           "log_scaling_tau", "matmul", "mlp", "param_count", "rms_norm", "row_parallel_linear", "split_qkvr",
           "tp_psum", "with_kv_conv"]


class LayerContext:
    """The layout-dependent part of a layer (see the module docstring). Subclasses implement
    `conv` and `attend`; `ops`, `parallel` and `conv_residual_norm` default to the
    single-device jnp ones."""

    ops: KernelOps = REFERENCE_OPS
    parallel: "ParallelAxes | None" = None

    def conv(self, stream: str, x: Array, weight: Array) -> Array:
        raise NotImplementedError

    def attend(self, q: Array, k: Array, v: Array, r: Array, rel_proj: Array, geom: AttentionGeometry) -> Array:
        raise NotImplementedError

    def conv_residual_norm(self, stream: str, a: Array, weight: Array, x: Array, norm_weight: Array, eps: float
                           ) -> tuple[Array, Array]:
        """(x + conv(stream, a, weight), rms_norm of that sum): the layer's residual short conv
        and the norm after it."""
        x = x + self.conv(stream, a, weight)
        return x, rms_norm(x, norm_weight, eps)


# ------------------------------------------------------------ mesh collectives


def tp_psum(x: Array, parallel: "ParallelAxes | None") -> Array:
    """Sum the tensor-parallel shards' partial outputs (identity without `parallel`)."""
    return x if parallel is None else jax.lax.psum(x, parallel.tp_axis)


def row_parallel_linear(x: Float[Array, "... i"], w: Float[Array, "i_local o"],
                        parallel: "ParallelAxes | None") -> Float[Array, "... o"]:
    """x @ W for a replicated x [.., I] and this tp shard's rows [I/tp, O] of W: the shard's
    slice of x times its rows, psum over tp (plain `linear` without `parallel`)."""
    if parallel is None:
        return linear(x, w)
    rows = w.shape[0]
    start = jax.lax.axis_index(parallel.tp_axis) * rows
    part = linear(jax.lax.dynamic_slice_in_dim(x, start, rows, axis=x.ndim - 1), w)
    return jax.lax.psum(part, parallel.tp_axis)


# ----------------------------------------------------------------------------- basics


def linear(x: Float[Array, "... i"], w: Float[Array, "i o"], matmul_op: Any = matmul) -> Float[Array, "... o"]:
    """x @ w with fp32 accumulation, returned in x's dtype (`matmul_op`: the product, an
    `ops.matmul`; `matmul` pads a lone row to two on GPU backends, see `_common.PAD_LONE_ROW`)."""
    return matmul_op(x, w).astype(x.dtype)


def causal_conv(
    x: Float[Array, "b t d"], weight: Float[Array, "k d"], window: Float[Array, "b km1 d"] | None = None
) -> tuple[Float[Array, "b t d"], Float[Array, "b km1 d"]]:
    """Depthwise causal conv over whole sequences, with an optional initial window.

    window: the K-1 inputs before x[:, 0] (oldest first); zeros when None.
    Returns (y, new_window) where new_window holds the last K-1 inputs of [window ++ x]."""
    k = weight.shape[0]
    b, t, d = x.shape
    if window is None:
        window = jnp.zeros((b, k - 1, d), x.dtype)
    padded = jnp.concatenate([window.astype(x.dtype), x], axis=1)  # [b, t+k-1, d]
    taps = jnp.stack([padded[:, i:i + t] for i in range(k)], axis=2)  # [b, t, k, d]
    return conv_from_taps(x, taps, weight), padded[:, t:]


# ------------------------------------------------------------------------- attention


def log_scaling_tau(positions: Int[Array, "..."], cfg: InklingConfig) -> Float[Array, "..."]:
    """tau = 1 + alpha * ln(max((pos+1)/n_floor, 1)), fp32."""
    n = (positions + 1).astype(jnp.float32)
    return 1.0 + cfg.log_scaling_alpha * jnp.log(jnp.maximum(n / cfg.log_scaling_n_floor, 1.0))


@jax.named_scope("attention_tables")
def attention_tables(q: Float[Array, "b tq nh hd"], r: Float[Array, "b tq nh dr"], rel_proj: Float[Array, "dr e"],
                     q_pos: Int[Array, "b tq"], geom: AttentionGeometry, cfg: InklingConfig
                     ) -> tuple[Float[Array, "b tq nh hd"], Float[Array, "b tq nh e"]]:
    """q times tau(pos_q) on log-scaling layers, and the bias table rel[b, q, h, d] =
    (r @ rel_proj) in q's dtype, times tau in fp32 and rounded again (`attention.ref.tables`):
    what `attention_core` gathers its bias from. The serving steps' attention ops
    (`ops.ring_attention / paged_attention`) take r, rel_proj and tau instead and round the
    same way (the decode kernels inside the kernel)."""
    return attention_ref.tables(q, r, rel_proj, log_scaling_tau(q_pos, cfg) if geom.log_scaling else None)


@jax.named_scope("attention_core")
def attention_core(
    q: Float[Array, "b tq nh hd"],
    k: Float[Array, "b tk nkv hd"] | tuple[Array, ...],
    v: Float[Array, "b tk nkv hd"] | tuple[Array, ...],
    r: Float[Array, "b tq nh dr"],
    rel_proj: Float[Array, "dr e"],
    q_pos: Int[Array, "b tq"],
    k_pos: Int[Array, "b tk"] | tuple[Array, ...],
    k_valid: Bool[Array, "b tk"] | tuple[Array, ...],
    geom: AttentionGeometry,
    cfg: InklingConfig,
) -> Float[Array, "b tq nh hd"]:
    """Inkling attention for queries against an explicit set of keys with known positions.

    q and k are already RMS-normalised per head. Score = q.k / head_dim + bias(pos_q - pos_k),
    with the learned relative bias zero outside [0, rel_extent); causal mask plus the sliding
    window (pos_q - pos_k <= window - 1) on local layers; invalid keys (k_valid False) masked.
    Full layers with log scaling multiply q and the bias by tau(pos_q). Softmax in fp32.
    A query with no valid key returns zeros: `attention_tables`, then
    `pallas_kernels.attention.ref.attention`.

    k, v, k_pos and k_valid may be tuples of key blocks (e.g. cached context and the step's
    own tokens): scores are concatenated, not the (much larger) keys and values."""
    q, rel = attention_tables(q, r, rel_proj, q_pos, geom, cfg)
    return attention_ref.attention(q, k, v, rel, q_pos, k_pos, k_valid, window=geom.window)


def split_qkvr(p: Params, x: Array, geom: AttentionGeometry, cfg: InklingConfig, matmul_op: Any = matmul
               ) -> tuple[Array, Array, Array]:
    """The q / k|v / r projections, from a fused `wqkvr` [H, q|k|v|r] (through `matmul_op`) or
    separate weights: (q_rows, kv, r) with k and v side by side in kv [..., 2 * kv_dim] (one
    slice of the fused product: separate k and v slices joined again cost two launches per
    layer on the GPU). q_rows: q, or the whole fused product, whose first q_dim columns are q
    (`ops.qk_norm` reads them in place: on the GPU a slice handed to a kernel is a copy of its
    own)."""
    if "wqkvr" in p:
        y = linear(x, p["wqkvr"], matmul_op)
        qd, kd = geom.q_dim, geom.kv_dim
        return y, y[..., qd:qd + 2 * kd], y[..., qd + 2 * kd:]
    return linear(x, p["wq"]), jnp.concatenate([linear(x, p["wk"]), linear(x, p["wv"])], axis=-1), linear(x, p["wr"])


def kv_conv_weight(p: Params) -> Float[Array, "k two_kv"]:
    """The k and v conv taps side by side, [K, 2 * kv_dim]: p["kv_conv"] where the caller
    joined them once (`with_kv_conv`), else joined here."""
    return p["kv_conv"] if "kv_conv" in p else jnp.concatenate([p["k_conv"], p["v_conv"]], axis=-1)


def with_kv_conv(params: Params) -> Params:
    """params with each attention block's k / v conv taps also joined as "kv_conv": a decode
    loop joins them once per dispatch instead of once per layer and token step (XLA keeps the
    concatenate inside the loop body: one launch per layer and step)."""
    layers = [{**p, "attn": {**p["attn"], "kv_conv": kv_conv_weight(p["attn"])}} for p in params["layers"]]
    return {**params, "layers": layers}


@jax.named_scope("attention")
def attention_block(p: Params, cfg: InklingConfig, geom: AttentionGeometry, x: Array, ctx: LayerContext) -> Array:
    """Projections (`ctx.ops.matmul`), k/v short convs, the per-head q/k RMSNorms
    (`ctx.ops.qk_norm`: q read from the fused projection and k from the conv output, in place),
    attention through ctx, output projection."""
    lead = x.shape[:-1]
    ops = ctx.ops
    q, kv, r = split_qkvr(p, x, geom, cfg, ops.matmul)
    # k and v convs are depthwise and adjacent in the conv state: one call over both
    kv = ctx.conv("kv", kv, kv_conv_weight(p))
    nh, nkv, hd = geom.num_heads, geom.num_kv_heads, geom.head_dim
    with jax.named_scope("qk_norm"):
        q, k = ops.qk_norm(q.reshape(-1, q.shape[-1]), kv.reshape(-1, kv.shape[-1]), p["q_norm"], p["k_norm"],
                           num_heads=nh, num_kv_heads=nkv, head_dim=hd, eps=cfg.rms_norm_eps)
    q, k = q.reshape(*lead, nh, hd), k.reshape(*lead, nkv, hd)
    v = kv[..., geom.kv_dim:].reshape(*lead, nkv, hd)
    r = r.reshape(*lead, nh, cfg.d_rel)
    o = ctx.attend(q, k, v, r, p["rel_proj"], geom)
    return tp_psum(linear(o.reshape(*lead, geom.q_dim), p["wo"], ops.matmul), ctx.parallel)


# ------------------------------------------------------------------------------ MLPs


@jax.named_scope("dense_mlp")
def dense_mlp(p: Params, cfg: InklingConfig, x: Array, parallel: "ParallelAxes | None" = None) -> Array:
    """The dense SwiGLU MLP (`moe.ref.swiglu`: down(silu(gate) * up), SwiGLU in fp32), times
    global_scale where the layer has one."""
    with jax.named_scope("swiglu"):
        out = tp_psum(swiglu(x, p["w13"], p["w2"]), parallel)
    if "global_scale" in p:
        out = (out.astype(jnp.float32) * p["global_scale"].astype(jnp.float32)).astype(x.dtype)
    return out


def mlp(p: Params, cfg: InklingConfig, dense: bool, x: Array, ops: KernelOps = REFERENCE_OPS,
        parallel: "ParallelAxes | None" = None) -> Array:
    if dense:
        return dense_mlp(p, cfg, x, parallel)
    return moe.moe_mlp(p, cfg, x, ops, parallel)


# ----------------------------------------------------------------------- the layer


@jax.named_scope("layer")
def decoder_layer(
    p: Params, cfg: InklingConfig, geom: AttentionGeometry, dense: bool, x: Array, ctx: LayerContext,
    h: Array | None = None, next_norm: Array | None = None,
) -> Array | tuple[Array, Array]:
    """attn_norm -> attention -> attn_sconv -> +residual -> mlp_norm -> MLP -> mlp_sconv -> +residual.

    h: rms_norm(x, attn_norm) where the caller has it already (the previous layer's h_next):
    not recomputed. next_norm: the weight of the norm that follows the layer (the next layer's
    attn_norm, the final norm, an MTP depth's chain norm); the layer then returns
    (x, h_next = rms_norm(x, next_norm)) instead of x. Either way each conv with its residual
    add and the norm after it go through `ctx.conv_residual_norm` (one kernel where the
    context fuses them); the default computes exactly the unfused ops."""
    eps = cfg.rms_norm_eps
    if h is None:
        h = rms_norm(x, p["attn_norm"], eps)
    a = attention_block(p["attn"], cfg, geom, h, ctx)
    x, h = ctx.conv_residual_norm("attn", a, p["attn_conv"], x, p["mlp_norm"], eps)
    m = mlp(p["mlp"], cfg, dense, h, ctx.ops, ctx.parallel)
    if next_norm is None:
        return x + ctx.conv("mlp", m, p["mlp_conv"])
    return ctx.conv_residual_norm("mlp", m, p["mlp_conv"], x, next_norm, eps)


@jax.named_scope("embed")
def embed(params: Params, cfg: InklingConfig, tokens: Array, dtype: Any,
          parallel: "ParallelAxes | None" = None) -> Array:
    """Token embeddings (+ embed_norm). With `parallel`, params["embed"] holds this tp shard's
    rows [V/tp, H]: tokens of other shards read zeros, and the psum over tp assembles them."""
    if parallel is None:
        x = params["embed"][tokens].astype(dtype)
    else:
        rows = params["embed"].shape[0]
        local = tokens - jax.lax.axis_index(parallel.tp_axis) * rows
        held = (local >= 0) & (local < rows)
        x = params["embed"][jnp.clip(local, 0, rows - 1)].astype(dtype)
        x = jax.lax.psum(jnp.where(held[..., None], x, jnp.zeros((), dtype)), parallel.tp_axis)
    if cfg.use_embed_norm:
        x = rms_norm(x, params["embed_norm"], cfg.rms_norm_eps)
    return x


@jax.named_scope("lm_head")
def lm_head(params: Params, cfg: InklingConfig, h: Array, parallel: "ParallelAxes | None" = None
            ) -> Float[Array, "... v"]:
    """Logits (fp32) from final-normed hidden states: (h / mup) @ unembed, sliced to the real vocab.

    With `parallel`, params["unembed"] holds this tp shard's columns [H, V/tp]: the shards'
    logits are gathered over tp (to [.., V_pad], replicated) before the unpadded slice."""
    h = (h.astype(jnp.float32) / cfg.logits_mup_width_multiplier).astype(h.dtype)
    logits = matmul(h, params["unembed"])
    if parallel is not None:
        logits = jax.lax.all_gather(logits, parallel.tp_axis, axis=logits.ndim - 1, tiled=True)
        cfg = parallel.global_cfg
    logits = logits[..., :cfg.unpadded_vocab_size]
    if cfg.final_logit_softcapping is not None:
        c = cfg.final_logit_softcapping
        logits = c * jnp.tanh(logits / c)
    return logits


def param_count(params: Params) -> int:
    return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(params))

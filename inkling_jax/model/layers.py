"""Inkling's layer math as pure functions over parameter dicts.

Everything here is independent of how tokens are laid out (dense `[B, T]` for the
reference forward, packed ragged `[T]` for the serving steps): the two places where the
layout matters, the short convolutions and the attention over past keys, are delegated to a
*context* object with two methods,

    ctx.conv(stream, x, weight) -> y          # stream in {"k", "v", "attn", "mlp"}
    ctx.attend(q, k, v, r, rel_proj, geom) -> o

so one copy of the layer math serves the reference path (`forward.py`) and the cached steps.

Optional context attributes, read with `getattr(ctx, name, None)` (absent = single device):

    ctx.few_token_experts   a moe_experts_slices-like function for few-token MoE (a kernel)
    ctx.few_token_matvec    y[i] = x[i // x_repeat] @ w[idx[i]] (fp32), the shared experts of few tokens
                            (a kernel)
    ctx.few_token_experts_with_shared   the routed + shared experts of few tokens in one call
                            (`moe_mlp`'s few_token_experts_with_shared; a kernel)
    ctx.conv_residual_norm  (stream, a, weight, x, norm_weight) -> (x + conv(a), its rms_norm): a
                            residual conv and the norm after it in one kernel (`residual_conv_norm`)
    ctx.qk_norm             a `pallas_kernels.norm.ref.qk_norm`-like function: the per-head q and k
                            RMSNorms of a few tokens in one kernel (`attention_block`)
    ctx.parallel            a `inkling_jax.parallel.ParallelAxes`: the layer runs as one shard
                            of a mesh-sharded model, inside `shard_map`, on the plan's *local*
                            params (see `inkling_jax/parallel/plan.py`)

With `ctx.parallel` set the residual stream [.., H] stays replicated and the layer adds the
collectives of the tensor / expert parallel design, at exactly these points:

    attention   after the output projection: psum over tp (each shard holds its heads)
    dense MLP   after the down projection, before global_scale: psum over tp
    MoE         the router runs replicated on the full router weights (the global config);
                choices of experts held by other ep shards get weight 0; routed + shared
                partial outputs: one psum over (ep, tp) (shared experts counted on ep rank 0)
    embed       vocab rows sharded over tp: out-of-shard tokens read zeros, psum over tp
    lm_head     vocab columns sharded over tp: all_gather over tp, then the unpadded slice
    MTP input   `row_parallel_linear`: input_proj rows sharded over tp, psum over tp

Partial outputs are cast to the activation dtype before the psum (as the single-device
layer casts its output). Without `ctx.parallel` none of this is traced: the program is the
single-device one.

Numerics follow `reference/inkling-model.md` §7: matmuls accumulate in fp32 and return the
activation dtype; norms, the router, SwiGLU, conv accumulation, softmax and log scaling run
in fp32.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int
from pallas_kernels._common import rms_norm  # the model's norm, shared with the kernels

from ..config import AttentionGeometry, InklingConfig

if TYPE_CHECKING:  # the parallel package imports this module; only the type is needed here
    from ..parallel.axes import ParallelAxes

Params = dict[str, Any]

CONV_STREAMS = ("k", "v", "attn", "mlp")


class LayerContext(Protocol):
    def conv(self, stream: str, x: Array, weight: Array) -> Array: ...

    def attend(self, q: Array, k: Array, v: Array, r: Array, rel_proj: Array, geom: AttentionGeometry) -> Array: ...


# ------------------------------------------------------------ mesh collectives


def tp_psum(x: Array, parallel: "ParallelAxes | None") -> Array:
    """Sum the tensor-parallel shards' partial outputs (identity without `parallel`)."""
    return x if parallel is None else jax.lax.psum(x, parallel.tp_axis)


def local_expert_choices(idx: Int[Array, "n k"], weight: Float[Array, "n k"], num_local: int,
                         parallel: "ParallelAxes") -> tuple[Int[Array, "n k"], Float[Array, "n k"]]:
    """Global expert choices -> this ep shard's local expert indices, with the weight of every
    choice held by another shard set to 0 (and its index to local expert 0, a valid row).

    Shard i of the ep axis holds experts [i * num_local, (i + 1) * num_local)."""
    local = idx - jax.lax.axis_index(parallel.ep_axis) * num_local
    held = (local >= 0) & (local < num_local)
    return jnp.where(held, local, 0), jnp.where(held, weight, jnp.zeros((), weight.dtype))


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


# Pad a lone token row to two before a weight product. XLA's GPU compiler rewrites a
# vector x matrix product below ~1e7 multiply-adds into multiply + reduce fusions, which read
# the weight at a quarter of the bandwidth a GEMM reaches (and, for per-expert slices, even
# materialise the f32 products): 1-token decode spent most of its time there. With two rows
# the product stays a GEMM. None: pad on GPU backends only (the CPU has no such rewrite).
PAD_LONE_ROW: bool | None = None


def _pad_lone_row() -> bool:
    return jax.default_backend() == "gpu" if PAD_LONE_ROW is None else PAD_LONE_ROW


def matmul(x: Float[Array, "... i"], w: Float[Array, "i o"], matvec: Any = None) -> Float[Array, "... o"]:
    """x @ w in x's dtype with fp32 accumulation and an fp32 result (a single row of x is
    padded to two where PAD_LONE_ROW says, see above; or goes through `matvec`, a
    `pallas_kernels.moe.pallas.grouped_matvec`-like kernel, where given: no pad, no slice)."""
    if matvec is not None and w.ndim == 2 and math.prod(x.shape[:-1]) == 1:
        y = matvec(x.reshape(1, -1), jnp.zeros((1,), jnp.int32), w[None])
        return y.reshape(*x.shape[:-1], w.shape[-1])
    w = w.astype(x.dtype)
    if w.ndim == 2 and math.prod(x.shape[:-1]) == 1 and _pad_lone_row():
        x2 = jnp.pad(x.reshape(1, -1), ((0, 1), (0, 0)))
        y = jnp.matmul(x2, w, preferred_element_type=jnp.float32)[:1]
        return y.reshape(*x.shape[:-1], w.shape[-1])
    return jnp.matmul(x, w, preferred_element_type=jnp.float32)


def linear(x: Float[Array, "... i"], w: Float[Array, "i o"], matvec: Any = None) -> Float[Array, "... o"]:
    """x @ w with fp32 accumulation, returned in x's dtype (`matvec`: see `matmul`)."""
    return matmul(x, w, matvec).astype(x.dtype)


def conv_from_taps(x: Float[Array, "... d"], taps: Float[Array, "... k d"], weight: Float[Array, "k d"]) -> Array:
    """Short-conv output for tokens whose K input taps are gathered already.

    taps[..., i, :] is the input K-1-i tokens before the current one (tap K-1 is the token
    itself). y = x + sum_i weight[i] * taps[i], accumulated in fp32 (Inkling's convs have a
    residual and no bias or activation)."""
    acc = jnp.einsum("...kd,kd->...d", taps.astype(jnp.float32), weight.astype(jnp.float32))
    return (x.astype(jnp.float32) + acc).astype(x.dtype)


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
    (r @ rel_proj) in q's dtype, times tau in fp32 and rounded again: what `attention_core`
    gathers its bias from, and the inputs of the fused kernel (`pallas_kernels.attention`), so
    both round alike. The decode / verify kernels (`attention.decode`, the in-place path of
    `steps.context.StepContext.attend`) take r, rel_proj and tau instead and round the same
    way in the kernel (`attention.decode_ref.tables`)."""
    dtype = q.dtype
    rel = jnp.einsum("bqhr,re->bqhe", r, rel_proj.astype(r.dtype), preferred_element_type=jnp.float32).astype(dtype)
    if geom.log_scaling:
        tau = log_scaling_tau(q_pos, cfg)[:, :, None, None]
        q = (q.astype(jnp.float32) * tau).astype(dtype)
        rel = (rel.astype(jnp.float32) * tau).astype(dtype)
    return q, rel


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
    A query with no valid key returns zeros.

    k, v, k_pos and k_valid may be tuples of key blocks (e.g. cached context and the step's
    own tokens): scores are concatenated, not the (much larger) keys and values."""
    if not isinstance(k, tuple):
        k, v, k_pos, k_valid = (k,), (v,), (k_pos,), (k_valid,)
    dtype = q.dtype
    b, tq, nh, hd = q.shape
    nkv = k[0].shape[2]
    group = nh // nkv

    q, rel = attention_tables(q, r, rel_proj, q_pos, geom, cfg)
    qg = q.reshape(b, tq, nkv, group, hd)

    scores, masks = [], []
    for kb, pb, vb in zip(k, k_pos, k_valid):
        dist = q_pos[:, :, None] - pb[:, None, :]  # [b, tq, tk]
        in_extent = (dist >= 0) & (dist < geom.rel_extent)
        gather_idx = jnp.clip(dist, 0, geom.rel_extent - 1)
        bias = jnp.take_along_axis(rel, jnp.broadcast_to(gather_idx[:, :, None, :], (b, tq, nh, dist.shape[-1])),
                                   axis=-1)
        bias = jnp.where(in_extent[:, :, None, :], bias, jnp.zeros((), dtype))  # [b, tq, nh, tk]
        allowed = vb[:, None, :] & (dist >= 0)
        if geom.window is not None:
            allowed = allowed & (dist < geom.window)
        sc = jnp.einsum("bqngd,bknd->bngqk", qg, kb, preferred_element_type=jnp.float32) * (1.0 / hd)
        scores.append(sc + bias.astype(jnp.float32).reshape(b, tq, nkv, group, -1).transpose(0, 2, 3, 1, 4))
        masks.append(allowed[:, None, None, :, :])
    sizes = [sc.shape[-1] for sc in scores]
    scores = jnp.concatenate(scores, axis=-1)
    mask = jnp.concatenate(masks, axis=-1)
    scores = jnp.where(mask, scores, -jnp.inf)
    any_valid = jnp.any(mask, axis=-1, keepdims=True)
    scores = jnp.where(any_valid, scores, 0.0)
    probs = jnp.where(mask, jax.nn.softmax(scores, axis=-1), 0.0).astype(dtype)
    out = None
    start = 0
    for vb, n in zip(v, sizes):
        part = jnp.einsum("bngqk,bknd->bqngd", probs[..., start:start + n], vb, preferred_element_type=jnp.float32)
        out = part if out is None else out + part
        start += n
    return out.astype(dtype).reshape(b, tq, nh, hd)


def split_qkvr(p: Params, x: Array, geom: AttentionGeometry, cfg: InklingConfig, matvec: Any = None,
               q_rows: bool = False) -> tuple[Array, Array, Array]:
    """The q / k|v / r projections, from a fused `wqkvr` [H, q|k|v|r] or separate weights:
    (q, kv, r) with k and v side by side in kv [..., 2 * kv_dim] (one slice of the fused
    product: separate k and v slices joined again cost two launches per layer on the GPU).

    q_rows: return the whole fused product in q's place (its first q_dim columns are q), for a
    kernel that reads q in place (`ctx.qk_norm`): on the GPU a slice handed to a kernel is a
    copy of its own (with separate weights q is returned as is)."""
    if "wqkvr" in p:
        y = linear(x, p["wqkvr"], matvec)
        qd, kd = geom.q_dim, geom.kv_dim
        return y if q_rows else y[..., :qd], y[..., qd:qd + 2 * kd], y[..., qd + 2 * kd:]
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


# tokens up to which attention_block takes `ctx.qk_norm` (one program per token row). Decode,
# verify and the MTP depths of batches up to 256 rows are below it: there the norms are a few
# launches of almost no work, and the kernel is one. Prefill chunks above keep rms_norm, whose
# epilogue XLA can fuse into the attention's per-row gathers of q and k; the kernel is unmeasured
# at thousands of rows
QK_NORM_MAX_TOKENS = 256


@jax.named_scope("attention")
def attention_block(p: Params, cfg: InklingConfig, geom: AttentionGeometry, x: Array, ctx: LayerContext) -> Array:
    """Projections, k/v short convs, q/k RMSNorm, attention through ctx, output projection.

    The per-head q / k RMSNorms go through `ctx.qk_norm` (a `pallas_kernels.norm.ref.qk_norm`-
    like function: one kernel reading q from the fused projection and k from the conv output
    in place) where the context has one and there are at most QK_NORM_MAX_TOKENS tokens; else
    `rms_norm` per head. Same result either way."""
    lead = x.shape[:-1]
    # one token (batch-1 decode): the projections through the context's mat-vec kernel
    matvec = getattr(ctx, "few_token_matvec", None)
    # few tokens: both per-head norms in one kernel reading q and k in place (see QK_NORM_MAX_TOKENS)
    qk_norm = getattr(ctx, "qk_norm", None)
    if qk_norm is not None and math.prod(lead) > QK_NORM_MAX_TOKENS:
        qk_norm = None
    q, kv, r = split_qkvr(p, x, geom, cfg, matvec, q_rows=qk_norm is not None)
    # k and v convs are depthwise and adjacent in the conv state: one call over both
    kv = ctx.conv("kv", kv, kv_conv_weight(p))
    if qk_norm is not None:
        # head counts from the shapes (under a mesh: this shard's heads): r holds d_rel values
        # per q head, kv head_dim k then head_dim v values per kv head
        hd = geom.head_dim
        nh, nkv = r.shape[-1] // cfg.d_rel, kv.shape[-1] // (2 * hd)
        with jax.named_scope("qk_norm"):
            q, k = qk_norm(q.reshape(-1, q.shape[-1]), kv.reshape(-1, kv.shape[-1]), p["q_norm"], p["k_norm"],
                           num_heads=nh, num_kv_heads=nkv, head_dim=hd, eps=cfg.rms_norm_eps)
        q, k = q.reshape(*lead, nh, hd), k.reshape(*lead, nkv, hd)
        v = kv[..., nkv * hd:].reshape(*lead, nkv, hd)
    else:
        k, v = kv[..., :geom.kv_dim], kv[..., geom.kv_dim:]
        q = rms_norm(q.reshape(*lead, geom.num_heads, geom.head_dim), p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k.reshape(*lead, geom.num_kv_heads, geom.head_dim), p["k_norm"], cfg.rms_norm_eps)
        v = v.reshape(*lead, geom.num_kv_heads, geom.head_dim)
    r = r.reshape(*lead, geom.num_heads, cfg.d_rel)
    o = ctx.attend(q, k, v, r, p["rel_proj"], geom)
    return tp_psum(linear(o.reshape(*lead, geom.q_dim), p["wo"], matvec), getattr(ctx, "parallel", None))


# ------------------------------------------------------------------------------ MLPs


@jax.named_scope("swiglu")
def swiglu(x: Array, w13: Float[Array, "h two_i"], w2: Float[Array, "i h"]) -> Array:
    """down(silu(gate) * up) with the gate | up halves of w13; SwiGLU in fp32."""
    gu = matmul(x, w13)
    half = gu.shape[-1] // 2
    act = (jax.nn.silu(gu[..., :half]) * gu[..., half:]).astype(x.dtype)
    return linear(act, w2)


@jax.named_scope("dense_mlp")
def dense_mlp(p: Params, cfg: InklingConfig, x: Array, parallel: "ParallelAxes | None" = None) -> Array:
    out = tp_psum(swiglu(x, p["w13"], p["w2"]), parallel)
    if "global_scale" in p:
        out = (out.astype(jnp.float32) * p["global_scale"].astype(jnp.float32)).astype(x.dtype)
    return out


@jax.named_scope("router")
def route(p: Params, cfg: InklingConfig, x: Float[Array, "n h"], epilogue: Any = None
          ) -> tuple[Array, Array, Array]:
    """Inkling's router (fp32): returns (topk_idx [n,k], topk_weight [n,k], shared_gamma [n,S]).

    Selection uses sigmoid (or softmax) scores of the routed experts plus the selection bias;
    with norm_after_topk the weights renormalise over the selected routed experts *and* the
    shared "sink" experts; everything is scaled by route_scale * global_scale.

    epilogue: a `pallas_kernels.moe.router.router_epilogue`-like function computing all of it
    from the logits in one launch (where XLA's GPU code takes ~5), used for the sigmoid +
    norm_after_topk configs; None: the jnp below."""
    e, s, k = cfg.n_routed_experts, cfg.n_shared_experts, cfg.num_experts_per_tok
    logits = jnp.matmul(x.astype(jnp.float32), p["router"].astype(jnp.float32))  # [n, e(+s)]
    if epilogue is not None and cfg.gate_activation == "sigmoid" and cfg.norm_after_topk:
        if not (cfg.shared_expert_sink and s > 0):
            logits = logits[:, :e]
        return epilogue(logits, p.get("router_bias"), p.get("router_scale"), k=k, route_scale=float(cfg.route_scale),
                        num_experts=e)
    routed = logits[:, :e]
    if cfg.gate_activation == "sigmoid":
        scores = jax.nn.sigmoid(routed)
    else:
        scores = jax.nn.softmax(routed, axis=-1)
    choice = scores + p["router_bias"].astype(jnp.float32) if "router_bias" in p else scores
    _, idx = jax.lax.top_k(choice, k)
    sel_logits = jnp.take_along_axis(routed, idx, axis=-1)
    sink = cfg.shared_expert_sink and s > 0
    if cfg.norm_after_topk:
        a = jnp.concatenate([sel_logits, logits[:, e:e + s]], axis=-1) if sink else sel_logits
        if cfg.gate_activation == "sigmoid":
            ls = jax.nn.log_sigmoid(a)
            w = jnp.exp(ls - jax.nn.logsumexp(ls, axis=-1, keepdims=True))
        else:
            w = jax.nn.softmax(a, axis=-1)
    else:
        w = jnp.take_along_axis(scores, idx, axis=-1)
        sink = False
    scale = cfg.route_scale
    if "router_scale" in p:
        w = w * scale * p["router_scale"].astype(jnp.float32)
    else:
        w = w * scale
    gamma = w[:, k:] if sink else jnp.zeros((x.shape[0], 0), jnp.float32)
    return idx, w[:, :k], gamma


def moe_experts_dense(x: Float[Array, "n h"], idx: Array, weight: Array, w13: Array, w2: Array) -> Array:
    """Routed experts by evaluating every expert and weighting (exact; cost ~ all experts).

    The activations are kept expert-feature-major, [E, 2F, n] with the tokens minor: that is
    the layout XLA's GPU GEMM writes for a few tokens (the tokens are the narrow dimension),
    where an [E, n, 2F] result cost a transpose of the fp32 products in every layer."""
    gu = jnp.einsum("nh,ehf->efn", x, w13.astype(x.dtype), preferred_element_type=jnp.float32)
    half = gu.shape[1] // 2
    act = (jax.nn.silu(gu[:, :half]) * gu[:, half:]).astype(x.dtype)  # [E, F, n]
    y = jnp.einsum("efn,efh->enh", act, w2.astype(x.dtype), preferred_element_type=jnp.float32)
    # each token's k chosen outputs gathered from y and summed in choice order (as
    # moe_experts_slices does): elementwise work XLA fuses into one kernel, where a combine
    # matrix (a scatter) and a dot over e cost a scatter, a transpose of y and a reduction on the
    # GPU, and rounded differently per batch size on the CPU
    y = y.astype(x.dtype).astype(jnp.float32)
    rows = jnp.arange(x.shape[0])
    out = jnp.zeros((x.shape[0], y.shape[-1]), jnp.float32)
    for j in range(idx.shape[1]):
        out = out + weight[:, j, None].astype(jnp.float32) * y[idx[:, j], rows]
    return out.astype(x.dtype)


def moe_experts_gather(x: Float[Array, "n h"], idx: Array, weight: Array, w13: Array, w2: Array) -> Array:
    """Routed experts by gathering each token's k expert matrices (reads only selected experts)."""
    g13 = w13[idx].astype(x.dtype)  # [n, k, h, 2f]
    gu = jnp.einsum("nh,nkhf->nkf", x, g13, preferred_element_type=jnp.float32)
    half = gu.shape[-1] // 2
    act = (jax.nn.silu(gu[..., :half]) * gu[..., half:]).astype(x.dtype)
    y = jnp.einsum("nkf,nkfh->nkh", act, w2[idx].astype(x.dtype), preferred_element_type=jnp.float32)
    y = y.astype(x.dtype).astype(jnp.float32)
    return jnp.einsum("nk,nkh->nh", weight.astype(jnp.float32), y).astype(x.dtype)


def moe_experts_slices(x: Float[Array, "n h"], idx: Array, weight: Array, w13: Array, w2: Array) -> Array:
    """Routed experts for a handful of tokens: one dynamic slice of each selected expert's
    matrices per (token, choice), a static loop of n * k matrix-vector products."""
    n, k = idx.shape
    rows = []
    for t in range(n):
        acc = jnp.zeros((x.shape[-1],), jnp.float32)
        for j in range(k):
            e = idx[t, j]
            g13 = jax.lax.dynamic_index_in_dim(w13, e, keepdims=False)  # [h, 2f]
            gu = matmul(x[t], g13)
            half = gu.shape[-1] // 2
            act = (jax.nn.silu(gu[:half]) * gu[half:]).astype(x.dtype)
            g2 = jax.lax.dynamic_index_in_dim(w2, e, keepdims=False)  # [f, h]
            y = matmul(act, g2).astype(x.dtype).astype(jnp.float32)
            acc = acc + weight[t, j].astype(jnp.float32) * y
        rows.append(acc)
    return jnp.stack(rows).astype(x.dtype)


def moe_experts_ragged(x: Float[Array, "n h"], idx: Array, weight: Array, w13: Array, w2: Array) -> Array:
    """Routed experts of many tokens through `jax.lax.ragged_dot`: the m = n * k choices
    sorted by expert (stable; ids clipped to [0, E)), each projection one grouped product over
    the experts' contiguous runs, so only chosen experts are computed (where XLA's lowering
    computes groups as groups). The roundings are moe_experts_dense's (act and y in x's
    dtype, fp32 products, the k outputs summed in choice order), the products' fp32 sums may
    run in another order: equal to dense within fp32 rounding, bf16 within an ulp of act / y.

    A candidate for `many_token_experts` against the Pallas sorted-block GEMMs
    (`bench/moe_micro.py --many` times both on the GPU)."""
    n, k = idx.shape
    e = w13.shape[0]
    expert = jnp.clip(idx.reshape(n * k), 0, e - 1).astype(jnp.int32)
    order = jnp.argsort(expert, stable=True)  # sorted position -> choice t * k + j
    group_sizes = jnp.zeros((e,), jnp.int32).at[expert].add(1)
    xs = x[order // k]  # [m, h]: each choice's token row, by expert
    gu = jax.lax.ragged_dot(xs, w13.astype(x.dtype), group_sizes, preferred_element_type=jnp.float32)
    half = gu.shape[-1] // 2
    act = (jax.nn.silu(gu[:, :half]) * gu[:, half:]).astype(x.dtype)  # [m, F]
    y = jax.lax.ragged_dot(act, w2.astype(x.dtype), group_sizes, preferred_element_type=jnp.float32)
    position = jnp.zeros((n * k,), jnp.int32).at[order].set(jnp.arange(n * k, dtype=jnp.int32))
    y = y.astype(x.dtype).astype(jnp.float32)[position].reshape(n, k, -1)  # back to choice order
    out = jnp.zeros((n, y.shape[-1]), jnp.float32)
    for j in range(k):
        out = out + weight[:, j, None].astype(jnp.float32) * y[:, j]
    return out.astype(x.dtype)


MOE_IMPLS = {"dense": lambda *a: moe_experts_dense(*a), "gather": lambda *a: moe_experts_gather(*a),
             "slices": lambda *a: moe_experts_slices(*a), "ragged": lambda *a: moe_experts_ragged(*a)}


# few_token_experts (the grouped mat-vec kernel, which reads one expert matrix per choice) up
# to n * k <= this * E choices, where dense reads all E once: on the H200 (bench model) the
# kernel moved its choices' bytes at 38 % (n = 1) and 52 % (n = 2) of copy bandwidth, rising
# with the rows (BENCHMARKS.md, kernel table); dense's GEMMs read all E at most at copy
# bandwidth: about E / 2 choices is where the two take the same time (an estimate: bench/
# serve.py --sections verify --few-token-bounds measures it). This takes a batch-1 verify step
# (4 tokens, top-4 of 32) and decode up to batch 4 off dense (all 32 experts per MoE layer).
FEW_TOKEN_KERNEL_CHOICES_PER_EXPERT = 0.5

# many_token_experts from n * k >= this * E choices: on the H200 (bench model, bench/moe_micro.py
# --many) the grouped GEMMs ran 0.6x dense at 128 tokens (16 choices per expert), 1.1x at 512
# (64), 2.4x at 2048, 5.8x at 32768
GROUPED_MIN_CHOICES_PER_EXPERT = 64


@jax.named_scope("shared_experts")
def shared_experts(p: Params, cfg: InklingConfig, flat: Float[Array, "n h"], gamma: Float[Array, "n s"],
                   parallel: "ParallelAxes | None" = None, matvec: Any = None) -> Float[Array, "n h"]:
    """The shared experts' summed output (fp32), each weighted by its sink gamma (the router's
    renormalised weight) when the config says so.

    matvec: a `pallas_kernels.moe.pallas.grouped_matvec`-like function (y[i] = x[i // x_repeat]
    @ w[idx[i]], fp32) for a few tokens: row t * S + s is token t through expert s (x_repeat = S:
    the kernel reads each token's row in place, no repeated copy), reading each expert's
    [h, 2f] / [f, h] matrix in place (the batched einsum below made XLA's GPU layout copy the
    whole shared_w13 to [h, S, 2f] in every decode step). Same math and roundings either way."""
    n = flat.shape[0]
    gated = cfg.shared_expert_sink and cfg.norm_after_topk
    if matvec is not None:
        s = p["shared_w13"].shape[0]
        idx = jnp.tile(jnp.arange(s, dtype=jnp.int32), n)  # [n * S]: token-major
        gu = matvec(flat, idx, p["shared_w13"], x_repeat=s)  # [n * S, 2f] fp32; row i reads flat[i // S]
        half = gu.shape[-1] // 2
        act = jax.nn.silu(gu[:, :half]) * gu[:, half:]
        if gated:
            act = act * gamma.reshape(n * s, 1)
        y = matvec(act.astype(flat.dtype), idx, p["shared_w2"])  # [n * S, h] fp32
        shared = y.astype(flat.dtype).astype(jnp.float32).reshape(n, s, -1).sum(axis=1)
    else:
        xs, gs = flat, gamma
        if n == 1 and _pad_lone_row():  # keep the batched products GEMMs (see PAD_LONE_ROW)
            xs, gs = jnp.pad(flat, ((0, 1), (0, 0))), jnp.pad(gamma, ((0, 1), (0, 0)))
        # [S, 2F, n], tokens minor, as moe_experts_dense (XLA merges the two products' GEMMs)
        gu = jnp.einsum("nh,shf->sfn", xs, p["shared_w13"].astype(flat.dtype), preferred_element_type=jnp.float32)
        half = gu.shape[1] // 2
        act = jax.nn.silu(gu[:, :half]) * gu[:, half:]
        if gated:
            act = act * gs.T[:, None, :]
        act = act.astype(flat.dtype)
        shared = jnp.einsum("sfn,sfh->snh", act, p["shared_w2"].astype(flat.dtype),
                            preferred_element_type=jnp.float32)
        shared = shared[:, :n].astype(flat.dtype).astype(jnp.float32).sum(axis=0)
    if parallel is not None and parallel.ep > 1:  # every ep shard holds the shared experts: count them once
        shared = jnp.where(jax.lax.axis_index(parallel.ep_axis) == 0, shared, 0.0)
    return shared


@jax.named_scope("moe")
def moe_mlp(p: Params, cfg: InklingConfig, x: Array, experts_impl: str = "auto",
            few_token_experts: Any = None, parallel: "ParallelAxes | None" = None,
            many_token_experts: Any = None, few_token_matvec: Any = None, router_epilogue: Any = None,
            few_token_experts_with_shared: Any = None) -> Array:
    """MoE: routed top-k experts plus shared experts (sink-weighted or plain).

    experts_impl: a MOE_IMPLS name, or "auto": a few tokens read only their experts:
    `few_token_experts` (a function with moe_experts_slices' signature such as the Pallas
    grouped mat-vec kernel) up to n * k <= FEW_TOKEN_KERNEL_CHOICES_PER_EXPERT * E, else one
    slice per choice up to 3 * n * k <= E; past that reading every expert once is cheaper
    ("dense"); from n * k >= GROUPED_MIN_CHOICES_PER_EXPERT * E choices, `many_token_experts`
    when given (same signature: the Pallas sorted-block grouped GEMMs, which compute only the
    chosen experts; below that their padding of each expert's rows costs more than dense).
    `few_token_matvec` (the grouped mat-vec kernel) computes the shared experts where
    `few_token_experts` computes the routed. `few_token_experts_with_shared` (a
    `pallas_kernels.moe.pallas.moe_experts_with_shared`-like function): where the few-token
    experts are chosen and shared experts exist, the routed and the shared experts and their
    sum in one call instead (one grouped mat-vec launch per product for both; the same math);
    single device only: under `parallel` (shared experts counted on ep rank 0) the separate
    calls run. `router_epilogue`: see `route`.

    With `parallel`, cfg is the local config (E / ep experts of width F / tp here) and the
    router runs on `parallel.global_cfg` (see the module docstring)."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    routing_cfg = cfg if parallel is None else parallel.global_cfg
    idx, w, gamma = route(p, routing_cfg, flat, router_epilogue)
    if parallel is not None:
        idx, w = local_expert_choices(idx, w, p["w13"].shape[0], parallel)
    n = flat.shape[0]
    if experts_impl == "auto":
        choices = n * routing_cfg.num_experts_per_tok
        if few_token_experts is not None and choices <= FEW_TOKEN_KERNEL_CHOICES_PER_EXPERT * cfg.n_routed_experts:
            experts_impl = few_token_experts
        else:
            experts_impl = "slices" if 3 * choices <= cfg.n_routed_experts else "dense"
        many = choices >= GROUPED_MIN_CHOICES_PER_EXPERT * routing_cfg.n_routed_experts
        if experts_impl == "dense" and many and many_token_experts is not None:
            experts_impl = many_token_experts
    fn = experts_impl if callable(experts_impl) else MOE_IMPLS[experts_impl]
    if (few_token_experts_with_shared is not None and few_token_experts is not None and fn is few_token_experts
            and cfg.n_shared_experts > 0 and parallel is None):
        with jax.named_scope("routed_and_shared_experts"):
            out = few_token_experts_with_shared(flat, idx, w, p["w13"], p["w2"], p["shared_w13"], p["shared_w2"],
                                                gamma, gated=bool(cfg.shared_expert_sink and cfg.norm_after_topk))
        return out.astype(x.dtype).reshape(*lead, x.shape[-1])
    with jax.named_scope("routed_experts"):
        out = fn(flat, idx, w, p["w13"], p["w2"]).astype(jnp.float32)
    if cfg.n_shared_experts > 0:
        matvec = few_token_matvec if few_token_experts is not None and fn is few_token_experts else None
        out = out + shared_experts(p, cfg, flat, gamma, parallel, matvec)
    out = out.astype(x.dtype)
    if parallel is not None:
        out = jax.lax.psum(out, (parallel.ep_axis, parallel.tp_axis))
    return out.reshape(*lead, x.shape[-1])


def mlp(p: Params, cfg: InklingConfig, dense: bool, x: Array, few_token_experts: Any = None,
        parallel: "ParallelAxes | None" = None, many_token_experts: Any = None,
        few_token_matvec: Any = None, router_epilogue: Any = None, few_token_experts_with_shared: Any = None
        ) -> Array:
    if dense:
        return dense_mlp(p, cfg, x, parallel)
    return moe_mlp(p, cfg, x, few_token_experts=few_token_experts, parallel=parallel,
                   many_token_experts=many_token_experts, few_token_matvec=few_token_matvec,
                   router_epilogue=router_epilogue, few_token_experts_with_shared=few_token_experts_with_shared)


# ----------------------------------------------------------------------- the layer


def residual_conv_norm(ctx: LayerContext, stream: str, a: Array, weight: Array, x: Array, norm_weight: Array,
                       eps: float) -> tuple[Array, Array]:
    """(x + ctx.conv(stream, a, weight), rms_norm of that sum): the layer's residual short conv
    and the norm after it, through `ctx.conv_residual_norm(stream, a, weight, x, norm_weight)`
    where the context has one (the serving steps: one kernel on few-token steps), else the
    conv, the add and the norm as ops."""
    fused = getattr(ctx, "conv_residual_norm", None)
    if fused is not None:
        return fused(stream, a, weight, x, norm_weight)
    x = x + ctx.conv(stream, a, weight)
    return x, rms_norm(x, norm_weight, eps)


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
    add and the norm after it go through `residual_conv_norm` (one kernel where the context
    fuses them); a context without the fused op computes exactly the unfused ops."""
    eps = cfg.rms_norm_eps
    if h is None:
        h = rms_norm(x, p["attn_norm"], eps)
    a = attention_block(p["attn"], cfg, geom, h, ctx)
    x, h = residual_conv_norm(ctx, "attn", a, p["attn_conv"], x, p["mlp_norm"], eps)
    m = mlp(p["mlp"], cfg, dense, h, getattr(ctx, "few_token_experts", None), getattr(ctx, "parallel", None),
            getattr(ctx, "many_token_experts", None), getattr(ctx, "few_token_matvec", None),
            getattr(ctx, "router_epilogue", None), getattr(ctx, "few_token_experts_with_shared", None))
    if next_norm is None:
        return x + ctx.conv("mlp", m, p["mlp_conv"])
    return residual_conv_norm(ctx, "mlp", m, p["mlp_conv"], x, next_norm, eps)


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

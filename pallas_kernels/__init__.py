"""Pallas GPU kernels (Triton lowering), each beside its jnp reference; independent of the
library that calls them (they take arena rows, index arrays and static sizes, nothing else).

    conv_state/  ref.py, pallas.py   fused short-conv update and window writes
    slot_ops/    ref.py, pallas.py   field reads / writes; copy and clear of unit runs
    attention/   ref.py, pallas.py   flash-style attention with the relative bias (prefill / extend)
                 decode_ref.py, decode.py   decode / verify attention reading rings and pages in place
    moe/         ref.py, pallas.py   grouped mat-vec for the routed experts of a few tokens
                 grouped.py          sorted-block grouped GEMMs for the routed experts of many
    norm/        ref.py, pallas.py   the attention block's per-head q / k RMSNorms in one launch

    conv_ops(use_pallas, interpret=False) -> ConvOps

picks the implementation of the operations once; every function of the returned `ConvOps`
has the reference's signature (`interpret` is bound):

    conv_update(arena, x, weight, rows, active_row, track_row, *, window_shape, channels,
                sink_rows) -> (y, arena)
    conv_write(arena, x, window, rows, active_row, track_row, *, window_shape, channels,
               sink_rows) -> arena
    conv_residual_norm(arena, x, weight, rows, active_row, track_row, residual, norm_weight, *,
               eps, window_shape, channels, sink_rows) -> (residual + y, rms_norm(residual + y), arena):
        conv_update fused with the decoder layer's residual add and next RMSNorm, or None for
        the references (the layer then runs conv_update, the add and the norm)
    copy_units(arena, src_rows, dst_rows, *, num_units, sink_rows) -> arena
    clear_units(arena, dst_rows, *, num_units, sink_rows) -> arena
    moe_experts(x, idx, weight, w13, w2) -> y, or None for the references (the model's MoE
        then picks its own jnp implementation)
    moe_experts_many(x, idx, weight, w13, w2) -> y, the same for many tokens, or None
    moe_experts_with_shared(x, idx, weight, w13, w2, shared_w13, shared_w2, gamma, *, gated) -> y:
        moe_experts plus the shared experts added as layers.moe_mlp adds them, each product of
        both in one grouped mat-vec launch (few tokens, single device), or None
    grouped_matvec(x, idx, w, *, x_repeat=1) -> y [m, F] fp32, y[i] = x[i // x_repeat] @ w[idx[i]]
        (ids clamped to [0, E) in the kernel): the shared experts of a few tokens
        (layers.shared_experts' matvec) and a lone token's attention projections (layers.matmul's
        matvec), or None
    attention(q, k, v, rel, q_pos, k_pos, k_valid, *, window) -> out, or None (the model's
        attention_core materialises the scores then)
    ring_attention(q, r, rel_proj, tau, k_new, v_new, q_pos, q_valid, arena, ring_unit_row,
        seq_start, has_state, *, ring, window) -> out, or None (the step gathers the ring then);
        the relative bias (r @ rel_proj) and the log scaling (tau) computed in the kernel
    paged_attention(q, r, rel_proj, tau, k_new, v_new, q_pos, q_valid, arena, page_unit_row,
        seq_start, *, page_size, window) -> out, or None (the step gathers the pages then)
    router_epilogue(logits, bias, scale, *, k, route_scale, num_experts) -> (idx, w, gamma):
        layers.route after its matmul, or None (route's jnp then)
    qk_norm(q, kv, q_weight, k_weight, *, num_heads, num_kv_heads, head_dim, eps)
        -> (q_normed [T, nh, hd], k_normed [T, nkv, hd]): layers.attention_block's per-head
        rms_norms of q (the first nh * hd columns of q, read in place) and k (the first half of
        the k|v conv output, read in place) in one launch, or None (the block's jnp then)

`use_pallas`: False -> the jnp references; True -> the Pallas kernels; "auto" -> Pallas when
`jax.default_backend() == "gpu"`, the references otherwise. `interpret=True` runs the Pallas
kernels in interpret mode (any backend; this is how CPU tests run them: `conv_ops(True, True)`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Callable

import jax

from . import attention, conv_state, moe, norm, slot_ops


@dataclass(frozen=True)
class ConvOps:
    """The conv-state and unit operations of one implementation (reference signatures)."""

    conv_update: Callable
    conv_write: Callable
    copy_units: Callable
    clear_units: Callable
    moe_experts: Callable | None = None  # few-token routed experts (layers.moe_mlp's few_token_experts)
    moe_experts_many: Callable | None = None  # many-token routed experts (layers.moe_mlp's many_token_experts)
    grouped_matvec: Callable | None = None  # y[i] = x[i] @ w[idx[i]] (layers.shared_experts' matvec, few tokens)
    moe_experts_with_shared: Callable | None = None  # few-token routed + shared experts (layers.moe_mlp)
    attention: Callable | None = None  # fused attention of many queries (steps.context.StepContext.attend)
    ring_attention: Callable | None = None  # few queries against sliding rings read in place (decode / verify)
    paged_attention: Callable | None = None  # few queries against full-attention pages read in place
    router_epilogue: Callable | None = None  # the MoE router after its matmul (layers.route's epilogue)
    conv_residual_norm: Callable | None = None  # conv_update + residual add + next RMSNorm (few-token steps)
    qk_norm: Callable | None = None  # the attention block's per-head q / k RMSNorms (few-token steps)
    pallas: bool = False  # True: the Pallas kernels
    interpret: bool = False


REFERENCE_OPS = ConvOps(conv_update=conv_state.ref.conv_update, conv_write=conv_state.ref.conv_write,
                        copy_units=slot_ops.ref.copy_units, clear_units=slot_ops.ref.clear_units,
                        pallas=False, interpret=False)


def conv_ops(use_pallas: bool | str, interpret: bool = False) -> ConvOps:
    """The implementation to use: see the module docstring."""
    if use_pallas == "auto":
        use_pallas = jax.default_backend() == "gpu"
    elif not isinstance(use_pallas, bool):
        raise ValueError(f"use_pallas must be True, False or 'auto', not {use_pallas!r}")
    if not use_pallas:
        return REFERENCE_OPS
    if not interpret and jax.default_backend() != "gpu":
        raise ValueError(f"Pallas kernels need a GPU (backend is {jax.default_backend()!r}); pass interpret=True "
                         "to run them in interpret mode, or use_pallas='auto'")
    return _pallas_ops(interpret)


@lru_cache(maxsize=None)
def _pallas_ops(interpret: bool) -> ConvOps:
    """The Pallas ops, each behind its own jit (one set per process): a step calls the same
    kernel at the same shapes in every layer, and a jit traces and lowers it once for all of
    them (the persistent compilation cache stores compiled programs, not this lowering, so
    without it every fresh process traced and lowered each layer's kernels again: ~25 s of a
    bench-model start). Inside the step the jit is a call XLA inlines: the arena is still
    updated in place."""
    def jitted(fn, *static):
        return jax.jit(partial(fn, interpret=interpret), static_argnames=static)

    conv = ("window_shape", "channels", "sink_rows", "block", "num_warps")
    units = ("num_units", "sink_rows")
    return ConvOps(
        conv_update=jitted(conv_state.pallas.conv_update, *conv, "tile"),
        conv_write=jitted(conv_state.pallas.conv_write, *conv),
        conv_residual_norm=jitted(conv_state.pallas.conv_update_residual_norm, "eps", "window_shape", "channels",
                                  "sink_rows", "num_warps"),
        copy_units=jitted(slot_ops.pallas.copy_units, *units),
        clear_units=jitted(slot_ops.pallas.clear_units, *units),
        moe_experts=jitted(moe.pallas.moe_experts, "tf", "bh", "splits", "num_warps", "target_programs"),
        moe_experts_many=jitted(moe.grouped.moe_experts_grouped, "bm", "bn", "bk", "num_warps", "num_stages"),
        moe_experts_with_shared=jitted(moe.pallas.moe_experts_with_shared, "gated", "tf", "bh", "splits",
                                       "num_warps", "target_programs"),
        grouped_matvec=jitted(moe.pallas.grouped_matvec, "x_repeat", "tf", "bh", "splits", "num_warps",
                              "target_programs"),
        attention=jitted(attention.pallas.attention, "window", "bq", "bk", "num_warps", "num_stages"),
        ring_attention=jitted(attention.decode.ring_attention, "ring", "window", "num_splits", "bk", "num_warps",
                              "num_stages"),
        paged_attention=jitted(attention.decode.paged_attention, "page_size", "window", "num_splits", "num_warps",
                               "num_stages"),
        router_epilogue=jitted(moe.router.router_epilogue, "k", "route_scale", "num_experts", "block_rows",
                               "num_warps"),
        qk_norm=jitted(norm.pallas.qk_norm, "num_heads", "num_kv_heads", "head_dim", "eps", "num_warps"),
        pallas=True, interpret=interpret)


__all__ = ["ConvOps", "REFERENCE_OPS", "attention", "conv_ops", "conv_state", "moe", "norm", "slot_ops"]

"""The kernel seam: one record, `KernelOps`, of every operation the serving steps and the layers
hand to a kernel, in two implementations with the same signatures.

    REFERENCE_OPS          the jnp implementations (the `ref.py` files): what the CPU serves,
                           and the oracle (and fallback, and backward) of each kernel
    pallas_ops(interpret)  the Pallas kernels behind the same signatures; each wrapper picks,
                           from the sizes it is given, the kernel or the reference (the bounds
                           below), so a caller never asks whether a kernel exists

`pallas_kernels.kernel_ops(use_pallas, interpret)` (alias `conv_ops`) picks one. Every field
of either record is a function; the fields and their Pallas choices:

    conv_update, conv_write, copy_units, clear_units    always the kernel (`conv_state`, `slot_ops`)
    conv_residual_norm   conv_update + residual add + the next RMSNorm: the fused kernel up to
                         FUSED_CONV_NORM_MAX_TOKENS packed tokens, else the conv_update kernel,
                         the add and the norm
    matmul(x, w)         x @ w, fp32 (the attention block's projections): a lone row through
                         the mat-vec kernel (`moe.pallas.matvec`), more rows XLA's product
    qk_norm              the per-head q / k RMSNorms: the kernel up to QK_NORM_MAX_TOKENS tokens
    router_epilogue      the router after its matmul: the kernel for the sigmoid +
                         norm_after_topk routers, the reference for the others
    experts              the MoE block's routed (+ shared) experts: the grouped mat-vec kernel
                         up to FEW_TOKEN_KERNEL_CHOICES_PER_EXPERT * E choices (routed and
                         shared rows in one launch per product on a single device; a mesh
                         keeps separate calls), the sorted-block grouped GEMMs from
                         GROUPED_MIN_CHOICES_PER_EXPERT * E choices, the reference between
    ring_attention,      a step's attention against the sliding rings / the pages and its own
    paged_attention      new keys: rows of < FUSED_ATTENTION_MIN_QUERY queries through the
                         decode kernels reading the arena in place, longer rows gather the
                         context and take the flash kernel

The bounds are module globals read when a step is traced (bench / tests may set them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp

from . import _common, attention, conv_state, moe, norm, slot_ops

# experts: the grouped mat-vec kernel (which reads one expert matrix per choice) up to
# n * k <= this * E choices, where dense reads all E once. Measured in the engine loop
# (BENCHMARKS.md, 2026-12-06, H100, `python -m bench.serve.serve --sections verify
# --few-token-bounds 0.3333,0.5`): a batch-1 verify step (4 tokens, top-4 of 32 = 16 choices)
# took 7.31 ms dense and 7.50 ms by the kernel (bound 1/2), batch 8 the same either way; so
# the bound stays at 1/3: decode up to batch 2 by the kernel, verify steps dense.
FEW_TOKEN_KERNEL_CHOICES_PER_EXPERT = 1 / 3

# experts: the sorted-block grouped GEMMs from n * k >= this * E choices (E: the router's, every
# ep shard's): on the H200 (bench model, python -m bench.kernels.moe_micro --many) they ran 0.6x dense at 128
# tokens (16 choices per expert), 1.1x at 512 (64), 2.4x at 2048, 5.8x at 32768
GROUPED_MIN_CHOICES_PER_EXPERT = 64

# qk_norm: tokens up to which the kernel (one program per token row) runs. Decode, verify and
# the MTP depths of batches up to 256 rows are below it: there the norms are a few launches of
# almost no work, and the kernel is one. Prefill chunks above keep the jnp norm, whose epilogue
# XLA can fuse into the attention's per-row gathers of q and k; the kernel is unmeasured at
# thousands of rows
QK_NORM_MAX_TOKENS = 256

# conv_residual_norm: packed tokens up to which the fused kernel (one program per token row)
# replaces conv_update + the residual add + the next norm. Decode (one token per row) and the
# MTP depths of small batches are below it; prefill chunks above keep conv_update, whose token
# tiles and channel blocks were tuned for many tokens (token_tile is 1 up to ~256 tokens at the
# bench width, so the fused kernel's one token per program gives up nothing here; above, unmeasured)
FUSED_CONV_NORM_MAX_TOKENS = 64

# ring / paged attention: query rows per row from which the context is gathered and the flash
# kernel runs (prefill, extend); below, the decode kernels read the arena in place
FUSED_ATTENTION_MIN_QUERY = 32


@dataclass(frozen=True)
class KernelOps:
    """The kernel-backed operations of one implementation (see the module docstring); every
    field of both records has the reference's signature (`tests/test_kernel_ops.py`)."""

    conv_update: Callable  # conv_state.ref.conv_update: one stream's short conv + window writes
    conv_write: Callable  # conv_state.ref.conv_write: the window writes alone (verify, after acceptance)
    conv_residual_norm: Callable  # conv_state.ref.conv_update_residual_norm: + residual add + next RMSNorm
    copy_units: Callable  # slot_ops.ref.copy_units
    clear_units: Callable  # slot_ops.ref.clear_units
    matmul: Callable  # _common.matmul: x @ w, fp32 (the attention block's projections)
    qk_norm: Callable  # norm.ref.qk_norm: the attention block's per-head q / k RMSNorms
    router_epilogue: Callable  # moe.router.router_epilogue_ref: the router after its matmul
    experts: Callable  # moe.ref.experts: the routed (+ shared) experts of a MoE layer
    ring_attention: Callable  # attention.decode_ref.ring_attention: attention against the sliding rings
    paged_attention: Callable  # attention.decode_ref.paged_attention: attention against the pages
    pallas: bool = False  # True: the Pallas kernels
    interpret: bool = False


REFERENCE_OPS = KernelOps(
    conv_update=conv_state.ref.conv_update, conv_write=conv_state.ref.conv_write,
    conv_residual_norm=conv_state.ref.conv_update_residual_norm, copy_units=slot_ops.ref.copy_units,
    clear_units=slot_ops.ref.clear_units, matmul=_common.matmul, qk_norm=norm.ref.qk_norm,
    router_epilogue=moe.router.router_epilogue_ref, experts=moe.ref.experts,
    ring_attention=attention.decode_ref.ring_attention, paged_attention=attention.decode_ref.paged_attention)


def pallas_ops(interpret: bool, many_token_experts: Callable | None = None) -> KernelOps:
    """The Pallas ops (`interpret`: interpret mode), each kernel behind its own jit: a step
    calls the same kernel at the same shapes in every layer, and a jit traces and lowers it
    once for all of them (the persistent compilation cache stores compiled programs, not this
    lowering, so without it every fresh process traced and lowered each layer's kernels again:
    ~25 s of a bench-model start). Inside the step the jit is a call XLA inlines: the arena is
    still updated in place. The wrappers around them are plain functions (their choices read
    the bounds above at trace time).

    many_token_experts: the routed experts of many tokens (default: the sorted-block grouped
    GEMMs; `bench.serve.prefill` swaps in `moe.ref.moe_experts_ragged`)."""
    def jitted(fn, *static):
        return jax.jit(partial(fn, interpret=interpret), static_argnames=static)

    conv, units = ("window_shape", "channels", "sink_rows", "block", "num_warps"), ("num_units", "sink_rows")
    matvec_tiles = ("tf", "bh", "splits", "num_warps", "target_programs")
    conv_update_k = jitted(conv_state.pallas.conv_update, *conv, "tile")
    conv_write_k = jitted(conv_state.pallas.conv_write, *conv)
    conv_norm_k = jitted(conv_state.pallas.conv_update_residual_norm, "eps", "window_shape", "channels", "sink_rows",
                         "num_warps")
    copy_k, clear_k = jitted(slot_ops.pallas.copy_units, *units), jitted(slot_ops.pallas.clear_units, *units)
    matvec_k = jitted(moe.pallas.grouped_matvec, "x_repeat", *matvec_tiles)
    lone_row_k = jitted(moe.pallas.matvec, "tf", "bh", "num_warps", "target_programs")
    few_k = jitted(moe.pallas.moe_experts, *matvec_tiles)
    joined_k = jitted(moe.pallas.moe_experts_with_shared, "gated", *matvec_tiles)
    many_k = many_token_experts or jitted(moe.grouped.moe_experts_grouped, "bm", "bn", "bk", "num_warps",
                                          "num_stages")
    router_k = jitted(moe.router.router_epilogue, "k", "route_scale", "num_experts", "block_rows", "num_warps")
    qk_norm_k = jitted(norm.pallas.qk_norm, "num_heads", "num_kv_heads", "head_dim", "eps", "num_warps")
    flash_k = jitted(attention.pallas.attention, "window", "bq", "bk", "num_warps", "num_stages")
    ring_k = jitted(attention.decode.ring_attention, "ring", "window", "num_splits", "bk", "num_warps", "num_stages")
    paged_k = jitted(attention.decode.paged_attention, "page_size", "window", "num_splits", "num_warps",
                     "num_stages")

    def conv_update(arena, x, weight, rows, active_row, track_row, *, window_shape, channels, sink_rows=0):
        return conv_update_k(arena, x, weight, rows, active_row, track_row, window_shape=window_shape,
                             channels=channels, sink_rows=sink_rows)

    def conv_write(arena, x, window, rows, active_row, track_row, *, window_shape, channels, sink_rows=0):
        return conv_write_k(arena, x, window, rows, active_row, track_row, window_shape=window_shape,
                            channels=channels, sink_rows=sink_rows)

    def conv_residual_norm(arena, x, weight, rows, active_row, track_row, residual, norm_weight, *, eps,
                           window_shape, channels, sink_rows=0):
        kw = dict(window_shape=window_shape, channels=channels, sink_rows=sink_rows)
        if x.shape[0] > FUSED_CONV_NORM_MAX_TOKENS:
            y, arena = conv_update(arena, x, weight, rows, active_row, track_row, **kw)
            return (*conv_state.ref.residual_norm(y, residual, norm_weight, eps), arena)
        return conv_norm_k(arena, x, weight, rows, active_row, track_row, residual, norm_weight, eps=eps, **kw)

    def copy_units(arena, src_rows, dst_rows, *, num_units=1, sink_rows=0):
        return copy_k(arena, src_rows, dst_rows, num_units=num_units, sink_rows=sink_rows)

    def clear_units(arena, dst_rows, *, num_units=1, sink_rows=0):
        return clear_k(arena, dst_rows, num_units=num_units, sink_rows=sink_rows)

    def matmul(x, w):
        # a lone row (batch-1 decode): where XLA's GEMM needed the row padded to two and sliced back
        if w.ndim == 2 and math.prod(x.shape[:-1]) == 1:
            return lone_row_k(x.reshape(1, -1), w).reshape(*x.shape[:-1], w.shape[-1])
        return _common.matmul(x, w)

    def qk_norm(q, kv, q_weight, k_weight, *, num_heads, num_kv_heads, head_dim, eps):
        fn = qk_norm_k if q.shape[0] <= QK_NORM_MAX_TOKENS else norm.ref.qk_norm
        return fn(q, kv, q_weight, k_weight, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                  eps=eps)

    def router_epilogue(logits, bias, scale, *, k, route_scale, num_experts=None, gate="sigmoid",
                        norm_after_topk=True):
        if gate == "sigmoid" and norm_after_topk:
            return router_k(logits, bias, scale, k=k, route_scale=float(route_scale), num_experts=num_experts)
        return moe.router.router_epilogue_ref(logits, bias, scale, k=k, route_scale=route_scale,
                                              num_experts=num_experts, gate=gate, norm_after_topk=norm_after_topk)

    def experts(x, idx, weight, w13, w2, shared_w13=None, shared_w2=None, gamma=None, *, gated=False,
                num_experts=None, shared_mask=None):
        choices = math.prod(idx.shape)
        few = choices <= FEW_TOKEN_KERNEL_CHOICES_PER_EXPERT * w13.shape[0]
        if few and shared_w13 is not None and shared_mask is None:
            with jax.named_scope("routed_and_shared_experts"):  # one launch per product for both
                return joined_k(x, idx, weight, w13, w2, shared_w13, shared_w2, gamma, gated=gated)
        many = choices >= GROUPED_MIN_CHOICES_PER_EXPERT * (num_experts or w13.shape[0])
        routed = few_k if few else many_k if many else moe.ref.moe_experts
        return moe.ref.add_shared(routed, matvec_k if few else None, x, idx, weight, w13, w2, shared_w13,
                                  shared_w2, gamma, gated, shared_mask)

    def flash(q, r, rel_proj, tau, k_new, v_new, q_pos, q_valid, keys, window):
        """The context keys and the new ones as one key set through the flash kernel."""
        ctx_k, ctx_v, ctx_pos, ctx_valid = keys
        qs, rel = attention.ref.tables(q, r, rel_proj, tau)
        return flash_k(qs, jnp.concatenate([ctx_k.astype(k_new.dtype), k_new], axis=1),
                       jnp.concatenate([ctx_v.astype(v_new.dtype), v_new], axis=1), rel, q_pos,
                       jnp.concatenate([ctx_pos, q_pos], axis=1), jnp.concatenate([ctx_valid, q_valid], axis=1),
                       window=window)

    def ring_attention(q, r, rel_proj, tau, k_new, v_new, q_pos, q_valid, arena, ring_unit_row, seq_start,
                       has_state, *, ring, window, context=None):
        if q.shape[1] < FUSED_ATTENTION_MIN_QUERY:
            return ring_k(q, r, rel_proj, tau, k_new, v_new, q_pos, q_valid, arena, ring_unit_row, seq_start,
                          has_state, ring=ring, window=window)
        keys = context() if context is not None else attention.decode_ref.ring_keys(
            arena, ring_unit_row, seq_start, has_state, ring=ring, nkv=k_new.shape[2], hd=k_new.shape[3])
        return flash(q, r, rel_proj, tau, k_new, v_new, q_pos, q_valid, keys, window)

    def paged_attention(q, r, rel_proj, tau, k_new, v_new, q_pos, q_valid, arena, page_unit_row, seq_start, *,
                        page_size, window=None, context=None):
        if q.shape[1] < FUSED_ATTENTION_MIN_QUERY:
            return paged_k(q, r, rel_proj, tau, k_new, v_new, q_pos, q_valid, arena, page_unit_row, seq_start,
                           page_size=page_size, window=window)
        keys = context() if context is not None else attention.decode_ref.page_keys(
            arena, page_unit_row, seq_start, nkv=k_new.shape[2], hd=k_new.shape[3])
        return flash(q, r, rel_proj, tau, k_new, v_new, q_pos, q_valid, keys, window)

    return KernelOps(conv_update=conv_update, conv_write=conv_write, conv_residual_norm=conv_residual_norm,
                     copy_units=copy_units, clear_units=clear_units, matmul=matmul, qk_norm=qk_norm,
                     router_epilogue=router_epilogue, experts=experts, ring_attention=ring_attention,
                     paged_attention=paged_attention, pallas=True, interpret=interpret)


__all__ = ["FEW_TOKEN_KERNEL_CHOICES_PER_EXPERT", "FUSED_ATTENTION_MIN_QUERY", "FUSED_CONV_NORM_MAX_TOKENS",
           "GROUPED_MIN_CHOICES_PER_EXPERT", "KernelOps", "QK_NORM_MAX_TOKENS", "REFERENCE_OPS", "pallas_ops"]

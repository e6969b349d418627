"""Pallas GPU kernels (Triton lowering), each beside its jnp reference; independent of the
library that calls them (they take arena rows, index arrays and static sizes, nothing else;
`inkling_jax` imports this package, never the other way round).

    ops.py       KernelOps: the kernel seam (below), its bounds and the Pallas wrappers
    _common.py   pow2 helpers, rms_norm and matmul (the model's own: one copy), kernel plumbing
    conv_state/  ref.py, pallas.py   fused short-conv update and window writes (+ residual add and
                                     the next RMSNorm: conv_update_residual_norm)
    slot_ops/    ref.py, pallas.py   field reads / writes; copy and clear of unit runs
    attention/   ref.py, pallas.py   the model's attention math; flash-style kernel with the relative
                                     bias (prefill / extend)
                 decode_ref.py, decode.py   a step's attention against the rings / pages of the
                                     arena; kernels reading them in place (decode / verify)
    moe/         ref.py              the routed and shared experts (every jnp strategy)
                 pallas.py           grouped mat-vec for the experts of a few tokens
                 grouped.py          sorted-block grouped GEMMs for the routed experts of many
                 router.py           the router after its matmul (jnp; one-launch kernel)
    norm/        ref.py, pallas.py   the attention block's per-head q / k RMSNorms in one launch

    kernel_ops(use_pallas, interpret=False) -> KernelOps      (conv_ops: the same function)

picks the implementation once. Every field of a `KernelOps` is a function with the same
signature in both implementations (`interpret` is bound): the jnp one (`REFERENCE_OPS`, the
ref.py functions) is what the CPU serves and the oracle of the Pallas one, and the Pallas one
decides by the sizes it is given whether its kernel or the reference runs:

    conv_update(arena, x, weight, rows, active_row, track_row, *, window_shape, channels,
                sink_rows=0) -> (y, arena)
    conv_write(arena, x, window, rows, active_row, track_row, *, window_shape, channels,
               sink_rows=0) -> arena
    conv_residual_norm(arena, x, weight, rows, active_row, track_row, residual, norm_weight, *,
               eps, window_shape, channels, sink_rows=0) -> (residual + y, rms_norm(residual + y), arena):
        conv_update with the decoder layer's residual add and next RMSNorm (one kernel up to
        ops.FUSED_CONV_NORM_MAX_TOKENS packed tokens)
    copy_units(arena, src_rows, dst_rows, *, num_units=1, sink_rows=0) -> arena
    clear_units(arena, dst_rows, *, num_units=1, sink_rows=0) -> arena
    matmul(x, w) -> x @ w fp32: the attention block's projections (a lone row: the grouped
        mat-vec kernel, where XLA's GEMM needed it padded to two)
    qk_norm(q, kv, q_weight, k_weight, *, num_heads, num_kv_heads, head_dim, eps)
        -> (q_normed [T, nh, hd], k_normed [T, nkv, hd]): the attention block's per-head
        rms_norms of q (the first nh * hd columns of q, read in place) and k (the first half of
        the k|v conv output, read in place) (one kernel up to ops.QK_NORM_MAX_TOKENS tokens)
    router_epilogue(logits, bias, scale, *, k, route_scale, num_experts=None, gate="sigmoid",
        norm_after_topk=True) -> (idx, w, gamma): the router after its matmul (one kernel for
        the sigmoid + norm_after_topk routers)
    experts(x, idx, weight, w13, w2, shared_w13=None, shared_w2=None, gamma=None, *, gated=False,
        num_experts=None, shared_mask=None) -> y: the routed experts plus the shared ones
        (shared_mask, on a mesh: applied to their sum before the add); the grouped mat-vec
        kernel for a few tokens (routed and shared rows in one launch per product where
        shared_mask is None), the grouped GEMMs for many (ops.FEW_TOKEN_KERNEL_CHOICES_PER_EXPERT,
        ops.GROUPED_MIN_CHOICES_PER_EXPERT)
    ring_attention(q, r, rel_proj, tau, k_new, v_new, q_pos, q_valid, arena, ring_unit_row,
        seq_start, has_state, *, ring, window, context=None) -> out
    paged_attention(q, r, rel_proj, tau, k_new, v_new, q_pos, q_valid, arena, page_unit_row,
        seq_start, *, page_size, window=None, context=None) -> out: a step's queries against
        the sliding rings / the full-attention pages and their own new keys, the relative
        bias (r @ rel_proj) and the log scaling (tau) applied; `context` (optional) reads the
        context keys for the paths that gather them. Rows of < ops.FUSED_ATTENTION_MIN_QUERY
        queries: the decode kernels, reading the arena in place; longer: the flash kernel

`use_pallas`: False -> the jnp references; True -> the Pallas kernels; "auto" -> Pallas when
`jax.default_backend() == "gpu"`, the references otherwise. `interpret=True` runs the Pallas
kernels in interpret mode (any backend; this is how CPU tests run them: `kernel_ops(True, True)`).
"""

from __future__ import annotations

from functools import lru_cache

import jax

from . import attention, conv_state, moe, norm, ops, slot_ops
from .ops import REFERENCE_OPS, KernelOps

ConvOps = KernelOps  # the record's earlier name


def kernel_ops(use_pallas: bool | str, interpret: bool = False) -> KernelOps:
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


conv_ops = kernel_ops  # the earlier name (engine/runner.py, steps/program.py, bench/)


@lru_cache(maxsize=None)
def _pallas_ops(interpret: bool) -> KernelOps:
    """The Pallas ops, one set per process and mode (`ops.pallas_ops`: each kernel behind its
    own jit, traced and lowered once for every layer that calls it)."""
    return ops.pallas_ops(interpret)


__all__ = ["ConvOps", "KernelOps", "REFERENCE_OPS", "attention", "conv_ops", "conv_state", "kernel_ops", "moe", "norm",
           "ops", "slot_ops"]

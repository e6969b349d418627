"""Pallas GPU kernels (Triton lowering), each beside its jnp reference in `inkling_jax.cache`.

    conv_ops(use_pallas, interpret=False) -> ConvOps

picks the implementation of the five conv-state / slot operations once; every function of
the returned `ConvOps` has the reference's signature (`interpret` is bound):

    conv_update(arena, layout, f, channels, x, weight, meta) -> (y, arena)
    conv_write(arena, layout, f, channels, x, window, meta) -> arena
    copy_slot_units(arena, layout, src, dst, first_unit=0, num_units=None) -> arena
    clear_slot_units(arena, layout, dst, first_unit=0, num_units=None) -> arena
    move_units(arena, src_rows, dst_rows) -> arena

plus `moe_experts` (`pallas_kernels.moe`: the routed experts of a few tokens as a grouped
mat-vec kernel; None for the references, whose MoE picks its own jnp implementation).

`use_pallas`: False -> the jnp references; True -> the Pallas kernels; "auto" -> Pallas when
`jax.default_backend() == "gpu"`, the references otherwise. `interpret=True` runs the Pallas
kernels in interpret mode (any backend; this is how CPU tests run them: `conv_ops(True, True)`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import jax

from inkling_jax.cache import conv_state as _ref_conv
from inkling_jax.cache import state as _ref_state

from . import conv_state, moe, slot_ops


@dataclass(frozen=True)
class ConvOps:
    """The conv-state and slot operations of one implementation (reference signatures)."""

    conv_update: Callable
    conv_write: Callable
    copy_slot_units: Callable
    clear_slot_units: Callable
    move_units: Callable
    moe_experts: Callable | None  # few-token routed experts (layers.moe_mlp's few_token_experts)
    pallas: bool  # True: the Pallas kernels
    interpret: bool


REFERENCE_OPS = ConvOps(_ref_conv.conv_update, _ref_conv.conv_write, _ref_state.copy_slot_units,
                        _ref_state.clear_slot_units, _ref_state.move_units, None, pallas=False, interpret=False)


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
    bind = partial(partial, interpret=interpret)
    return ConvOps(bind(conv_state.conv_update), bind(conv_state.conv_write), bind(slot_ops.copy_slot_units),
                   bind(slot_ops.clear_slot_units), bind(slot_ops.move_units), bind(moe.moe_experts), pallas=True, interpret=interpret)


__all__ = ["ConvOps", "REFERENCE_OPS", "conv_ops", "conv_state", "moe", "slot_ops"]

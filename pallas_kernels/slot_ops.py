"""Pallas kernels for whole-unit slot operations on the arena: copy, clear, move.

Mirror `inkling_jax/cache/state.py` (`copy_slot_units`, `clear_slot_units`, `move_units`)
with the same signatures plus `interpret`, update the arena in place
(`input_output_aliases`; donate the arena to the enclosing jit), have a `jax.custom_vjp`
whose backward is the reference's VJP, and run on CPU with `interpret=True`.

The arena `[U, E]` is viewed as `[U * E / L, L]` with L the largest power of two dividing E
(at most `MAX_TILE`); program (pair m, tile j) moves one contiguous L-element row of the view.
Row indices are int32, so `U * E / L` must stay below 2^31 (else: the reference).

Deviations from the reference, confined to state that never matters: copy / clear pairs
whose destination is the sink (physical slot 0) do nothing, where the reference writes the
sink (copy: in an unspecified order when several pairs aim at it).

Preconditions (the kernels do not check them): destination slots / rows are pairwise distinct
(sink pairs aside) and disjoint from the source slots / rows, as the reference's docstrings
ask; the reference reads every source before writing, a kernel in place does not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Int

from inkling_jax.cache import state as ref
from inkling_jax.cache.layout import ArenaLayout

from ._common import INT32_MAX, pallas_call, pow2_factor, with_ref_vjp

MAX_TILE = 4096  # elements per program


def _tile(arena_shape: tuple[int, ...]) -> int | None:
    """L (elements moved per program), or None when the arena needs the reference."""
    if len(arena_shape) != 2:
        return None
    num_units, e = arena_shape
    tile = min(pow2_factor(e), MAX_TILE)
    if num_units * (e // tile) > INT32_MAX:
        return None
    return tile


def _num_warps(tile: int) -> int:
    return max(1, min(8, tile // 512))


def _split(pid, tiles: int):
    return (pid, 0) if tiles == 1 else (pid // tiles, pid % tiles)


def _unit_range(layout: ArenaLayout, first_unit: int, num_units: int | None) -> tuple[int, int]:
    n = layout.slot_units - first_unit if num_units is None else num_units
    return first_unit, n


# ---------------------------------------------------------------------------------- copy


def _copy_pallas(arena, layout: ArenaLayout, src, dst, first_unit: int, n: int, tile: int, interpret: bool):
    per_unit = arena.shape[1] // tile
    tiles = n * per_unit
    slot_stride = layout.slot_units * per_unit
    first = first_unit * per_unit

    def kernel(src_ref, dst_ref, arena_in, arena_out):
        m, j = _split(pl.program_id(0), tiles)
        d = dst_ref[m]

        @pl.when(d != 0)
        def _():
            arena_out[d * slot_stride + first + j, :] = arena_in[src_ref[m] * slot_stride + first + j, :]

    arena2 = arena.reshape(-1, tile)
    out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(arena2.shape, arena2.dtype),
                      grid=(src.shape[0] * tiles,), aliases={2: 0}, interpret=interpret,
                      num_warps=_num_warps(tile), name="copy_slot_units")(
        src.astype(jnp.int32), dst.astype(jnp.int32), arena2)
    return out.reshape(arena.shape)


def copy_slot_units(arena: Array, layout: ArenaLayout, src: Int[Array, "m"], dst: Int[Array, "m"],
                    first_unit: int = 0, num_units: int | None = None, *, interpret: bool = False) -> Array:
    """Copy units [first_unit, first_unit + num_units) of physical slots src -> dst (whole
    entry by default); pairs with dst = 0 (the sink) are inert."""
    first, n = _unit_range(layout, first_unit, num_units)
    tile = _tile(arena.shape)
    ref_fn = lambda a, s, d: ref.copy_slot_units(a, layout, s, d, first_unit, num_units)
    if tile is None or n <= 0 or src.ndim != 1 or src.shape != dst.shape or src.shape[0] == 0:
        return ref_fn(arena, src, dst)
    kernel_fn = lambda a, s, d: _copy_pallas(a, layout, s, d, first, n, tile, interpret)
    return with_ref_vjp(kernel_fn, ref_fn)(arena, src, dst)


# --------------------------------------------------------------------------------- clear


def _clear_pallas(arena, layout: ArenaLayout, dst, first_unit: int, n: int, tile: int, interpret: bool):
    per_unit = arena.shape[1] // tile
    tiles = n * per_unit
    slot_stride = layout.slot_units * per_unit
    first = first_unit * per_unit
    dtype = arena.dtype

    def kernel(dst_ref, arena_in, arena_out):
        del arena_in  # aliased to arena_out; only written
        m, j = _split(pl.program_id(0), tiles)
        d = dst_ref[m]

        @pl.when(d != 0)
        def _():
            arena_out[d * slot_stride + first + j, :] = jnp.zeros((tile,), dtype)

    arena2 = arena.reshape(-1, tile)
    out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(arena2.shape, arena2.dtype),
                      grid=(dst.shape[0] * tiles,), aliases={1: 0}, interpret=interpret,
                      num_warps=_num_warps(tile), name="clear_slot_units")(dst.astype(jnp.int32), arena2)
    return out.reshape(arena.shape)


def clear_slot_units(arena: Array, layout: ArenaLayout, dst: Int[Array, "m"], first_unit: int = 0,
                     num_units: int | None = None, *, interpret: bool = False) -> Array:
    """Zero units [first_unit, first_unit + num_units) of physical slots dst; dst = 0 (the
    sink) is inert."""
    first, n = _unit_range(layout, first_unit, num_units)
    tile = _tile(arena.shape)
    ref_fn = lambda a, d: ref.clear_slot_units(a, layout, d, first_unit, num_units)
    if tile is None or n <= 0 or dst.ndim != 1 or dst.shape[0] == 0:
        return ref_fn(arena, dst)
    kernel_fn = lambda a, d: _clear_pallas(a, layout, d, first, n, tile, interpret)
    return with_ref_vjp(kernel_fn, ref_fn)(arena, dst)


# ---------------------------------------------------------------------------------- move


def _move_pallas(arena, src_rows, dst_rows, tile: int, interpret: bool):
    per_unit = arena.shape[1] // tile

    def kernel(src_ref, dst_ref, arena_in, arena_out):
        m, j = _split(pl.program_id(0), per_unit)
        arena_out[dst_ref[m] * per_unit + j, :] = arena_in[src_ref[m] * per_unit + j, :]

    arena2 = arena.reshape(-1, tile)
    out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(arena2.shape, arena2.dtype),
                      grid=(src_rows.shape[0] * per_unit,), aliases={2: 0}, interpret=interpret,
                      num_warps=_num_warps(tile), name="move_units")(
        src_rows.astype(jnp.int32), dst_rows.astype(jnp.int32), arena2)
    return out.reshape(arena.shape)


def move_units(arena: Array, src_rows: Int[Array, "m"], dst_rows: Int[Array, "m"], *,
               interpret: bool = False) -> Array:
    """arena[dst] = arena[src] for disjoint src / dst unit-row sets (compaction moves)."""
    tile = _tile(arena.shape)
    if tile is None or src_rows.ndim != 1 or src_rows.shape != dst_rows.shape or src_rows.shape[0] == 0:
        return ref.move_units(arena, src_rows, dst_rows)
    kernel_fn = lambda a, s, d: _move_pallas(a, s, d, tile, interpret)
    return with_ref_vjp(kernel_fn, ref.move_units)(arena, src_rows, dst_rows)

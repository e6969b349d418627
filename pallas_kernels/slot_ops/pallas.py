"""Pallas kernels for whole-unit operations on the arena: copy and clear runs of units.

Same signatures and results as `ref.py` (plus `interpret`), updating the arena in place
(`input_output_aliases`; donate the arena to the enclosing jit), with a `jax.custom_vjp`
whose backward is the reference's VJP; they run on CPU with `interpret=True`.

The arena `[U, E]` is viewed as `[U * E / L, L]` with L the largest power of two dividing E
(at most `MAX_TILE`); program (pair m, tile j) moves one contiguous L-element row of the view.
Row indices are int32, so `U * E / L` must stay below 2^31 (else: the reference).

Deviation from the reference, confined to state that never matters: pairs whose destination
lies in the sink (`dst_row < sink_rows`) do nothing, where the reference writes the sink
(copy: in an unspecified order when several pairs aim at it).

Preconditions (the kernels do not check them): destination runs are pairwise disjoint (sink
pairs aside) and disjoint from the source runs, as `ref.copy_units` asks; the reference reads
every source before writing, a kernel in place does not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Int

from .._common import INT32_MAX, pallas_call, pow2_factor, with_ref_vjp
from . import ref

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


# ---------------------------------------------------------------------------------- copy


def _copy_pallas(arena, src_rows, dst_rows, num_units: int, sink_rows: int, tile: int, interpret: bool):
    per_unit = arena.shape[1] // tile
    tiles = num_units * per_unit

    def kernel(src_ref, dst_ref, arena_in, arena_out):
        m, j = _split(pl.program_id(0), tiles)
        d = dst_ref[m]

        @pl.when(d >= sink_rows)
        def _():
            arena_out[d * per_unit + j, :] = arena_in[src_ref[m] * per_unit + j, :]

    arena2 = arena.reshape(-1, tile)
    out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(arena2.shape, arena2.dtype),
                      grid=(src_rows.shape[0] * tiles,), aliases={2: 0}, interpret=interpret,
                      num_warps=_num_warps(tile), name="copy_units")(
        src_rows.astype(jnp.int32), dst_rows.astype(jnp.int32), arena2)
    return out.reshape(arena.shape)


def copy_units(arena: Array, src_rows: Int[Array, " m"], dst_rows: Int[Array, " m"], *, num_units: int = 1,
               sink_rows: int = 0, interpret: bool = False) -> Array:
    """`ref.copy_units`: runs of `num_units` units src -> dst; pairs aimed at the sink are inert."""
    tile = _tile(arena.shape)
    ref_fn = lambda a, s, d: ref.copy_units(a, s, d, num_units=num_units, sink_rows=sink_rows)
    if tile is None or num_units <= 0 or src_rows.ndim != 1 or src_rows.shape != dst_rows.shape \
            or src_rows.shape[0] == 0:
        return ref_fn(arena, src_rows, dst_rows)
    kernel_fn = lambda a, s, d: _copy_pallas(a, s, d, num_units, sink_rows, tile, interpret)
    return with_ref_vjp(kernel_fn, ref_fn)(arena, src_rows, dst_rows)


# --------------------------------------------------------------------------------- clear


def _clear_pallas(arena, dst_rows, num_units: int, sink_rows: int, tile: int, interpret: bool):
    per_unit = arena.shape[1] // tile
    tiles = num_units * per_unit
    dtype = arena.dtype

    def kernel(dst_ref, arena_in, arena_out):
        del arena_in  # aliased to arena_out; only written
        m, j = _split(pl.program_id(0), tiles)
        d = dst_ref[m]

        @pl.when(d >= sink_rows)
        def _():
            arena_out[d * per_unit + j, :] = jnp.zeros((tile,), dtype)

    arena2 = arena.reshape(-1, tile)
    out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(arena2.shape, arena2.dtype),
                      grid=(dst_rows.shape[0] * tiles,), aliases={1: 0}, interpret=interpret,
                      num_warps=_num_warps(tile), name="clear_units")(dst_rows.astype(jnp.int32), arena2)
    return out.reshape(arena.shape)


def clear_units(arena: Array, dst_rows: Int[Array, " m"], *, num_units: int = 1, sink_rows: int = 0,
                interpret: bool = False) -> Array:
    """`ref.clear_units`: zero runs of `num_units` units; runs in the sink are inert."""
    tile = _tile(arena.shape)
    ref_fn = lambda a, d: ref.clear_units(a, d, num_units=num_units, sink_rows=sink_rows)
    if tile is None or num_units <= 0 or dst_rows.ndim != 1 or dst_rows.shape[0] == 0:
        return ref_fn(arena, dst_rows)
    kernel_fn = lambda a, d: _clear_pallas(a, d, num_units, sink_rows, tile, interpret)
    return with_ref_vjp(kernel_fn, ref_fn)(arena, dst_rows)

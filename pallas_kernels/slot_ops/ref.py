"""jnp references for whole-unit operations on an arena `[U, E]`: field reads and writes,
copies and clears of runs of units.

The kernels know nothing of slots or pages: callers pass the arena row of each run's first
unit (`inkling_jax.cache.layout` owns the formula from a physical slot or page to its rows).
A *field* is a row-major array of `shape` stored from its first row on, over
ceil(prod(shape) / E) whole units; the elements past prod(shape) in the last unit are
padding (zero in any arena the library builds).

`sink_rows`: rows [0, sink_rows) belong to the sink (physical slot 0). The references write
there like anywhere else; the Pallas kernels skip such writes (the sink's contents never
matter).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jaxtyping import Array, Int


def field_units(shape: tuple[int, ...], unit_elems: int) -> int:
    """Whole units a field of `shape` occupies."""
    return max(1, -(-math.prod(shape) // unit_elems))


def unit_rows(first_rows: Int[Array, "..."], num_units: int) -> Int[Array, "... n"]:
    """Arena rows of runs of `num_units` units starting at `first_rows`."""
    return first_rows[..., None] + jnp.arange(num_units, dtype=jnp.int32)


def read_field(arena: Array, first_rows: Int[Array, " b"], shape: tuple[int, ...]) -> Array:
    """[B, *shape]: the field of `shape` stored from each of B first rows."""
    b, e = first_rows.shape[0], arena.shape[1]
    n = field_units(shape, e)
    flat = arena[unit_rows(first_rows, n)].reshape(b, n * e)
    return flat[:, :math.prod(shape)].reshape(b, *shape)


def write_field(arena: Array, first_rows: Int[Array, " b"], values: Array) -> Array:
    """Store values [B, *shape] as fields from B first rows (padding elements become zero)."""
    b, e = first_rows.shape[0], arena.shape[1]
    elems = math.prod(values.shape[1:])
    n = field_units(values.shape[1:], e)
    flat = values.reshape(b, elems).astype(arena.dtype)
    if n * e > elems:
        flat = jnp.pad(flat, ((0, 0), (0, n * e - elems)))
    return arena.at[unit_rows(first_rows, n)].set(flat.reshape(b, n, e))


def copy_units(arena: Array, src_rows: Int[Array, " m"], dst_rows: Int[Array, " m"], *, num_units: int = 1,
               sink_rows: int = 0) -> Array:
    """arena[dst + i] = arena[src + i] for i < num_units, every pair at once (all sources are
    read before any write). Destination runs must be pairwise disjoint (sink pairs aside)."""
    del sink_rows  # the reference writes the sink too
    return arena.at[unit_rows(dst_rows, num_units)].set(arena[unit_rows(src_rows, num_units)])


def clear_units(arena: Array, dst_rows: Int[Array, " m"], *, num_units: int = 1, sink_rows: int = 0) -> Array:
    """Zero runs of `num_units` units starting at dst_rows."""
    del sink_rows
    rows = unit_rows(dst_rows, num_units)
    return arena.at[rows].set(jnp.zeros(rows.shape + (arena.shape[1],), arena.dtype))

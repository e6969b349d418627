"""Device serving state: the unit arena and the virtual -> physical id tables.

    arena     [num_units, unit_elems]   model dtype; slots grow up from unit 0, pages down
                                        from the top (see `layout.py`)
    slot_v2p  int32 [num_virtual_slots + 1]   virtual slot id -> physical slot index
    page_v2p  int32 [num_virtual_pages + 1]   virtual page id -> physical page index

Physical slot j occupies units [j * slot_units, (j + 1) * slot_units); physical page q
occupies units [U - (q + 1) * page_units, U - q * page_units). Physical slot 0 and page 0
are sinks: padded rows and masked writes land there, and they are never handed out.

Batches carry virtual ids only; `translate_*` (used inside the jitted steps, and only there)
turns them into physical indices through the live tables.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from .layout import ArenaLayout, Field


@jax.tree_util.register_dataclass
@dataclass
class ServingState:
    arena: Array
    slot_v2p: Int[Array, "vs"]
    page_v2p: Int[Array, "vp"]

    def replace(self, **kw: Any) -> "ServingState":
        return replace(self, **kw)

    @property
    def num_units(self) -> int:
        return self.arena.shape[0]


def init_state(layout: ArenaLayout, num_units: int, num_virtual_slots: int, num_virtual_pages: int,
               dtype: Any) -> ServingState:
    return ServingState(
        arena=jnp.zeros((num_units, layout.unit_elems), dtype),
        slot_v2p=jnp.zeros((num_virtual_slots + 1,), jnp.int32),
        page_v2p=jnp.zeros((num_virtual_pages + 1,), jnp.int32),
    )


# ------------------------------------------------------------------- translation


def translate_slots(state: ServingState, virtual: Int[Array, "..."]) -> Int[Array, "..."]:
    """Virtual slot ids -> physical slot indices. -1 ("absent") and 0 map to the sink."""
    return jnp.where(virtual > 0, state.slot_v2p[jnp.maximum(virtual, 0)], 0)


def translate_pages(state: ServingState, virtual: Int[Array, "..."]) -> Int[Array, "..."]:
    return jnp.where(virtual > 0, state.page_v2p[jnp.maximum(virtual, 0)], 0)


# ------------------------------------------------------------------ unit row maths


def slot_rows(layout: ArenaLayout, phys_slot: Int[Array, "..."], f: Field) -> Int[Array, "... n"]:
    """Arena rows of field f of the given physical slots."""
    base = phys_slot * layout.slot_units + f.unit_offset
    return base[..., None] + jnp.arange(f.units, dtype=jnp.int32)


def page_rows(layout: ArenaLayout, num_units: int, phys_page: Int[Array, "..."], page_layer: int) -> Int[Array, "..."]:
    """Arena row holding `page_layer`'s K/V of the given physical pages."""
    return num_units - (phys_page + 1) * layout.page_units + page_layer


def read_field(arena: Array, layout: ArenaLayout, rows: Int[Array, "b n"], f: Field) -> Array:
    """[B, *f.shape] from the arena rows of one field of B objects."""
    b = rows.shape[0]
    flat = arena[rows].reshape(b, f.units * layout.unit_elems)
    return flat[:, :f.elems].reshape(b, *f.shape)


def write_field(arena: Array, layout: ArenaLayout, rows: Int[Array, "b n"], f: Field, values: Array) -> Array:
    """Write [B, *f.shape] values into whole units (padding elements become zero)."""
    b = rows.shape[0]
    flat = values.reshape(b, f.elems).astype(arena.dtype)
    pad = f.units * layout.unit_elems - f.elems
    if pad:
        flat = jnp.pad(flat, ((0, 0), (0, pad)))
    return arena.at[rows].set(flat.reshape(b, f.units, layout.unit_elems))


def copy_slot_units(arena: Array, layout: ArenaLayout, src: Int[Array, "m"], dst: Int[Array, "m"],
                    first_unit: int = 0, num_units: int | None = None) -> Array:
    """Copy units [first_unit, first_unit + num_units) of physical slots src -> dst.

    The whole entry by default (target and draft blocks); the draft block alone with
    first_unit = layout.draft_unit_start. Pairs with dst = 0 (the sink) are inert."""
    n = layout.slot_units - first_unit if num_units is None else num_units
    f = Field(first_unit, n, (n * layout.unit_elems,))
    src_rows, dst_rows = slot_rows(layout, src, f), slot_rows(layout, dst, f)
    return arena.at[dst_rows].set(arena[src_rows])


def clear_slot_units(arena: Array, layout: ArenaLayout, dst: Int[Array, "m"], first_unit: int = 0,
                     num_units: int | None = None) -> Array:
    n = layout.slot_units - first_unit if num_units is None else num_units
    f = Field(first_unit, n, (n * layout.unit_elems,))
    rows = slot_rows(layout, dst, f)
    return arena.at[rows].set(jnp.zeros(rows.shape + (layout.unit_elems,), arena.dtype))


def move_units(arena: Array, src_rows: Int[Array, "m"], dst_rows: Int[Array, "m"]) -> Array:
    """arena[dst] = arena[src] for disjoint src / dst sets (compaction moves)."""
    return arena.at[dst_rows].set(arena[src_rows])

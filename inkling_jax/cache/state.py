"""Device serving state: the unit arena and the virtual -> physical id tables.

    arena     [num_units, unit_elems]   model dtype; slots grow up from unit 0, pages down
                                        from the top (see `layout.py`, which owns the row
                                        formulas)
    slot_v2p  int32 [num_virtual_slots + 1]   virtual slot id -> physical slot index
    page_v2p  int32 [num_virtual_pages + 1]   virtual page id -> physical page index
    counts    int32 [rows, vocab] or None     the penalties' token counts, one row per running
                                        request (`steps/counts.py`); None: no count table (a
                                        step then applies no count-based penalty)

Physical slot 0 and page 0 are sinks: padded rows and masked writes land there, and they are
never handed out.

Batches carry virtual ids only; `translate_*` (used inside the jitted steps, and only there)
turns them into physical indices through the live tables.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, no_type_check

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int
from pallas_kernels.slot_ops import ref as units

from .layout import ArenaLayout, Field


# no_type_check (the tests' jaxtyping hook): a pytree node, rebuilt through __init__ by JAX with
# leaves of any kind (lowering's ArgInfo, specs, float0 cotangents; numpy on the host)
@no_type_check
@jax.tree_util.register_dataclass
@dataclass
class ServingState:
    arena: Array
    slot_v2p: Int[Array, " vs"]
    page_v2p: Int[Array, " vp"]
    counts: Int[Array, "r v"] | None = None

    def replace(self, **kw: Any) -> "ServingState":
        return replace(self, **kw)

    @property
    def num_units(self) -> int:
        return self.arena.shape[0]


def init_state(layout: ArenaLayout, num_units: int, num_virtual_slots: int, num_virtual_pages: int,
               dtype: Any, count_rows: int = 0, vocab: int = 0) -> ServingState:
    """A zero state; with count_rows > 0 a zero count table [count_rows, vocab] too."""
    return ServingState(
        arena=jnp.zeros((num_units, layout.unit_elems), dtype),
        slot_v2p=jnp.zeros((num_virtual_slots + 1,), jnp.int32),
        page_v2p=jnp.zeros((num_virtual_pages + 1,), jnp.int32),
        counts=jnp.zeros((count_rows, vocab), jnp.int32) if count_rows else None,
    )


# ------------------------------------------------------------------- translation


def translate_slots(state: ServingState, virtual_slot: Int[Array, "..."]) -> Int[Array, "..."]:
    """Virtual slot ids -> physical slot indices. -1 ("absent") and 0 map to the sink."""
    return jnp.where(virtual_slot > 0, state.slot_v2p[jnp.maximum(virtual_slot, 0)], 0)


def translate_pages(state: ServingState, virtual_page: Int[Array, "..."]) -> Int[Array, "..."]:
    return jnp.where(virtual_page > 0, state.page_v2p[jnp.maximum(virtual_page, 0)], 0)


# ------------------------------------------------------------------- slot fields


def read_slot_field(arena: Array, layout: ArenaLayout, physical_slot: Int[Array, " b"], f: Field) -> Array:
    """[B, *f.shape]: field f of B physical slots."""
    return units.read_field(arena, layout.slot_row(physical_slot, f), f.shape)


def write_slot_field(arena: Array, layout: ArenaLayout, physical_slot: Int[Array, " b"], f: Field,
                     values: Array) -> Array:
    """Store values [B, *f.shape] as field f of B physical slots (padding elements zero)."""
    return units.write_field(arena, layout.slot_row(physical_slot, f), values)

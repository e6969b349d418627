"""The bucket the step-level checks compile for (`Geometry`), and the hand-built step over
several requests that the isolation check probes (`isolation_scenario`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

from ..cache.layout import ArenaLayout
from ..cache.state import ServingState, init_state
from ..config import InklingConfig
from ..steps import RowPlan, StepBatch, StepShape, pack_batch
from .step_fns import StepFn, make_step_fn


@dataclass(frozen=True)
class Geometry:
    """The bucket the step-level checks compile for: the arena layout, the step shape, and how
    many slots / pages the arena holds (physical = virtual, behind shuffled id tables)."""

    layout: ArenaLayout
    shape: StepShape
    num_slots: int
    num_pages: int

    @property
    def num_units(self) -> int:
        return self.layout.arena_units(self.num_slots, self.num_pages)

    def state(self, arena: np.ndarray | None = None, seed: int = 0, dtype: Any = jnp.float32) -> ServingState:
        """A state of this geometry: zero arena unless given; slot and page tables shuffled
        permutations (virtual 0 -> physical 0, the sinks)."""
        rng = np.random.RandomState(seed)
        st = init_state(self.layout, self.num_units, self.num_slots, self.num_pages, dtype)
        slot_v2p = np.concatenate([[0], rng.permutation(np.arange(1, self.num_slots + 1))]).astype(np.int32)
        page_v2p = np.concatenate([[0], rng.permutation(np.arange(1, self.num_pages + 1))]).astype(np.int32)
        st = st.replace(slot_v2p=jnp.asarray(slot_v2p), page_v2p=jnp.asarray(page_v2p))
        if arena is not None:
            st = st.replace(arena=jnp.asarray(arena, dtype))
        return st


def default_geometry(cfg: InklingConfig, page_size: int = 4) -> Geometry:
    """extend step, B 4 rows, T 16 packed tokens, Q 8 new tokens per row, P 8 pages per row
    (32 positions); 8 slots and 32 pages."""
    return Geometry(ArenaLayout.build(cfg, page_size), StepShape("extend", 4, 16, 8, 8), 8, 32)


@dataclass
class Scenario:
    """One step over several requests, built by hand."""

    cfg: InklingConfig
    geometry: Geometry
    state: ServingState
    batch: StepBatch
    description: str

    @property
    def layout(self) -> ArenaLayout:
        return self.geometry.layout

    @property
    def shape(self) -> StepShape:
        return self.geometry.shape

    def step_fn(self, context_cls: type | None = None) -> StepFn:
        return make_step_fn(self.cfg, self.layout, self.shape, context_cls)


def isolation_scenario(cfg: InklingConfig, geometry: Geometry | None = None, seed: int = 0,
                       dtype: Any = jnp.float32) -> Scenario:
    """An extend step (default geometry: B 4, T 16, Q 8, P 8 with page_size 4) over:

      row 0: a continuing request, 6 cached tokens, 3 new, checkpointing after 2 of them
      row 1: a continuing request, 13 cached tokens (its sliding ring has wrapped), 1 new
      row 2: a fresh request, 5 new (its slot holds a stale entry that it must not read)
      row 3: a padded row (the sink slot and sink pages, no tokens)
      tokens 9..15: padding tokens (on the padded row)

    Virtual slot / page ids go through shuffled tables; the arena is random normal, so any
    row a request reads moves its logits. Unlike `pack_batch`'s padding (offsets past any
    conv tap, token id 0), the padding tokens here are random ids at offsets 0, 1, ... of the
    padded row, where its new tokens would sit: only its num_new = 0 may keep them out."""
    geometry = geometry or default_geometry(cfg)
    if geometry.shape.batch < 4 or geometry.shape.tokens < 9 or geometry.shape.query < 5 \
            or geometry.shape.pages < 4 or geometry.num_slots < 7 or geometry.num_pages < 12:
        raise ValueError("isolation_scenario needs B >= 4, T >= 9, Q >= 5, P >= 4, 7 slots and 12 pages")
    b, t, p = geometry.shape.batch, geometry.shape.tokens, geometry.shape.pages
    rng = np.random.RandomState(seed)
    state = geometry.state(rng.standard_normal((geometry.num_units, geometry.layout.unit_elems)), seed, dtype)
    tokens = rng.randint(3, cfg.unpadded_vocab_size, t).astype(np.int32)
    batch = pack_batch(geometry.shape, [
        RowPlan(tokens[0:3], seq_start=6, virtual_slot=2, virtual_pages=[3, 9, 1], virtual_track_slots=[3],
                track_lens=[2]),
        RowPlan(tokens[3:4], seq_start=13, virtual_slot=5, virtual_pages=[4, 6, 11, 12]),
        RowPlan(tokens[4:9], seq_start=0, virtual_slot=7, virtual_pages=[8, 10]),
    ])
    # padding tokens: row 3's would-be new tokens (random ids, offsets 0, 1, ...); the padded
    # rows start where they do
    batch.layout.tokens[9:] = tokens[9:]
    batch.layout.token_row[9:] = 3
    batch.layout.token_offset[9:] = np.arange(t - 9)
    batch.layout.query_start[3:] = 9
    description = "\n".join([
        f"extend step, B {b} rows, T {t} packed tokens, Q {geometry.shape.query}, P {p} pages per row:",
        "  row 0: continuing request, 6 cached tokens, 3 new, checkpoint after 2 of them",
        "  row 1: continuing request, 13 cached tokens (its sliding ring has wrapped), 1 new",
        "  row 2: fresh request, 5 new (its slot holds a stale entry it must not read)",
        f"  row 3{'..' + str(b - 1) if b > 4 else ''}: padded (sink slot, sink pages, no tokens)",
        f"  tokens 9..{t - 1}: padding tokens"])
    return Scenario(cfg, geometry, state, batch, description)

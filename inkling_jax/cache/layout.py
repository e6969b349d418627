"""Where every piece of per-request serving state lives inside the unit arena.

The device holds one arena `[num_units, unit_elems]` (model dtype). Two kinds of object
live in it, each a whole number of contiguous units:

* a **slot** (`slot_units` units): everything a request needs to resume besides its
  full-attention history. Target block: for every layer the K-1-row conv windows of its
  four streams (k, v, attn, mlp; channels concatenated), and for every sliding layer a
  ring of the last `ring` tokens' K/V. Draft block (with speculative decoding): the same for
  each MTP depth, plus the depth's carried hidden state. A prefix-cache checkpoint is a slot
  too, so a checkpoint restores conv windows, sliding K/V and draft state together.
* a **page** (`page_units` units): `page_size` tokens of K/V for every full-attention layer
  (trunk full layers, then full-attention MTP depths), one unit per layer.

Where things are (the one place that says it; kernels take the rows these give):

    physical slot j, unit u of it:   arena row  j * slot_units + u          (`slot_unit_row`)
    physical page q, page layer l:   arena row  U - (q + 1) * page_units + l  (`page_unit_row`)
    conv stream s of a layer:        channels `LayerSlotFields.channels(s)` of its conv field

Physical slot 0 (rows [0, slot_units)) and physical page 0 are sinks; an arena of n slots
and m pages has `arena_units(n, m)` = (n + 1) * slot_units + (m + 1) * page_units units.

The unit is one full-attention layer's K/V page: `page_size * 2 * kv_heads * head_dim`
elements. Every field starts on a unit boundary, so steps move whole units (int32 row
indices into the arena; no element-level indexing, which would need 64-bit indices for an
arena past 2^31 elements).

A sliding ring has `ring >= window + spec_steps` rows: token at position p sits in row
p % ring. The extra `spec_steps` rows let a verify write draft K/V without overwriting any
key a later query of the same request can still see (see `steps.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..config import AttentionGeometry, InklingConfig


@dataclass(frozen=True)
class Field:
    """A run of `units` units starting `unit_offset` units into its object, holding a
    row-major array of `shape` (padded with unused elements to whole units)."""

    unit_offset: int
    units: int
    shape: tuple[int, ...]

    @property
    def elems(self) -> int:
        return math.prod(self.shape)


def slot_unit_row(physical_slot, slot_units: int, unit_offset: int = 0):
    """Arena row of unit `unit_offset` of physical slot(s) (ints, numpy or jax arrays)."""
    return physical_slot * slot_units + unit_offset


def arena_units(slot_units: int, page_units: int, num_slots: int, num_pages: int) -> int:
    """Units of an arena holding num_slots slots and num_pages pages besides the two sinks."""
    return (num_slots + 1) * slot_units + (num_pages + 1) * page_units


def page_unit_row(physical_page, num_units: int, page_units: int, page_layer: int = 0):
    """Arena row of unit `page_layer` of physical page(s): pages grow down from the top."""
    return num_units - (physical_page + 1) * page_units + page_layer


@dataclass(frozen=True)
class LayerSlotFields:
    conv: Field  # [K-1, C] with C = kv_dim (k) + kv_dim (v) + H (attn) + H (mlp)
    ring: Field | None  # sliding layers: [ring, 2, kv_heads, head_dim]
    hidden: Field | None  # MTP depths but the last: [H], the hidden state carried to the next depth
    kv_dim: int  # channels of the k (and of the v) stream

    def channels(self, stream: str) -> tuple[int, int]:
        """Channel range [c0, c1) of a conv stream in the conv field ("kv": k and v together)."""
        kv, h = self.kv_dim, (self.conv.shape[1] - 2 * self.kv_dim) // 2
        ranges = {"k": (0, kv), "v": (kv, 2 * kv), "kv": (0, 2 * kv), "attn": (2 * kv, 2 * kv + h),
                  "mlp": (2 * kv + h, 2 * kv + 2 * h)}
        if stream not in ranges:
            raise ValueError(f"unknown conv stream {stream!r}; streams: {', '.join(ranges)}")
        return ranges[stream]


@dataclass(frozen=True)
class ArenaLayout:
    cfg: InklingConfig
    page_size: int
    spec_steps: int  # MTP depths with state in the slot (0 = no draft block)
    unit_elems: int
    slot_units: int
    page_units: int
    ring: int
    target: tuple[LayerSlotFields, ...]  # per trunk layer
    draft: tuple[LayerSlotFields, ...]  # per MTP depth in use
    target_page_layer: tuple[int | None, ...]  # trunk layer -> unit within a page (None: sliding)
    draft_page_layer: tuple[int | None, ...]  # MTP depth -> unit within a page (None: sliding)
    draft_unit_start: int = field(default=0)  # first unit of the draft block in a slot

    @staticmethod
    def build(cfg: InklingConfig, page_size: int, spec_steps: int = 0) -> "ArenaLayout":
        if spec_steps > cfg.num_mtp_layers:
            raise ValueError(f"spec_steps={spec_steps} exceeds the model's {cfg.num_mtp_layers} MTP depths")
        full_kv = cfg.num_kv_heads * cfg.head_dim
        unit = page_size * 2 * full_kv
        k1 = cfg.conv_kernel_size - 1
        ring = cfg.max_window + spec_steps

        cursor = 0

        def take(shape: tuple[int, ...]) -> Field:
            nonlocal cursor
            n = max(1, math.ceil(math.prod(shape) / unit))
            f = Field(cursor, n, shape)
            cursor += n
            return f

        def layer_fields(g: AttentionGeometry, with_hidden: bool) -> LayerSlotFields:
            conv = take((k1, 2 * g.kv_dim + 2 * cfg.hidden_size))
            ring_f = take((ring, 2, g.num_kv_heads, g.head_dim)) if g.is_sliding else None
            hidden = take((cfg.hidden_size,)) if with_hidden else None
            return LayerSlotFields(conv, ring_f, hidden, g.kv_dim)

        target = tuple(layer_fields(cfg.layer_geometry(i), False) for i in range(cfg.num_layers))
        draft_start = cursor
        # the last depth hands its hidden to no one: no carry field
        draft = tuple(layer_fields(cfg.mtp_geometry(d), d < spec_steps - 1) for d in range(spec_steps))
        slot_units = cursor

        page_layer = 0
        target_page: list[int | None] = []
        for i in range(cfg.num_layers):
            g = cfg.layer_geometry(i)
            if g.is_sliding:
                target_page.append(None)
            else:
                assert g.kv_dim == full_kv
                target_page.append(page_layer)
                page_layer += 1
        draft_page: list[int | None] = []
        for d in range(spec_steps):
            g = cfg.mtp_geometry(d)
            if g.is_sliding:
                draft_page.append(None)
            else:
                draft_page.append(page_layer)
                page_layer += 1
        return ArenaLayout(cfg, page_size, spec_steps, unit, slot_units, max(page_layer, 1), ring,
                           target, draft, tuple(target_page), tuple(draft_page), draft_start)

    def slot_row(self, physical_slot, f: Field | None = None):
        """Arena row of field f's first unit (of the slot's first unit when f is None)."""
        return slot_unit_row(physical_slot, self.slot_units, 0 if f is None else f.unit_offset)

    def page_row(self, physical_page, num_units: int, page_layer: int):
        """Arena row holding `page_layer`'s K/V of the given physical pages."""
        return page_unit_row(physical_page, num_units, self.page_units, page_layer)

    def arena_units(self, num_slots: int, num_pages: int) -> int:
        """Units of an arena holding num_slots slots and num_pages pages besides the two sinks."""
        return arena_units(self.slot_units, self.page_units, num_slots, num_pages)

    @property
    def sink_rows(self) -> int:
        """Arena rows [0, sink_rows) are the sink slot's."""
        return self.slot_units

    @property
    def slot_elems(self) -> int:
        return self.slot_units * self.unit_elems

    @property
    def draft_units(self) -> int:
        return self.slot_units - self.draft_unit_start

    def describe(self) -> str:
        b = self.unit_elems
        return (f"unit {b} elems; slot {self.slot_units} units (draft block {self.draft_units}); "
                f"page {self.page_units} units of {self.page_size} tokens; ring {self.ring} rows")

"""Host-side allocator of slots and pages in the unit arena, with virtual ids and compaction.

Everything outside this class (scheduler, prefix tree, sessions, request records) holds
*virtual* ids only. This class alone knows where an object physically lives; it keeps the
virtual -> physical tables that the device steps translate through, and plans the device
copies (compaction moves) that change them.

Arena picture (`pool="unified"`)::

    unit 0                                                        unit U-1
    | sink slot | slot 1 | slot 2 | ... ->   free   <- ... | page 2 | page 1 | sink page |

Slots grow up from the bottom, pages down from the top, both kept dense, so the boundary
between them follows the workload: a budget that holds many short requests (many slots,
few pages) also holds a few long ones (few slots, many pages).

* eager compaction: freeing an object moves the outermost live one of its kind into the
  hole at once (one whole-entry copy);
* lazy compaction: a freed object leaves a hole that the next allocation of the same kind
  reuses; holes are compacted only when the other kind needs the space (`_make_room`).

`pool="static"`: the same arena split once into `num_slots` slots and `num_pages` pages,
identity tables, no moves. The baseline the unified pool is measured against.

Moves are queued and coalesced: `pending_moves()` returns (src_rows, dst_rows) of arena
unit rows such that one gather-then-scatter (`arena.at[dst].set(arena[src])`) realises them
all. The engine applies them, with the new tables, before the next step, and only then
`ack_moves()`: a copy that fails leaves them queued (the tables already say where objects
will live, so the copy must happen before any step reads them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .layout import arena_units, page_unit_row, slot_unit_row


class PoolExhausted(Exception):
    """No room for the object even after compaction (the caller may evict and retry)."""


@dataclass
class _Kind:
    """One object kind (slots or pages) of the arena."""

    name: str
    units: int  # units per object
    max_virtual: int
    v2p: np.ndarray  # [ids the arena could hold + 1] int32 (>= max_virtual + 1); 0 = not allocated (the sink)
    p2v: dict[int, int]  # physical index -> virtual id of live objects
    free_virtual: list[int]  # sorted descending (pop() gives the smallest id)
    top: int  # highest physical index in use or reserved as a hole (0 = none)
    holes: set[int]  # lazy mode: freed physical indices below top
    fixed_capacity: int | None  # static pool: objects this kind may ever hold

    @property
    def live(self) -> int:
        return len(self.p2v)


class UnitPool:
    """The allocator of one arena of `num_units` unit rows (see the module docstring).

    budget_units (default num_units): the most units the unified pool's slots and pages may
    occupy together, sinks included; the arena may be larger (EngineConfig.arena_units). Every
    decision (room, compaction, exhaustion) is then exactly that of a pool of budget_units
    units: slots still grow from row 0 and pages from the arena's last row, with the unused rows
    between them. Only the arena's size sets the device tables' shapes, so engines of one arena
    size share compiled steps whatever their budgets."""

    def __init__(self, num_units: int, slot_units: int, page_units: int, *, unified: bool, lazy: bool,
                 num_slots: int, num_pages: int, budget_units: int | None = None):
        budget = num_units if budget_units is None else budget_units
        if budget > num_units:
            raise ValueError(f"budget of {budget} units exceeds the arena's {num_units}")
        if unified and arena_units(slot_units, page_units, num_slots, num_pages) > budget:
            raise ValueError("arena too small for the requested slots and pages")
        self.num_units = num_units
        self.budget_units = budget
        self.unified = unified
        self.lazy = lazy
        # Virtual id spaces: as many objects as the arena could hold of each kind. The static
        # pool hands out only its split's ids but keeps tables of the same size, so both pools
        # of one arena have the same state shapes (and share compiled steps); so does a unified
        # pool whose budget is smaller than its arena (ids past what the budget holds are
        # never handed out).
        table_slots = (num_units - page_units) // slot_units - 1
        table_pages = (num_units - slot_units) // page_units - 1
        if unified:
            max_slots = (budget - page_units) // slot_units - 1
            max_pages = (budget - slot_units) // page_units - 1
            cap_s = cap_p = None
        else:
            max_slots, max_pages = num_slots, num_pages
            cap_s, cap_p = num_slots, num_pages
        self.slots = _Kind("slot", slot_units, max_slots, np.zeros(table_slots + 1, np.int32), {},
                           list(range(max_slots, 0, -1)), 0, set(), cap_s)
        self.pages = _Kind("page", page_units, max_pages, np.zeros(table_pages + 1, np.int32), {},
                           list(range(max_pages, 0, -1)), 0, set(), cap_p)
        self._pending: dict[int, int] = {}  # dst unit row -> src unit row (pre-move contents)
        self.tables_dirty = True
        self.moves_done = 0

    # ------------------------------------------------------------------ geometry

    def _rows(self, kind: _Kind, phys: int) -> range:
        """The arena rows of a physical object (`layout.py`'s formulas)."""
        if kind is self.slots:
            first = slot_unit_row(phys, kind.units)
        else:
            first = page_unit_row(phys, self.num_units, kind.units)
        return range(first, first + kind.units)

    def _row_is_live(self, row: int) -> bool:
        """Whether arena row `row` belongs to a live slot or page (moves into rows whose
        object was freed since are dropped)."""
        if row < slot_unit_row(self.slots.top + 1, self.slots.units):
            return row // self.slots.units in self.slots.p2v
        phys = (self.num_units - 1 - row) // self.pages.units  # page_unit_row, inverted
        return phys <= self.pages.top and phys in self.pages.p2v

    def _units_used(self) -> int:
        return (self.slots.top + 1) * self.slots.units + (self.pages.top + 1) * self.pages.units

    def free_units(self) -> int:
        """Units available to new objects (holes included)."""
        holes = len(self.slots.holes) * self.slots.units + len(self.pages.holes) * self.pages.units
        return self.budget_units - self._units_used() + holes

    def can_alloc(self, slots: int, pages: int) -> bool:
        """Whether `slots` slots and `pages` pages fit now (compaction allowed)."""
        if not self.unified:
            return (self.slots.fixed_capacity - self.slots.live >= slots
                    and self.pages.fixed_capacity - self.pages.live >= pages)
        if len(self.slots.free_virtual) < slots or len(self.pages.free_virtual) < pages:
            return False
        return slots * self.slots.units + pages * self.pages.units <= self.free_units()

    def free_count(self, kind: str) -> int:
        """How many more objects of one kind fit if nothing else is allocated."""
        k = self.slots if kind == "slot" else self.pages
        if not self.unified:
            return k.fixed_capacity - k.live
        return min(len(k.free_virtual), self.free_units() // k.units)

    def capacity(self, kind: str) -> int:
        """The most objects of one kind the arena can ever hold (all else empty)."""
        k = self.slots if kind == "slot" else self.pages
        return k.fixed_capacity if not self.unified else k.max_virtual

    def live_count(self, kind: str) -> int:
        return (self.slots if kind == "slot" else self.pages).live

    # ------------------------------------------------------------------- alloc/free

    def alloc_slot(self) -> int:
        return self._alloc(self.slots)

    def alloc_page(self) -> int:
        return self._alloc(self.pages)

    def free_slot(self, virtual: int) -> None:
        self._free(self.slots, virtual)

    def free_page(self, virtual: int) -> None:
        self._free(self.pages, virtual)

    def _other(self, kind: _Kind) -> _Kind:
        return self.pages if kind is self.slots else self.slots

    def _alloc(self, kind: _Kind) -> int:
        if not kind.free_virtual:
            raise PoolExhausted(f"no free virtual {kind.name} id")
        if not self.unified:
            if kind.live >= kind.fixed_capacity:
                raise PoolExhausted(f"static pool: all {kind.fixed_capacity} {kind.name}s in use")
            virtual = kind.free_virtual.pop()
            phys = virtual  # identity
            kind.top = max(kind.top, phys)
        elif kind.holes:
            phys = min(kind.holes)
            kind.holes.remove(phys)
            virtual = kind.free_virtual.pop()
        else:
            if self._units_used() + kind.units > self.budget_units:
                self._make_room(self._other(kind))
                if self._units_used() + kind.units > self.budget_units:
                    raise PoolExhausted(f"unified pool: no room for a {kind.name}")
            virtual = kind.free_virtual.pop()
            kind.top += 1
            phys = kind.top
        kind.v2p[virtual] = phys
        kind.p2v[phys] = virtual
        self.tables_dirty = True
        return virtual

    def _free(self, kind: _Kind, virtual: int) -> None:
        if virtual <= 0 or virtual > kind.max_virtual or kind.v2p[virtual] == 0:
            raise AssertionError(f"stale {kind.name} id {virtual}: double free or never allocated")
        phys = int(kind.v2p[virtual])
        kind.v2p[virtual] = 0
        del kind.p2v[phys]
        kind.free_virtual.append(virtual)
        kind.free_virtual.sort(reverse=True)
        self.tables_dirty = True
        for row in self._rows(kind, phys):  # a planned copy into a dead object is moot
            self._pending.pop(row, None)
        if not self.unified:
            return
        if self.lazy:
            kind.holes.add(phys)
            self._trim(kind)
        else:
            if phys != kind.top:
                self._move(kind, kind.top, phys)
            kind.top -= 1

    def _trim(self, kind: _Kind) -> None:
        while kind.top in kind.holes:
            kind.holes.remove(kind.top)
            kind.top -= 1

    def _make_room(self, kind: _Kind) -> None:
        """Compact `kind`'s holes (lazy mode) so the other kind can grow into the space."""
        self._trim(kind)
        while kind.holes:
            hole = min(kind.holes)
            kind.holes.remove(hole)
            self._move(kind, kind.top, hole)
            kind.top -= 1
            self._trim(kind)

    def compact(self) -> None:
        """Force a full compaction of both kinds (lazy holes closed)."""
        if self.unified:
            self._make_room(self.slots)
            self._make_room(self.pages)

    def _move(self, kind: _Kind, src: int, dst: int) -> None:
        virtual = kind.p2v.pop(src)
        kind.p2v[dst] = virtual
        kind.v2p[virtual] = dst
        for s_row, d_row in zip(self._rows(kind, src), self._rows(kind, dst)):
            self._pending[d_row] = self._pending.get(s_row, s_row)
        self.moves_done += 1
        self.tables_dirty = True

    # ---------------------------------------------------------------- device sync

    def pending_moves(self) -> tuple[np.ndarray, np.ndarray]:
        """Coalesced pending moves as (src_rows, dst_rows); they stay queued until ack_moves()."""
        if not self._pending:  # the common step: nothing moved (no scan of the live objects)
            return np.zeros(0, np.int32), np.zeros(0, np.int32)
        pairs = [(s, d) for d, s in self._pending.items() if s != d and self._row_is_live(d)]
        if not pairs:
            self._pending.clear()
            return np.zeros(0, np.int32), np.zeros(0, np.int32)
        src, dst = zip(*sorted(pairs, key=lambda p: p[1]))
        return np.asarray(src, np.int32), np.asarray(dst, np.int32)

    def ack_moves(self) -> None:
        """The device copy of pending_moves() is done."""
        self._pending.clear()

    def has_pending_moves(self) -> bool:
        return bool(self._pending)

    def tables(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the (slot, page) virtual -> physical tables (the device takes these)."""
        return self.slots.v2p.copy(), self.pages.v2p.copy()

    def physical_slot(self, virtual: int) -> int:
        """For tests and invariant checks only: never store the result."""
        return int(self.slots.v2p[virtual])

    def physical_page(self, virtual: int) -> int:
        return int(self.pages.v2p[virtual])

    # ---------------------------------------------------------------- invariants

    def check(self, allow_pending_moves: bool = False) -> None:
        """The tables are a bijection between live virtual ids and live physical indices,
        slots and pages never overlap, nothing sits on a sink, and (unless allowed) every
        planned move was copied."""
        for kind in (self.slots, self.pages):
            live_v = {v for v in range(1, kind.max_virtual + 1) if kind.v2p[v] != 0}
            assert live_v == set(kind.p2v.values()), f"{kind.name}: v2p and p2v disagree"
            for phys, virtual in kind.p2v.items():
                assert kind.v2p[virtual] == phys, f"{kind.name} {virtual}: v2p[{virtual}] != {phys}"
                assert 1 <= phys <= kind.top, f"{kind.name} {virtual} at physical {phys} outside [1, {kind.top}]"
            assert not (kind.holes & set(kind.p2v)), f"{kind.name}: a hole is live"
            assert set(kind.free_virtual).isdisjoint(live_v), f"{kind.name}: a live id is on the free list"
            assert len(kind.free_virtual) + len(live_v) == kind.max_virtual, f"{kind.name}: ids leaked"
            if self.unified and not self.lazy:
                assert kind.top == kind.live and not kind.holes, f"{kind.name}: eager pool not dense"
        assert self._units_used() <= self.budget_units <= self.num_units, "slots and pages overlap or exceed the budget"
        assert allow_pending_moves or not self._pending, "moves planned but not applied"

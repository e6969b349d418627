"""UnitPool: virtual ids, compaction, the unified boundary, against a simulated arena."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inkling_jax.cache.pool import PoolExhausted, UnitPool

SLOT_UNITS, PAGE_UNITS = 3, 2


def make_pool(unified=True, lazy=False, slots=6, pages=10):
    units = (slots + 1) * SLOT_UNITS + (pages + 1) * PAGE_UNITS
    return UnitPool(units, SLOT_UNITS, PAGE_UNITS, unified=unified, lazy=lazy, num_slots=slots, num_pages=pages)


def take_moves(pool: UnitPool):
    """The pool's pending moves, acknowledged as done (what the engine does after its copy)."""
    moves = pool.pending_moves()
    pool.ack_moves()
    return moves


class SimArena:
    """Unit rows holding labels: applies the pool's moves exactly as the device would."""

    def __init__(self, pool: UnitPool):
        self.pool = pool
        self.rows = np.full(pool.num_units, -1, np.int64)

    def sync(self):
        src, dst = take_moves(self.pool)
        self.rows[dst] = self.rows[src]  # one gather-then-scatter, like `move_units`

    def write(self, kind: str, virtual: int, label: int):
        k = self.pool.slots if kind == "slot" else self.pool.pages
        self.rows[list(self.pool._rows(k, int(k.v2p[virtual])))] = label

    def read(self, kind: str, virtual: int) -> set[int]:
        k = self.pool.slots if kind == "slot" else self.pool.pages
        return set(self.rows[list(self.pool._rows(k, int(k.v2p[virtual])))].tolist())


@settings(max_examples=60, deadline=None)
@given(unified=st.booleans(), lazy=st.booleans(),
       ops=st.lists(st.tuples(st.sampled_from(["alloc_slot", "alloc_page", "free_slot", "free_page", "compact"]),
                              st.integers(0, 1000)), max_size=60))
def test_objects_keep_their_contents_through_compaction(unified, lazy, ops):
    """Random alloc / free / compact sequences: after applying the planned moves, every live
    virtual id still finds its own contents, the tables are a bijection, nothing overlaps."""
    pool = make_pool(unified, lazy)
    arena = SimArena(pool)
    live = {"slot": {}, "page": {}}
    label = 0
    for op, pick in ops:
        if op == "compact":
            pool.compact()
        elif op.startswith("alloc"):
            kind = op[6:]
            try:
                v = pool.alloc_slot() if kind == "slot" else pool.alloc_page()
            except PoolExhausted:
                assert not pool.can_alloc(kind == "slot", kind == "page")
                continue
            arena.sync()  # moves planned by this allocation land before the write
            label += 1
            arena.write(kind, v, label)
            live[kind][v] = label
        else:
            kind = op[5:]
            if not live[kind]:
                continue
            v = sorted(live[kind])[pick % len(live[kind])]
            (pool.free_slot if kind == "slot" else pool.free_page)(v)
            del live[kind][v]
        arena.sync()
        pool.check()
        for kind in live:
            for v, lab in live[kind].items():
                assert arena.read(kind, v) == {lab}, f"{kind} {v} lost its contents"


def test_stale_free_is_an_error():
    pool = make_pool()
    v = pool.alloc_slot()
    pool.free_slot(v)
    with pytest.raises(AssertionError, match="stale slot id"):
        pool.free_slot(v)
    with pytest.raises(AssertionError, match="stale page id"):
        pool.free_page(3)


def test_eager_unified_stays_dense():
    pool = make_pool()
    vs = [pool.alloc_slot() for _ in range(4)]
    ps = [pool.alloc_page() for _ in range(5)]
    pool.free_slot(vs[0])
    pool.free_page(ps[1])
    src, dst = take_moves(pool)
    assert len(src) == SLOT_UNITS + PAGE_UNITS  # one slot and one page moved into the holes
    pool.check()
    assert pool.slots.top == 3 and pool.pages.top == 4
    assert sorted(pool.slots.v2p[vs[1:]]) == [1, 2, 3]


def test_lazy_reuses_holes_and_compacts_on_demand():
    pool = make_pool(lazy=True, slots=2, pages=2)  # 3*3 + 3*2 = 15 units
    s = [pool.alloc_slot() for _ in range(3)]  # slots fill units 0..11 (sink + 3)
    pool.free_slot(s[0])  # a hole at physical 1, nothing moves
    assert take_moves(pool)[0].size == 0 and pool.slots.holes == {1}
    s3 = pool.alloc_slot()  # reuses the hole
    assert pool.slots.v2p[s3] == 1 and not pool.slots.holes
    pool.free_slot(s[1])  # hole at 2
    p = pool.alloc_page()  # needs the units: slots are compacted first (3 -> 2)
    src, dst = take_moves(pool)
    assert len(src) == SLOT_UNITS and pool.slots.top == 2
    pool.check()
    assert p > 0


def test_unified_boundary_follows_the_workload():
    """One budget: all slots, or all pages, or any mix; the static split cannot do both."""
    for unified in (True, False):
        pool = make_pool(unified=unified, slots=6, pages=10)
        slots = []
        while pool.can_alloc(1, 0):
            slots.append(pool.alloc_slot())
        for v in slots:
            pool.free_slot(v)
        pages = []
        while pool.can_alloc(0, 1):
            pages.append(pool.alloc_page())
        if unified:
            assert len(slots) == (pool.num_units - PAGE_UNITS) // SLOT_UNITS - 1  # 12 slots: twice the split
            assert len(pages) == (pool.num_units - SLOT_UNITS) // PAGE_UNITS - 1  # 19 pages
        else:
            assert (len(slots), len(pages)) == (6, 10)


# allocations three times as likely as frees: schedules reach exhaustion, where the budget decides
ALLOC_HEAVY = ["alloc_slot"] * 3 + ["alloc_page"] * 3 + ["free_slot", "free_page", "compact"]


@settings(max_examples=60, deadline=None)
@given(unified=st.booleans(), lazy=st.booleans(), extra=st.integers(1, 40),
       ops=st.lists(st.tuples(st.sampled_from(ALLOC_HEAVY), st.integers(0, 1000)), max_size=60))
def test_a_budget_in_a_larger_arena_decides_as_an_arena_of_its_size(unified, lazy, extra, ops):
    """EngineConfig.arena_units: a pool whose budget is B units inside an arena of B + extra
    makes every decision an arena of exactly B makes (the same virtual ids and physical
    indices, the same exhaustion, free counts and capacities, as many rows moved; pages sit
    `extra` rows higher, placed from the arena's last row down), and keeps every object's
    contents through its moves (a simulated arena of its own size)."""
    exact = make_pool(unified, lazy)
    budget = exact.num_units
    wide = UnitPool(budget + extra, SLOT_UNITS, PAGE_UNITS, unified=unified, lazy=lazy, num_slots=6, num_pages=10,
                    budget_units=budget)
    arena = SimArena(wide)
    live = {"slot": {}, "page": {}}
    label = 0

    def same_view():
        for kind in ("slot", "page"):
            assert wide.free_count(kind) == exact.free_count(kind) and wide.capacity(kind) == exact.capacity(kind)
            assert wide.live_count(kind) == exact.live_count(kind)
        assert wide.free_units() == exact.free_units()
        assert [wide.can_alloc(s, p) for s, p in ((1, 0), (0, 1), (2, 3))] == \
            [exact.can_alloc(s, p) for s, p in ((1, 0), (0, 1), (2, 3))]

    def moves_agree():
        """As many rows moved; where they went: every object's physical index below, its
        contents in the simulated arena."""
        assert len(wide.pending_moves()[0]) == len(exact.pending_moves()[0])
        arena.sync()
        exact.ack_moves()

    for op, pick in ops:
        if op == "compact":
            wide.compact()
            exact.compact()
        elif op.startswith("alloc"):
            kind = op[6:]
            outcome = []
            for pool in (wide, exact):
                try:
                    outcome.append(pool.alloc_slot() if kind == "slot" else pool.alloc_page())
                except PoolExhausted:
                    outcome.append(None)
            assert outcome[0] == outcome[1], f"{kind}: {outcome}"
            moves_agree()
            if outcome[0] is None:
                continue
            label += 1
            arena.write(kind, outcome[0], label)
            live[kind][outcome[0]] = label
        else:
            kind = op[5:]
            if not live[kind]:
                continue
            v = sorted(live[kind])[pick % len(live[kind])]
            for pool in (wide, exact):
                (pool.free_slot if kind == "slot" else pool.free_page)(v)
            del live[kind][v]
        moves_agree()
        wide.check()
        exact.check()
        same_view()
        for kind in live:
            for v, lab in live[kind].items():
                assert arena.read(kind, v) == {lab}, f"{kind} {v} lost its contents"
                k_w, k_e = (wide.slots, exact.slots) if kind == "slot" else (wide.pages, exact.pages)
                assert k_w.v2p[v] == k_e.v2p[v]  # the same physical index (rows: see moves_agree)


def test_budget_is_checked():
    with pytest.raises(ValueError, match="budget of 50 units exceeds the arena's 40"):
        UnitPool(40, SLOT_UNITS, PAGE_UNITS, unified=True, lazy=False, num_slots=2, num_pages=2, budget_units=50)
    with pytest.raises(ValueError, match="arena too small"):
        UnitPool(400, SLOT_UNITS, PAGE_UNITS, unified=True, lazy=False, num_slots=6, num_pages=10, budget_units=30)


@pytest.mark.parametrize("lazy", [False, True])
def test_a_budget_fills_as_an_arena_of_its_size(lazy):
    """Slots, then pages, until each pool refuses: the budget, not the larger arena, says when."""
    exact = make_pool(lazy=lazy)
    wide = UnitPool(exact.num_units + 17, SLOT_UNITS, PAGE_UNITS, unified=True, lazy=lazy, num_slots=6,
                    num_pages=10, budget_units=exact.num_units)
    counts = []
    for pool in (wide, exact):
        slots = [pool.alloc_slot() for _ in range(10)]  # 11 slots of 3 units with the sink, 2 for the page sink
        pages = 0
        with pytest.raises(PoolExhausted):
            while True:
                pool.alloc_page()
                pages += 1
        pool.check()
        counts.append((len(slots), pages, pool.free_units(), pool.can_alloc(1, 0)))
    assert counts[0] == counts[1] == (10, 4, 0, False)  # 43 units: 33 + 2 + 4 pages of 2

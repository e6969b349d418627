"""Prefix caching with conv-state checkpoints, ping-pong slots, sessions, admission, and the
unified pool: the scenarios of serving-state.md §6 rewritten for this design, plus a
property test of random schedules against an engine with the prefix cache off."""

from __future__ import annotations


import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import inkling_jax as ik
from inkling_jax.cache.layout import ArenaLayout
from inkling_jax.cache.state import init_state, read_slot_field
from inkling_jax.engine import Request, Resources
from inkling_jax.engine.checkpoints import Checkpoint
from inkling_jax.steps import RowPlan, StepShape, compile_step, pack_batch
from conftest import ENGINE_KW, TRUNK, make_engine, reference_logprobs

POOLS = [("unified", "eager"), ("unified", "lazy"), ("static", "eager"), ("static", "lazy")]


def prompts_from(seed, lengths):
    rng = np.random.RandomState(seed)
    return [list(rng.randint(3, TRUNK.unpadded_vocab_size, n)) for n in lengths]


def slot_contents(engine, virtual: int) -> dict[str, np.ndarray]:
    """Every field of a slot (conv windows, sliding rings), read through the live table."""
    return {name: v for name, v in engine.read_slot(virtual).items() if name.startswith("target.")}


def drain(engine):
    while engine.running or engine.waiting:
        engine.step()


# --------------------------------------------------------------------- prefix hits


@pytest.mark.parametrize("pool, ping_pong", POOLS)
def test_same_prompt_twice_hits_exactly(trunk_params, pool, ping_pong):
    """The second run reports cached tokens, gives the same tokens, logprobs within 1e-5,
    also after compactions between the runs; accounting closes throughout."""
    engine = make_engine(trunk_params, pool=pool, ping_pong=ping_pong)
    prompts = prompts_from(1, (21, 30, 9))
    sp = ik.SamplingParams(max_new_tokens=10, stop_at_eos=False)
    first = engine.generate(prompts, sp)
    engine.check_invariants()
    engine.pool.compact()  # close any lazy holes: entries move, ids stay
    filler = engine.generate(prompts_from(2, (13, 5)), sp)  # allocate and free: more moves
    assert all(c.cached_tokens == 0 for c in filler)
    second = engine.generate(prompts, sp)
    engine.check_invariants()
    for p, a, b in zip(prompts, first, second):
        assert b.tokens == a.tokens
        np.testing.assert_allclose(b.logprobs, a.logprobs, rtol=0, atol=1e-5)
        assert b.cached_tokens == (len(p) - 1) // ENGINE_KW["track_interval"] * ENGINE_KW["track_interval"]
        ref, _ = reference_logprobs(trunk_params, TRUNK, p, b.tokens)
        np.testing.assert_allclose(b.logprobs, ref, rtol=0, atol=1e-5)
    assert engine.stats()["cache_hit_tokens"] == sum(c.cached_tokens for c in second)
    if pool == "unified":
        assert engine.stats()["compaction_moves"] > 0


def test_branching_prompts_share_a_prefix(trunk_params):
    base = prompts_from(3, (20,))[0]
    a, b, c = base + [11, 12, 13, 14, 15], base + [21, 22, 23], base[:17] + [9, 9, 9, 9, 9, 9]
    sp = ik.SamplingParams(max_new_tokens=8, stop_at_eos=False)
    engine = make_engine(trunk_params)
    engine.generate([a], sp)
    out_b, out_c = engine.generate([b, c], sp)
    assert out_b.cached_tokens == 16 and out_c.cached_tokens == 16  # the checkpoint at 16 is shared
    clean = make_engine(trunk_params, prefix_cache=False).generate([b, c], sp)
    assert [out_b.tokens, out_c.tokens] == [x.tokens for x in clean]
    engine.check_invariants()


SYSTEM = prompts_from(21, (30,))[0]  # a system prompt the workloads below share (30 tokens)


def common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def deepest_boundary(n: int) -> int:
    return n // ENGINE_KW["track_interval"] * ENGINE_KW["track_interval"]


@pytest.mark.parametrize("chunk", [1, 3, 8, 64, 1024])
def test_hits_at_the_deepest_boundary_whatever_the_chunking(trunk_params, chunk):
    """Four prompts sharing a 30-token system prompt, sent one after another: the 2nd on hit at
    24, the deepest boundary inside the shared part (every prompt boundary is checkpointed,
    several per chunk when a chunk crosses several); an exact repeat of a prompt that fits in
    one chunk hits at its deepest boundary; every chunk size gives the same hits and the same
    tokens as an engine with the cache off."""
    sp = ik.SamplingParams(max_new_tokens=5, stop_at_eos=False)
    engine = make_engine(trunk_params, chunk_size=chunk, max_step_tokens=max(16, chunk), num_slots=40)
    prompts = [SYSTEM + u for u in prompts_from(22, (15, 9, 19, 12))]
    outs = [engine.generate([p], sp)[0] for p in prompts]
    repeat = engine.generate([prompts[2]], sp)[0]
    assert [o.cached_tokens for o in outs] == [0, 24, 24, 24]
    assert repeat.cached_tokens == deepest_boundary(len(prompts[2]) - 1) == 48
    clean = make_engine(trunk_params, prefix_cache=False).generate(prompts + prompts[2:3], sp)
    assert [o.tokens for o in outs + [repeat]] == [c.tokens for c in clean]
    engine.check_invariants()
    assert engine.stats()["cache_hit_tokens"] == 3 * 24 + 48


@pytest.mark.parametrize("pool, ping_pong", POOLS)
def test_branch_point_is_checkpointed_for_the_next_request(trunk_params, pool, ping_pong):
    """A request that branches off a cached path where no checkpoint was kept (inside the
    first request's generated text: only its newest generation checkpoint went to the tree)
    hits at the last checkpoint before the branch, and leaves one at the deepest boundary at
    or below its branch point during its own prefill: the third request hits there."""
    sp = ik.SamplingParams(max_new_tokens=30, stop_at_eos=False)
    engine = make_engine(trunk_params, pool=pool, ping_pong=ping_pong, num_slots=24)
    prompt = prompts_from(23, (12,))[0]
    history = prompt + engine.generate([prompt], sp)[0].tokens  # checkpoints: 8 (prompt), 40 (newest)
    second = history[:29] + prompts_from(24, (10,))[0]  # branches off at 29: deepest boundary 24
    third = history[:29] + prompts_from(25, (7,))[0]
    short = ik.SamplingParams(max_new_tokens=3, stop_at_eos=False)
    outs = [engine.generate([p], short)[0] for p in (second, third)]
    assert [o.cached_tokens for o in outs] == [8, 24]
    clean = make_engine(trunk_params, prefix_cache=False).generate([second, third], short)
    assert [o.tokens for o in outs] == [c.tokens for c in clean]
    engine.check_invariants()


@pytest.mark.parametrize("ping_pong", ["eager", "lazy"])
def test_restored_windows_are_bit_exact(trunk_params, ping_pong):
    """The checkpoint a run leaves at depth 16 holds exactly (bit for bit) the conv windows
    and sliding K/V ring of a request that processed those 16 tokens, and a hit restores it."""
    prompt = prompts_from(4, (23,))[0]
    engine = make_engine(trunk_params, ping_pong=ping_pong)
    engine.generate([prompt], ik.SamplingParams(max_new_tokens=2, stop_at_eos=False))
    match = engine.tree.match(prompt, max_depth=16)
    assert match.depth == 16
    cached = slot_contents(engine, match.node.checkpoint)

    other = make_engine(trunk_params, prefix_cache=False)  # processes exactly the 16 tokens
    req = other.submit([prompt[:16]], ik.SamplingParams(max_new_tokens=2, stop_at_eos=False))[0]
    other.step()
    other.step()  # chunks [0, 8), [8, 16): the same chunking as the first run
    assert req.committed == 16 and req.finish_reason is None
    fresh = slot_contents(other, req.held.virtual_slot)
    assert cached.keys() == fresh.keys()
    for name in cached:
        np.testing.assert_array_equal(cached[name], fresh[name], err_msg=name)

    # a hit copies it into the new request's own slot inside its first step
    req2 = engine.submit([prompt], ik.SamplingParams(max_new_tokens=1, stop_at_eos=False))[0]
    engine.requests.admit_waiting()
    assert req2.virtual_cow_slot == match.node.checkpoint and req2.held.virtual_slot != req2.virtual_cow_slot
    drain(engine)
    engine.check_invariants()


@pytest.mark.parametrize("ping_pong", ["eager", "lazy"])
def test_multi_turn_session(trunk_params, ping_pong):
    """A session keeps its slot and pages: later turns send only new tokens and give what a
    fresh request over the whole history gives. Closing frees exactly the real slots (S15)."""
    engine = make_engine(trunk_params, ping_pong=ping_pong)
    clean = make_engine(trunk_params, prefix_cache=False)
    sp = ik.SamplingParams(max_new_tokens=7, stop_at_eos=False)
    sid = engine.open_session()
    history: list[int] = []
    for turn in prompts_from(5, (10, 6, 13)):
        out = engine.generate([turn], sp, session=sid)[0]
        expected = clean.generate([history + turn], sp)[0]
        assert out.tokens == expected.tokens
        np.testing.assert_allclose(out.logprobs, expected.logprobs, rtol=0, atol=1e-5)
        history += turn + out.tokens
        engine.check_invariants()
    sess = engine.sessions[sid]
    held = sess.held.slots()
    if ping_pong == "lazy":
        assert -1 in sess.held.virtual_track_slots  # lazily absent
    live_before = engine.pool.live_count("slot")
    engine.close_session(sid)
    assert engine.pool.live_count("slot") == live_before - len(held)
    engine.check_invariants()
    with pytest.raises(ValueError, match="not open"):
        engine.close_session(sid)


# --------------------------------------------------------------------- admission


def test_admission_needs_and_rollback(trunk_params):
    """S13: eager needs 1 + 2 slots, lazy 1 + 1; a short pool defers with nothing taken;
    evicting the tree frees room; a failed admission rolls back exactly what it took."""
    sp = ik.SamplingParams(max_new_tokens=2, stop_at_eos=False)
    for ping_pong, need in (("eager", 3), ("lazy", 2)):
        engine = make_engine(trunk_params, pool="static", num_slots=need, ping_pong=ping_pong)
        req = engine.submit([[5, 6, 7]], sp)[0]
        engine.requests.admit_waiting()
        assert engine.running == [req] and engine.pool.live_count("slot") == need
        assert (req.held.virtual_track_slots[1] == -1) == (ping_pong == "lazy")

    engine = make_engine(trunk_params, pool="static", num_slots=3)
    engine.generate([prompts_from(6, (20,))[0]], sp)  # leaves checkpoints in the tree
    assert engine.pool.live_count("slot") >= 1
    before = (engine.pool.live_count("slot"), engine.pool.live_count("page"), engine.tree.owned())
    blocker = engine.submit([[1, 2, 3]], sp)[0]
    engine.requests.admit_waiting()  # needs 3 slots: evicts the tree's checkpoints to get them
    assert engine.running == [blocker] and engine.stats()["evicted_slots"] >= 1
    waiter = engine.submit([[4, 5, 6]], sp)[0]
    live = (engine.pool.live_count("slot"), engine.pool.live_count("page"))
    engine.requests.admit_waiting()  # nothing left to evict: deferred, nothing taken
    assert engine.waiting == [waiter] and engine.stats()["deferred"] == 1
    assert (engine.pool.live_count("slot"), engine.pool.live_count("page")) == live
    engine.check_invariants()
    drain(engine)
    assert waiter.finish_reason == "length" and before[0] >= 1
    engine.check_invariants()


@pytest.mark.parametrize("committed, n, expected", [
    (0, 8, 8), (0, 7, None), (3, 8, 8), (8, 8, 16), (16, 3, None), (13, 11, 24), (15, 1, 16), (16, 1, None),
])
def test_generation_checkpoint_positions(trunk_params, committed, n, expected):
    """S14 for our grid (track_interval 8, absolute), past the prompt: a step that reaches or
    crosses a multiple of 8 writes the state there into the next ping-pong slot, and only the
    newest boundary of the step; the track length is counted from the step start."""
    engine = make_engine(trunk_params)
    req = Request(0, list(range(40)), 2, ik.SamplingParams(),
                  held=Resources(virtual_track_slots=[5, 6], committed=committed))
    n_out, cks = engine.checkpoints.plan(req, n)
    assert n_out == n
    assert cks == ([] if expected is None else [Checkpoint(expected, 5, donate=False, track_index=0)])


@pytest.mark.parametrize("committed, n, cap, expected_n, expected", [
    (0, 8, 4, 8, [8]), (0, 40, 4, 32, [8, 16, 24, 32]), (3, 30, 4, 30, [8, 16, 24, 32]), (4, 30, 2, 12, [8, 16]),
    (8, 7, 4, 7, []), (13, 27, 4, 27, [16, 24, 32, 40]),
])
def test_every_prompt_boundary_is_checkpointed(trunk_params, committed, n, cap, expected_n, expected):
    """Inside the prompt every boundary of a chunk is checkpointed for the tree, up to
    max_step_checkpoints per step: a chunk crossing more is cut at the last one it writes."""
    engine = make_engine(trunk_params, num_slots=32, chunk_size=64, max_step_tokens=64, max_step_checkpoints=cap)
    req = Request(0, list(range(3, 43)), 40, ik.SamplingParams(),
                  held=Resources(virtual_track_slots=[5, 6], committed=committed))
    n_out, cks = engine.checkpoints.plan(req, n)
    assert n_out == expected_n and [ck.depth for ck in cks] == expected
    assert all(ck.donate for ck in cks) and len({ck.virtual_slot for ck in cks}) == len(cks)
    assert [ck.virtual_slot for ck in cks][:2] == [5, 6][:len(cks)]  # its idle ping-pong slots first


# ------------------------------------------------------- step-level scenarios


def _decode_batch(b, slots, track_slots, track_len, seq, pages, tokens):
    rows = [RowPlan(tokens=[tok], seq_start=st, virtual_slot=v, virtual_pages=pg, virtual_track_slots=[tv],
                    track_lens=[tl])
            for tok, st, v, pg, tv, tl in zip(tokens, seq, slots, pages, track_slots, track_len)]
    return pack_batch(StepShape("decode", b, b, 1, len(pages[0])), rows)


def test_checkpoints_land_only_in_translated_slots(trunk_params):
    """S1 / S3 / S11 / S12 at the step level: after slots moved (tables remapped), a decode
    step with 3 live rows of 4 (one padded) and checkpoints masked in for rows 0 and 2 only
    changes the live rows' active slots, the two checkpoint slots, the rows' pages and the
    sink; the checkpoint slots hold the new windows; an all-padded step changes nothing."""
    lay = ArenaLayout.build(TRUNK, 4)
    n_slots, n_pages = 12, 12
    units = lay.arena_units(n_slots, n_pages)
    step = compile_step(TRUNK, lay, StepShape("decode", 4, 4, 1, 4))
    rng = np.random.RandomState(0)
    state = init_state(lay, units, n_slots, n_pages, jnp.float32)
    perm = np.concatenate([[0], rng.permutation(np.arange(1, n_slots + 1))]).astype(np.int32)  # "compacted"
    state = state.replace(arena=jnp.asarray(rng.standard_normal(state.arena.shape), jnp.float32),
                          slot_v2p=jnp.asarray(perm), page_v2p=jnp.arange(n_pages + 1, dtype=jnp.int32))
    before = np.asarray(state.arena)
    active, track = [1, 2, 3], [4, 5, 6]
    pages = [[1, 2, 3, 0], [4, 5, 6, 0], [7, 8, 9, 0]]
    batch = _decode_batch(4, active, track, [1, 0, 1], [7, 9, 8], pages, [5, 6, 7])
    _, state = step(trunk_params, state, batch)
    after = np.asarray(state.arena)
    changed = set(np.nonzero(np.any(after != before, axis=1))[0].tolist())

    def rows_of_slot(v):
        return set(range(lay.slot_row(perm[v]), lay.slot_row(perm[v]) + lay.slot_units))

    allowed = set(range(lay.slot_units))  # the sink slot
    for v in active + [4, 6]:
        allowed |= rows_of_slot(v)
    allowed |= {lay.page_row(p, units, k) for row in pages for p in row if p for k in range(lay.page_units)}
    allowed |= {lay.page_row(0, units, k) for k in range(lay.page_units)}  # the sink page
    assert changed <= allowed, f"unexpected rows written: {sorted(changed - allowed)}"
    assert not (changed & rows_of_slot(5)), "a masked-off checkpoint slot was written"
    assert changed & rows_of_slot(4) and changed & rows_of_slot(6)
    f = lay.target[1].conv  # the checkpoint windows equal the active windows after the step
    for act, trk in ((1, 4), (3, 6)):
        a = read_slot_field(state.arena, lay, jnp.asarray([perm[act]]), f)
        t = read_slot_field(state.arena, lay, jnp.asarray([perm[trk]]), f)
        np.testing.assert_array_equal(a, t)

    inert = pack_batch(StepShape("decode", 4, 4, 1, 4), [])
    snapshot = np.asarray(state.arena)
    _, state = step(trunk_params, state, inert)
    diff = np.nonzero(np.any(np.asarray(state.arena) != snapshot, axis=1))[0]
    sinks = set(range(lay.sink_rows)) | {lay.page_row(0, units, k) for k in range(lay.page_units)}
    assert set(diff.tolist()) <= sinks


# ------------------------------------------------------- unified vs static


def test_unified_holds_what_no_static_split_can(trunk_params):
    """One fixed budget (units). Unified holds (a) 8 short requests at once and (b) two long
    ones at once; every static split of the same budget fails (a) or (b)."""
    kw = dict(prefix_cache=False, max_running=8, max_step_tokens=64)
    sp_short = ik.SamplingParams(max_new_tokens=4, stop_at_eos=False)
    sp_long = ik.SamplingParams(max_new_tokens=8, stop_at_eos=False)
    short = prompts_from(7, (10,) * 8)
    long = prompts_from(8, (380, 370))

    def holds(engine, prompts, sp) -> bool:
        try:
            engine.submit(prompts, sp)
        except ValueError:
            return False  # longer than this split can ever hold
        engine.requests.admit_waiting()
        return len(engine.running) == len(prompts)

    unified = make_engine(trunk_params, pool="unified", **kw)
    budget = unified.pool.budget_units
    assert holds(unified, short, sp_short)
    unified = make_engine(trunk_params, pool="unified", **kw)
    assert holds(unified, long, sp_long)

    lay = unified.layout
    for s in range(1, budget // lay.slot_units):
        p = (budget - (s + 1) * lay.slot_units) // lay.page_units - 1
        if p < 1:
            continue
        a = make_engine(trunk_params, pool="static", num_slots=s, num_pages=p, **kw)
        b = make_engine(trunk_params, pool="static", num_slots=s, num_pages=p, **kw)
        assert a.pool.budget_units <= budget
        assert not (holds(a, short, sp_short) and holds(b, long, sp_long)), f"static split {s} slots / {p} pages"


# ------------------------------------------------------- property test


OPS = st.lists(st.one_of(
    st.tuples(st.just("submit"), st.integers(0, 3), st.integers(1, 18), st.integers(1, 6)),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("session"), st.integers(0, 3), st.integers(1, 9), st.integers(1, 5)),
    st.tuples(st.just("close")),
    st.tuples(st.just("compact")),
    st.tuples(st.just("evict")),
    st.tuples(st.just("shared"), st.integers(0, 3), st.integers(1, 4)),
), min_size=3, max_size=10)


# Schedules a random search once failed on with the old model of expected hits (see
# run_schedule): they run in every pool, every time.
KNOWN_SCHEDULES = [
    # unified-eager: the first shared-prompt request skips a checkpoint (the arena is short of
    # room: the running request's page reservation), so the second cannot hit that deep
    [("session", 0, 1, 1), ("submit", 0, 7, 4), ("shared", 0, 1), ("shared", 0, 1)],
    # static-eager: the same, short of slots (the pool's 10 are two requests' 3 each and the
    # tree's 4 when the first shared-prompt request reaches 40): the second hits at 32, not 40
    [("submit", 0, 15, 4), ("shared", 3, 1), ("shared", 3, 1)],
    # unified-eager: the second shared-prompt request evicts (a slot, two pages), the third
    # repeats the first, whose checkpoint at 32 survived: it hits at 32, deeper than the 24
    # the old model expected from the second alone
    [("submit", 0, 2, 6), ("shared", 1, 2), ("shared", 3, 1), ("shared", 1, 1)],
]


@pytest.mark.parametrize("pool, ping_pong", POOLS)
# derandomize: CI runs the same 25 schedules every time (a random one once found an
# admission livelock with a session open in the static pool; see admit_waiting)
@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_random_schedules_match_no_cache(trunk_params, pool, ping_pong, ops):
    """Random schedules of submit / step / session turns / close / compaction / eviction and
    requests that share a system prompt (run_schedule says what is checked)."""
    run_schedule(trunk_params, pool, ping_pong, ops)


@pytest.mark.parametrize("pool, ping_pong", POOLS)
@pytest.mark.parametrize("ops", KNOWN_SCHEDULES)
def test_known_schedules_match_no_cache(trunk_params, pool, ping_pong, ops):
    run_schedule(trunk_params, pool, ping_pong, ops)


def run_schedule(trunk_params, pool, ping_pong, ops):
    """Run `ops`, calling check_invariants() after every operation; then check

    * tokens: every completion equals what an engine with the prefix cache off gives for the
      same full history;
    * hits, exactly, against the engine's own state: a request is admitted with the deepest
      checkpointed prefix the tree holds when it is admitted (read just before the step that
      admits it: admission inserts nothing). Only when that step counted an eviction may
      the hit be shallower (an entry was evicted, or admission fell back to a shallower
      prefix, which it does only after evicting: a deeper prefix reserves fewer pages);
    * hits against the history: never deeper than the deepest boundary the prompt shares
      (below its last token) with a sequence submitted before it, since every checkpoint
      is the state of some request's tokens;
    * hits against a model that does not look at the tree (hit rate 1): a shared-prompt
      request that follows finished ones ("the chain") with no eviction and no skipped
      checkpoint counted from before the chain's first request ran until it is admitted
      hits at least at the deepest boundary of its shared part (below its last token) that
      some chain request P is known to have left: P's own hit and every prompt boundary
      above it (a prompt boundary is only skipped, uncounted, when the tree already holds
      it). Only a lower bound: entries of earlier requests outside the chain may survive
      and give deeper hits; the exact value is the check above."""
    bases = prompts_from(9, (19, 24, 11, 30))
    suffixes = prompts_from(10, (5, 9, 3, 12))
    engine = make_engine(trunk_params, pool=pool, ping_pong=ping_pong, num_slots=10, num_pages=40)
    sp = lambda n: ik.SamplingParams(max_new_tokens=n, stop_at_eos=False)
    submitted = []  # (request, full history it answers), in submission order
    # rid -> (the tree's depth for it, counters before and after, requests submitted) at its admission step
    admitted = {}
    at_least = []  # (shared-prompt request, the model's lower bound on its hit)
    chain, chain_since = [], None  # see the docstring; chain_since: counters before its first request ran
    sid, history = None, []
    # every way an entry leaves the tree or a prompt boundary is not checkpointed (but evict_all,
    # the "evict" operation: it ends the chain)
    counters = lambda: tuple(engine.stats()[k] for k in ("evicted_slots", "evicted_pages", "skipped_checkpoints",
                                                          "resets"))

    def step():
        # requests admission matches against the tree (a session's later turns take its state over)
        looked_up = [(r, engine.tree.match(r.tokens, max_depth=len(r.tokens) - 1).depth) for r in engine.waiting
                     if r.session is None or r.session.held is None]
        before, known = counters(), len(submitted)
        engine.step()
        still = {id(r) for r in engine.waiting}
        for r, depth in looked_up:
            if id(r) not in still and r.error is None:  # admitted by this step
                admitted[r.rid] = (depth, before, counters(), known)

    def finish(r):
        while r.finish_reason is None and r.error is None:
            step()
        assert r.error is None, r.error

    def drain_all():
        while engine.running or engine.waiting:
            step()

    def submit(prompt, n, session=None):
        r = engine.submit([prompt], sp(n), session=session)[0]
        submitted.append((r, (history if session is not None else []) + prompt))
        return r

    for op in ops:
        if op[0] == "submit":
            _, base, cut, n = op
            submit(bases[base][:cut] + [3 + cut], n)
        elif op[0] == "step":
            for _ in range(op[1]):
                step()
        elif op[0] == "session":
            _, base, cut, n = op
            if sid is None:
                sid, history = engine.open_session(), []
            drain_all()
            turn = bases[base][:cut]
            r = submit(turn, n, session=sid)
            finish(r)
            history = history + turn + r.out_tokens
        elif op[0] == "close" and sid is not None:
            drain_all()
            engine.close_session(sid)
            sid = None
        elif op[0] == "compact":
            engine.compact()
        elif op[0] == "evict":
            engine.evict_all()
            chain = []
        elif op[0] == "shared":
            _, which, n = op
            prompt = SYSTEM + suffixes[which]
            since = counters()
            r = submit(prompt, n)
            finish(r)
            if chain and admitted[r.rid][2] == chain_since:
                # P left a checkpoint at its hit and at every prompt boundary above it; the
                # boundaries below its hit were there when P was admitted, but nothing says
                # they were checkpointed (only that some descendant was)
                left = lambda p, b: b if b >= p.cached else 0
                shared = [deepest_boundary(min(common_prefix(p.tokens[:p.prompt_len], prompt), len(prompt) - 1))
                          for p in chain]
                at_least.append((r, max(left(p, b) for p, b in zip(chain, shared))))
            else:  # counted since the chain began (in the old model: since its last request ended, which
                # missed a checkpoint the last request itself skipped): a new chain starts here
                chain, chain_since = [], since
            chain.append(r)
        engine.check_invariants()
    drain_all()
    engine.check_invariants()

    for i, (r, _) in enumerate(submitted):
        if r.rid not in admitted:
            continue  # a session's later turn: it continues from the session's own state
        depth, before, after, known = admitted[r.rid]
        assert r.cached <= depth, f"request {i} hit deeper ({r.cached}) than the tree held ({depth})"
        if before == after:
            assert r.cached == depth, f"request {i} hit at {r.cached}, the tree held {depth}"
        prompt = r.tokens[:r.prompt_len]
        seen = max([common_prefix(prompt, q.tokens) for q, _ in submitted[:known] if q is not r], default=0)
        assert r.cached <= deepest_boundary(min(seen, len(prompt) - 1)), f"request {i}: a hit nobody computed"
    for r, lower in at_least:
        assert r.cached >= lower, f"shared-prompt request hit at {r.cached}, below {lower}"
    if not submitted:
        return
    clean = make_engine(trunk_params, pool=pool, ping_pong=ping_pong, prefix_cache=False, num_slots=10,
                        num_pages=40, max_running=2)
    for r, full in submitted:
        n = len(r.out_tokens)
        expected = clean.generate([full], sp(n))[0].tokens
        assert r.out_tokens == expected

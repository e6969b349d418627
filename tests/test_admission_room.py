"""Admission agrees with `never_fits`: a request it says fits is admitted once nothing runs
(even when its deepest cached prefix would pin too many checkpoints beside a session's
state), and one that can never fit beside what open sessions pin (their own slots and pages,
and the prefix-cache entries their locked prefixes keep) is refused at once with the reason."""

from __future__ import annotations

import numpy as np
import pytest

import inkling_jax as ik
from conftest import TRUNK, make_engine
from inkling_jax.engine import Request

# the geometry of test_prefix_cache.py's random schedules (shares their compiled steps)
POOL_KW = dict(pool="static", ping_pong="eager", num_slots=10, num_pages=40)


def prompts_from(seed, lengths):
    rng = np.random.RandomState(seed)
    return [list(rng.randint(3, TRUNK.unpadded_vocab_size, n)) for n in lengths]


def sp(n):
    return ik.SamplingParams(max_new_tokens=n, stop_at_eos=False)


def drain(engine):
    while engine.running or engine.waiting:
        engine.step()


def clean_tokens(trunk_params, full, n):
    """What an engine with the prefix cache off generates for the same full history."""
    clean = make_engine(trunk_params, prefix_cache=False, max_running=2, **POOL_KW)
    return clean.generate([full], sp(n))[0].tokens


def test_replayed_schedule_admits_with_a_shallower_prefix(trunk_params):
    """The schedule a random test_random_schedules_match_no_cache run found (static pool,
    eager ping-pong, 10 slots): a session keeps 3 slots; a 42-token shared-prompt request
    leaves checkpoints at 8..40 (5 slots); the same prompt again hits at 40, but locking that
    path pins all 5 checkpoints, leaving 2 free slots for the 3 it needs. It used to be given
    up ("nothing is running ..."); it must be admitted (a shallower hit) and match a cache-off run."""
    bases = prompts_from(9, (19, 24, 11, 30))
    system = prompts_from(21, (30,))[0]
    shared = system + prompts_from(10, (5, 9, 3, 12))[3]
    engine = make_engine(trunk_params, **POOL_KW)
    sid = engine.open_session()
    turn = engine.generate([bases[0][:1]], sp(1), session=sid)[0]
    engine.check_invariants()
    first = engine.generate([shared], sp(1))[0]
    engine.check_invariants()
    assert engine.pool.free_count("slot") == 2  # session 3 + tree 5 checkpoints
    assert engine.admission.never_fits(_probe(shared, 1)) is None
    second = engine.generate([shared], sp(1))[0]  # raised RuntimeError ("was given up") before the fix
    engine.check_invariants()
    assert 0 < second.cached_tokens < 40  # a shallower checkpoint than the deepest (40) one
    assert first.tokens == second.tokens == clean_tokens(trunk_params, shared, 1)
    assert turn.tokens == clean_tokens(trunk_params, bases[0][:1], 1)
    engine.close_session(sid)
    engine.evict_all()
    assert engine.pool.live_count("slot") == engine.pool.live_count("page") == 0
    engine.check_invariants()


def _probe(prompt, n):
    """A request record for never_fits, not queued."""
    return Request(-1, list(prompt), len(prompt), sp(n))


def _two_sessions_on_one_cached_prefix(trunk_params):
    """An engine whose two open sessions both lock the cached 24-token prefix (3 checkpoint
    slots, 6 pages, shared): 3 + 3 slots of their own and 3 pinned leave 1 of 10 slots."""
    engine = make_engine(trunk_params, **POOL_KW)
    prefix = prompts_from(31, (30,))[0]
    engine.generate([prefix], sp(2))  # checkpoints at 8, 16, 24 go to the tree
    s1, s2 = engine.open_session(), engine.open_session()
    out1 = engine.generate([prefix + [5]], sp(2), session=s1)[0]
    assert out1.cached_tokens == 24
    return engine, prefix, s1, s2


def test_request_that_never_fits_beside_pinned_prefixes_is_refused_at_once(trunk_params):
    """Sessions' locked prefixes count against capacity: a request that cannot fit beside them
    is refused at submit naming what it needs and what can ever be free; the queued session
    turn, the prefix cache and the pool are untouched and run on; once a session closes, it fits.
    The queued turn counts at its worst case: s1 keeps 2 pages of its own and may grow by 2
    (to 38 tokens), s2 keeps 2, their shared prefix pins 6: 12 of 40 pages."""
    engine, prefix, s1, s2 = _two_sessions_on_one_cached_prefix(trunk_params)
    engine.generate([prefix + [6]], sp(2), session=s2)
    assert engine.admission.session_holdings(engine.sessions.values()) == (9, 10, 3, 6)
    bystander = engine.submit([[7, 8]], sp(3), session=s1)[0]  # a session turn: needs no new slot
    tree_before = engine.tree.owned()
    pool_before = [(engine.pool.free_count(k), engine.pool.live_count(k)) for k in ("slot", "page")]
    stats_before = engine.stats()
    with pytest.raises(ValueError, match=r"can never be admitted: it needs 3 slots and 2 pages, but at most 1 slots "
                                         r"and 28 pages can be free \(open sessions hold 9 slots and 12 pages, 3 "
                                         r"slots and 6 pages of them in prefix-cache entries their prefixes lock\)"):
        engine.submit([[5, 6, 7]], sp(2))
    assert engine.waiting == [bystander] and not engine.running
    assert engine.tree.owned() == tree_before and engine.stats() == stats_before
    assert [(engine.pool.free_count(k), engine.pool.live_count(k)) for k in ("slot", "page")] == pool_before
    engine.check_invariants()
    drain(engine)
    assert bystander.error is None and bystander.finish_reason == "length"
    assert bystander.out_tokens == clean_tokens(trunk_params, bystander.tokens[:bystander.prompt_len], 3)
    engine.close_session(s2)
    late = engine.generate([[5, 6, 7]], sp(2))[0]  # fits now
    assert late.tokens == clean_tokens(trunk_params, [5, 6, 7], 2)
    engine.close_session(s1)
    engine.evict_all()
    assert engine.pool.live_count("slot") == engine.pool.live_count("page") == 0
    engine.check_invariants()


def test_request_that_would_stop_fitting_while_queued_is_refused_at_submit(trunk_params):
    """A running session turn counts at what the session will keep when it ends (3 slots of its
    own): a request that only fits while the turn runs is refused at submit with the reason
    (it used to be queued, then given up once the turn handed its state back); the turn
    completes exactly."""
    engine, prefix, s1, s2 = _two_sessions_on_one_cached_prefix(trunk_params)
    turn = engine.submit([prefix + [6]], sp(2), session=s2)[0]
    engine.step()  # the turn runs (its state is not the session's yet)
    with pytest.raises(ValueError, match=r"at most 1 slots .* 3 slots and 6 pages of them in prefix-cache entries"):
        engine.submit([[5, 6, 7]], sp(2))
    drain(engine)
    assert turn.error is None and turn.out_tokens == clean_tokens(trunk_params, prefix + [6], 2)
    assert not engine.waiting and not engine.running
    engine.close_session(s1)
    engine.close_session(s2)
    engine.evict_all()
    assert engine.pool.live_count("slot") == engine.pool.live_count("page") == 0
    engine.check_invariants()

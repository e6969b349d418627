"""Overlapped decode dispatches (`EngineConfig.overlap`, `steps/feed.py`): the engine
dispatches decode N+1, planned ahead, before it reads decode N. Outputs, checkpoints and
accounting must be those of the synchronous engine, whatever stops in N: a stop token
mid-dispatch, a budget, an abort, waiting requests, prefix-cache checkpoints."""

from __future__ import annotations

import numpy as np
import pytest

import inkling_jax as ik
from conftest import LOOP_ATOL, TRUNK, make_engine

K = dict(decode_steps=4)


def prompts_from(seed, lengths):
    rng = np.random.RandomState(seed)
    return [list(rng.randint(3, TRUNK.unpadded_vocab_size, n)) for n in lengths]


def run(engine, prompts, sampling):
    """generate() through step(), with the invariants checked after every step."""
    reqs = engine.submit(prompts, sampling)
    while any(r.finish_reason is None for r in reqs):
        engine.step()
        engine.check_invariants()
    return reqs


@pytest.mark.parametrize("sampling", [ik.SamplingParams(max_new_tokens=13, stop_at_eos=False),
                                      ik.SamplingParams(max_new_tokens=11, temperature=0.9, top_p=0.9, seed=3,
                                                        stop_at_eos=False)], ids=["greedy", "sampled"])
def test_overlap_equals_synchronous(trunk_params, sampling):
    """Five requests over two rows (three wait), budgets that end mid-dispatch, checkpoints
    every 8 tokens: tokens and log-probs exactly the synchronous engine's, the prefix cache
    serves the same hits after, and dispatches were overlapped."""
    prompts = prompts_from(0, (5, 9, 3, 14, 7))
    sync = make_engine(trunk_params, overlap=False, **K)
    over = make_engine(trunk_params, overlap=True, **K)
    want = run(sync, prompts, sampling)
    got = run(over, prompts, sampling)
    assert [r.out_tokens for r in got] == [r.out_tokens for r in want]
    assert [r.out_logprobs for r in got] == [r.out_logprobs for r in want]
    assert over.stats()["overlapped_dispatches"] > 0
    assert sync.stats()["overlapped_dispatches"] == 0
    # the checkpoints left behind are the same: a follow-up hits equally deep, with the same tokens
    follow = [prompts[3] + want[3].out_tokens[:9]]
    a, b = run(sync, follow, sampling)[0], run(over, follow, sampling)[0]
    assert (b.cached, b.out_tokens) == (a.cached, a.out_tokens) and a.cached > 0


def test_stop_token_mid_dispatch(trunk_params):
    """Row 0 samples a stop token in the middle of a dispatch while the next dispatch, planned
    ahead, is already queued: the row stops there, the other row runs on, and a request
    admitted afterwards (into the freed row) gets the synchronous engine's tokens."""
    prompts = prompts_from(1, (6, 10))
    free = ik.SamplingParams(max_new_tokens=14, stop_at_eos=False)
    ref = make_engine(trunk_params, overlap=False, **K).generate(prompts, free)
    stop = ref[0].tokens[5]  # sampled in the second dispatch (steps 4..7), at its second step
    assert stop not in ref[0].tokens[:5]
    sampling = ik.SamplingParams(max_new_tokens=14, stop_at_eos=False, stop_token_ids=(stop,))
    sync = make_engine(trunk_params, overlap=False, **K)
    over = make_engine(trunk_params, overlap=True, **K)
    late = prompts_from(2, (8,))
    want = run(sync, prompts, sampling) + run(sync, late, free)
    got_reqs = over.submit(prompts, sampling)
    while not got_reqs[0].finish_reason:
        over.step()
        over.check_invariants()
    assert over._flights, "a dispatch planned ahead should be in flight when row 0 stops"
    got = got_reqs + run(over, late, free)
    while over._flights or over.running:
        over.step()
    over.check_invariants()
    assert got[0].out_tokens == ref[0].tokens[:6] and got[0].finish_reason == "stop"
    assert [r.out_tokens for r in got] == [r.out_tokens for r in want]
    # after row 0 stops, row 1 and the late request share steps here but not in `want` (the late
    # one runs alone there): other step shapes, so log-probs agree to float32 rounding (LOOP_ATOL)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.out_logprobs, w.out_logprobs, rtol=0, atol=LOOP_ATOL)


def test_abort_with_a_dispatch_ahead(trunk_params):
    """Aborting a request while a dispatch planned ahead holds its row: the request ends
    with a prefix of its output, the other request is exact, nothing leaks."""
    prompts = prompts_from(3, (7, 5))
    sampling = ik.SamplingParams(max_new_tokens=16, stop_at_eos=False)
    ref = make_engine(trunk_params, overlap=False, **K).generate(prompts, sampling)
    over = make_engine(trunk_params, overlap=True, **K)
    reqs = over.submit(prompts, sampling)
    while len(reqs[0].out_tokens) < 4:
        over.step()
    assert over._flights
    over.abort(reqs[0])
    over.check_invariants()
    while over.running:
        over.step()
        over.check_invariants()
    assert reqs[0].finish_reason == "abort" and reqs[0].out_tokens == ref[0].tokens[:len(reqs[0].out_tokens)]
    assert reqs[1].out_tokens == ref[1].tokens
    over.evict_all()  # the prefix cache's entries gone, nothing may remain live
    over.check_invariants()
    s = over.stats()
    assert (s["live_slots"], s["live_pages"]) == (0, 0)


def test_overlap_needs_multi_step_decode():
    with pytest.raises(ValueError, match="overlap needs multi-step decode"):
        ik.EngineConfig(overlap=True, decode_steps=1)
    with pytest.raises(ValueError, match="overlap needs spec_steps=0"):
        ik.EngineConfig(overlap=True, spec_steps=2, decode_steps=4)
    with pytest.raises(ValueError, match="overlap must be"):
        ik.EngineConfig(overlap="yes")

"""Several decode steps per dispatch (`EngineConfig.decode_steps`, `steps/decode_loop.py`):
the engine's tokens, cache hits and state are those of one step per dispatch (tokens exactly,
log-probs and state to float32 rounding: XLA may fuse the loop body otherwise).

Oracle: the same engine geometry with decode_steps=1 (itself checked against the reference
forward and HF transformers elsewhere), and the reference forward's greedy tokens."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import inkling_jax as ik

from conftest import ENGINE_KW, TRUNK, assert_same_completions, count_xla_compiles, make_engine, reference_logprobs
from conftest import LOOP_ATOL as ATOL
PARAMS = ik.init_params(TRUNK, jax.random.key(0), std=0.1)
_rng = np.random.RandomState(11)
SHARED = list(_rng.randint(3, 256, 10))
PROMPTS = [SHARED + list(_rng.randint(3, 256, n)) for n in (2, 7)] + [list(_rng.randint(3, 256, 5))]


def _run(decode_steps: int, sampling: ik.SamplingParams, cuts: list | None = None, **overrides):
    """Generate PROMPTS, then their completions as new prompts (hits on generation
    checkpoints), then a two-turn session; returns everything the engine produced. `cuts`
    collects the decode rows whose dispatch stopped before their second checkpoint boundary
    (fewer steps than both K and the row's remaining budget allow): (committed, steps)."""
    engine = make_engine(PARAMS, decode_steps=decode_steps, max_context=128, **overrides)
    if cuts is not None:
        plan = engine.scheduler.plan

        def recording_plan(*args, **kwargs):
            p = plan(*args, **kwargs)
            if p is not None and p.mode == "decode":
                for r, row in zip(p.requests, p.rows):
                    if row.num_steps < min(decode_steps, r.sampling.max_new_tokens - len(r.out_tokens)):
                        cuts.append((r.committed, row.num_steps))
            return p

        engine.scheduler.plan = recording_plan
    first = engine.generate(PROMPTS, sampling)
    grown = [p + c.tokens for p, c in zip(PROMPTS, first)]
    second = engine.generate(grown, sampling)
    sid = engine.open_session()
    turns = [engine.generate([PROMPTS[0]], sampling, session=sid)[0], engine.generate([[7, 8, 9]], sampling,
                                                                                       session=sid)[0]]
    slot = engine.read_slot(engine.sessions[sid].held.virtual_slot)
    engine.check_invariants()
    return engine, first + second + turns, slot


@pytest.mark.parametrize("sampling", [
    ik.SamplingParams(max_new_tokens=11, stop_at_eos=False),
    ik.SamplingParams(max_new_tokens=14, temperature=0.9, top_k=40, top_p=0.9, seed=5, stop_at_eos=False),
], ids=["greedy", "sampled"])
def test_k_steps_per_dispatch_equal_one(sampling):
    """K = 3 (not a divisor of the budgets) and 9 (past the checkpoint interval of 8: a row's
    dispatch stops before its second boundary): tokens, log-probs, finish reasons, cache hits
    (prompt and generation checkpoints), a session's slot after its turns: all equal to one
    step per dispatch; fewer decode dispatches."""
    one, want, want_slot = _run(1, sampling)
    for k in (3, 9):
        cuts = []
        engine, got, slot = _run(k, sampling, cuts)
        if k == 9:  # the cut happened (a row at 7 mod 8: 8 steps reach the next boundary + 7)
            interval = ENGINE_KW["track_interval"]
            assert cuts and all(n == 2 * interval - 1 - c % interval for c, n in cuts), cuts
        assert_same_completions(got, want)
        assert sum(c.cached_tokens for c in got[3:6]) > 0  # the grown prompts hit
        assert slot.keys() == want_slot.keys()
        for key in slot:
            np.testing.assert_allclose(slot[key], want_slot[key], rtol=0, atol=ATOL, err_msg=key)
        assert engine.stats()["decode_steps"] < one.stats()["decode_steps"]
        assert engine.stats()["generated_tokens"] == one.stats()["generated_tokens"]
    if sampling.temperature == 0:
        for p, c in zip(PROMPTS, want[:3]):
            assert c.tokens == reference_logprobs(PARAMS, TRUNK, p, c.tokens)[1].tolist()


def test_stop_token_inside_a_dispatch():
    """A stop token sampled mid-dispatch ends the row there: the steps after it write no
    state (the session's slot equals the one-step engine's) and the other rows go on."""
    greedy = ik.SamplingParams(max_new_tokens=12, stop_at_eos=False)
    _, free, _ = _run(1, greedy)
    stops = sorted({c.tokens[4] for c in free[:3]} | {free[6].tokens[2]})  # mid-dispatch for K = 4
    sampling = ik.SamplingParams(max_new_tokens=12, stop_at_eos=False, stop_token_ids=tuple(stops))
    _, want, want_slot = _run(1, sampling)
    assert "stop" in [c.finish_reason for c in want] and "length" in [c.finish_reason for c in want]
    _, got, slot = _run(4, sampling)
    assert_same_completions(got, want)
    for key in slot:
        np.testing.assert_allclose(slot[key], want_slot[key], rtol=0, atol=ATOL, err_msg=key)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_no_compile_after_warmup(overlap):
    """warmup() compiles the K-step decode program of every bucket (with overlap, the decode
    feed of every pair of batch buckets, for the outputs a step returns: uncommitted here, as
    the params are; a feed warmed up on committed arrays compiled again): serving compiles
    nothing (XLA's own compile events), and the tokens are the reference forward's greedy ones."""
    engine = make_engine(PARAMS, decode_steps=4, max_context=64, warmup=True, overlap=overlap, min_batch_bucket=1)
    rng = np.random.RandomState(2)
    runs = []
    with count_xla_compiles() as compiles:
        for n in (1, 2, 3):
            prompts = [list(rng.randint(3, 256, rng.randint(1, 20))) for _ in range(n)]
            sampling = ik.SamplingParams(max_new_tokens=int(rng.randint(2, 12)), stop_at_eos=False)
            runs += zip(prompts, engine.generate(prompts, sampling))
    assert compiles[0] == 0
    assert (engine.stats()["overlapped_dispatches"] > 0) == overlap
    for p, c in runs:
        assert c.tokens == reference_logprobs(PARAMS, TRUNK, p, c.tokens)[1].tolist()
    engine.check_invariants()


def test_decode_steps_config():
    for bad in (0, -1, 2.0, True, "8"):
        with pytest.raises(ValueError, match="decode_steps must be 'auto' or an int >= 1"):
            ik.EngineConfig(decode_steps=bad)
    # "auto": 8 on an accelerator, 1 on the CPU (where a step dwarfs the host round trip)
    engine = make_engine(PARAMS)
    assert engine.config.decode_steps == "auto"
    assert engine.runner.decode_steps == (1 if jax.default_backend() == "cpu" else 8)
    assert engine.runner.shape("decode", 1, 1, 1).steps == engine.runner.decode_steps

"""The host policy (requests, admission, scheduler, checkpoints, prefix tree, pool compaction)
over the fake runner (`inkling_jax.engine.fake_runner`): numpy bookkeeping and a model made of
hashes, no XLA program compiled (asserted). Random schedules of thousands of operations in
every engine mode check outputs against the fake model's plain decoding, `check_invariants()`
after every operation, and that admission's last guard never fires.

`INKLING_HOST_FUZZ_EXAMPLES` (default `DEFAULT_EXAMPLES`) sets how many modes one run draws.
"""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import inkling_jax as ik
from inkling_jax.engine.fake_runner import FakeRunner, FakeStateError, fake_generate, fake_params
from conftest import count_xla_compiles
from faults import housekeeping

CFG = ik.InklingConfig.tiny()  # 3 MTP depths: speculation up to 3
VOCAB = CFG.unpadded_vocab_size
DEFAULT_EXAMPLES = 40
EXAMPLES = int(os.environ.get("INKLING_HOST_FUZZ_EXAMPLES", DEFAULT_EXAMPLES))
OPS = ("submit", "step", "step", "step", "abort", "turn", "close", "evict", "compact", "lose")
COVERAGE: Counter = Counter()


class FakeEngine(ik.Engine):
    runner_cls = FakeRunner


POISON = 77  # the fake's NaN token (`FakeRunner.poison`) in the error-path fuzz


class PoisonRunner(FakeRunner):
    poison = frozenset({POISON})


class PoisonEngine(ik.Engine):
    runner_cls = PoisonRunner


def fake_engine(engine_cls=FakeEngine, **kw) -> FakeEngine:
    base = dict(max_running=2, num_slots=16, num_pages=64, page_size=4, track_interval=8, chunk_size=8,
                max_step_tokens=16, min_context_bucket=64)
    return engine_cls(CFG, fake_params(CFG), ik.EngineConfig(**{**base, **kw}))


def expected(r) -> tuple[list[int], str]:
    """The fake model's plain decoding of what r answers (its prompt, session history included)."""
    stops = list(r.sampling.stop_token_ids) + ([CFG.eos_token_id] if r.sampling.stop_at_eos else [])
    tokens, _, reason = fake_generate(r.tokens[:r.prompt_len], r.sampling.max_new_tokens, vocab=VOCAB,
                                      temperature=r.sampling.temperature, seed=r.seed, stop_ids=stops)
    return tokens, reason


def check_outputs(tracked, poison=frozenset()) -> None:
    """Every finished request against plain decoding; with `poison` (the fake's NaN tokens) a
    request fails ("error") exactly when a poison token would enter its state: in its history
    or among its tokens before the last, its output then a prefix of plain decoding's."""
    for r in tracked:
        assert r.finish_reason == "error" or r.error is None, f"request {r.rid} given up: {r.error}"
        if r.finish_reason is None:
            continue
        want, reason = expected(r)
        fed = r.tokens[:r.prompt_len] + want[:-1]
        if r.finish_reason in ("abort", "error"):
            assert r.out_tokens == want[:len(r.out_tokens)], (r.rid, r.out_tokens, want)
            assert r.finish_reason == "abort" or poison.intersection(fed), (r.rid, r.error)
        else:
            assert (r.out_tokens, r.finish_reason) == (want, reason), (r.rid, r.out_tokens, r.finish_reason, want)
            assert not poison.intersection(fed), (r.rid, "a poisoned request did not fail")


@st.composite
def modes(draw) -> dict:
    spec = draw(st.integers(0, 3))
    decode_steps = draw(st.integers(1, 4))
    page_size = draw(st.sampled_from([2, 4, 8]))
    interval = page_size * draw(st.integers(1, 4))
    if interval <= spec + 1:
        interval = page_size * (spec // page_size + 2)
    max_running = draw(st.integers(1, 4))
    chunk = draw(st.sampled_from([1, 2, 3, 5, 8, 16, 32]))
    cache = draw(st.sampled_from(["off", "eager", "lazy"]))
    return dict(spec_steps=spec, decode_steps=decode_steps,
                overlap=draw(st.booleans()) if spec == 0 and decode_steps > 1 else False,
                prefix_cache=cache != "off", ping_pong="lazy" if cache == "lazy" else "eager",
                pool=draw(st.sampled_from(["unified", "static"])), max_running=max_running, chunk_size=chunk,
                max_step_tokens=max(chunk, max_running, draw(st.sampled_from([4, 16, 32]))), page_size=page_size,
                track_interval=interval, num_slots=draw(st.integers(4, 24)), num_pages=draw(st.integers(24, 96)),
                min_context_bucket=16, max_step_checkpoints=draw(st.integers(1, 4)),
                evict_policy=draw(st.sampled_from(["lru", "lfu", "deepest"])))


def run_ops(engine: FakeEngine, rng: np.random.RandomState, num_ops: int, poison_rate: float = 0.0) -> Counter:
    """A random schedule (submit, step, abort, session turns and closes, eviction, compaction,
    a lost device state) with invariants checked after every operation; returns what it did.
    poison_rate: the chance that a prompt gets the fake's poison token (`POISON`) somewhere."""
    bases = [list(rng.randint(3, VOCAB, n)) for n in (23, 40, 9)]

    def maybe_poisoned(prompt: list[int]) -> list[int]:
        if rng.rand() < poison_rate:
            prompt = list(prompt)
            prompt.insert(rng.randint(len(prompt) + 1), POISON)
        return prompt

    tracked, sessions, figures = [], {}, Counter()
    before = {}  # a session turn's rid -> the history length it was submitted on
    for _ in range(num_ops):
        op = OPS[rng.randint(len(OPS))]
        figures[op] += 1
        try:
            if op == "submit":
                base = bases[rng.randint(len(bases))]
                prompts = [maybe_poisoned(base[:rng.randint(0, len(base) + 1)]
                                          + list(rng.randint(3, VOCAB, rng.randint(1, 6))))
                           for _ in range(rng.randint(1, 4))]
                sp = sampling(rng)
                tracked += engine.submit(prompts, sp)
            elif op == "step":
                engine.step()
            elif op == "abort":
                live = [r for r in tracked if r.finish_reason is None and r.error is None]
                if live:
                    engine.abort(live[rng.randint(len(live))])
            elif op == "turn":
                idle = [s for s, turn in sessions.items() if turn is None or turn.finish_reason is not None]
                sid = engine.open_session() if not idle or rng.rand() < 0.3 else idle[rng.randint(len(idle))]
                prev = sessions.get(sid)
                if prev is not None and prev.finish_reason in ("length", "stop"):  # the history: the turn's
                    assert engine.sessions[sid].tokens == prev.tokens
                elif prev is not None and prev.finish_reason == "error":  # a failed turn left none of it
                    assert engine.sessions[sid].tokens == prev.tokens[:before[prev.rid]]
                    figures["turns after a failed turn"] += 1
                history = len(engine.sessions[sid].tokens)
                r = engine.submit([maybe_poisoned(list(rng.randint(3, VOCAB, rng.randint(1, 8))))], sampling(rng),
                                  session=sid)[0]
                before[r.rid] = history
                sessions[sid] = r
                tracked.append(r)
            elif housekeeping(engine, op, sessions, rng):  # close, evict, compact
                pass
            elif op == "lose" and rng.rand() < 0.2:
                engine.runner.lose_state()
                engine.step()
        except ValueError as exc:  # refused at the door: nothing changed
            assert "exceed" in str(exc) or "never be admitted" in str(exc), exc
            figures["refused"] += 1
        except RuntimeError as exc:
            assert "lost" in str(exc), exc
            figures["lost"] += 1
        engine.check_invariants()
    while engine.running or engine.waiting:
        engine.step()
        engine.check_invariants()
    check_outputs(tracked, engine.runner.poison)
    figures["requests"] += len(tracked)
    figures["failed"] += sum(r.finish_reason == "error" for r in tracked)
    figures["tokens"] += sum(len(r.out_tokens) for r in tracked)
    return figures


def sampling(rng) -> ik.SamplingParams:
    return ik.SamplingParams(max_new_tokens=int(rng.randint(1, 12)), temperature=float(rng.choice([0.0, 0.7])),
                             seed=int(rng.randint(100)), stop_at_eos=bool(rng.rand() < 0.5),
                             stop_token_ids=tuple(int(t) for t in rng.randint(3, VOCAB, rng.randint(0, 3))))


@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(mode=modes(), seed=st.integers(0, 2**31 - 1))
def test_random_schedules_in_every_mode(mode, seed):
    """Outputs equal plain decoding, invariants hold after every operation, no request is
    ever given up by admission's last guard, and nothing compiles."""
    with count_xla_compiles() as compiles:
        engine = fake_engine(**mode)
        figures = run_ops(engine, np.random.RandomState(seed), 300)
    assert compiles[0] == 0
    s = engine.stats()
    COVERAGE.update(figures)
    COVERAGE["modes"] += 1
    COVERAGE["verify steps"] += s["verify_steps"]
    COVERAGE["accepted drafts"] += s["accepted_draft_tokens"]
    COVERAGE["cache hit tokens"] += s["cache_hit_tokens"]
    COVERAGE["compaction moves"] += s["compaction_moves"]
    COVERAGE["resets"] += s["resets"]


@settings(max_examples=max(EXAMPLES // 2, 1), deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(mode=modes(), seed=st.integers(0, 2**31 - 1))
def test_random_schedules_with_a_poison_token(mode, seed):
    """The error path (issue 35) fuzzed: the fake's poison token stands for a NaN embedding row;
    requests that feed it fail alone, nothing they wrote is read again (the fake marks it:
    a cached or kept piece of it would raise `FakeStateError`), sessions whose turn failed go
    on from their history before the turn, every other output is plain decoding's, and the
    invariants hold after every operation."""
    engine = fake_engine(PoisonEngine, **mode)
    figures = run_ops(engine, np.random.RandomState(seed), 300, poison_rate=0.15)
    COVERAGE["poisoned modes"] += 1
    COVERAGE["turns after a failed turn"] += figures["turns after a failed turn"]
    COVERAGE["failed requests"] += figures["failed"]
    assert figures["failed"] == engine.stats()["failed_requests"]


def test_coverage_report():
    print("host fuzz coverage:", dict(sorted(COVERAGE.items())))
    if COVERAGE:
        assert COVERAGE["tokens"] > 0 and COVERAGE["cache hit tokens"] > 0 and COVERAGE["accepted drafts"] > 0
    if COVERAGE["poisoned modes"]:
        assert COVERAGE["failed requests"] > 0 and COVERAGE["turns after a failed turn"] > 0


# ------------------------------------------------------------ the fake is an oracle


def test_fake_catches_a_dropped_compaction_move(monkeypatch):
    """The fake is an oracle: when compaction copies are lost (the tables move objects, their
    data stays behind), the moved request continues another's state and its output differs
    from plain decoding."""
    engine = fake_engine(max_running=3, prefix_cache=False)
    reqs = engine.submit([[5, 6, 7], [8, 9], [10, 11, 12]], ik.SamplingParams(max_new_tokens=30))
    engine.step()
    engine.step()
    monkeypatch.setattr(engine.runner, "move_units", lambda arena, src, dst: arena)
    engine.abort(reqs[0])  # eager: the outermost slot and page move into the holes
    assert engine.pool.has_pending_moves()
    with pytest.raises((FakeStateError, AssertionError)):
        while engine.running:
            engine.step()
        check_outputs(reqs)


def test_fake_catches_a_wrong_copy_on_write():
    """A prefix hit restored from another checkpoint than the matched one is caught."""
    engine = fake_engine()
    prompt = list(range(10, 30))
    engine.generate([prompt, list(range(50, 70))], ik.SamplingParams(max_new_tokens=2))
    r = engine.submit([prompt + [3]], ik.SamplingParams(max_new_tokens=2))[0]
    engine.requests.admit_waiting()
    other = engine.tree.match(list(range(50, 70)), max_depth=16).node.checkpoint
    assert r.virtual_cow_slot and other and other != r.virtual_cow_slot
    r.virtual_cow_slot = other
    with pytest.raises(FakeStateError):
        engine.step()

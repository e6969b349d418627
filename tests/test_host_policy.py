"""The host policy (requests, admission, scheduler, checkpoints, prefix tree, pool compaction)
over the fake runner (`inkling_jax.engine.fake_runner`): numpy bookkeeping and a model made of
hashes, no XLA program compiled (asserted). Random schedules of thousands of operations in
every engine mode check outputs against the fake model's plain decoding, `check_invariants()`
after every operation, and that admission's last guard never fires.

`INKLING_HOST_FUZZ_EXAMPLES` (default `DEFAULT_EXAMPLES`) sets how many modes one run draws.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import inkling_jax as ik
from inkling_jax.engine.fake_runner import (FakeRunner, FakeStateError, fake_generate, fake_params, fold,
                                             token_logprob, top_tokens)
from inkling_jax.tokenizer import ByteTokenizer
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


TOKENIZER = ByteTokenizer(CFG)
POISON = 77  # the fake's NaN token (`FakeRunner.poison`) in the error-path fuzz


class PoisonRunner(FakeRunner):
    poison = frozenset({POISON})


class PoisonEngine(ik.Engine):
    runner_cls = PoisonRunner


def fake_engine(engine_cls=FakeEngine, **kw) -> FakeEngine:
    base = dict(max_running=2, num_slots=16, num_pages=64, page_size=4, track_interval=8, chunk_size=8,
                max_step_tokens=16, min_context_bucket=64)
    return engine_cls(CFG, fake_params(CFG), ik.EngineConfig(**{**base, **kw}), tokenizer=TOKENIZER)


def stop_string_cut(tokens, stops, include):
    """The oracle of stop strings: the first k whose whole decoded text holds a stop string
    (the earliest match, the longest of those at one place): (tokens[:k], the text cut, the
    stop string), or None."""
    for k in range(1, len(tokens) + 1):
        text = TOKENIZER.decode(tokens[:k])
        found = [(text.find(s), -len(s), s) for s in stops if s in text]
        if found:
            i, _, s = min(found)
            return tokens[:k], text[:i + (len(s) if include else 0)], s
    return None


def plain(r) -> tuple[list[int], str]:
    """The fake model's plain decoding of what r answers (its prompt, session history included),
    its processors emulated (fake_runner's docstring), before any stop-string cut: (tokens,
    finish reason)."""
    sp = r.sampling
    stops = list(sp.stop_token_ids) + ([CFG.eos_token_id] if sp.stop_at_eos else [])
    tokens, _, reason = fake_generate(r.tokens[:r.prompt_len], sp.max_new_tokens, vocab=VOCAB,
                                      temperature=sp.temperature, seed=r.seed, stop_ids=stops,
                                      min_tokens=sp.min_tokens, repetition=sp.repetition_penalty != 1,
                                      output_penalty=sp.presence_penalty != 0 or sp.frequency_penalty != 0)
    return tokens, reason


def expected(r) -> tuple[list[int], str, str]:
    """The fake model's plain decoding of what r answers (its prompt, session history included),
    its processors emulated (fake_runner's docstring), stop strings cut by `stop_string_cut`:
    (tokens, finish reason, text)."""
    sp = r.sampling
    tokens, reason = plain(r)
    eos_stop = reason == "stop" and sp.stop_at_eos and tokens[-1] == CFG.eos_token_id and len(tokens) > sp.min_tokens
    text = TOKENIZER.decode(tokens[:-1] if eos_stop else tokens)  # an eos that stops is not text
    cut = stop_string_cut(tokens, sp.stop, sp.include_stop_str) if sp.stop else None
    if cut is not None:
        tokens, text, reason = cut[0], cut[1], "stop"
    return tokens, reason, text


def check_outputs(tracked, poison=frozenset()) -> None:
    """Every finished request against plain decoding; with `poison` (the fake's NaN tokens) a
    request fails ("error") when a poison token enters its state: in its history or among its
    tokens before the last, its output then a prefix of plain decoding's. (Past a stop string's
    cut the device may have run on within the dispatch that matched it: a poison token there
    may fail the request too.)"""
    for r in tracked:
        assert r.finish_reason == "error" or r.error is None, f"request {r.rid} given up: {r.error}"
        if r.finish_reason is None:
            continue
        want, reason, text = expected(r)
        surely_fed = r.tokens[:r.prompt_len] + want[:-1]
        maybe_fed = r.tokens[:r.prompt_len] + plain(r)[0][:-1]  # a stop string's cut: the device ran on
        if r.finish_reason in ("abort", "error"):
            assert r.out_tokens == want[:len(r.out_tokens)], (r.rid, r.out_tokens, want)
            assert r.finish_reason == "abort" or poison.intersection(maybe_fed), (r.rid, r.error)
        else:
            assert (r.out_tokens, r.finish_reason) == (want, reason), (r.rid, r.out_tokens, r.finish_reason, want)
            assert r.text.text == text, (r.rid, r.text.text, text)
            assert not poison.intersection(surely_fed), (r.rid, "a poisoned request did not fail")
        prompt = r.tokens[:r.prompt_len]
        for j, top in enumerate(r.out_tops):  # logprobs=k: the k alternatives where each token was chosen
            assert top == [(t, float(np.float32(lp))) for t, lp in
                           top_tokens(fold(prompt + r.out_tokens[:j]), r.sampling.logprobs, VOCAB)]
        if r.score_from is not None and r.finish_reason not in ("abort", "error"):  # prompt_logprobs
            want_lps = [None] * r.score_from + [float(np.float32(token_logprob(fold(prompt[:p]), prompt[p])))
                                                for p in range(r.score_from, r.prompt_len)]
            assert r.prompt_lps == want_lps, (r.rid, r.prompt_lps, want_lps)
            if r.prompt_top:
                assert r.prompt_tops[r.score_from:] == [
                    [(t, float(np.float32(lp))) for t, lp in top_tokens(fold(prompt[:p]), r.prompt_top, VOCAB)]
                    for p in range(r.score_from, r.prompt_len)]


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
                sp = sampling(rng, n=int(rng.choice([1, 1, 1, 2, 3])))
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
                    assert engine.sessions[sid].tokens == prev.tokens[:prev.output_end]  # (a stop string's cut)
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
    figures["stop strings matched"] += sum(isinstance(r.stop_reason, str) for r in tracked)
    figures["forked samples"] += sum(r.sample > 0 and r.cached > 0 for r in tracked)
    figures["penalized"] += sum(r.sampling.penalized for r in tracked)
    figures["scored prompts"] += sum(r.score_from is not None for r in tracked)
    return figures


# the fake's tokens are uniform bytes: single printable characters match now and then, pairs rarely
STOP_STRINGS = tuple(chr(c) for c in range(32, 127)) + ("ab", "\n\n", "~x")


def sampling(rng, n: int = 1) -> ik.SamplingParams:
    """Drawn settings: greedy or sampled, stop ids, and (each now and then) the options the fake
    emulates: stop strings, min_tokens (not with them: see `stop_string_cut`), penalties,
    top alternatives, prompt log-probs; n samples for plain submits."""
    max_new = int(rng.randint(1, 12))
    stop = tuple(rng.choice(STOP_STRINGS, rng.randint(1, 12), replace=False)) if rng.rand() < 0.3 else ()
    return ik.SamplingParams(max_new_tokens=max_new, temperature=float(rng.choice([0.0, 0.7])),
                             seed=int(rng.randint(100)), stop_at_eos=bool(rng.rand() < 0.5),
                             stop_token_ids=tuple(int(t) for t in rng.randint(3, VOCAB, rng.randint(0, 3))),
                             stop=stop, include_stop_str=bool(rng.rand() < 0.5),
                             min_tokens=int(rng.randint(0, max_new + 1)) if not stop and rng.rand() < 0.3 else 0,
                             repetition_penalty=1.3 if rng.rand() < 0.2 else 1.0,
                             presence_penalty=float(rng.choice([0.0, 0.5])) if rng.rand() < 0.3 else 0.0,
                             frequency_penalty=0.25 if rng.rand() < 0.1 else 0.0,
                             logprobs=int(rng.choice([0, 2])) if rng.rand() < 0.3 else 0,
                             prompt_logprobs=int(rng.choice([0, 2])) if rng.rand() < 0.2 else None, n=n)


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
    COVERAGE["multi-round verify steps"] += s["multi_round_verify_steps"]
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


def test_a_failed_request_fails_alone_in_every_interface():
    """The error path through the generation interface (fake runner, no compile): a poisoned
    prompt's n samples all fail ("error", the reason in Completion.error) while the clean
    prompt's samples are plain decoding's; a stream's last delta of the poisoned request says
    "error"; a scored pair whose context is poisoned has ScoreResult.error and no log-probs,
    the other pair the fake model's."""
    engine = fake_engine(PoisonEngine)
    clean, bad = [5, 6, 7, 8, 9, 10], [5, 6, POISON, 8, 9, 10]
    sp = ik.SamplingParams(max_new_tokens=5, stop_at_eos=False, temperature=0.7, seed=3)
    with count_xla_compiles() as compiles:
        got = engine.generate([clean, bad], sp, n=2)
        deltas = list(engine.stream([clean, bad], ik.SamplingParams(max_new_tokens=4, stop_at_eos=False)))
        scored = engine.score([clean, bad], [[11, 12, 13], [11, 12, 13]])
    assert compiles[0] == 0
    for j, c in enumerate(got[0]):
        r = engine.submit([clean], dataclasses.replace(sp, seed=sp.seed + j))[0]  # the same request, alone
        while r.finish_reason is None:
            engine.step()
        assert (c.finish_reason, c.error, c.tokens) == ("length", None, r.out_tokens)
    assert all(c.finish_reason == "error" and "non-finite" in c.error and not c.tokens for c in got[1])
    assert {d.index: d.finish_reason for d in deltas if d.finish_reason} == {0: "length", 1: "error"}
    full = clean + [11, 12, 13]
    assert scored[0].error is None and scored[0].logprobs == [
        float(np.float32(token_logprob(fold(full[:p]), full[p]))) for p in range(len(clean), len(full))]
    assert "non-finite" in scored[1].error and scored[1].logprobs == [None] * 3
    assert engine.stats()["failed_requests"] == 4
    engine.check_invariants()


def test_coverage_report():
    print("host fuzz coverage:", dict(sorted(COVERAGE.items())))
    if COVERAGE:
        assert COVERAGE["tokens"] > 0 and COVERAGE["cache hit tokens"] > 0 and COVERAGE["accepted drafts"] > 0
        assert COVERAGE["multi-round verify steps"] > 0
        assert COVERAGE["stop strings matched"] and COVERAGE["forked samples"] and COVERAGE["penalized"]
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

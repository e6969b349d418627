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
from inkling_jax.engine.fake_runner import FakeRunner, FakeStateError, fake_generate, fake_params, fold, token_logprob, \
    top_tokens
from inkling_jax.tokenizer import ByteTokenizer
from conftest import count_xla_compiles

CFG = ik.InklingConfig.tiny()  # 3 MTP depths: speculation up to 3
VOCAB = CFG.unpadded_vocab_size
DEFAULT_EXAMPLES = 40
EXAMPLES = int(os.environ.get("INKLING_HOST_FUZZ_EXAMPLES", DEFAULT_EXAMPLES))
OPS = ("submit", "step", "step", "step", "abort", "turn", "close", "evict", "compact", "lose")
COVERAGE: Counter = Counter()


class FakeEngine(ik.Engine):
    runner_cls = FakeRunner


TOKENIZER = ByteTokenizer(CFG)


def fake_engine(**kw) -> FakeEngine:
    base = dict(max_running=2, num_slots=16, num_pages=64, page_size=4, track_interval=8, chunk_size=8,
                max_step_tokens=16, min_context_bucket=64)
    return FakeEngine(CFG, fake_params(CFG), ik.EngineConfig(**{**base, **kw}), tokenizer=TOKENIZER)


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


def expected(r) -> tuple[list[int], str, str]:
    """The fake model's plain decoding of what r answers (its prompt, session history included),
    its processors emulated (fake_runner's docstring), stop strings cut by `stop_string_cut`:
    (tokens, finish reason, text)."""
    sp = r.sampling
    stops = list(sp.stop_token_ids) + ([CFG.eos_token_id] if sp.stop_at_eos else [])
    tokens, _, reason = fake_generate(r.tokens[:r.prompt_len], sp.max_new_tokens, vocab=VOCAB,
                                      temperature=sp.temperature, seed=r.seed, stop_ids=stops,
                                      min_tokens=sp.min_tokens, repetition=sp.repetition_penalty != 1,
                                      output_penalty=sp.presence_penalty != 0 or sp.frequency_penalty != 0)
    eos_stop = reason == "stop" and sp.stop_at_eos and tokens[-1] == CFG.eos_token_id and len(tokens) > sp.min_tokens
    text = TOKENIZER.decode(tokens[:-1] if eos_stop else tokens)  # an eos that stops is not text
    cut = stop_string_cut(tokens, sp.stop, sp.include_stop_str) if sp.stop else None
    if cut is not None:
        tokens, text, reason = cut[0], cut[1], "stop"
    return tokens, reason, text


def check_outputs(tracked) -> None:
    for r in tracked:
        assert r.error is None, f"request {r.rid} given up: {r.error}"
        if r.finish_reason is None:
            continue
        want, reason, text = expected(r)
        if r.finish_reason == "abort":
            assert r.out_tokens == want[:len(r.out_tokens)], (r.rid, r.out_tokens, want)
        else:
            assert (r.out_tokens, r.finish_reason) == (want, reason), (r.rid, r.out_tokens, r.finish_reason, want)
            assert r.text.text == text, (r.rid, r.text.text, text)
        prompt = r.tokens[:r.prompt_len]
        for j, top in enumerate(r.out_tops):  # logprobs=k: the k alternatives where each token was chosen
            assert top == [(t, float(np.float32(lp))) for t, lp in
                           top_tokens(fold(prompt + r.out_tokens[:j]), r.sampling.logprobs, VOCAB)]
        if r.score_from is not None and r.finish_reason != "abort":  # prompt_logprobs
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


def run_ops(engine: FakeEngine, rng: np.random.RandomState, num_ops: int) -> Counter:
    """A random schedule (submit, step, abort, session turns and closes, eviction, compaction,
    a lost device state) with invariants checked after every operation; returns what it did."""
    bases = [list(rng.randint(3, VOCAB, n)) for n in (23, 40, 9)]
    tracked, sessions, figures = [], {}, Counter()
    for _ in range(num_ops):
        op = OPS[rng.randint(len(OPS))]
        figures[op] += 1
        try:
            if op == "submit":
                base = bases[rng.randint(len(bases))]
                prompts = [base[:rng.randint(0, len(base) + 1)] + list(rng.randint(3, VOCAB, rng.randint(1, 6)))
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
                r = engine.submit([list(rng.randint(3, VOCAB, rng.randint(1, 8)))], sampling(rng), session=sid)[0]
                sessions[sid] = r
                tracked.append(r)
            elif op == "close" and sessions:
                sid = list(sessions)[rng.randint(len(sessions))]
                engine.close_session(sid, abort=True)
                del sessions[sid]
            elif op == "evict":
                engine.evict_all()
            elif op == "compact":
                engine.compact()
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
    check_outputs(tracked)
    figures["requests"] += len(tracked)
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
    COVERAGE["accepted drafts"] += s["accepted_draft_tokens"]
    COVERAGE["cache hit tokens"] += s["cache_hit_tokens"]
    COVERAGE["compaction moves"] += s["compaction_moves"]
    COVERAGE["resets"] += s["resets"]


def test_coverage_report():
    print("host fuzz coverage:", dict(sorted(COVERAGE.items())))
    if COVERAGE:
        assert COVERAGE["tokens"] > 0 and COVERAGE["cache hit tokens"] > 0 and COVERAGE["accepted drafts"] > 0
        assert COVERAGE["stop strings matched"] and COVERAGE["forked samples"] and COVERAGE["penalized"]


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

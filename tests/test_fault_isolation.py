"""One bad request fails alone (issue 35, items 1 and 2).

Kernels: the attention of a row never multiplies a value it does not attend to by a zero
weight: NaN or inf in invalid keys (another row's tokens in the packed step, stale page or
ring rows, padding) leave every output exactly what finite garbage gives, in the jnp
references and the Pallas kernels (interpret mode).

Engine: a copy of the params with one token's embedding row NaN (or, in bf16, large enough
that the trunk overflows to inf); requests whose history holds that token finish with
finish_reason "error" and the reason, every other request's tokens and log-probs equal a run
without the faulty ones (with the prefix cache, in sessions, with speculation, multi-step
decode and overlap), nothing of the faulty ones reaches the prefix cache or a session, and
the accounting closes. The fake runner's poison token fuzzes the host side of the same path.
"""

from __future__ import annotations

import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import decode, decode_ref
from pallas_kernels.attention import pallas as attn
from pallas_kernels.attention import ref as attn_ref

INTERPRET = jax.default_backend() != "gpu"
BAD = {"nan": np.nan, "inf": np.inf}


@pytest.fixture(autouse=True)
def true_float32_references():
    with jax.default_matmul_precision("highest"):
        yield


def same(a, b):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# ------------------------------------------------------------------ kernels


def test_flash_attention_ignores_invalid_values():
    """Invalid keys holding NaN (one row) and inf (the other): the flash kernel's and the
    reference's outputs equal those with finite garbage there, bit for bit. Keys 0..47 in
    blocks of 16, queries 32..47, bias extent 8: a far block with invalid keys (its own loop),
    then near blocks."""
    from test_attention_kernel import SMALL, make_case

    rng = np.random.default_rng(35)
    q, k, v, rel, q_pos, k_pos, k_valid = make_case(rng, b=2, nq=16, nk=48, h=4, hkv=2, d=16, e=8,
                                                    dtype=jnp.float32, layout="sorted", q_start=32,
                                                    invalid_frac=0.25)
    assert not np.asarray(k_valid)[:, :16].all() and np.asarray(k_valid)[:, :16].any()
    bad = jnp.where(~np.asarray(k_valid)[:, :, None, None], jnp.asarray([np.nan, np.inf])[:, None, None, None], 0.0)
    kb, vb = k + bad, v + bad
    for fn in (partial(attn.attention, **SMALL, interpret=INTERPRET), attn_ref.attention):
        clean = fn(q, k, v, rel, q_pos, k_pos, k_valid, window=None)
        got = fn(q, kb, vb, rel, q_pos, k_pos, k_valid, window=None)
        assert np.isfinite(np.asarray(got)).all()
        same(got, clean)


@pytest.mark.parametrize("kind, bad", [("ring", "nan"), ("pages", "inf")])
def test_decode_attention_ignores_stale_rows(kind, bad):
    """Every arena token row that is not a row's live context (inside live blocks too: a
    page's positions past seq_start, ring rows not written, the sink) and the invalid new keys
    hold NaN / inf: the decode kernels and the reference give exactly what finite garbage
    gives."""
    import test_decode_attention as T

    rows = dict(seq_start=[37, 0, 61]) if kind == "pages" else dict(seq_start=[57, 9, 13],
                                                                       has_state=[True, False, True])
    c = T.Case(np.random.default_rng(3), kind=kind, q_valid=T.Q_VALID[3], **rows)
    tok = c.arena_np.reshape(-1, 2 * T.NKV * T.HD)
    live = np.zeros(tok.shape[0], bool)
    for i in range(c.b):
        s = int(c.seq_start[i])
        if kind == "ring":
            if bool(c.has_state[i]):
                for p in range(max(0, s - c.ring), s):
                    live[int(c.unit_row[i]) * T.UNIT_TOKENS + p % c.ring] = True
        else:
            for p in range(s):
                live[int(c.unit_row[i, p // T.UNIT_TOKENS]) * T.UNIT_TOKENS + p % T.UNIT_TOKENS] = True
    poisoned = jnp.asarray(np.where(live[:, None], tok, BAD[bad]).reshape(c.arena_np.shape))
    dead_new = ~np.asarray(c.q_valid)[:, :, None, None]
    clean_new = (c.k_new, c.v_new)
    for fn, tune in ((decode.ring_attention if kind == "ring" else decode.paged_attention, dict(interpret=INTERPRET)),
                     (decode_ref.ring_attention if kind == "ring" else decode_ref.paged_attention, {})):
        if kind == "ring" and tune:
            tune["bk"] = 16
        call = jax.jit(partial(fn, **c.static(20 if kind == "ring" else None), **tune))
        clean = call(*c.args())
        c.k_new, c.v_new = (jnp.where(dead_new, BAD[bad], x) for x in clean_new)
        got = call(*c.args(arena=poisoned))
        c.k_new, c.v_new = clean_new
        assert np.isfinite(np.asarray(got)).all()
        same(got, clean)


# ------------------------------------------------------------------ the engine

import inkling_jax as ik  # noqa: E402
from conftest import ENGINE_KW, TWO_LAYER  # noqa: E402

CFG = TWO_LAYER  # every kind of state (conftest)
VOCAB = CFG.unpadded_vocab_size
KW = {**ENGINE_KW, "max_running": 3, "min_batch_bucket": 4}  # one batch bucket: few compiles
GREEDY = ik.SamplingParams(max_new_tokens=6, stop_at_eos=False)
MODES = {"cache": {}, "spec": dict(spec_steps=2), "multistep": dict(decode_steps=3, overlap=True)}


@pytest.fixture(scope="module")
def params():
    return ik.init_params(CFG, jax.random.key(7), std=0.1)


def poisoned(params, token: int, value: float = np.nan):
    """A copy of params whose embedding row `token` is `value` (the rest shared)."""
    return {**params, "embed": params["embed"].at[token].set(value)}


_ORACLE: dict = {}


def oracle(params, history: list[int], sp=GREEDY, dtype="float32") -> ik.Completion:
    """Plain greedy decoding of one history, alone (no cache, one step per dispatch)."""
    key = (tuple(history), sp, dtype)
    if key not in _ORACLE:
        engine = _ORACLE.get(dtype)
        if engine is None:
            engine = _ORACLE[dtype] = ik.Engine(CFG, params, ik.EngineConfig(**{**KW, "prefix_cache": False,
                                                                                 "decode_steps": 1}))
        _ORACLE[key] = engine.generate([history], sp)[0]
    return _ORACLE[key]


def toks(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.RandomState(seed).randint(3, VOCAB, n)]


@pytest.fixture(scope="module")
def scenario(params):
    """Clean prompts (two share a prefix), the poison token X: the third token prompt F's plain
    run generates (so F fails in a decode step, when X enters its state) and in no other clean
    prompt or output; prompts D and E hold X (D after B's first 16 tokens: a cached prefix)."""
    a, b = toks(1, 13), toks(2, 21)
    c = b[:16] + toks(3, 4)
    clean = [a, b, c]
    for seed in range(10, 60):
        f = toks(seed, 7)
        x = oracle(params, f).tokens[2]
        used = set(f) | set(oracle(params, f).tokens[:2])
        for p in clean:
            used |= set(p) | set(oracle(params, p).tokens)
        if x not in used:
            break
    else:
        raise AssertionError("no poison token found")
    d, e = b[:16] + [x] + toks(4, 3), [x] + toks(5, 9)
    return dict(clean=clean, f=f, x=x, bad=[d, e])


def check_no_trace(engine, x: int) -> None:
    """Nothing of a failed request survives: the accounting closes (every live slot and page is
    owned), the prefix tree holds no path through X, no session holds state or history of it."""
    engine.check_invariants()
    if engine.tree is not None:
        for node in engine.tree._nodes():
            assert x not in node.tokens, "a failed request's prefix reached the cache"
    for sess in engine.sessions.values():
        assert x not in sess.tokens


@pytest.mark.parametrize("mode", list(MODES))
def test_nonfinite_requests_fail_alone(params, scenario, mode):
    """Requests whose history holds the NaN token finish with "error" and the reason (in a
    prefill chunk, and in a decode step for F, whose own greedy output is X); the clean ones
    batched with them, sharing a cached prefix with one of them, are exactly their plain run;
    nothing of the failed ones is cached, and later requests reuse their freed (NaN-filled)
    slots and pages and hit the prefixes cached before X exactly."""
    x = scenario["x"]
    bad_params = poisoned(params, x)
    engine = ik.Engine(CFG, bad_params, ik.EngineConfig(**{**KW, **MODES[mode]}))
    clean, bad, f = scenario["clean"], scenario["bad"], scenario["f"]
    out = engine.generate([clean[0], bad[0], clean[1], f, bad[1], clean[2]], GREEDY)
    for c, p in zip([out[0], out[2], out[5]], clean):
        want = oracle(params, p)
        assert c.finish_reason == "length" and c.tokens == want.tokens
        np.testing.assert_allclose(c.logprobs, want.logprobs, rtol=0, atol=1e-5)
    for c in (out[1], out[4], out[3]):
        assert c.finish_reason == "error" and "non-finite logits" in c.error, c
    assert out[1].tokens == out[4].tokens == []
    assert out[3].tokens == oracle(params, f).tokens[:len(out[3].tokens)] and len(out[3].tokens) <= 3
    check_no_trace(engine, x)
    assert engine.stats()["failed_requests"] == 3
    again = engine.generate([clean[2], clean[1][:16] + [5, 6], bad[0]], GREEDY)
    if engine.tree is not None:
        assert again[0].cached_tokens == 16 and again[1].cached_tokens == 16
    for c, p in zip(again[:2], [clean[2], clean[1][:16] + [5, 6]]):
        assert c.tokens == oracle(params, p).tokens
    assert again[2].finish_reason == "error"
    check_no_trace(engine, x)
    if engine.tree is not None:
        assert engine.pool.live_count("slot") == len(engine.tree.owned()[0])


def test_inf_row_fails_alone(params, scenario):
    """An inf embedding row (what an overflow leaves) fails the same way, one step at a time."""
    x = scenario["x"]
    engine = ik.Engine(CFG, poisoned(params, x, np.inf), ik.EngineConfig(**{**KW, "decode_steps": 1}))
    out = engine.generate([scenario["bad"][1], scenario["clean"][0]], GREEDY)
    assert out[0].finish_reason == "error" and out[1].tokens == oracle(params, scenario["clean"][0]).tokens
    check_no_trace(engine, x)


def test_session_turn_that_fails_leaves_the_history(params, scenario):
    """A session turn holding X fails: the session keeps its history from before the turn and
    drops its state (the turn wrote into it); its next turn recomputes the state from the tokens
    and equals plain decoding of the history. A session whose first turn fails starts over."""
    x = scenario["x"]
    engine = ik.Engine(CFG, poisoned(params, x), ik.EngineConfig(**KW))
    t1, t3 = toks(20, 11), toks(21, 5)
    sid = engine.open_session()
    first = engine.generate([t1], GREEDY, session=sid)[0]
    history = t1 + first.tokens
    failed = engine.generate([toks(22, 3) + [x]], GREEDY, session=sid)[0]
    assert failed.finish_reason == "error" and engine.sessions[sid].tokens == history
    assert engine.sessions[sid].held is None
    check_no_trace(engine, x)
    third = engine.generate([t3], GREEDY, session=sid)[0]
    assert third.tokens == oracle(params, history + t3).tokens
    other = engine.open_session()
    assert engine.generate([[x] + t3], GREEDY, session=other)[0].finish_reason == "error"
    assert engine.sessions[other].tokens == [] and engine.sessions[other].held is None
    assert engine.generate([t3], GREEDY, session=other)[0].tokens == oracle(params, t3).tokens
    for s in (sid, other):
        engine.close_session(s)
    check_no_trace(engine, x)
    assert engine.pool.live_count("slot") == len(engine.tree.owned()[0])


def test_processors_and_samples_beside_a_failing_row(params, scenario):
    """The generation interface's device paths (issue 34) beside a NaN row (issue 35): a clean
    prompt's n samples with every processor the device runs (the penalties' count table, logit
    bias, min_p, min_tokens) and top alternatives, batched with a poisoned prompt's samples,
    equal the same requests on the clean params; the poisoned samples fail and give back their
    count rows."""
    x = scenario["x"]
    config = ik.EngineConfig(**{**KW, **MODES["multistep"]})  # (the programs of the multistep test above)
    sp = ik.SamplingParams(max_new_tokens=6, stop_at_eos=False, temperature=0.8, seed=2, repetition_penalty=1.3,
                           presence_penalty=0.5, frequency_penalty=0.2, logit_bias={5: 2.0}, min_p=0.05, min_tokens=2,
                           logprobs=2)
    clean, bad = scenario["clean"][0], scenario["bad"][1]
    want = ik.Engine(CFG, params, config).generate([clean], sp, n=2)[0]
    engine = ik.Engine(CFG, poisoned(params, x), config)
    out = engine.generate([clean, bad], sp, n=2)
    for c, w in zip(out[0], want):
        assert (c.finish_reason, c.tokens) == ("length", w.tokens)
        np.testing.assert_allclose(c.logprobs, w.logprobs, rtol=0, atol=1e-5)
        np.testing.assert_allclose([[lp for _, lp in t] for t in c.top_logprobs],
                                   [[lp for _, lp in t] for t in w.top_logprobs], rtol=0, atol=1e-5)
    assert [c.finish_reason for c in out[1]] == ["error", "error"]
    check_no_trace(engine, x)
    assert sorted(engine.requests.free_count_rows) == list(range(1, config.max_running + 1))


def test_bf16_overflow_fails_alone(params, scenario):
    """bf16 serving: an embedding row of 3.4e38 (finite in fp32) overflows to inf in the bf16
    cast; the request holding it fails, the clean one batched with it is the bf16 plain run."""
    x = scenario["x"]
    bf16 = ik.cast_params(poisoned(params, x, 3.4e38), jnp.bfloat16)
    assert np.isinf(np.asarray(bf16["embed"][x], np.float32)).all()
    clean_bf16 = ik.cast_params(params, jnp.bfloat16)
    prompt = scenario["clean"][0]
    want = ik.Engine(CFG, clean_bf16, ik.EngineConfig(**KW)).generate([prompt], GREEDY)[0]  # (the same programs)
    engine = ik.Engine(CFG, bf16, ik.EngineConfig(**KW))
    out = engine.generate([scenario["bad"][1], prompt], GREEDY)
    assert out[0].finish_reason == "error" and out[1].tokens == want.tokens
    np.testing.assert_allclose(out[1].logprobs, want.logprobs, rtol=0, atol=2e-2)
    check_no_trace(engine, x)


@pytest.mark.skipif(not os.environ.get("INKLING_PALLAS_ISOLATION"),
                    reason="~25 s of interpret-mode kernels: INKLING_PALLAS_ISOLATION=1 runs it (the kernel tests "
                           "above check the kernels' changes)")
def test_pallas_kernels_keep_rows_apart(params, scenario):
    """The same with the Pallas ops (interpret mode; pages of 16 so the paged decode kernel
    runs too): every kernel a step takes (conv, norm, router, experts, ring and paged decode
    attention) with a NaN row in the batch; the clean row equals its jnp plain run."""
    x = scenario["x"]
    kw = {**KW, "page_size": 16, "track_interval": 16, "chunk_size": 16, "use_pallas": True, "pallas_interpret": True}
    engine = ik.Engine(CFG, poisoned(params, x), ik.EngineConfig(**kw))
    sp = ik.SamplingParams(max_new_tokens=4, stop_at_eos=False)  # F feeds X (its 3rd token) in its 4th step
    clean = scenario["clean"][0]
    # the clean row first: its padded query columns reach into the bad row's packed tokens
    out = engine.generate([clean, scenario["bad"][1], scenario["f"]], sp)
    assert out[1].finish_reason == "error" and out[2].finish_reason == "error"
    want = oracle(params, clean, sp)
    assert out[0].tokens == want.tokens
    np.testing.assert_allclose(out[0].logprobs, want.logprobs, rtol=0, atol=1e-4)
    check_no_trace(engine, x)


def test_on_delta_that_raises_fails_its_request_alone(params, scenario):
    """A stream consumer the engine calls (generate's on_delta) raising for one request's
    delta fails that request only, with the reason; it gets no more deltas; the others get
    every delta and finish exactly as without the consumer; the accounting closes, a later
    call is unaffected. A KeyboardInterrupt is not a consumer error: it leaves the call and
    the unfinished requests are aborted."""
    engine = ik.Engine(CFG, params, ik.EngineConfig(**{**KW, **MODES["multistep"]}))
    clean = scenario["clean"]
    seen: dict[int, list[int]] = {}

    def consumer(delta):
        seen.setdefault(delta.index, []).extend(delta.tokens)
        if delta.index == 1 and len(seen[1]) >= 2:
            raise ValueError("printer broke")

    out = engine.generate(clean, GREEDY, on_delta=consumer)
    assert out[1].finish_reason == "error" and out[1].error == "on_delta raised ValueError: printer broke"
    assert out[1].tokens == oracle(params, clean[1]).tokens[:len(out[1].tokens)]
    assert out[1].tokens[:len(seen[1])] == seen[1]  # (a step in flight may have added more)
    for i in (0, 2):
        assert out[i].finish_reason == "length" and out[i].tokens == oracle(params, clean[i]).tokens == seen[i]
    assert engine.stats()["failed_requests"] == 1
    engine.check_invariants()
    assert engine.generate([clean[1]], GREEDY)[0].tokens == oracle(params, clean[1]).tokens

    def interrupted(delta):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        engine.generate(clean[:2], GREEDY, on_delta=interrupted)
    engine.check_invariants()
    assert not engine.requests.running and not engine.requests.waiting
    assert engine.generate([clean[0]], GREEDY)[0].tokens == oracle(params, clean[0]).tokens

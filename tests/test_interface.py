"""The generation interface's host side over the fake runner (no XLA): streaming deltas and
leaving a stream early, incremental detokenization, stop strings (multi-step decode,
speculation, sessions), n samples forked from one prefill, prompt log-probs with the prefix
cache, and bad values refused at the door. Oracles: the fake model's plain decoding
(`test_host_policy.expected`) and the byte tokenizer's whole-text decode."""

from __future__ import annotations

import numpy as np
import pytest

import inkling_jax as ik
from inkling_jax.engine.text import TextState
from conftest import count_xla_compiles
from test_host_policy import CFG, TOKENIZER, VOCAB, expected, fake_engine, stop_string_cut

MODES = {"plain": {}, "K4": dict(decode_steps=4), "overlap": dict(decode_steps=4, overlap=True),
         "spec": dict(spec_steps=2), "nocache": dict(prefix_cache=False, decode_steps=3)}


def prompts(seed: int, n: int = 3, lo: int = 3, hi: int = 30) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    return [list(rng.randint(3, VOCAB, rng.randint(lo, hi))) for _ in range(n)]


# ------------------------------------------------------------------ text


def test_incremental_text_never_splits_a_character():
    """Byte tokens of multi-byte UTF-8 characters: every delta is whole characters (no U+FFFD),
    and the deltas join to the text; an incomplete character at the end is flushed as U+FFFD."""
    text = "héllo, wörld € 𝄞!"
    state, deltas = TextState(TOKENIZER), []
    for b in text.encode("utf-8"):
        before = state.text
        state.push(b)
        deltas.append(state.text[len(before):])
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    assert deltas[1] == "" and deltas[2] == "é"  # é is two bytes: nothing until the second
    state = TextState(TOKENIZER)
    for b in "a€".encode("utf-8")[:-1]:
        state.push(b)
    assert state.text == "a"
    state.finish()
    assert state.text == "a\ufffd"


def test_stop_strings_across_token_boundaries():
    """A stop string split over tokens (and over a multi-byte character) is found; the text is
    cut before it (or after it with include_stop_str); the earliest match wins, the longest
    at one place; visible() holds back what may start a stop string."""
    for include, want in ((False, "one "), (True, "one two")):
        state = TextState(TOKENIZER, stop=("two", "€€"), include_stop_str=include)
        hit = None
        for i, b in enumerate(b"one two three"):
            hit = state.push(b)
            if hit:
                break
        assert (hit, i, state.text) == ("two", 6, want)
    state = TextState(TOKENIZER, stop=("b", "ab"))
    for b in b"xab":
        hit = state.push(b)
    assert hit == "ab" and state.text == "x"
    state = TextState(TOKENIZER, stop=("€!",))
    for b in "a €".encode():
        assert state.push(b) is None
    assert state.visible() == "a " and state.text == "a €"  # "€" may start "€!": held back
    assert state.push(ord("!")) == "€!" and state.visible() == "a "
    state = TextState(TOKENIZER, stop=("xy",))
    assert state.push(ord("x"), match_stops=False) is None and state.push(ord("y")) == "xy"


# ------------------------------------------------------------------ streaming


@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
def test_stream_deltas_join_to_the_completion(mode):
    """Concatenated deltas are the completion: tokens, log-probs, top alternatives, text (never
    text that a stop string later cuts), one finish reason on the last delta of each request;
    deltas arrive in chunks with multi-step decode and speculation. Outputs are the oracle's."""
    engine = fake_engine(**MODES[mode], max_running=2)
    sp = ik.SamplingParams(max_new_tokens=14, stop_at_eos=False, logprobs=2, stop=("e", "Q", "\n"), seed=3,
                           temperature=0.7)
    ps = prompts(1, n=4)
    got: dict = {}
    chunks = []
    for d in engine.stream(ps, sp, n=2):
        g = got.setdefault((d.index, d.sample), dict(tokens=[], logprobs=[], tops=[], text="", finish=[]))
        assert not g["finish"], "a delta after the request finished"
        g["tokens"] += d.tokens
        g["logprobs"] += d.logprobs
        g["tops"] += d.top_logprobs
        g["text"] += d.text
        if d.finish_reason:
            g["finish"].append(d.finish_reason)
        chunks.append(len(d.tokens))
    reqs = {(r.index, r.sample): r for r in engine.requests.running + engine.requests.waiting}
    assert not reqs and len(got) == 8
    for (i, j), g in got.items():
        want, reason, text = expected(_request_like(engine, ps[i], sp, i, j))
        assert (g["tokens"], g["finish"], g["text"]) == (want, [reason], text)
        assert len(g["logprobs"]) == len(g["tops"]) == len(want)
    if mode != "plain":
        assert max(chunks) > 1  # several tokens in one delta
    engine.check_invariants()


def _request_like(engine, prompt, sp, index, sample):
    """A Request as submit makes it (for `expected`), without queueing one."""
    seed = ((sp.seed + sample) * 7919 + index) % (1 << 31)
    return ik.engine.Request(0, list(prompt), len(prompt), sp, seed=seed)


@pytest.mark.parametrize("how", ["break", "exception", "ctrl-c"])
def test_leaving_a_stream_early_aborts_its_requests(how, monkeypatch):
    """break, an exception in the loop body, or a Ctrl-C inside a step: the stream's unfinished
    requests finish with "abort", nothing else changes, and the engine stays exact (later
    outputs are the oracle's); a session turn keeps its history so far."""
    engine = fake_engine(decode_steps=3, overlap=True, max_running=3)
    other = engine.submit(prompts(5, n=1), ik.SamplingParams(max_new_tokens=20, stop_at_eos=False))
    sid = engine.open_session()
    stream = engine.stream([[7, 8, 9, 10]], ik.SamplingParams(max_new_tokens=30, stop_at_eos=False), session=sid)
    mine = [r for r in engine.requests.waiting if r.session is not None]
    if how == "ctrl-c":
        real_run, calls = engine.runner.run, [0]

        def run(*a, **kw):
            calls[0] += 1
            if calls[0] == 4:
                raise KeyboardInterrupt
            return real_run(*a, **kw)

        monkeypatch.setattr(engine.runner, "run", run)
    with pytest.raises((KeyboardInterrupt, RuntimeError)) if how != "break" else _nothing():
        for k, d in enumerate(stream):
            if k == 2 and how == "break":
                break
            if k == 2 and how == "exception":
                raise RuntimeError("the caller's own error")
    del stream
    assert mine[0].finish_reason == "abort"
    assert engine.sessions[sid].tokens == mine[0].tokens[:mine[0].output_end]
    engine.check_invariants()
    while engine.running or engine.waiting:
        engine.step()
    assert other[0].out_tokens == expected(other[0])[0]
    turn = engine.generate([[11, 12]], ik.SamplingParams(max_new_tokens=5, stop_at_eos=False), session=sid)[0]
    history = engine.sessions[sid].tokens[:-len(turn.tokens)]
    assert turn.tokens == expected(ik.engine.Request(0, history, len(history), ik.SamplingParams(
        max_new_tokens=5, stop_at_eos=False)))[0]
    engine.check_invariants()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ------------------------------------------------------------------ stop strings


def _stop_char(prompt, mode, max_new=24):
    """A printable character the oracle's output has at index >= 2 and not before (so a stop
    string there cuts the output in its middle)."""
    free = expected(_request_like(None, prompt, ik.SamplingParams(max_new_tokens=max_new, stop_at_eos=False), 0, 0))[0]
    text = TOKENIZER.decode(free)
    return next(text[i] for i in range(2, len(text)) if text[i].isprintable() and text[i] != "\ufffd"
                and text[i] not in text[:i])


@pytest.mark.parametrize("mode", ["K4", "spec"])
def test_stop_string_in_a_session_cuts_its_history(mode):
    """With multi-step decode or speculation the device runs past a stop string's match; the
    tokens past it are dropped from the output, the session's history ends where the output
    ends (its state dropped when it ran past), and the next turn is the oracle's on that
    history."""
    engine = fake_engine(**MODES[mode], max_running=1)
    prompt = [20, 21, 22, 23, 24]
    stop = _stop_char(prompt, mode)
    sp = ik.SamplingParams(max_new_tokens=24, stop_at_eos=False, stop=(stop,))
    sid = engine.open_session()
    c = engine.generate([prompt], sp, session=sid)[0]
    free = expected(_request_like(None, prompt, ik.SamplingParams(max_new_tokens=24, stop_at_eos=False), 0, 0))[0]
    cut = stop_string_cut(free, (stop,), False)
    assert (c.tokens, c.text, c.finish_reason, c.stop_reason) == (cut[0], cut[1], "stop", stop)
    sess = engine.sessions[sid]
    assert sess.tokens == prompt + c.tokens
    assert sess.held is None or sess.held.committed <= len(sess.tokens)
    engine.check_invariants()
    nxt = engine.generate([[30, 31]], ik.SamplingParams(max_new_tokens=6, stop_at_eos=False), session=sid)[0]
    history = prompt + c.tokens + [30, 31]
    assert nxt.tokens == expected(_request_like(None, history, ik.SamplingParams(max_new_tokens=6,
                                                                                   stop_at_eos=False), 0, 0))[0]
    engine.check_invariants()


def test_no_checkpoint_deeper_than_a_stop_string_cut():
    """A request cut by a stop string leaves no prefix-cache checkpoint on its path deeper than
    its returned output (the device ran past the match)."""
    engine = fake_engine(decode_steps=4, track_interval=4, page_size=2)
    prompt = [40, 41, 42]
    stop = _stop_char(prompt, "K4")
    r = engine.submit([prompt], ik.SamplingParams(max_new_tokens=24, stop_at_eos=False, stop=(stop,)))[0]
    while engine.running or engine.waiting:
        engine.step()
    assert r.finish_reason == "stop" and len(r.tokens) > r.output_end  # it ran past the match
    for node in engine.tree._nodes():
        path = node_path(node)
        if node.checkpoint is not None and path == r.tokens[:len(path)]:
            assert node.depth <= r.output_end, (node.depth, r.output_end)
    engine.check_invariants()


def node_path(node) -> list[int]:
    parts = []
    while node is not None:
        parts.append(node.tokens)
        node = node.parent
    return [t for part in reversed(parts) for t in part]


# ------------------------------------------------------------------ n samples


@pytest.mark.parametrize("mode", ["plain", "spec", "nocache"])
def test_n_samples_share_one_prefill(mode):
    """n = 3 samples of each prompt: outputs equal to separate requests with seeds seed + j;
    with the prefix cache the prompt is computed once up to the last page boundary before its
    last token (stats: prompt_tokens_computed), and prompt_tokens counts each prompt once."""
    engine = fake_engine(**MODES[mode], max_running=4)
    ps = prompts(7, n=2, lo=18, hi=31)
    sp = ik.SamplingParams(max_new_tokens=6, temperature=0.7, seed=11, stop_at_eos=False)
    out = engine.generate(ps, sp, n=3)
    assert [[c.sample for c in cs] for cs in out] == [[0, 1, 2]] * 2
    for i, cs in enumerate(out):
        for j, c in enumerate(cs):
            assert c.tokens == expected(_request_like(engine, ps[i], sp, i, j))[0]
            sep = fake_engine(**MODES[mode]).generate([ps[i]], ik.SamplingParams(
                max_new_tokens=6, temperature=0.7, seed=11 + j, stop_at_eos=False))
            if i == 0:
                assert c.tokens == sep[0].tokens
    s = engine.stats()
    assert s["prompt_tokens"] == sum(map(len, ps))
    if mode != "nocache":
        ps_ = engine.config.page_size
        tails = sum(len(p) - (len(p) - 1) // ps_ * ps_ for p in ps)
        assert s["prompt_tokens_computed"] == sum(map(len, ps)) + 2 * tails
    else:
        assert s["prompt_tokens_computed"] == 3 * sum(map(len, ps))
    engine.check_invariants()


def test_prompt_logprobs_start_after_the_cached_prefix():
    """prompt_logprobs = k: every prompt position from the second is scored (the prefix cache
    serves nothing the request must score), with the k alternatives."""
    engine = fake_engine()
    p = prompts(3, n=1, lo=25, hi=26)[0]
    engine.generate([p], ik.SamplingParams(max_new_tokens=2))  # p's boundaries are cached now
    r = engine.submit([p], ik.SamplingParams(max_new_tokens=2, prompt_logprobs=3))[0]
    while engine.running or engine.waiting:
        engine.step()
    c = r.completion()
    assert r.cached == 0 and c.prompt_logprobs[0] is None and None not in c.prompt_logprobs[1:]
    assert len(c.prompt_top_logprobs[1]) == 3
    from test_host_policy import check_outputs
    check_outputs([r])


# ------------------------------------------------------------------ bad values


@pytest.mark.parametrize("kw, name", [
    (dict(n=0), "n"), (dict(n=1.5), "n"), (dict(min_p=-0.1), "min_p"), (dict(min_p=1.5), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(logit_bias={3: float("inf")}), "logit_bias"),
    (dict(logit_bias=[(3, 1.0), (3, 2.0)]), "logit_bias"), (dict(logit_bias="x"), "logit_bias"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=40), "min_tokens"), (dict(logprobs=-1), "logprobs"),
    (dict(prompt_logprobs=-2), "prompt_logprobs"), (dict(stop=("ok", "")), "stop"), (dict(stop=[3]), "stop"),
    (dict(include_stop_str=1), "include_stop_str"),
])
def test_bad_sampling_values_name_the_field(kw, name):
    with pytest.raises(ValueError, match=name):
        ik.SamplingParams(**kw)


def test_bad_values_for_the_engine_change_nothing():
    """Values a SamplingParams accepts but this engine cannot serve are refused at submit, by
    name, before anything is queued; nothing compiles."""
    engine = fake_engine(max_logit_bias=2, max_logprobs=3)
    bad = [(dict(logit_bias={VOCAB: 1.0}), "logit_bias token id"), (dict(logit_bias={3: 1.0, 4: 1.0, 5: 1.0}),
                                                                      "max_logit_bias"),
           (dict(logprobs=4), "max_logprobs"), (dict(prompt_logprobs=5), "max_logprobs")]
    with count_xla_compiles() as compiles:
        for kw, msg in bad:
            with pytest.raises(ValueError, match=msg):
                engine.submit([[3, 4]], ik.SamplingParams(**kw))
        sid = engine.open_session()
        with pytest.raises(ValueError, match="n=2"):
            engine.submit([[3, 4]], ik.SamplingParams(n=2), session=sid)
        with pytest.raises(ValueError, match="same length"):
            engine.score([[3, 4]], [[5], [6]])
        with pytest.raises(ValueError, match="tokenizer"):
            type(engine)(CFG, engine.params, engine.config).submit([[3]], ik.SamplingParams(stop=("x",)))
        with pytest.raises(ValueError, match="n must be"):
            engine.generate([[3, 4]], n=0)
    assert compiles[0] == 0
    assert not engine.waiting and not engine.running and engine.sessions[sid].turn is None
    assert engine.stats()["prompt_tokens"] == 0
    engine.check_invariants()

"""MTP speculative decoding: the chain math against HF's decoder layer, greedy equality with
plain decoding, every accept length with oracle drafts, committed state and checkpoints,
prefix hits after speculation, and the sampling distribution."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

import inkling_jax as ik
from inkling_jax.steps import StepShape
from conftest import ENGINE_KW, TWO_LAYER, assert_same_completions, echo_model

SPEC_CFG = TWO_LAYER  # every kind of draft state (conftest)
# Committed state of a speculative run vs a plain one: equal up to float32 rounding, not bit
# for bit: verify batches spec_steps + 1 positions per row where decode has one, so XLA's CPU
# kernels accumulate attention and MoE sums in another order (measured: ~2e-6 absolute).
STATE_ATOL = 2e-5


_FWD = jax.jit(lambda p, t: ik.forward(p, SPEC_CFG, t))
_HIDDEN = jax.jit(lambda p, t: ik.forward_hidden(p, SPEC_CFG, t))
_MTP = jax.jit(lambda p, h, t: ik.mtp_forward(p, SPEC_CFG, h, t))


@pytest.fixture(scope="module")
def spec_params():
    return ik.init_params(SPEC_CFG, jax.random.key(1), std=0.1)


class ScriptedDrafts(ik.Engine):
    """A test double: verify steps check `script(request, proposed_drafts)` instead of the MTP
    chain's proposals (through the engine's documented `drafts_for` hook)."""

    def __init__(self, *args, script, **kw):
        super().__init__(*args, **kw)
        self.script = script

    def drafts_for(self, r):
        return list(self.script(r, super().drafts_for(r)))


def spec_engine(params, spec, script=None, **kw):
    config = ik.EngineConfig(**{**ENGINE_KW, "spec_steps": spec, **kw})
    if script is None:
        return ik.Engine(SPEC_CFG, params, config)
    return ScriptedDrafts(SPEC_CFG, params, config, script=script)


def prompts_from(seed, lengths):
    rng = np.random.RandomState(seed)
    return [list(rng.randint(3, SPEC_CFG.unpadded_vocab_size, n)) for n in lengths]


def run_with_compactions(engine, prompts, sp):
    """generate(), forcing compaction of every hole between rounds."""
    reqs = engine.submit(prompts, sp)
    while engine.running or engine.waiting:
        engine.step()
        engine.compact()
        engine.check_invariants()
    return reqs


def slot_fields(engine, virtual, depth):
    """Every field of a slot; ring rows reordered to positions [depth - W, depth)."""
    ring_rows = [p % engine.layout.ring for p in range(depth - SPEC_CFG.sliding_window, depth)]
    return {name: v[ring_rows] if name.endswith(".ring") else v for name, v in engine.read_slot(virtual).items()}


# ------------------------------------------------------------------ the chain math


def test_mtp_chain_matches_hf_decoder_layer(spec_params, torch_threads):
    """§6 evaluated directly in torch, with HF's own InklingDecoderLayer as each depth's
    block: z = input_proj([hidden_norm(h), enorm(embed_norm(E[t]))]), y = block(z), h' = y,
    logits = (h' / mup) @ unembed; tokens past the sequence are the previous greedy picks."""
    import torch
    from transformers.models.inkling.configuration_inkling import InklingTextConfig
    from transformers.models.inkling.modeling_inkling import InklingDecoderLayer
    from inkling_jax.weights.names import _layer_entries

    cfg, params = SPEC_CFG, spec_params
    tokens = prompts_from(3, (14,))[0]
    t = len(tokens)
    hidden = _HIDDEN(params, np.asarray([tokens]))
    ours, _ = _MTP(params, hidden, np.asarray([tokens]))

    tt = lambda x: torch.tensor(np.asarray(x, np.float32))

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    embed, unembed = tt(params["embed"]), tt(params["unembed"])
    h = tt(hidden[0])
    logits_prev = (h / cfg.logits_mup_width_multiplier) @ unembed
    known = list(tokens)
    for d in range(cfg.num_mtp_layers):
        g = cfg.mtp_geometry(d)
        layer_cfg = dict(cfg.to_hf()["text_config"], num_hidden_layers=1, local_layer_ids=[0] if g.is_sliding else [],
                         layer_types=["hybrid_sliding" if g.is_sliding else "hybrid"], mlp_layer_types=["dense"],
                         sliding_window_size=g.window or cfg.sliding_window)
        layer_cfg.pop("model_type")
        layer = InklingDecoderLayer(InklingTextConfig(**layer_cfg), 0).eval()
        state = {}
        for e in _layer_entries(cfg, (), "", g, True, "transformers", True):
            leaf = params["mtp"]["layers"][d]["block"]
            for k in e.path:
                leaf = leaf[k]
            for name, value in zip(e.names, e.to_tensors(np.asarray(leaf))):
                state[name] = torch.tensor(np.asarray(value, np.float32))
        missing, unexpected = layer.load_state_dict(state, strict=False)
        assert not unexpected and not [m for m in missing if "e_score" not in m]
        p = params["mtp"]["layers"][d]
        known.append(int(torch.argmax(logits_prev[-1])))
        step_tokens = known[d + 1:d + 1 + t]
        e_vec = rms(embed[step_tokens], tt(params["embed_norm"]))
        z = torch.cat([rms(h, tt(p["hidden_norm"])), rms(e_vec, tt(p["embed_norm"]))], -1) @ tt(p["input_proj"])
        q_pos = torch.arange(t)
        allowed = (q_pos[:, None] >= q_pos[None, :])
        if g.is_sliding:
            allowed &= (q_pos[:, None] - q_pos[None, :]) < g.window
        mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]
        with torch.no_grad():
            y = layer(z[None], attention_mask=mask)[0]
        h = y
        logits_prev = (h / cfg.logits_mup_width_multiplier) @ unembed
        ref = logits_prev[:, :cfg.unpadded_vocab_size].numpy()
        np.testing.assert_allclose(np.asarray(ours[d, 0]), ref, rtol=0, atol=1e-4 * np.abs(ref).max(),
                                   err_msg=f"depth {d}")


# -------------------------------------------------------------- engine behaviour


@pytest.mark.parametrize("spec, pool, ping_pong", [(1, "unified", "eager"), (2, "static", "lazy"),
                                                   (3, "unified", "lazy"), (3, "static", "eager")])
def test_spec_greedy_equals_plain(spec_params, spec, pool, ping_pong):
    """Greedy output with speculation equals greedy output without it, token for token, for
    mixed prompts, with the prefix cache on, compactions forced between rounds, and a second
    pass that hits the cache."""
    prompts = prompts_from(5, (5, 19, 11, 26))
    sp = ik.SamplingParams(max_new_tokens=14, stop_at_eos=False)
    plain = spec_engine(spec_params, 0, pool=pool, ping_pong=ping_pong).generate(prompts, sp)
    engine = spec_engine(spec_params, spec, pool=pool, ping_pong=ping_pong)
    for rnd in range(2):
        reqs = run_with_compactions(engine, prompts, sp)
        assert [r.out_tokens for r in reqs] == [c.tokens for c in plain], f"round {rnd}"
        for r, c in zip(reqs, plain):
            np.testing.assert_allclose(r.out_logprobs, c.logprobs, rtol=0, atol=1e-4)
    st = engine.stats()
    assert st["verify_steps"] > 0 and st["cache_hit_tokens"] > 0
    assert len(st["depth_acceptance"]) == spec


def oracle(truth: dict, spec: int, corrupt_at: int | None):
    """Draft source: the true continuation (from a plain run), wrong at index corrupt_at."""
    def drafts(r, proposed):
        full = truth[tuple(r.tokens[:r.prompt_len])]
        nxt = list(full[r.committed + 1:r.committed + 1 + spec])
        nxt += [3] * (spec - len(nxt))
        if corrupt_at is not None and corrupt_at < spec:
            nxt[corrupt_at] = (nxt[corrupt_at] + 1) % SPEC_CFG.unpadded_vocab_size
        return nxt
    return drafts


def test_every_accept_length_commits_the_plain_state(spec_params):
    """Oracle drafts corrupted at index k give accept length k (0..S): outputs equal the plain
    run's, and the checkpoint each run leaves at depth 24 holds the plain run's target state
    (conv windows and sliding K/V) within float32 rounding; the draft state does not depend
    on how many drafts were accepted along the way."""
    spec = 3
    prompt = prompts_from(6, (13,))[0]
    sp = ik.SamplingParams(max_new_tokens=16, stop_at_eos=False)
    plain_engine = spec_engine(spec_params, 0)
    plain = plain_engine.generate([prompt], sp)[0]
    truth = {tuple(prompt): prompt + plain.tokens}
    depth = 24
    ref = slot_fields(plain_engine, plain_engine.tree.match(truth[tuple(prompt)], depth).node.checkpoint, depth)
    drafts_by_k = {}
    for k in range(spec + 1):
        engine = spec_engine(spec_params, spec, script=oracle(truth, spec, k))
        out = engine.generate([prompt], sp)[0]
        assert out.tokens == plain.tokens
        np.testing.assert_allclose(out.logprobs, plain.logprobs, rtol=0, atol=1e-4)
        st = engine.stats()
        if k < spec:  # every round accepts exactly k (the last may be capped by max_new_tokens)
            assert st["depth_acceptance"][k] == 0 and (k == 0 or st["depth_acceptance"][k - 1] > 0.7)
        else:
            assert st["mean_accept_length"] > spec
        match = engine.tree.match(truth[tuple(prompt)], depth)
        assert match.depth == depth
        got = slot_fields(engine, match.node.checkpoint, depth)
        for name, value in ref.items():
            np.testing.assert_allclose(got[name], value, rtol=0, atol=STATE_ATOL, err_msg=f"k={k} {name}")
        drafts_by_k[k] = {n: v for n, v in got.items() if n.startswith("draft")}
        engine.check_invariants()
    for k in range(1, spec + 1):
        for name, value in drafts_by_k[0].items():
            np.testing.assert_allclose(drafts_by_k[k][name], value, rtol=0, atol=STATE_ATOL, err_msg=name)


def test_engine_drafts_are_the_mtp_chain(spec_params):
    """After prefill the drafts are the MTP chain's greedy picks at the prompt's last row."""
    spec = 3
    prompt = prompts_from(7, (17,))[0]
    engine = spec_engine(spec_params, spec)
    req = engine.submit([prompt], ik.SamplingParams(max_new_tokens=8, stop_at_eos=False))[0]
    while not req.out_tokens:
        engine.step()
    hidden = _HIDDEN(spec_params, np.asarray([prompt]))
    logits, _ = _MTP(spec_params, hidden, np.asarray([prompt]))
    assert req.drafts == [int(np.argmax(logits[d, 0, -1])) for d in range(spec)]


def test_prefix_hit_after_spec_restores_target_and_draft(spec_params):
    """A checkpoint written during speculative rounds restores target and draft state: a
    cached run proposes exactly the drafts and accepts exactly what an uncached run does."""
    spec = 2
    prompt = prompts_from(8, (11,))[0]
    sp = ik.SamplingParams(max_new_tokens=26, stop_at_eos=False)
    seen, seen_fresh, recording = [], [], []

    def record(r, d):
        recording[0].append(tuple(d)) if recording else None
        return d
    engine = spec_engine(spec_params, spec, script=record)
    first = engine.generate([prompt], sp)[0]
    history = prompt + first.tokens
    continuation = history[:34] + [5, 6, 7]
    recording.append(seen)
    hit = engine.generate([continuation], ik.SamplingParams(max_new_tokens=10, stop_at_eos=False))[0]
    assert hit.cached_tokens == 32  # the checkpoint the speculative rounds left last (interval 8)
    fresh = spec_engine(spec_params, spec, prefix_cache=False,
                        script=lambda r, d: (seen_fresh.append(tuple(d)), d)[1])
    ref = fresh.generate([continuation], ik.SamplingParams(max_new_tokens=10, stop_at_eos=False))[0]
    assert hit.tokens == ref.tokens
    assert seen == seen_fresh  # the restored draft state drafts as the uncached one does
    engine.check_invariants()


@pytest.mark.parametrize("pool, ping_pong", [("unified", "eager"), ("unified", "lazy"), ("static", "eager"),
                                             ("static", "lazy")])
def test_prefix_hits_with_speculation(spec_params, pool, ping_pong):
    """With speculative decoding (verify steps crossing generation boundaries) prompts sharing
    a 26-token system prompt hit from the second on at 24, the deepest boundary inside the
    shared part; the tokens are plain greedy decoding's."""
    system = prompts_from(30, (26,))[0]
    prompts = [system + u for u in prompts_from(31, (7, 11, 5))]
    sp = ik.SamplingParams(max_new_tokens=12, stop_at_eos=False)
    engine = spec_engine(spec_params, 2, pool=pool, ping_pong=ping_pong, num_slots=24)
    outs = [engine.generate([p], sp)[0] for p in prompts]
    assert [o.cached_tokens for o in outs] == [0, 24, 24]
    plain = spec_engine(spec_params, 0, prefix_cache=False).generate(prompts, sp)
    assert [o.tokens for o in outs] == [c.tokens for c in plain]
    engine.check_invariants()


def test_spec_sampling_matches_the_target_distribution(spec_params):
    """temperature > 0: the second generated token (the first one that goes through a verify
    round) follows the target's marginal distribution: chi-square over many samples."""
    from scipy import stats

    spec = 1
    prompt = prompts_from(9, (6,))[0]
    temp = 1.0
    sp = lambda seed: ik.SamplingParams(max_new_tokens=2, temperature=temp, seed=seed, stop_at_eos=False)
    engine = spec_engine(spec_params, spec, prefix_cache=False)
    n = 1024
    reqs = engine.submit([prompt] * n, sp(0))
    while engine.running or engine.waiting:
        engine.step()
    assert engine.stats()["verify_steps"] > 0
    second = np.array([r.out_tokens[1] for r in reqs])
    first = np.array([r.out_tokens[0] for r in reqs])
    # the exact marginal of token 2: sum_t1 p(t1) p(t2 | t1)
    v = SPEC_CFG.unpadded_vocab_size
    logits1 = np.asarray(_FWD(spec_params, np.asarray([prompt])))[0, -1]
    p1 = np.exp(logits1 - logits1.max())
    p1 /= p1.sum()
    t1s = np.unique(first)
    batch = np.asarray([prompt + [t] for t in range(v)])
    logits2 = np.asarray(_FWD(spec_params, batch))[:, -1]
    p2 = np.exp(logits2 - logits2.max(-1, keepdims=True))
    p2 /= p2.sum(-1, keepdims=True)
    marginal = p1.astype(np.float64) @ p2.astype(np.float64)
    marginal /= marginal.sum()
    # pool rare tokens so every expected count is >= 5
    order = np.argsort(-marginal)
    expected = marginal[order] * n
    keep = expected >= 5
    observed = np.bincount(second, minlength=v)[order]
    f_obs = np.append(observed[keep], observed[~keep].sum())
    f_exp = np.append(expected[keep], expected[~keep].sum())
    f_exp *= f_obs.sum() / f_exp.sum()  # chisquare wants equal totals to ~1e-8
    assert len(t1s) > 10  # the first token really varied
    chi2, pval = stats.chisquare(f_obs, f_exp)
    assert pval > 1e-3, (chi2, pval)


def test_prompt_whose_last_token_is_pending_alone(spec_params):
    """The state behind issue 37's crash: a prompt's last token pending alone (chunking left it,
    or a prefix hit one token short of the prompt) has no drafts yet, so its next step is an
    extend step, never a verify step (every verify row checks drafts proposed for it); the
    speculative engine gives plain greedy's tokens. The prompts are issue 37's report's
    schedule (25 and 8 tokens, spec_steps=2, chunks of 8: the 25-token prompt's last token
    pending alone after three chunks) on SPEC_CFG; the report's tiny-preset engine raised
    IndexError in the scheduler, here the tokens differ (measured: both fail without the fix)."""
    sp = ik.SamplingParams(max_new_tokens=12, stop_at_eos=False)
    proposed_lengths = []
    engine = spec_engine(spec_params, 2, script=lambda r, proposed: proposed_lengths.append(len(proposed)) or proposed)
    prompts = prompts_from(37, (25, 8))
    plain = spec_engine(spec_params, 0, prefix_cache=False)
    assert [c.tokens for c in engine.generate(prompts, sp)] == [c.tokens for c in plain.generate(prompts, sp)]
    again = engine.generate([prompts[0][:17]], sp)[0]  # a hit at 16 of 17 tokens
    assert again.cached_tokens == 16
    assert again.tokens == plain.generate([prompts[0][:17]], sp)[0].tokens
    assert proposed_lengths and set(proposed_lengths) == {2}
    engine.check_invariants()


def test_drafts_hook_of_the_wrong_length_fails_its_request_alone(spec_params):
    """A drafts_for hook that returns the wrong drafts for one request, or raises, fails that
    request with the reason (issue 35); the other request's tokens are plain greedy's."""
    def script(r, proposed):
        if r.rid == 0:
            return proposed[:1]
        if r.rid == 2:
            raise KeyError("no drafts here")
        return proposed

    engine = spec_engine(spec_params, 2, script=script)
    sp = ik.SamplingParams(max_new_tokens=4, stop_at_eos=False)
    prompts = prompts_from(38, (5, 7, 6))
    out = engine.generate(prompts, sp)
    assert [c.finish_reason for c in out] == ["error", "length", "error"]
    assert re.search(r"drafts_for raised ValueError: drafts_for\(request 0\) returned .*exactly spec_steps=2",
                     out[0].error)
    assert out[2].error == "drafts_for raised KeyError: 'no drafts here'"
    plain = spec_engine(spec_params, 0, prefix_cache=False)
    assert out[1].tokens == plain.generate([prompts[1]], sp)[0].tokens
    engine.check_invariants()
    assert engine.pool.live_count("slot") == len(engine.tree.owned()[0])


# ------------------------------------------------ several verify rounds per dispatch


@pytest.fixture(scope="module")
def echo_params(spec_params):
    """A model whose MTP heads draft well (`conftest.echo_model`), its distributions sharp
    enough for sampled rows to accept drafts (unembed x 30)."""
    return echo_model(SPEC_CFG, spec_params, unembed_scale=30)


ROUND_PROMPTS = prompts_from(40, (5, 19, 11))
ROUNDS_ATOL = 1e-5  # float32 rounding of a differently fused program (the tokens are compared exactly)


def run_rounds(params, rounds: int, sampling, interval: int = 8, plans: list | None = None):
    """spec_steps 3, `rounds` model steps per dispatch (verify rounds): generate ROUND_PROMPTS,
    then their completions cut short plus a token as new prompts (hits on the generation
    checkpoints the verify rounds wrote), then a two-turn session; invariants after each call,
    and no finished request's state holds a token past its output (the device stops a row at
    its stop token and its budget). Returns (engine, the completions, the session's slot).
    `plans` collects each verify row's (committed, rounds planned, tokens left)."""
    engine = spec_engine(params, 3, decode_steps=rounds, track_interval=interval)
    plan, commit = engine.scheduler.plan, engine.scheduler.commit

    def recording_plan(*args, **kwargs):
        p = plan(*args, **kwargs)
        if plans is not None and p is not None and p.mode == "verify":
            plans.extend((r.committed, row.num_steps, row.tokens_left) for r, row in zip(p.requests, p.rows))
        return p

    def checked_commit(p, out):
        finished = commit(p, out)
        assert all(len(r.tokens) == r.output_end for r in finished), "state committed past a stop"
        return finished

    engine.scheduler.plan, engine.scheduler.commit = recording_plan, checked_commit
    first = engine.generate(ROUND_PROMPTS, sampling)
    engine.check_invariants()
    grown = [p + c.tokens[:len(c.tokens) - 3] + [7] for p, c in zip(ROUND_PROMPTS, first)]
    second = engine.generate(grown, sampling)
    engine.check_invariants()
    sid = engine.open_session()
    turns = [engine.generate([ROUND_PROMPTS[1]], sampling, session=sid)[0],
             engine.generate([[9, 8, 7, 6]], sampling, session=sid)[0]]
    engine.check_invariants()
    return engine, first + second + turns, engine.read_slot(engine.sessions[sid].held.virtual_slot)


@pytest.mark.parametrize("sampling", [
    ik.SamplingParams(max_new_tokens=13, stop_at_eos=False, logprobs=2),
    ik.SamplingParams(max_new_tokens=14, temperature=1.0, top_k=40, seed=5, presence_penalty=0.5, stop_at_eos=False),
], ids=["greedy", "sampled"])
@pytest.mark.parametrize("rounds, interval", [(2, 8), (4, 8), (4, 16)])
def test_verify_rounds_equal_one_round(echo_params, sampling, rounds, interval):
    """R verify rounds per dispatch (decode_steps = R with the MTP heads' drafts) give exactly
    the tokens, finish reasons and cache hits of one round per dispatch, log-probs and top
    alternatives within float32 rounding, and a session's slot alike: budgets land mid-round
    and mid-dispatch, the grown prompts hit generation checkpoints the rounds wrote, sampled
    rows draw as they do round by round (keys fold in positions), presence penalties count
    every round's tokens. With interval 8 a row's dispatch stops at the last round that
    cannot reach its second checkpoint boundary (2 or 3 rounds of at most 4 tokens)."""
    _, want, want_slot = run_rounds(echo_params, 1, sampling, interval)
    plans = []
    engine, got, slot = run_rounds(echo_params, rounds, sampling, interval, plans)
    assert_same_completions(got, want, ROUNDS_ATOL)
    assert sum(c.cached_tokens for c in got[3:6]) > 0
    assert slot.keys() == want_slot.keys()
    for key in slot:
        np.testing.assert_allclose(slot[key], want_slot[key], rtol=0, atol=STATE_ATOL, err_msg=key)
    st = engine.stats()
    assert st["multi_round_verify_steps"] > 0 and st["accepted_draft_tokens"] > 0
    most = [min(rounds, left, (interval - c % interval + interval - 1) // 4) for c, _, left in plans]
    assert [n for _, n, _ in plans] == most
    assert any(n == rounds for n in most) == (interval > 8 or rounds == 2)


def test_stop_tokens_inside_verify_rounds(echo_params):
    """Stop tokens accepted among the drafts or sampled as a round's bonus, in any round of a
    dispatch, end the request there: the rounds after it never run (no state past the stop:
    `run_rounds` checks it), min_tokens suppresses a stop id until its out_len, which advances
    round by round; tokens, finish reasons, cache hits and the session's slot are those of one
    round per dispatch."""
    free = run_rounds(echo_params, 1, ik.SamplingParams(max_new_tokens=13, stop_at_eos=False), 16)[1]
    # stops the plain run meets at or just past min_tokens: in a dispatch's later rounds (its
    # first round commits output indices 1..4 at most)
    stops = sorted({c.tokens[k] for c in free for k in (6, 7)})
    sampling = ik.SamplingParams(max_new_tokens=13, stop_at_eos=False, stop_token_ids=tuple(stops), min_tokens=6)
    _, want, want_slot = run_rounds(echo_params, 1, sampling, 16)
    assert {"stop", "length"} <= {c.finish_reason for c in want}
    plans = []
    engine, got, slot = run_rounds(echo_params, 4, sampling, 16, plans)
    assert_same_completions(got, want, ROUNDS_ATOL)
    for key in slot:
        np.testing.assert_allclose(slot[key], want_slot[key], rtol=0, atol=STATE_ATOL, err_msg=key)
    assert engine.stats()["multi_round_verify_steps"] > 0


def test_drafts_hook_keeps_one_round_per_dispatch(echo_params):
    """With a drafts_for hook (a subclass's, or one set on the instance) every verify dispatch
    is one round, whatever decode_steps (the hook must see each round's drafts; rounds after
    the first would check the device's own): its shapes, warmup's buckets included, have
    steps = 1, and the tokens are the MTP drafts' engine's. Only extend shapes may not loop."""
    sp = ik.SamplingParams(max_new_tokens=9, stop_at_eos=False)
    want = spec_engine(echo_params, 3, decode_steps=4).generate(ROUND_PROMPTS, sp)
    hooked = spec_engine(echo_params, 3, script=lambda r, proposed: proposed, decode_steps=4)
    assert {s.steps for s in hooked.runner.all_shapes() if s.mode == "verify"} == {1}
    patched = spec_engine(echo_params, 3, decode_steps=4)
    patched.drafts_for = lambda r: list(r.drafts)
    for engine in (hooked, patched):
        assert [c.tokens for c in engine.generate(ROUND_PROMPTS, sp)] == [c.tokens for c in want]
        assert engine.stats()["verify_steps"] > 0 and engine.stats()["multi_round_verify_steps"] == 0
        assert {s.steps for s in engine.runner.compiled if s.mode == "verify"} == {1}
    assert StepShape("verify", 2, 8, 4, 16, steps=4).steps == 4
    with pytest.raises(ValueError, match="only decode and verify dispatches run several steps"):
        StepShape("extend", 2, 16, 8, 16, steps=2)

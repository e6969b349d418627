"""The generation interface on the model, against its oracles: HF transformers' own
`LogitsProcessor` classes on the same logits (repetition penalty, min-p, min new tokens,
sequence bias) and a numpy reference of the OpenAI presence / frequency penalties; the
reference forward (`ik.forward`) for greedy decoding with every processor and for scoring;
the target distribution for speculative acceptance with processors; separate requests for n
samples; `generate` for streams; XLA's compile events for "a new value compiles nothing".
(Speculation, sessions and every cache mode with processors, n and stop strings: the
differential fuzz, `test_fuzz_modes.py`.)"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import inkling_jax as ik
from inkling_jax.steps import RowPlan
from inkling_jax.steps.counts import host_rows
from inkling_jax.steps.sampling import SamplingArrays, accept_drafts, filtered_logits, processed
from inkling_jax.tokenizer import ByteTokenizer
from conftest import ENGINE_KW, TRUNK, count_xla_compiles, make_engine, reference_forward

V = TRUNK.unpadded_vocab_size
EOS = TRUNK.eos_token_id


def hf_process(logits: np.ndarray, prompt, output, sp: ik.SamplingParams, stop_ids) -> np.ndarray:
    """One row's logits through HF's processor classes (and the numpy OpenAI penalties) in the
    engine's order: bias, min new tokens, repetition, frequency / presence (before temperature)."""
    import torch
    from transformers import MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor, \
        SequenceBiasLogitsProcessor

    ids = torch.tensor([list(prompt) + list(output)], dtype=torch.long)
    scores = torch.tensor(logits[None].astype(np.float32))
    if sp.logit_bias:
        scores = SequenceBiasLogitsProcessor([[[t], b] for t, b in sp.logit_bias])(ids, scores)
    if sp.min_tokens and stop_ids:
        scores = MinNewTokensLengthLogitsProcessor(len(prompt), sp.min_tokens, list(stop_ids))(ids, scores)
    if sp.repetition_penalty != 1:
        scores = RepetitionPenaltyLogitsProcessor(sp.repetition_penalty)(ids, scores)
    out = scores[0].numpy().copy()
    n = np.bincount(np.asarray(output, np.int64), minlength=len(out)).astype(np.float32)
    if sp.frequency_penalty or sp.presence_penalty:  # OpenAI: output tokens only
        out = out - np.float32(sp.frequency_penalty) * n - np.float32(sp.presence_penalty) * (n > 0).astype(np.float32)
    return out


def hf_min_p(logits: np.ndarray, temperature: float, min_p: float) -> np.ndarray:
    import torch
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper

    scores = TemperatureLogitsWarper(temperature)(None, torch.tensor(logits[None]))
    return MinPLogitsWarper(min_p)(None, scores)[0].numpy()


ROWS = [  # (SamplingParams, prompt length, output length)
    (ik.SamplingParams(repetition_penalty=1.3, temperature=0.8, min_p=0.1), 9, 5),
    (ik.SamplingParams(repetition_penalty=0.7, presence_penalty=0.5, frequency_penalty=0.25, min_p=0.3,
                       temperature=1.0), 4, 12),
    (ik.SamplingParams(logit_bias={5: 3.0, 17: -2.5, 200: 0.5}, min_tokens=6, stop_token_ids=(9, 11),
                       temperature=1.3, min_p=0.05), 6, 3),
    (ik.SamplingParams(presence_penalty=-1.0, frequency_penalty=1.5, min_tokens=2, stop_at_eos=False,
                       stop_token_ids=(4,)), 7, 2),
    (ik.SamplingParams(), 5, 5),  # no processor: untouched
]


def test_processors_match_hf_logits_processors(torch_threads):
    """process_logits (every row its own values, counts from the count table) equals HF's
    classes and the numpy penalties (within 1 ulp: XLA's fp32 division rounds otherwise than
    torch's now and then; a row without processors bit for bit); min-p after temperature keeps
    HF's tokens."""
    rng = np.random.RandomState(0)
    b = len(ROWS)
    logits = (3 * rng.randn(b, V)).astype(np.float32)
    prompts = [list(rng.randint(3, 40, n)) for _, n, _ in ROWS]  # small ids: prompt and output overlap
    outputs = [list(rng.randint(3, 40, n)) for _, _, n in ROWS]
    stops = [list(sp.stop_token_ids) + ([EOS] if sp.stop_at_eos else []) for sp, _, _ in ROWS]
    rows = [RowPlan(tokens=[0], seq_start=0, virtual_slot=0, virtual_pages=[], sampling=sp, stop_ids=st,
                    out_len=len(o), count_row=i + 1) for i, ((sp, _, _), st, o) in enumerate(zip(ROWS, stops, outputs))]
    s = SamplingArrays.pack(rows, b, 8, 16)
    table = np.zeros((b + 1, V), np.int32)
    table[1:] = host_rows(prompts, outputs, V)
    got = np.asarray(jax.jit(processed)(logits, s, table, s.out_len))
    for i, (sp, _, _) in enumerate(ROWS):
        want = hf_process(logits[i], prompts[i], outputs[i], sp, stops[i])
        np.testing.assert_allclose(got[i], want, rtol=2e-7, atol=0, err_msg=f"row {i}")
        np.testing.assert_array_equal(np.isneginf(got[i]), np.isneginf(want))
    np.testing.assert_array_equal(got[-1], logits[-1])
    filt = np.asarray(jax.jit(filtered_logits)(got, s.temperature, s.top_k, s.top_p, s.min_p))
    for i, (sp, _, _) in enumerate(ROWS[:3]):
        want = hf_min_p(got[i], sp.temperature, sp.min_p)
        np.testing.assert_array_equal(np.isfinite(filt[i]), np.isfinite(want), err_msg=f"row {i}")
        np.testing.assert_allclose(filt[i][np.isfinite(want)], want[np.isfinite(want)], rtol=1e-6)


def test_sampled_acceptance_draws_from_the_processed_distribution():
    """Speculative sampling with processors: the first emitted token is distributed as the
    processed target at position 0, the second (after an accepted first draft) as the
    processed target at position 1 with that draft counted (8192 draws, |error| < 0.02)."""
    rng = np.random.RandomState(1)
    v, n = 6, 8192
    logits = np.broadcast_to(rng.randn(1, 3, v).astype(np.float32), (n, 3, v))
    drafts = np.broadcast_to(np.array([[0, 3]], np.int32), (n, 2))
    sp = ik.SamplingParams(temperature=1.0, logit_bias={0: 1.0}, repetition_penalty=2.0, presence_penalty=0.7,
                           min_tokens=1, stop_token_ids=(2,), stop_at_eos=False)
    rows = [RowPlan(tokens=[0], seq_start=0, virtual_slot=0, virtual_pages=[], sampling=sp, seed=i, stop_ids=[2],
                    count_row=1) for i in range(n)]
    s = SamplingArrays.pack(rows, n, 1, 1)
    table = np.zeros((2, v), np.int32)
    table[1] = host_rows([[1, 4]], [[3]], v)[0]  # 1, 4 in the prompt; 3 generated once
    n_acc, bonus, _, _ = jax.jit(accept_drafts)(logits, drafts, s, np.full(n, 2, np.int32), np.zeros(n, np.int32),
                                                table)
    n_acc, bonus = np.asarray(n_acc), np.asarray(bonus)
    first = np.where(n_acc > 0, drafts[:, 0], bonus)
    s1 = jax.tree.map(lambda x: x[:1], s)
    p0 = jax.nn.softmax(np.asarray(processed(logits[:1, 0], s1, table, np.zeros(1, np.int32))))[0]
    np.testing.assert_allclose(np.bincount(first, minlength=v) / n, p0, atol=0.02)
    second = np.where(n_acc > 1, drafts[:, 1], bonus)[n_acc > 0]
    assert len(second) > n // 4
    p1 = jax.nn.softmax(np.asarray(processed(logits[:1, 1], s1, table + 2 * np.eye(v, dtype=np.int32)[0],
                                             np.ones(1, np.int32))))[0]
    np.testing.assert_allclose(np.bincount(second, minlength=v) / len(second), p1, atol=0.02)
    assert p0[2] == 0 and p1[2] > 0  # min_tokens: the stop id only from the second token on


def test_all_greedy_acceptance_skips_the_sort_and_matches_a_mixed_batch():
    """accept_drafts of an all-greedy batch (the common case) runs no sort over the vocabulary
    and draws nothing (the filtered distributions sit in a `lax.cond` branch, as sample_tokens'
    do), and its greedy rows accept and emit exactly what the same rows do beside a sampled row
    (the branch that runs both rules)."""
    rng = np.random.RandomState(2)
    v, n = 12, 4
    logits = rng.randn(n, 3, v).astype(np.float32)
    greedy_next = logits.argmax(-1)
    drafts = np.stack([greedy_next[:, 0], np.where(np.arange(n) % 2, greedy_next[:, 1], (greedy_next[:, 1] + 1) % v)],
                      axis=1).astype(np.int32)  # every first draft right, every other second draft wrong
    plans = [ik.SamplingParams(stop_at_eos=False), ik.SamplingParams(temperature=0.8, top_k=5, stop_at_eos=False)]

    def arrays(sps):
        rows = [RowPlan(tokens=[0], seed=i, sampling=sp, virtual_slot=0, virtual_pages=[], seq_start=0,
                        stop_ids=[], count_row=0) for i, sp in enumerate(sps)]
        return SamplingArrays.pack(rows, n, 1, 1)

    args = (np.full(n, 2, np.int32), np.zeros(n, np.int32), np.zeros((1, v), np.int32))

    def unconditional(jaxpr) -> set[str]:
        """The primitives a run always executes: jaxpr's and its sub-jaxprs' (jit calls, custom
        derivatives, loops), but not a cond's branches."""
        names = set()
        for e in jaxpr.eqns:
            names.add(e.primitive.name)
            if e.primitive.name != "cond":
                for sub in jax.core.jaxprs_in_params(e.params):
                    names |= unconditional(sub)
        return names

    all_greedy, mixed = arrays([plans[0]] * n), arrays([plans[0]] * (n - 1) + [plans[1]])
    names = unconditional(jax.make_jaxpr(accept_drafts)(logits, drafts, all_greedy, *args).jaxpr)
    assert "cond" in names and "argmax" in names
    assert not names & {"sort", "random_bits", "random_wrap", "threefry2x32"}, names
    got = [np.asarray(a) for a in jax.jit(accept_drafts)(logits, drafts, all_greedy, *args)]
    want = [np.asarray(a) for a in jax.jit(accept_drafts)(logits, drafts, mixed, *args)]
    assert got[0].tolist() == [1, 2, 1, 2]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g[:n - 1], w[:n - 1])


# ------------------------------------------------------------------ the engine


def reference_greedy(params, prompt, sp: ik.SamplingParams, stop_ids):
    """Greedy decoding of the reference forward with HF's processors: (tokens, logprobs,
    top alternatives)."""
    tokens, lps, tops = [], [], []
    for _ in range(sp.max_new_tokens):
        logits = reference_forward(params, TRUNK, list(prompt) + tokens)[-1]
        logp = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        t = int(np.argmax(hf_process(logits, prompt, tokens, sp, stop_ids)))
        tokens.append(t)
        lps.append(logp[t])
        tops.append(np.sort(logp)[::-1][:sp.logprobs])
        if t in stop_ids and len(tokens) > sp.min_tokens:
            break
    return tokens, lps, tops


def processor_params(stop):
    return ik.SamplingParams(max_new_tokens=10, repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.4,
                             logit_bias={7: 2.5, 100: -1.0}, min_tokens=4, stop_token_ids=(stop,), stop_at_eos=False,
                             min_p=0.2, logprobs=3)


@pytest.mark.parametrize("mode", ["no-cache", "K3", "session"])
def test_greedy_with_every_processor_matches_the_reference(trunk_params, torch_threads, mode):
    """Greedy decoding with every processor (a stop id that the reference reaches before
    min_tokens among them) equals the reference forward's greedy decoding through HF's
    processors: tokens exactly, log-probs and top-3 alternatives within 1e-5; with the prefix
    cache off, multi-step decode (K = 3) with the cache, and a session's second turn."""
    rng = np.random.RandomState(2)
    prompts = [list(rng.randint(3, V, n)) for n in (13, 6)]
    engine = make_engine(trunk_params, **({"prefix_cache": False} if mode == "no-cache" else
                                          {"decode_steps": 3} if mode == "K3" else {}))
    if mode == "session":
        sid = engine.open_session()
        first = engine.generate([prompts[0]], ik.SamplingParams(max_new_tokens=3), session=sid)[0]
        history = prompts[0] + first.tokens
        prompts = [prompts[1]]
    for i, p in enumerate(prompts):
        full = history + p if mode == "session" else p
        free = reference_greedy(trunk_params, full, ik.SamplingParams(max_new_tokens=4, stop_at_eos=False), [])[0]
        sp = processor_params(stop=free[1])
        want, want_lp, want_top = reference_greedy(trunk_params, full, sp, [free[1]])
        got = engine.generate([p], sp, session=sid if mode == "session" else None)[0]
        assert got.tokens == want, (i, got.tokens, want)
        np.testing.assert_allclose(got.logprobs, want_lp, atol=1e-5)
        np.testing.assert_allclose([[lp for _, lp in top] for top in got.top_logprobs], want_top, atol=1e-5)
    engine.check_invariants()


def test_changing_processor_values_compiles_nothing(trunk_params):
    """After warm-up, requests with every processor at varied values, n samples, stop strings,
    top alternatives and streams compile nothing (XLA's compile events)."""
    engine = ik.Engine(TRUNK, trunk_params, ik.EngineConfig(**{**ENGINE_KW, "warmup": True, "max_context": 64}),
                       tokenizer=ByteTokenizer(TRUNK))
    rng = np.random.RandomState(4)
    with count_xla_compiles() as compiles:
        for k in range(4):
            sp = ik.SamplingParams(max_new_tokens=int(rng.randint(2, 8)), temperature=float(rng.choice([0, 0.9])),
                                   repetition_penalty=float(rng.uniform(0.5, 2)), min_p=float(rng.uniform(0, 0.5)),
                                   presence_penalty=float(rng.uniform(-2, 2)),
                                   frequency_penalty=float(rng.uniform(0, 2)),
                                   logit_bias={int(rng.randint(V)): float(rng.randn())}, min_tokens=1, logprobs=k,
                                   stop=("x", "yz"), top_k=int(rng.randint(0, 9)), seed=k)
            engine.generate([list(rng.randint(3, V, rng.randint(2, 20))) for _ in range(3)], sp, n=1 + k % 2)
            list(engine.stream([[5, 6, 7]], sp))
    assert compiles[0] == 0
    engine.check_invariants()


# ------------------------------------------------------------------ scoring


def reference_logp(params, tokens):
    logits = reference_forward(params, TRUNK, tokens)
    m = logits.max(-1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))


def test_score_equals_the_reference_with_and_without_a_cache_hit(trunk_params):
    """score(): each continuation token's log-prob equals the reference forward's log-softmax
    within 1e-5 (fp32; the steps' attention sums in another order); a request whose context
    is served from the prefix cache gives the same values bit for bit (chunk_size divides
    track_interval: the scored positions run in the same chunks either way), top-2
    alternatives included; prompt_logprobs scores a request's own prompt."""
    rng = np.random.RandomState(5)
    ctx = [list(rng.randint(3, V, n)) for n in (17, 9, 24)]
    cont = [list(rng.randint(3, V, n)) for n in (6, 11, 3)]
    off = make_engine(trunk_params, prefix_cache=False).score(ctx, cont, top_logprobs=2)
    engine = make_engine(trunk_params)
    engine.generate(ctx, ik.SamplingParams(max_new_tokens=1))  # the contexts' checkpoints are cached now
    hit = engine.score(ctx, cont, top_logprobs=2)
    for a, b, c, k in zip(off, hit, ctx, cont):
        ref = reference_logp(trunk_params, c + k)
        np.testing.assert_allclose(a.logprobs, [ref[len(c) - 1 + i, t] for i, t in enumerate(k)], rtol=0, atol=1e-5)
        assert a.cached_tokens == 0 and b.cached_tokens == (len(c) - 1) // 8 * 8 > 0
        assert a.logprobs == b.logprobs and a.top_logprobs == b.top_logprobs
        assert [t for t, _ in a.top_logprobs[0]] == list(np.argsort(-ref[len(c) - 1])[:2])
    prompt = ctx[2] + cont[2]
    c = engine.generate([prompt], ik.SamplingParams(max_new_tokens=2, prompt_logprobs=1))[0]
    ref = reference_logp(trunk_params, prompt)
    assert c.prompt_logprobs[0] is None and c.cached_tokens == 0
    np.testing.assert_allclose(c.prompt_logprobs[1:], [ref[p - 1, prompt[p]] for p in range(1, len(prompt))], atol=1e-5)
    engine.check_invariants()


# ------------------------------------------------------------------ n samples, streams


def test_n_samples_equal_separate_requests(trunk_params):
    """n = 3 sampled continuations of two prompts: each equals a separate request with seed
    + j (tokens exactly, log-probs within 1e-5); the prompts' shared part is computed once."""
    rng = np.random.RandomState(6)
    prompts = [list(rng.randint(3, V, n)) for n in (21, 14)]
    sp = ik.SamplingParams(max_new_tokens=6, temperature=1.0, seed=9, stop_at_eos=False, repetition_penalty=1.2)
    engine = make_engine(trunk_params, max_running=4)
    out = engine.generate(prompts, sp, n=3)
    computed = engine.stats()["prompt_tokens_computed"]
    solo = make_engine(trunk_params, prefix_cache=False)
    for j in range(3):  # sample j of prompt i: prompt i of a call with seed + j
        want = solo.generate(prompts, ik.SamplingParams(max_new_tokens=6, temperature=1.0, seed=9 + j,
                                                        stop_at_eos=False, repetition_penalty=1.2))
        for i in range(2):
            assert out[i][j].tokens == want[i].tokens, (i, j)
            np.testing.assert_allclose(out[i][j].logprobs, want[i].logprobs, atol=1e-5)
    assert computed == sum(len(p) + 2 * (len(p) - (len(p) - 1) // 4 * 4) for p in prompts) < 3 * sum(map(len, prompts))
    engine.check_invariants()


def test_stream_with_overlap_equals_generate_and_leaves_exactly(trunk_params):
    """A stream over overlapped multi-step decode (K = 4) yields the generate() outputs in
    chunks; a stream left after its first delta aborts its requests and the engine's next
    outputs are exact."""
    rng = np.random.RandomState(7)
    prompts = [list(rng.randint(3, V, n)) for n in (5, 12)]
    sp = ik.SamplingParams(max_new_tokens=9, stop_at_eos=False, temperature=0.8, seed=1)
    engine = make_engine(trunk_params, decode_steps=4, overlap=True)
    want = engine.generate(prompts, sp)
    got = {0: [], 1: []}
    sizes = []
    for d in engine.stream(prompts, sp):
        got[d.index] += d.tokens
        sizes.append(len(d.tokens))
    assert [got[0], got[1]] == [c.tokens for c in want] and max(sizes) > 1
    for d in engine.stream(prompts, sp):
        break
    assert not engine.running and not engine.waiting
    engine.check_invariants()
    assert [c.tokens for c in engine.generate(prompts, sp)] == [c.tokens for c in want]

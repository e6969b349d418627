"""The serving core against its oracles: HF transformers' greedy generate, the reference
forward (logprobs), and itself (chunking, compaction replay, recompiles, bad input)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import inkling_jax as ik
from inkling_jax.cache.layout import ArenaLayout
from inkling_jax.cache.state import init_state, read_slot_field
from inkling_jax.steps import RowPlan, StepShape, check_batch, compile_step, pack_batch
from conftest import ENGINE_KW, PARITY_CONFIGS, TRUNK, hf_config, make_engine, perturb_, reference_logprobs

GREEDY = ik.SamplingParams(max_new_tokens=24, stop_at_eos=False)


def mixed_prompts(seed=0, lengths=(3, 11, 19, 26, 7)):
    rng = np.random.RandomState(seed)
    return [list(rng.randint(3, TRUNK.unpadded_vocab_size, n)) for n in lengths]


def test_greedy_matches_hf_generate(tmp_path, torch_threads):
    """Same random weights (float32): engine greedy tokens == HF greedy generate, for mixed
    prompt lengths whose generations run past the window (8) and rel_extent (16), with
    max_running 2 < 5 prompts (requests join mid-flight) and chunk_size 8 splitting prompts."""
    from transformers.models.inkling import InklingForConditionalGeneration

    torch_threads.manual_seed(0)
    model = InklingForConditionalGeneration(hf_config(TRUNK)).eval()
    perturb_(model, head_std=1.0)
    model.save_pretrained(tmp_path)
    cfg, params = ik.load_pretrained(tmp_path, dtype=jnp.float32)
    assert cfg == TRUNK
    prompts = mixed_prompts()
    expected = []
    for p in prompts:
        with torch_threads.no_grad():
            out = model.generate(torch_threads.tensor([p]), max_new_tokens=24, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    engine = make_engine(params)
    got = engine.generate(prompts, GREEDY)
    assert [c.tokens for c in got] == expected
    assert engine.stats()["extend_steps"] >= 4  # prompts were chunked and interleaved
    engine.check_invariants()


@pytest.mark.parametrize("chunk", [1, 3, 7, 32])
def test_logprobs_and_chunk_sizes(trunk_params, chunk):
    """Logprobs equal the reference forward's on the full sequence (float32, within 1e-5),
    and chunked prefill with chunk sizes 1, 3, 7 and whole prompts gives the same tokens."""
    prompts = mixed_prompts(lengths=(5, 13, 29))
    kw = dict(chunk_size=chunk) if chunk < 32 else dict(chunk_size=32, max_step_tokens=32)
    engine = make_engine(trunk_params, prefix_cache=False, **kw)
    out = engine.generate(prompts, ik.SamplingParams(max_new_tokens=12, stop_at_eos=False))
    for p, c in zip(prompts, out):
        ref_lp, ref_greedy = reference_logprobs(trunk_params, TRUNK, p, c.tokens)
        assert c.tokens == ref_greedy.tolist()
        np.testing.assert_allclose(c.logprobs, ref_lp, rtol=0, atol=1e-5)
        assert c.finish_reason == "length" and c.cached_tokens == 0


# conftest's "heads" layer pattern without its MTP depths: 5 layers, sliding 0, 2, 3 and full 1, 4
# (two full layers: pages per full layer), dense 0 and 3 (not a prefix), conv kernel 3, GQA
# full heads beside sliding heads of another shape
DEEP = PARITY_CONFIGS["heads"].replace(num_mtp_layers=0, mtp_local_layer_ids=())


def test_deep_layer_pattern_matches_the_reference():
    """The engine tests' TRUNK has one layer of each kind; here every layer's state fields,
    rings and pages are told apart: several sliding and full layers, chunked prompts past the
    window (5) and rel_extent (12), then prefix hits restoring every layer's checkpoint.
    Greedy tokens equal the reference forward's picks and log-probs agree within 1e-5."""
    params = ik.init_params(DEEP, jax.random.key(5), std=0.1)
    engine = ik.Engine(DEEP, params, ik.EngineConfig(**{**ENGINE_KW, "max_context": 64}))
    shared = mixed_prompts(seed=4, lengths=(19,))[0]
    prompts = [shared + [5, 6, 7], shared[:10], mixed_prompts(seed=5, lengths=(26,))[0]]
    sp = ik.SamplingParams(max_new_tokens=12, stop_at_eos=False)
    first = engine.generate(prompts, sp)
    second = engine.generate([shared + [9, 9]], sp)[0]
    assert second.cached_tokens == 16  # the checkpoint at 16 (track_interval 8)
    for p, c in zip(prompts + [shared + [9, 9]], first + [second]):
        ref_lp, ref_greedy = reference_logprobs(params, DEEP, p, c.tokens)
        assert c.tokens == ref_greedy.tolist()
        np.testing.assert_allclose(c.logprobs, ref_lp, rtol=0, atol=1e-5)
    engine.check_invariants()


def test_no_recompiles_after_warmup(trunk_params):
    """After warm-up, 300 steps with live batch sizes and lengths varying inside the buckets,
    with evictions and compactions, compile nothing new: counted by the engine and by XLA's
    own compile events (any program, compaction copies and eager ops included)."""
    import jax.monitoring

    engine = make_engine(trunk_params, max_context=64, warmup=True, num_slots=8, num_pages=40)
    after_warmup = engine.stats()["compiles"]
    assert after_warmup == len(engine.runner.compiled) > 0
    xla_compiles = []
    counting = [True]
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: xla_compiles.append(name) if counting[0] and name.endswith("backend_compile_duration")
        else None)
    rng = np.random.RandomState(3)
    steps = 0
    try:
        while steps < 300:
            n = rng.randint(1, 4)
            prompts = [list(rng.randint(3, 200, rng.randint(1, 30))) for _ in range(n)]
            engine.submit(prompts, ik.SamplingParams(max_new_tokens=int(rng.randint(1, 20)), stop_at_eos=False))
            while engine.running or engine.waiting:
                engine.step()
                steps += 1
            if rng.rand() < 0.2:
                engine.evict_all()
    finally:
        counting[0] = False
    assert engine.stats()["compiles"] == after_warmup
    assert xla_compiles == []
    assert engine.stats()["steps"] >= 300 and engine.stats()["compaction_moves"] > 0
    engine.check_invariants()


def test_compiled_step_replayed_after_slot_moves(trunk_params):
    """Invariant I4: a compiled decode step, replayed after the id table changed (the slot
    moved), reads and writes the *new* physical rows, and computes the same result."""
    cfg, lay = TRUNK, ArenaLayout.build(TRUNK, 4)
    shape = StepShape("decode", 2, 2, 1, 8)
    step = compile_step(cfg, lay, shape)
    units = 10 * lay.slot_units + 9 * lay.page_units
    prompt = [7, 8, 9, 10, 11]

    def run(slot_phys: list[int]):
        state = init_state(lay, units, 9, 8, jnp.float32)
        v2p = np.zeros(10, np.int32)
        v2p[3] = slot_phys[0]
        state = state.replace(slot_v2p=jnp.asarray(v2p), page_v2p=jnp.arange(9, dtype=jnp.int32))
        toks, seen = [], []
        for i, tok in enumerate(prompt):
            if i == 2 and slot_phys[1] != slot_phys[0]:  # compaction between steps: move the units, update the table
                src = np.arange(lay.slot_units) + lay.slot_row(slot_phys[0])
                dst = np.arange(lay.slot_units) + lay.slot_row(slot_phys[1])
                state = state.replace(arena=state.arena.at[dst].set(state.arena[src]).at[src].set(0.0))
                v2p[3] = slot_phys[1]
                state = state.replace(slot_v2p=jnp.asarray(v2p))
            batch = pack_batch(shape, [RowPlan(tokens=[tok], seq_start=i, virtual_slot=3,
                                               virtual_pages=list(range(1, 9)))])
            out, state = step(trunk_params, state, batch)
            toks.append(int(out.tokens[0]))
            seen.append(np.asarray(out.logprobs)[0])
        return toks, seen, state

    toks_a, lp_a, state_a = run([2, 2])  # no move
    toks_b, lp_b, state_b = run([2, 7])  # moved from physical slot 2 to 7 after two steps
    assert toks_a == toks_b
    np.testing.assert_array_equal(lp_a, lp_b)
    f = lay.target[0].conv
    win_a = read_slot_field(state_a.arena, lay, jnp.array([2]), f)
    win_b = read_slot_field(state_b.arena, lay, jnp.array([7]), f)
    np.testing.assert_array_equal(win_a, win_b)  # the replay wrote the moved slot
    old = read_slot_field(state_b.arena, lay, jnp.array([2]), f)
    assert not np.any(np.asarray(old))  # and nothing went to the old physical rows


def test_sliding_memory_is_bounded(trunk_params):
    """Over a long generation a request's slots (conv windows + sliding K/V ring) stay
    fixed while its full-attention pages grow with length. (3 + 56 tokens: seven windows of 8
    and 15 pages, inside the 64-token context bucket the other tests compile: a longer run
    compiled steps of another bucket for this test alone.)"""
    engine = make_engine(trunk_params, max_running=1, prefix_cache=False)
    new_tokens = 56
    engine.submit([[5, 6, 7]], ik.SamplingParams(max_new_tokens=new_tokens, stop_at_eos=False))
    slots, pages = [], []
    while engine.running or engine.waiting:
        engine.step()
        if engine.running:
            slots.append(engine.stats()["live_slots"])
            pages.append(engine.stats()["live_pages"])
    assert set(slots) == {1}  # one slot: conv windows and a ring of window + spec rows
    assert pages[-1] >= new_tokens // ENGINE_KW["page_size"] and pages == sorted(pages)
    assert len(set(pages)) > 10  # the pages really grew
    lay = engine.layout
    assert lay.ring == TRUNK.sliding_window  # per-request sliding K/V is window-bounded
    engine.check_invariants()


@pytest.mark.parametrize("bad, match", [
    ([[1, 2, 999]], "token id 999 out of range"),
    ([[]], "prompt 0 is empty"),
    ([[1, 2], [3, -1]], "token id -1 out of range"),
    ([list(range(10, 250)) * 8], "exceed the longest sequence"),
])
def test_bad_input_changes_nothing(trunk_params, bad, match):
    """A bad prompt is a ValueError before anything changes: in-flight requests finish with
    exactly the tokens they get in an engine that never saw the bad call."""
    prompts = mixed_prompts(lengths=(9, 14))
    params = ik.SamplingParams(max_new_tokens=10, stop_at_eos=False)
    clean = make_engine(trunk_params).generate(prompts, params)
    engine = make_engine(trunk_params)
    reqs = engine.submit(prompts, params)
    engine.step()
    engine.step()
    before = engine.stats()
    with pytest.raises(ValueError, match=match):
        engine.generate(bad, params)
    assert engine.stats() == before
    engine.check_invariants()
    while engine.running or engine.waiting:
        engine.step()
    assert [r.out_tokens for r in reqs] == [c.tokens for c in clean]
    engine.check_invariants()


def test_other_bad_arguments(trunk_params):
    engine = make_engine(trunk_params)
    with pytest.raises(ValueError, match="session 42 is not open"):
        engine.generate([[1, 2]], session=42)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate([[1, 2]], ik.SamplingParams(max_new_tokens=0))
    with pytest.raises(ValueError, match="spec_steps=2 exceeds the model's MTP depths"):
        make_engine(trunk_params, spec_steps=2)
    with pytest.raises(ValueError, match="track_interval"):
        make_engine(trunk_params, track_interval=6)
    engine.check_invariants()


def test_oversize_batch_is_a_clear_error(trunk_params):
    """S6: a batch with more rows than the compiled bucket is rejected before the step runs."""
    engine = make_engine(trunk_params)
    shape = StepShape("decode", 2, 2, 1, 16)
    batch = engine.runner.empty_batch(StepShape("decode", 4, 4, 1, 16))
    with pytest.raises(ValueError,
                       match=r"StepBatch.layout.tokens has shape \(4,\); the compiled decode bucket takes \(2,\)"):
        check_batch(batch, shape, max_stop_ids=engine.config.max_stop_ids)


def test_sampling(trunk_params):
    engine = make_engine(trunk_params, prefix_cache=False)
    prompts = mixed_prompts(lengths=(6, 9))
    hot = ik.SamplingParams(max_new_tokens=16, temperature=1.5, seed=11, stop_at_eos=False)
    a = engine.generate(prompts, hot)
    b = engine.generate(prompts, hot)
    c = engine.generate(prompts, ik.SamplingParams(max_new_tokens=16, temperature=1.5, seed=12, stop_at_eos=False))
    assert [x.tokens for x in a] == [x.tokens for x in b]  # explicit keys: reproducible
    assert [x.tokens for x in a] != [x.tokens for x in c]
    greedy = engine.generate(prompts, ik.SamplingParams(max_new_tokens=16, stop_at_eos=False))
    for trunc in (ik.SamplingParams(max_new_tokens=16, temperature=2.0, top_k=1, stop_at_eos=False),
                  ik.SamplingParams(max_new_tokens=16, temperature=2.0, top_p=1e-6, stop_at_eos=False)):
        assert [x.tokens for x in engine.generate(prompts, trunc)] == [x.tokens for x in greedy]
    # logprobs of sampled tokens are the model's (temperature 1, untruncated)
    for p, x in zip(prompts, a):
        ref_lp, _ = reference_logprobs(trunk_params, TRUNK, p, x.tokens)
        np.testing.assert_allclose(x.logprobs, ref_lp, atol=1e-5)


def test_stop_tokens(trunk_params):
    engine = make_engine(trunk_params, prefix_cache=False)
    prompt = mixed_prompts(lengths=(8,))
    free = engine.generate(prompt, ik.SamplingParams(max_new_tokens=12, stop_at_eos=False))[0]
    stop = free.tokens[4]
    stopped = engine.generate(prompt, ik.SamplingParams(max_new_tokens=12, stop_at_eos=False,
                                                        stop_token_ids=(stop,)))[0]
    assert stopped.tokens == free.tokens[:free.tokens.index(stop) + 1]
    assert stopped.finish_reason == "stop"
    assert engine.generate(prompt, ik.SamplingParams(max_new_tokens=12))[0].finish_reason == (
        "stop" if TRUNK.eos_token_id in free.tokens else "length")

"""A failure-safe engine: every exception leaves it consistent and the next call exact.

One test per failure found by the probe (issue 15): interrupted output reads (prefill,
decode, a session turn), failed compaction copies (before and after the arena was donated),
unvalidated settings and prompts, sessions ignored by admission, dead tree leaves after
eviction, stop ids past the batch's width with speculation, seeded speculative sampling that
depended on the batch, params of another config, two threads on one engine; a
fault-injection soak (`faults.py`; `INKLING_SOAK_OPS` sets its length); and chaos: real SIGINTs
at random moments inside steps (`chaos.py`; `INKLING_CHAOS_OPS` sets its length, issue 35)."""

from __future__ import annotations

import os
import threading

import jax
import numpy as np
import pytest

import inkling_jax as ik
from conftest import ENGINE_KW, TRUNK, make_engine
from chaos import CHAOS_MODES, run_chaos
from faults import InjectedFault, run_soak

GREEDY = ik.SamplingParams(max_new_tokens=8, stop_at_eos=False)


def prompts_from(seed, lengths):
    rng = np.random.RandomState(seed)
    return [list(rng.randint(3, TRUNK.unpadded_vocab_size, n)) for n in lengths]


def drain(engine):
    while engine.running or engine.waiting:
        engine.step()


def fail_once(obj, name: str, exc: BaseException, after: bool = False):
    """Make obj.<name> raise exc on its next call (after running the real call if `after`)."""
    real = getattr(obj, name)
    state = {"armed": True}

    def wrapper(*args, **kw):
        if not state["armed"]:
            return real(*args, **kw)
        state["armed"] = False
        if after:
            real(*args, **kw)
        raise exc
    setattr(obj, name, wrapper)
    return state


# ------------------------------------------------------------ 1. interrupted reads


@pytest.mark.parametrize("when", ["prefill", "decode"])
@pytest.mark.parametrize("exc", [KeyboardInterrupt(), InjectedFault("read")], ids=["ctrl-c", "error"])
def test_interrupted_output_read_finishes_the_step_later(trunk_params, when, exc):
    """An exception while a step's outputs are read (a prefill chunk that donates a
    checkpoint, or a decode step): the next call commits that step, nothing replays; the
    outputs, and a later prefix hit on the checkpoint, equal a clean engine's."""
    prompt = prompts_from(1, (27,))[0]
    clean = make_engine(trunk_params, prefix_cache=False).generate([prompt, prompt + [5, 6]], GREEDY)
    engine = make_engine(trunk_params)
    req = engine.submit([prompt], GREEDY)[0]
    if when == "decode":
        while not req.out_tokens:
            engine.step()
    fail_once(engine, "_fetch", exc)
    with pytest.raises(type(exc)):
        engine.step()
    assert engine._flights
    engine.check_invariants()
    drain(engine)
    assert req.out_tokens == clean[0].tokens
    again = engine.generate([prompt + [5, 6]], GREEDY)[0]
    assert again.cached_tokens == 24 and again.tokens == clean[1].tokens
    engine.check_invariants()


def test_interrupted_session_turn_continues_and_closes(trunk_params):
    engine = make_engine(trunk_params)
    sid = engine.open_session()
    turn1, turn2 = prompts_from(2, (11, 6))
    fail_once(engine, "_fetch", KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        engine.generate([turn1], GREEDY, session=sid)
    engine.check_invariants()
    first = engine.sessions[sid].turn
    drain(engine)  # the interrupted turn finishes
    second = engine.generate([turn2], GREEDY, session=sid)[0]
    clean = make_engine(trunk_params, prefix_cache=False)
    assert first.out_tokens == clean.generate([turn1], GREEDY)[0].tokens
    assert second.tokens == clean.generate([turn1 + first.out_tokens + turn2], GREEDY)[0].tokens
    # a turn in flight: close_session(abort=True) cancels it and frees everything
    engine.submit([prompts_from(3, (5,))[0]], GREEDY, session=sid)
    engine.step()
    with pytest.raises(ValueError, match="turn in flight"):
        engine.close_session(sid)
    engine.close_session(sid, abort=True)
    engine.check_invariants()
    assert engine.pool.live_count("slot") == len(engine.tree.owned()[0])


# -------------------------------------------------------------- 2. compaction copy


@pytest.mark.parametrize("after", [False, True], ids=["before-copy", "arena-donated"])
def test_failed_compaction_copy_is_applied_or_reset(trunk_params, after):
    """A compaction copy that fails before it starts stays pending and is applied by the next
    call; one that fails after the arena was donated loses the device state, and the engine
    restarts its running requests from their tokens. Either way the outputs of the requests
    running meanwhile are exact, and the invariants (device tables against the pool's) hold."""
    cached, running = prompts_from(4, (21, 14)), prompts_from(5, (9, 18))
    clean = make_engine(trunk_params, prefix_cache=False).generate(running, GREEDY)
    engine = make_engine(trunk_params, ping_pong="eager")
    engine.generate(cached, GREEDY)  # leaves checkpoints in the tree
    reqs = engine.submit(running, GREEDY)
    for _ in range(3):
        engine.step()
    fail_once(engine.runner, "move_units", InjectedFault("copy"), after=after)
    with pytest.raises(InjectedFault):
        engine.evict_all()  # frees the tree's slots: eager compaction moves live slots down
    engine.check_invariants()
    assert engine.pool.has_pending_moves() == (not after)
    drain(engine)
    assert [r.out_tokens for r in reqs] == [c.tokens for c in clean]
    assert engine.stats()["resets"] == (1 if after else 0)
    engine.check_invariants()


# --------------------------------------------------------- 3, 9. validation at the door


@pytest.mark.parametrize("kw, match", [
    (dict(stop_token_ids=5), "stop_token_ids must be a sequence"), (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(max_new_tokens=None), "max_new_tokens"), (dict(temperature=float("nan")), "temperature"),
    (dict(seed=None), "seed"), (dict(top_p=0.0), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(stop_at_eos="yes"), "stop_at_eos"), (dict(stop_token_ids=(1.5,)), "stop_token_ids"),
])
def test_bad_sampling_params_are_refused_at_once(kw, match):
    with pytest.raises(ValueError, match=match):
        ik.SamplingParams(**kw)


@pytest.mark.parametrize("kw, match", [
    (dict(max_running=2.5), "max_running"), (dict(max_context=-5), "max_context"), (dict(num_slots="4"), "num_slots"),
    (dict(page_size=True), "page_size"), (dict(use_pallas="yes"), "use_pallas"), (dict(prefix_cache=1), "prefix_cache"),
    (dict(spec_steps=-1), "spec_steps"), (dict(pool="shared"), "pool"), (dict(track_interval=6), "track_interval"),
])
def test_bad_engine_config_is_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        ik.EngineConfig(**{**ENGINE_KW, **kw})


@pytest.mark.parametrize("prompts, match", [
    ([[1, 2.0]], "token ids must be ints"), ([[1, True]], "token ids must be ints"), (["hello"], "prompt 0 must be"),
    ([1, 2, 3], "prompt 0 must be"), ("hello", "prompts must be a list"), ([np.array([1.0, 2.0])], "integer array"),
    ([[1, 2]] * 3 + [[]], "prompt 3 is empty"),
])
def test_bad_prompts_change_nothing(trunk_params, prompts, match):
    engine = make_engine(trunk_params)
    before = engine.stats()
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts, GREEDY)
    assert engine.stats() == before and not engine.waiting
    assert engine.generate([np.array([5, 6, 7], np.int64)], GREEDY)[0].finish_reason == "length"  # numpy ints: fine
    engine.check_invariants()


def test_params_of_another_config_are_refused(trunk_params):
    other = ik.init_params(ik.InklingConfig.tiny(num_mtp_layers=0, mtp_local_layer_ids=(), hidden_size=32),
                           jax.random.key(0))
    with pytest.raises(ValueError, match="params do not fit the config"):
        ik.Engine(TRUNK, other, ik.EngineConfig(**ENGINE_KW))


# ------------------------------------------------------------ 4. sessions admitted


def test_sessions_count_in_admission(trunk_params):
    """Idle sessions hold their state: a request that cannot fit beside it is refused at
    submit with the reason; so is one that would stop fitting while it waits (a running turn
    counts at what its session keeps afterwards), instead of being queued and given up later;
    the session's turns run on; closing the session makes room again."""
    engine = make_engine(trunk_params, pool="static", num_slots=5)  # eager: a request needs 3 slots
    sid = engine.open_session()
    engine.generate([prompts_from(5, (6,))[0]], GREEDY, session=sid)  # the session keeps 3 slots
    with pytest.raises(ValueError, match=r"can never be admitted: it needs 3 slots .* sessions hold 3 slots"):
        engine.submit([[5, 6, 7]], GREEDY)
    engine.check_invariants()
    turn = engine.submit([prompts_from(6, (4,))[0]], GREEDY, session=sid)[0]
    engine.step()  # the turn runs: its 3 slots are not the session's yet, but will be
    with pytest.raises(ValueError, match=r"can never be admitted: it needs 3 slots .* sessions hold 3 slots"):
        engine.submit([[8, 9, 10]], GREEDY)
    while turn.finish_reason is None:
        engine.step()
    assert not engine.waiting
    engine.generate([[1, 2, 3]], GREEDY, session=sid)
    engine.close_session(sid)
    assert engine.generate([[5, 6, 7]], GREEDY)[0].finish_reason == "length"
    engine.check_invariants()


# -------------------------------------------------------- 5. eviction at idle


def test_invariants_hold_at_idle_after_eviction(trunk_params):
    """Eviction under pressure leaves no dead leaf (a node without checkpoint or children)."""
    engine = make_engine(trunk_params, num_slots=8, num_pages=30)
    for seed in range(6):
        engine.generate(prompts_from(10 + seed, (23, 17)), GREEDY)
        engine.check_invariants()
    assert engine.stats()["evicted_slots"] > 0
    for node in engine.tree._nodes():
        assert node is engine.tree.root or node.children or node.checkpoint is not None


# ------------------------------------------------- 6, 7. speculative decoding

SPEC_CFG = ik.InklingConfig.tiny(num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,), num_mtp_layers=3,
                                 mtp_local_layer_ids=(1,))


@pytest.fixture(scope="module")
def spec_params():
    return ik.init_params(SPEC_CFG, jax.random.key(1), std=0.1)


class OracleDrafts(ik.Engine):
    """Verify steps check the true continuation: many drafts are accepted per round."""

    truth: dict = {}

    def drafts_for(self, r):
        full = self.truth[tuple(r.tokens[:r.prompt_len])]
        nxt = list(full[r.committed + 1:r.committed + 1 + self.config.spec_steps])
        return nxt + [3] * (self.config.spec_steps - len(nxt))


def test_many_stop_ids_with_speculation(spec_params):
    """A stop token accepted among the drafts ends the turn there, however many stop ids
    there are (up to the engine's max_stop_ids; more are refused at submit), and the
    session's next turn continues from exactly what the caller saw."""
    kw = {**ENGINE_KW, "spec_steps": 3}
    plain = ik.Engine(SPEC_CFG, spec_params, ik.EngineConfig(**{**kw, "spec_steps": 0, "prefix_cache": False}))
    prompt, nxt = prompts_from(20, (9, 5))
    free = plain.generate([prompt], ik.SamplingParams(max_new_tokens=14, stop_at_eos=False))[0].tokens
    stop = free[6]
    stops = tuple(range(240, 245)) + (stop,)  # 6 stop ids + eos: past the old batch width of 4
    engine = OracleDrafts(SPEC_CFG, spec_params, ik.EngineConfig(**kw))
    OracleDrafts.truth = {tuple(prompt): prompt + free}
    sid = engine.open_session()
    sp = ik.SamplingParams(max_new_tokens=14, stop_token_ids=stops)
    out = engine.generate([prompt], sp, session=sid)[0]
    assert out.tokens == free[:free.index(stop) + 1] and out.finish_reason == "stop"
    assert engine.stats()["mean_accept_length"] > 2
    OracleDrafts.truth = {}
    engine.drafts_for = lambda r: list(r.drafts)
    second = engine.generate([nxt], GREEDY, session=sid)[0]
    assert second.tokens == plain.generate([prompt + out.tokens + nxt], GREEDY)[0].tokens
    with pytest.raises(ValueError, match="exceed the engine's max_stop_ids"):
        engine.submit([prompt], ik.SamplingParams(stop_token_ids=tuple(range(10, 18))))


def test_seeded_speculative_sampling_does_not_depend_on_the_batch(spec_params):
    """With speculative decoding a seeded sampled request draws the same tokens alone and
    batched with a long prefill (decoding rows never ride in extend steps)."""
    kw = {**ENGINE_KW, "spec_steps": 2}
    sp = ik.SamplingParams(max_new_tokens=12, temperature=1.3, seed=5, stop_at_eos=False)
    prompt, long = prompts_from(21, (7, 40))
    alone = ik.Engine(SPEC_CFG, spec_params, ik.EngineConfig(**kw)).generate([prompt], sp)[0]
    engine = ik.Engine(SPEC_CFG, spec_params, ik.EngineConfig(**kw))
    req = engine.submit([prompt], sp)[0]
    engine.step()
    engine.step()
    engine.submit([long], ik.SamplingParams(max_new_tokens=4, stop_at_eos=False))
    drain(engine)
    assert req.out_tokens == alone.tokens


# ---------------------------------------------------------------- 10. threads


def test_two_threads_share_one_engine(trunk_params):
    engine = make_engine(trunk_params)
    prompts = prompts_from(30, (13, 8, 19, 5))
    clean = make_engine(trunk_params, prefix_cache=False).generate(prompts, GREEDY)
    results, errors = {}, []

    def worker(i):
        try:
            results[i] = engine.generate(prompts[2 * i:2 * i + 2], GREEDY)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [c.tokens for c in results[0] + results[1]] == [c.tokens for c in clean]
    engine.check_invariants()


# -------------------------------------------------------------------- the soak


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_fault_injection_soak(trunk_params, overlap):
    """Random schedules with exceptions injected at output reads, compaction copies and
    allocations: invariants after every operation, every completed greedy output equal to a
    cache-off engine's, every aborted one a prefix of it. `overlap`: 4-step decode dispatches,
    each dispatched before the previous one is read (`EngineConfig.overlap`)."""
    ops = int(os.environ.get("INKLING_SOAK_OPS", "250"))
    kw = dict(decode_steps=4, overlap=True) if overlap else {}
    figures = run_soak(TRUNK, trunk_params, {**ENGINE_KW, "num_slots": 10, "num_pages": 40, **kw}, ops, seed=0,
                       max_new_tokens=24 if overlap else 7)
    assert figures["completed"] > 10 and figures["raised"] > 3
    assert (figures["overlapped dispatches"] > 10) == overlap, figures
    assert sum(v for k, v in figures.items() if k.startswith("faults:")) > 3


# ------------------------------------------------------------------- chaos


@pytest.mark.parametrize("mode", list(CHAOS_MODES))
def test_chaos_interrupts(trunk_params, spec_params, mode):
    """Real Ctrl-C (SIGINT from a timer thread to the main thread) at random moments inside
    about half the steps of a random schedule (shared prefixes, session turns and closes,
    aborts, evictions, compactions) with the prefix cache and speculative decoding or
    multi-step decode with overlap: the invariants hold after every operation and every greedy
    output is the model's teacher-forced argmax (an aborted one a prefix of it). The engines
    are those of the tests above (the same compiled steps): the speculative one of
    `test_seeded_speculative_sampling_does_not_depend_on_the_batch`, the overlap soak's."""
    ops = int(os.environ.get("INKLING_CHAOS_OPS", "300"))
    if mode == "spec":
        cfg, params, kw = SPEC_CFG, spec_params, {**ENGINE_KW, **CHAOS_MODES[mode]}
    else:
        cfg, params, kw = TRUNK, trunk_params, {**ENGINE_KW, "num_slots": 10, "num_pages": 40, **CHAOS_MODES[mode]}
    figures = run_chaos(cfg, params, kw, ops, seed=1)
    print(f"chaos {mode}:", figures)
    assert figures["interrupted steps"] >= ops // 15 and figures["completed"] >= 20, figures
    assert figures["verify steps" if mode == "spec" else "overlapped dispatches"] > 0, figures


def test_ctrl_c_right_after_an_allocation(trunk_params):
    """A real SIGINT raised the moment a slot or page allocation returns (inside admission,
    page growth and checkpoint planning: the host's windows between taking a resource and
    recording its owner): the interrupt waits for the section to end, so every allocation has
    an owner (the invariants hold after each interrupted step) and the outputs are exact."""
    import signal

    engine = make_engine(trunk_params, num_slots=10, num_pages=40)
    armed = {"n": 0}
    for name in ("alloc_slot", "alloc_page"):
        real = getattr(engine.pool, name)

        def alloc(real=real):
            got = real()
            if armed["n"] > 0:
                armed["n"] -= 1
                signal.raise_signal(signal.SIGINT)
            return got
        setattr(engine.pool, name, alloc)
    prompts = prompts_from(40, (21, 9, 30, 14, 25))
    reqs = engine.submit(prompts[:3], GREEDY)
    sid = engine.open_session()
    turns = [engine.submit([prompts[3]], GREEDY, session=sid)[0]]
    interrupted = 0
    while engine.running or engine.waiting:
        armed["n"] = 1
        try:
            engine.step()
        except KeyboardInterrupt:
            interrupted += 1
        engine.check_invariants()
        if turns[-1].finish_reason is not None and len(turns) == 1:
            turns.append(engine.submit([prompts[4]], GREEDY, session=sid)[0])
    armed["n"] = 0
    assert interrupted >= 5
    clean = make_engine(trunk_params, prefix_cache=False)
    assert [r.out_tokens for r in reqs] == [c.tokens for c in clean.generate(prompts[:3], GREEDY)]
    history = prompts[3] + turns[0].out_tokens + prompts[4]
    assert turns[1].out_tokens == clean.generate([history], GREEDY)[0].tokens
    engine.close_session(sid)
    engine.check_invariants()

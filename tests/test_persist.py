"""Sessions and the prefix cache survive a restart (issue 35, item 3): `Engine.save` /
`Engine.restore` against a run without the restart, bad saves refused with nothing changed,
and a save process killed (SIGKILL) in the middle of a save leaving the previous save
loadable (a subprocess over the fake runner: no XLA program in the child)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import inkling_jax as ik
from conftest import ENGINE_KW, TRUNK
from inkling_jax.engine import persist
from inkling_jax.engine.fake_runner import FakeRunner, fake_generate, fake_params

CFG = TRUNK  # every kind of state, few compiles (conftest)
SP = ik.SamplingParams(max_new_tokens=5, stop_at_eos=False)
VOCAB = CFG.unpadded_vocab_size


def toks(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.RandomState(seed).randint(3, VOCAB, n)]


SYSTEM = toks(0, 19)


@pytest.fixture(scope="module")
def params():
    return ik.init_params(CFG, jax.random.key(0), std=0.1)


TURNS = ([11, 12], [13])  # each session's next turn
PROMPTS = (SYSTEM + [5, 6, 1], SYSTEM + [7, 8], SYSTEM[:10])  # hits at 16, 16 and none


def warm(engine) -> dict:
    """Two sessions (one with a history of two turns, one of one) and a warm prefix cache;
    returns {session id: its history}."""
    engine.generate([SYSTEM + [5, 6], SYSTEM + [7]], SP)
    s1, s2 = engine.open_session(), engine.open_session()
    engine.generate([SYSTEM + [9, 9, 9]], SP, session=s1)
    engine.generate([toks(1, 13)], SP, session=s2)
    engine.generate([[4, 5, 6]], SP, session=s1)
    return {sid: list(engine.sessions[sid].tokens) for sid in (s1, s2)}


def go_on(engine, histories) -> tuple[list, list]:
    """Each session's next turn, then PROMPTS (their prefix-cache hits)."""
    turns = [engine.generate([turn], SP, session=sid)[0] for sid, turn in zip(histories, TURNS)]
    return turns, [engine.generate([p], SP)[0] for p in PROMPTS]


@pytest.fixture(scope="module")
def saved(params, tmp_path_factory):
    """An engine with sessions and a warm cache, saved with and without the cache, and what it
    does next (the run without the restart)."""
    engine = ik.Engine(CFG, params, ik.EngineConfig(**ENGINE_KW))
    histories = warm(engine)
    paths = {k: str(tmp_path_factory.mktemp(k)) for k in ("cache", "sessions")}
    infos = {k: engine.save(paths[k], prefix_cache=k == "cache") for k in paths}
    engine.check_invariants()
    return histories, paths, infos, go_on(engine, histories)


@pytest.mark.parametrize("kind", ["cache", "static-pool", "sessions-only"])
def test_turns_after_a_restore_equal_the_turns_without(params, saved, kind):
    """A restored engine continues every session exactly as the saved engine does (tokens and
    log-probs) and keeps the session ids; with the cache saved it gives the same hits, also
    in another kind of pool (the saved objects are compacted to a canonical order, then
    allocated anew); saved without the
    cache, only the entries the sessions lock come back (the later prompts hit less, their
    tokens are the same)."""
    histories, paths, infos, (want_turns, want_hits) = saved
    info = infos["sessions" if kind == "sessions-only" else "cache"]
    assert info["sessions"] == 2 and info["slots"] > 0 and info["pages"] > 0 and info["bytes"] > 0
    # a static pool (identity tables: the objects land elsewhere; the same arena size, so the
    # same compiled steps)
    config = ik.EngineConfig(**{**ENGINE_KW, "pool": "static"}) if kind == "static-pool" else None
    restored = ik.Engine.restore(paths["sessions" if kind == "sessions-only" else "cache"], CFG, params, config)
    restored.check_invariants()
    assert {sid: s.tokens for sid, s in restored.sessions.items()} == histories
    assert (restored.pool.live_count("slot"), restored.pool.live_count("page")) == (info["slots"], info["pages"])
    turns, hits = go_on(restored, histories)
    for got, want in zip(turns + hits, want_turns + want_hits):
        assert got.tokens == want.tokens
        np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0, atol=1e-6)
    for got, want in zip(turns, want_turns):
        assert got.cached_tokens == want.cached_tokens
    if kind == "sessions-only":
        assert infos["sessions"]["slots"] < infos["cache"]["slots"]
        assert infos["sessions"]["pages"] < infos["cache"]["pages"]
    else:
        assert [c.cached_tokens for c in hits] == [c.cached_tokens for c in want_hits] == [16, 16, 8]
    assert restored.open_session() == max(histories) + 1
    restored.check_invariants()


# ------------------------------------------------------------------ bad saves


def fingerprint(engine) -> tuple:
    """What a failed restore must leave as it was."""
    return (engine.stats(), {sid: list(s.tokens) for sid, s in engine.sessions.items()},
            [r.rid for r in engine.waiting], sorted(engine.tree.owned()[0]), np.asarray(engine.state.arena).sum())


def test_bad_saves_are_clear_errors_and_change_nothing(params, saved, tmp_path):
    """A missing or partial save, another model's (config or params), one of another layout
    or another engine setting it depends on, into an engine that is not idle or whose pool is
    too small: ValueError naming it, and the engine (here one with a session and a queued
    request) is exactly as before and still serves exactly."""
    _, paths, _, _ = saved
    busy = ik.Engine(CFG, params, ik.EngineConfig(**ENGINE_KW))
    sid = busy.open_session()
    first = busy.generate([toks(5, 9)], SP, session=sid)[0]
    queued = busy.submit([SYSTEM + [3]], SP)[0]

    def copy(name):
        dst = str(tmp_path / name)
        shutil.copytree(paths["cache"], dst)
        return dst

    latest = lambda p: os.path.join(p, open(os.path.join(p, "LATEST")).read())  # noqa: E731
    gone = copy("gone")
    shutil.rmtree(latest(gone))
    torn = copy("torn")
    with open(os.path.join(latest(torn), "state.json"), "w") as f:
        f.write('{"format": 1, "model"')
    no_arrays = copy("no_arrays")
    shutil.rmtree(os.path.join(latest(no_arrays), "arrays"))
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    other_params = str(tmp_path / "other_params")
    ik.Engine(CFG, ik.init_params(CFG, jax.random.key(1), std=0.1), ik.EngineConfig(**ENGINE_KW)).save(other_params)
    small = CFG.replace(hidden_size=32)
    other_model = str(tmp_path / "other_model")
    ik.Engine(small, ik.init_params(small, jax.random.key(0)), ik.EngineConfig(**ENGINE_KW)).save(other_model)
    other_layout = str(tmp_path / "other_layout")
    ik.Engine(CFG, params, ik.EngineConfig(**{**ENGINE_KW, "page_size": 8, "track_interval": 16})).save(other_layout)
    lazy = str(tmp_path / "lazy")
    ik.Engine(CFG, params, ik.EngineConfig(**{**ENGINE_KW, "ping_pong": "lazy"})).save(lazy)
    cases = [(str(tmp_path / "missing"), "no such directory"), (empty, "no complete engine save"),
             (gone, "not a complete save"), (torn, "state.json is unreadable"),
             (no_arrays, "arrays is missing or damaged"), (other_params, "another model's save: .*params differ"),
             (other_model, r"another model's save: the config differs in hidden_size \(saved 32, here 64\)"),
             (other_layout, "another layout: unit_elems .*page_size is 8 there, 4 here"),
             (lazy, "EngineConfig.ping_pong is 'lazy' in the save, 'eager' here"),
             (paths["cache"], "the engine is not idle")]
    before = fingerprint(busy)
    for path, match in cases:
        with pytest.raises(ValueError, match=match):
            busy.load(path)
        assert fingerprint(busy) == before, path
        busy.check_invariants()
    tiny_pool = ik.Engine(CFG, params, ik.EngineConfig(**{**ENGINE_KW, "num_slots": 4, "num_pages": 8}))
    with pytest.raises(ValueError, match="cannot hold them"):
        tiny_pool.load(paths["cache"])
    tiny_pool.check_invariants()
    assert not tiny_pool.sessions and tiny_pool.pool.live_count("slot") == 0
    while queued.finish_reason is None:
        busy.step()
    clean = ik.Engine(CFG, params, ik.EngineConfig(**{**ENGINE_KW, "prefix_cache": False}))
    assert queued.out_tokens == clean.generate([SYSTEM + [3]], SP)[0].tokens
    turn = busy.generate([[7, 7]], SP, session=sid)[0]
    assert turn.tokens == clean.generate([toks(5, 9) + first.tokens + [7, 7]], SP)[0].tokens
    with pytest.raises(ValueError, match="is not a directory"):
        busy.save(os.path.join(latest(paths["cache"]), "state.json"))


# ------------------------------------------------------------ killed saves

CHILD = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    import inkling_jax as ik
    from inkling_jax.engine import persist
    from inkling_jax.engine.fake_runner import FakeRunner, fake_params

    class FakeEngine(ik.Engine):
        runner_cls = FakeRunner

    path, plan = sys.argv[1], sys.argv[2]
    cfg = ik.InklingConfig.tiny()
    engine = FakeEngine(cfg, fake_params(cfg), ik.EngineConfig(**KW))
    sp = ik.SamplingParams(max_new_tokens=4, stop_at_eos=False)
    rng = np.random.RandomState(0)
    system = [int(t) for t in rng.randint(3, 250, 17)]
    engine.generate([system + [5], system + [6, 7]], sp)
    sids = [engine.open_session() for _ in range(2)]
    for sid in sids:
        engine.generate([system + [int(t) for t in rng.randint(3, 250, 5)]], sp, session=sid)
    engine.save(path)
    print("saved 1", flush=True)
    if plan == "pointer":  # killed with the new save complete, before LATEST names it
        write = persist._write_file
        def killing(target, data, atomic=False):
            if atomic:
                with open(target + ".tmp-" + str(os.getpid()), "wb") as f:
                    f.write(data)
                os.kill(os.getpid(), signal.SIGKILL)
            write(target, data, atomic)
        persist._write_file = killing
    i = 1
    while True:  # plan "random": the parent kills this loop at a random moment
        engine.generate([[int(t) for t in rng.randint(3, 250, 3)]], sp, session=sids[i % 2])
        i += 1
        engine.save(path)
        print("saved", i, flush=True)
""")


class FakeEngine(ik.Engine):
    runner_cls = FakeRunner


FAKE_KW = dict(max_running=2, num_slots=16, num_pages=64, page_size=4, track_interval=8, chunk_size=8,
               max_step_tokens=16, min_context_bucket=64)


def test_a_save_killed_midway_leaves_the_previous_one(tmp_path):
    """A process killed (SIGKILL) while it saves, once right before the new save is named in
    LATEST and once at a random moment of a loop of turns and saves: a fresh process restores
    a complete save (the previous one in the first case), whose sessions continue exactly as
    plain decoding of their histories (the fake runner checks every state it reads), and the
    next save there removes the debris."""
    script = tmp_path / "child.py"
    script.write_text(CHILD.replace("**KW", "**" + repr(FAKE_KW)))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=repo)
    runs = {}
    for plan in ("pointer", "random"):
        path = str(tmp_path / plan)
        runs[plan] = (path, subprocess.Popen([sys.executable, str(script), path, plan], stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True, env=env, cwd=repo))
    rng = np.random.default_rng()
    for plan, (path, child) in runs.items():
        if plan == "random":
            assert child.stdout.readline().strip() == "saved 1", child.stderr.read()[-3000:]
            import time

            time.sleep(float(rng.uniform(0.0, 0.4)))
            child.send_signal(signal.SIGKILL)
        child.wait(timeout=120)
        assert child.returncode == -signal.SIGKILL, child.stderr.read()[-3000:]
        out = child.stdout.read()
        cfg = ik.InklingConfig.tiny()
        engine = FakeEngine.restore(path, cfg, fake_params(cfg))
        engine.check_invariants()
        if plan == "pointer":
            assert "saved 2" not in out and any(n.startswith(".save-") or n.startswith("save-000002")
                                                for n in os.listdir(path))
            assert open(os.path.join(path, "LATEST")).read() == "save-000001"
        assert len(engine.sessions) == 2
        for sid, sess in engine.sessions.items():
            history = list(sess.tokens)
            got = engine.generate([[9, 8, 7]], ik.SamplingParams(max_new_tokens=4, stop_at_eos=False), session=sid)[0]
            assert got.tokens == fake_generate(history + [9, 8, 7], 4, vocab=cfg.unpadded_vocab_size)[0]
        engine.check_invariants()
        info = engine.save(path)
        assert sorted(os.listdir(path)) == ["LATEST", os.path.basename(info["path"])]


# ------------------------------------------------------------------ the CLI


def test_cli_session_dir_keeps_a_chat_across_runs(capsys, tmp_path):
    """`inkling-generate --session-dir DIR`: a second run continues the first run's session from
    its save: the history saved after both is the two prompts each followed by the model's
    greedy continuation (teacher-forced argmax of the reference forward), printed as each
    run's completion; a run with another layout flag is a one-line error, the save unchanged."""
    from conftest import reference_logprobs
    from inkling_jax import cli

    chat = str(tmp_path / "chat")
    flags = ["--model", "tiny", "--max-new-tokens", "4", "--ignore-eos", "--no-progress", "--no-warmup",
             "--session-dir", chat]
    texts = ("To be, or", " not to be")
    outs = []
    for text in texts:
        assert cli.main(["--prompt", text, *flags]) == 0
        outs.append(capsys.readouterr().out)
    assert "new (it is saved to" in outs[0] and "restored from" in outs[1]
    cfg, params = cli.load_model("tiny")
    tok = cli.ByteTokenizer(cfg)
    _, state = persist.read_state(chat)
    history = state["sessions"][0]["tokens"]
    p1, p2 = (tok.encode(t) for t in texts)
    o1 = history[len(p1):len(p1) + 4]
    o2 = history[len(p1) + 4 + len(p2):]
    assert history == p1 + o1 + p2 + o2 and len(o2) == 4
    for prompt, out, printed in ((p1, o1, outs[0]), (p1 + o1 + p2, o2, outs[1])):
        assert list(reference_logprobs(params, cfg, prompt, out)[1]) == out
        assert f"    -> {tok.decode(out)!r}" in printed
    assert cli.main(["--prompt", "x", *flags, "--page-size", "8"]) == 2
    assert "a save from another layout" in capsys.readouterr().err
    assert persist.read_state(chat)[1]["sessions"][0]["tokens"] == history


def test_a_turn_in_flight_is_saved_as_its_history(tmp_path):
    """A session whose turn is running when the engine saves is saved as its history before the
    turn (the turn is not saved); after a restore the same turn gives what the saving engine's
    turn gives (fake runner: its checks catch any state that does not match the history)."""
    cfg = ik.InklingConfig.tiny()
    engine = FakeEngine(cfg, fake_params(cfg), ik.EngineConfig(**FAKE_KW))
    sp = ik.SamplingParams(max_new_tokens=6, stop_at_eos=False)
    sid = engine.open_session()
    engine.generate([toks(7, 11)], sp, session=sid)
    history = list(engine.sessions[sid].tokens)
    turn = engine.submit([[8, 9]], sp, session=sid)[0]
    engine.step()
    assert turn in engine.running
    engine.save(str(tmp_path))
    engine.check_invariants()
    restored = FakeEngine.restore(str(tmp_path), cfg, fake_params(cfg))
    assert restored.sessions[sid].tokens == history and restored.sessions[sid].held is None
    got = restored.generate([[8, 9]], sp, session=sid)[0]
    while turn.finish_reason is None:
        engine.step()
    assert got.tokens == turn.out_tokens == fake_generate(history + [8, 9], 6, vocab=cfg.unpadded_vocab_size)[0]
    restored.check_invariants()

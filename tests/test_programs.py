"""Compiled programs (`inkling_jax/programs.py`): an engine's programs go with it (and with
the process-wide table's bound), a dropped engine's are reused while cached, and the
executable cache on disk loads programs in later processes, refusing every entry it cannot
trust."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import inkling_jax as ik
from inkling_jax import cli, programs
from inkling_jax.compile_cache import EXECUTABLE_CACHE_ENV, ExecutableCacheWarning, ExecutableStore

import cpu_flags
from conftest import TRUNK, TWO_LAYER, assert_same_completions, count_xla_compiles, make_engine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7]]
SAMPLING = ik.SamplingParams(max_new_tokens=3, stop_at_eos=False)
SMALL = TRUNK  # two layers (one sliding, one full): programs that compile in about a second


@pytest.fixture(scope="module")
def small_params():
    return ik.init_params(SMALL, jax.random.key(1), std=0.1)


def small_engine(params, **kw):
    return make_engine(params, SMALL, **kw)


def mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def tokens(completions) -> list[list[int]]:
    return [c.tokens for c in completions]


@pytest.fixture(autouse=True)
def _empty_table():
    """Each test starts from an empty program table (a program in memory is never looked up
    on disk)."""
    ik.clear_program_cache()


def drop_everything() -> None:
    ik.clear_program_cache()
    jax.clear_caches()
    gc.collect()


# ------------------------------------------------------------- programs in memory


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="counts the process's memory mappings")
def test_dropped_engines_free_their_programs(small_params):
    """Six engines of different arena sizes (so different programs), each generating, then
    dropped: nothing (no cycle, no global) keeps an engine or its arena alive past `del`, and
    after `clear_program_cache()` the mappings their executables held (hundreds each on the
    CPU) and the live device arrays are back where they started."""
    one_token = ik.SamplingParams(max_new_tokens=1)  # the prefill's step only
    small_engine(small_params, executable_cache=None).generate(PROMPTS, one_token)  # libraries load once
    drop_everything()
    start_maps, start_arrays = mappings(), len(jax.live_arrays())
    peak = start_maps
    gc.disable()  # a reference cycle would keep the engine until a collection: none allowed
    try:
        for i in range(6):
            engine = small_engine(small_params, num_pages=40 + 8 * i, arena_units=None, executable_cache=None)
            engine.generate(PROMPTS, one_token)
            alive, arena = weakref.ref(engine), weakref.ref(engine.runner.state.arena)
            peak = max(peak, mappings())
            del engine
            assert alive() is None and arena() is None
    finally:
        gc.enable()
    assert peak > start_maps + 1000  # the programs were mapped
    assert len(programs.TABLE) > 0  # ... and the table still holds the latest
    drop_everything()
    assert mappings() <= start_maps + 150
    assert len(jax.live_arrays()) == start_arrays


def test_dropped_engines_programs_serve_the_next_until_evicted(small_params, monkeypatch):
    """A new engine of a dropped engine's shapes compiles nothing while the table holds its
    programs (XLA's compile events), and the same tokens; after clear_program_cache() it
    compiles again; the table never holds more than its bound."""
    kw = dict(num_pages=56, executable_cache=None)
    engine = small_engine(small_params, **kw)
    want = tokens(engine.generate(PROMPTS, SAMPLING))
    del engine
    gc.collect()
    with count_xla_compiles() as compiles:
        got = tokens(small_engine(small_params, **kw).generate(PROMPTS, SAMPLING))
    assert compiles[0] == 0 and got == want
    ik.clear_program_cache()
    monkeypatch.setattr(programs.TABLE, "max_programs", 2)
    with count_xla_compiles() as compiles:
        got = tokens(small_engine(small_params, **kw).generate(PROMPTS, SAMPLING))
    assert compiles[0] > 2 and got == want
    assert len(programs.TABLE) == 2


def test_engines_of_one_arena_size_share_steps_whatever_their_budgets(small_params):
    """EngineConfig.arena_units: an engine whose slot / page budget is smaller than another's
    but whose arena has the same size runs that engine's compiled steps (none waited for:
    `compile_seconds` counts step programs only) and gives exactly what
    an engine whose arena is its budget gives: tokens, log-probs, cache hits, evictions and moves
    under pressure. An arena smaller than the budget, or not an int, is refused by name."""
    rng = np.random.RandomState(3)
    shared = list(rng.randint(3, 256, 17))
    work = [shared + list(rng.randint(3, 256, n)) for n in (9, 14, 5, 11)] + \
        [list(rng.randint(3, 256, n)) for n in (30, 26, 21)] + [shared + [7, 7]]
    sp = ik.SamplingParams(max_new_tokens=4, stop_at_eos=False)
    kw = dict(arena_units=400, executable_cache=None)
    small_engine(small_params, num_slots=16, num_pages=64, **kw).generate(work, sp)
    tight = small_engine(small_params, num_slots=10, num_pages=40, **kw)  # a 151-unit budget
    got = tight.generate(work, sp)
    assert tight.stats()["compile_seconds"] == 0  # every step from the first engine's
    exact = small_engine(small_params, num_slots=10, num_pages=40, arena_units=None, executable_cache=None)
    assert exact.state.arena.shape[0] == 151 and tight.state.arena.shape[0] == 400
    assert_same_completions(got, exact.generate(work, sp), atol=0)  # the same math: only the arena rows differ
    keys = ("evicted_slots", "evicted_pages", "compaction_moves", "skipped_checkpoints", "cache_hit_tokens")
    assert [tight.stats()[k] for k in keys] == [exact.stats()[k] for k in keys]
    assert tight.stats()["evicted_slots"] > 0 and tight.stats()["cache_hit_tokens"] > 0  # the budget pressed
    tight.check_invariants()
    with pytest.raises(ValueError, match=r"arena_units=100 is smaller than the 235 units that num_slots=16 and "
                                         r"num_pages=64 need"):
        small_engine(small_params, num_slots=16, num_pages=64, arena_units=100)
    with pytest.raises(ValueError, match="arena_units must be None or an int >= 1"):
        ik.EngineConfig(arena_units=0)


def test_a_plain_engine_runs_the_trunks_programs(small_params):
    """A plain engine (spec_steps 0) of a model with MTP depths runs the programs of the same
    model without them (`InklingConfig.trunk`: MTP fields and weights left out of its steps):
    after the trunk model's engine it compiles nothing and gives the same completions. A
    speculative engine of that model keeps its draft state (another layout)."""
    with_mtp = {**small_params, "mtp": ik.init_params(TWO_LAYER, jax.random.key(1), std=0.1)["mtp"]}
    assert TWO_LAYER.trunk() == SMALL
    trunk = small_engine(small_params)
    want = trunk.generate(PROMPTS, SAMPLING)
    with count_xla_compiles() as compiles:
        plain = make_engine(with_mtp, TWO_LAYER)
        got = plain.generate(PROMPTS, SAMPLING)
    assert compiles[0] == 0 and plain.layout == trunk.layout and plain.cfg == TWO_LAYER
    assert_same_completions(got, want, atol=0)
    assert make_engine(with_mtp, TWO_LAYER, spec_steps=1).layout.draft


def test_count_table_writes_come_from_the_table(small_params):
    """The penalties' count-table write (`StepRunner.reset_counts`) is a program of the table
    like the steps: a second engine of the same shapes serving requests with penalties
    compiles nothing, with the same tokens."""
    kw = dict(num_pages=48, executable_cache=None)
    penalised = ik.SamplingParams(max_new_tokens=4, stop_at_eos=False, repetition_penalty=1.5, presence_penalty=0.5)
    want = tokens(small_engine(small_params, **kw).generate(PROMPTS, penalised))
    gc.collect()
    with count_xla_compiles() as compiles:
        engine = small_engine(small_params, **kw)
        got = tokens(engine.generate(PROMPTS, penalised))
    assert compiles[0] == 0 and got == want
    assert engine.runner._programs["counts"]


def test_background_warmup_serves_at_once(small_params):
    """warmup(wait=False) returns before its programs are made; the first steps wait only
    for theirs; the tokens are a lazily compiled engine's."""
    want = tokens(small_engine(small_params).generate(PROMPTS, SAMPLING))
    engine = small_engine(small_params, max_context=64)
    engine.warmup(wait=False)
    assert engine.runner._pending  # asked for, not taken
    assert tokens(engine.generate(PROMPTS, SAMPLING)) == want
    engine.warmup()  # the rest: nothing is left pending, serving compiles nothing
    assert not engine.runner._pending
    with count_xla_compiles() as compiles:
        assert tokens(engine.generate(PROMPTS, SAMPLING)) == want
    assert compiles[0] == 0


def test_thread_local_settings_trace_in_the_callers_thread():
    """A program asked for in the background under a thread-local JAX setting (matmul
    precision) is traced in the caller's thread, with that setting in its key; without one,
    in the pool."""
    threads = []

    def make():
        threads.append(threading.current_thread())
        return jax.jit(lambda x: x @ x)

    x = np.ones((4, 4), np.float32)
    plain = programs.request("test_matmul", {}, make, (x,), cache=None, background=True).result()
    with jax.default_matmul_precision("highest"):
        assert programs.trace_context() != programs._pool_context()
        precise = programs.request("test_matmul", {}, make, (x,), cache=None, background=True).result()
    assert threads[0] is not threading.current_thread() and threads[1] is threading.current_thread()
    assert plain is not precise
    np.testing.assert_array_equal(np.asarray(precise(x)), 4 * x)


def test_a_program_needed_now_is_taken_out_of_the_queue():
    """With every pool worker busy, a program queued in the background and then needed
    (asked for without background) is made at once in the caller's thread, not after the
    queue."""
    release = threading.Event()

    def blocked():
        release.wait(60)
        return jax.jit(lambda x: x - 1)

    x = np.zeros(2, np.float32)
    busy = [programs.request("test_busy", {"i": i}, blocked, (x,), cache=None, background=True)
            for i in range(programs._pool()._max_workers)]
    made_in = []

    def make():
        made_in.append(threading.current_thread())
        return jax.jit(lambda x: x + 2)

    queued = programs.request("test_needed", {}, make, (x,), cache=None, background=True)
    try:
        needed = programs.get("test_needed", {}, make, (x,), cache=None)
        assert made_in == [threading.current_thread()] and queued.result(timeout=0) is needed
        assert not any(f.done() for f in busy)
    finally:
        release.set()
    assert [float(f.result(timeout=60)(x)[0]) for f in busy] == [-1.0] * len(busy)


def test_the_pool_lowers_in_the_order_asked_for(monkeypatch):
    """Background jobs lower (and so compile) in the order they were asked for, whatever the
    pool's threads do first: here the first job's disk lookup is slow, so without the order the
    second job's thread would lower first; a job whose make() fails hands the turn on.
    (Regression: make run's warm-up asks for the extend step, then decode; on 2 cores decode was
    lowered and compiled first in 3 of 4 cold runs, and the first token waited for both compiles.)"""
    real_load = programs._Job.load

    def load(job):
        if job.key.startswith("kind test_order_0"):
            time.sleep(0.3)
        return real_load(job)

    monkeypatch.setattr(programs._Job, "load", load)
    lowered = []

    def maker(i):
        def make():
            lowered.append(i)
            if i == 1:
                raise RuntimeError("make failed")
            return jax.jit(lambda x: x + i)
        return make

    x = np.zeros(2, np.float32)
    futures = [programs.request(f"test_order_{i}", {}, maker(i), (x,), cache=None, background=True) for i in range(3)]
    with pytest.raises(RuntimeError, match="make failed"):
        futures[1].result(timeout=60)
    assert [float(futures[i].result(timeout=60)(x)[0]) for i in (0, 2)] == [0.0, 2.0]
    assert lowered == [0, 1, 2]


def test_a_patched_library_global_gets_its_own_program(monkeypatch, tmp_path):
    """A global of a traced module rebound after import (a test's spy, a benchmark's constant)
    is in the key: the spy is traced although the program is cached, and the patched program
    is not stored on disk; undone, the cached program serves again."""
    from inkling_jax.model import layers

    w = jnp.ones(8, jnp.float32)  # (rms_norm takes a jax Array: the run-time checks hold it to that)
    make = lambda: jax.jit(lambda x: layers.rms_norm(x, w, 1e-6))
    args = (np.ones((2, 8), np.float32),)
    cached = programs.get("test_norm", {}, make, args, cache=str(tmp_path))
    traced = []
    real = layers.rms_norm
    monkeypatch.setattr(layers, "rms_norm", lambda *a: traced.append(1) or real(*a))
    assert "inkling_jax.model.layers.rms_norm" in programs.patches()
    spied = programs.get("test_norm", {}, make, args, cache=str(tmp_path))
    assert traced and spied is not cached
    assert len(ExecutableStore(str(tmp_path)).entries()) == 1
    monkeypatch.undo()
    assert programs.patches() == ""
    with count_xla_compiles() as compiles:
        assert programs.get("test_norm", {}, make, args, cache=str(tmp_path)) is cached
    assert compiles[0] == 0


# --------------------------------------------------------------- programs on disk


def add_one(path, n: int = 3):
    """A small program stored under `path`: x + 1 for float32[n]."""
    return programs.get("test_add_one", {"n": n}, lambda: jax.jit(lambda x: x + 1), (np.zeros(n, np.float32),),
                        cache=str(path))


def test_stored_program_loads_without_compiling(tmp_path):
    add_one(tmp_path)
    (entry,) = ExecutableStore(str(tmp_path)).entries()
    ik.clear_program_cache()
    before = programs.program_stats()
    with count_xla_compiles() as compiles:
        fn = add_one(tmp_path)
    assert compiles[0] == 0 and programs.program_stats()["loaded"] == before["loaded"] + 1
    np.testing.assert_array_equal(np.asarray(fn(np.arange(3, dtype=np.float32))), [1, 2, 3])
    assert ExecutableStore(str(tmp_path)).entries()[0][2] >= entry[2]  # the read touched it


def _damage(path, how: str, monkeypatch) -> str:
    """Damage the entry of add_one(n=3) `how`; the warning it must raise."""
    store = ExecutableStore(str(path))
    add_one(path)
    (entry, size, _), = store.entries()
    data = open(entry, "rb").read()
    if how == "corrupt":
        open(entry, "wb").write(data[:-1] + bytes([data[-1] ^ 0xFF]))
        return "corrupt"
    if how == "truncated":
        open(entry, "wb").write(data[:size // 2])
        return "truncated"
    if how == "garbage":
        open(entry, "wb").write(b"\x00" * 100)
        return "bad magic"
    if how == "format":
        header_end = data.index(b"\n", len(store.MAGIC))
        header = json.loads(data[len(store.MAGIC):header_end])
        header["format"] = store.FORMAT + 1
        open(entry, "wb").write(store.MAGIC + json.dumps(header).encode() + data[header_end:])
        return "format"
    os.remove(entry)
    if how == "foreign":  # another program's entry renamed into place
        add_one(path, n=4)
        match = "written for another program"
    else:  # "version": written by another jax, renamed into place
        env = programs.environment()
        monkeypatch.setattr(programs, "_ENVIRONMENT", [env[0].replace(f"jax={jax.__version__}", "jax=0.0.1")] + env[1:])
        ik.clear_program_cache()
        add_one(path)
        monkeypatch.undo()
        match = "jax=0.0.1"
    (other, _, _), = store.entries()
    os.replace(other, entry)
    return match


@pytest.mark.parametrize("how", ["corrupt", "truncated", "garbage", "format", "foreign", "version"])
def test_bad_entries_are_compiled_afresh(tmp_path, monkeypatch, how):
    match = _damage(tmp_path, how, monkeypatch)
    ik.clear_program_cache()
    with pytest.warns(ExecutableCacheWarning, match=match), count_xla_compiles() as compiles:
        fn = add_one(tmp_path)
    assert compiles[0] == 1
    np.testing.assert_array_equal(np.asarray(fn(np.zeros(3, np.float32))), [1, 1, 1])
    ik.clear_program_cache()  # rewritten: loads cleanly now
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with count_xla_compiles() as compiles:
            add_one(tmp_path)
    assert compiles[0] == 0


def test_store_keeps_the_most_recently_used_within_its_cap(tmp_path):
    store = ExecutableStore(str(tmp_path))
    store.write("a", bytes(900))
    (_, size, _), = store.entries()
    store.max_bytes = 3 * size  # room for three entries
    for i, key in enumerate("abc"):
        store.write(key, bytes(900))
        os.utime(store.entry_path(key), (1000 + i, 1000 + i))  # a, b, c: oldest first
    assert store.read("a") == bytes(900)  # touched: now the most recent
    store.write("d", bytes(900))  # over the cap: the least recently used (b) goes
    assert [os.path.exists(store.entry_path(k)) for k in "abcd"] == [True, False, True, True]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
    assert ik.clear_executable_cache(str(tmp_path)) == 3 and store.entries() == []


def test_cli_clears_the_cache(tmp_path, monkeypatch, capsys):
    add_one(tmp_path)
    monkeypatch.setenv(EXECUTABLE_CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cli.main(["--clear-compile-cache"]) == 0
    assert f"removed 1 executable cache entries from {tmp_path}" in capsys.readouterr().out
    assert ExecutableStore(str(tmp_path)).entries() == []


FILL = """
import sys
import jax, numpy as np
from inkling_jax import programs
for n in range(1, 13):
    f = programs.get("test_add_one", {"n": n}, lambda: jax.jit(lambda x: x + 1), (np.zeros(n, np.float32),),
                     cache=sys.argv[1])
    assert float(f(np.zeros(n, np.float32))[0]) == 1.0
"""


def test_two_processes_fill_one_cache_at_once(tmp_path):
    """Two processes writing the same entries at the same time: both finish, and every entry
    is whole (loads without a warning or a compile)."""
    env = dict(os.environ, PYTHONPATH=REPO)
    runs = [subprocess.Popen([sys.executable, "-c", FILL, str(tmp_path)], env=env, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    for run in runs:
        assert run.wait(timeout=300) == 0, run.stderr.read()
    assert len(ExecutableStore(str(tmp_path)).entries()) == 12
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
    ik.clear_program_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with count_xla_compiles() as compiles:
            for n in range(1, 13):
                np.testing.assert_array_equal(np.asarray(add_one(tmp_path, n)(np.zeros(n, np.float32))), np.ones(n))
    assert compiles[0] == 0


ON_FOUR = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from inkling_jax import programs
zeros = programs.get("test_zeros", {}, lambda: jax.jit(lambda: jnp.zeros(3)), cache=sys.argv[1])
assert zeros().sharding.device_set == {jax.devices()[0]}
mesh = jax.make_mesh((4,), ("x",))
arg = jax.ShapeDtypeStruct((4, 2), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("x")))
double = programs.get("test_double", {}, lambda: jax.jit(lambda a: 2 * a), (arg,), cache=sys.argv[1])
out = double(jax.device_put(np.ones((4, 2), np.float32), arg.sharding))
assert out.sharding.device_set == set(jax.devices()) and float(out.sum()) == 16.0
print(programs.program_stats()["loaded"])
"""


def test_programs_load_onto_their_own_devices(tmp_path):
    """On a host of four devices, a program without arguments (one device) and one over all
    four are stored, then loaded by a second process onto the same devices each."""
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu",
               XLA_FLAGS=cpu_flags.with_devices(4))
    loaded = []
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", ON_FOUR, str(tmp_path)], env=env, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        loaded.append(int(run.stdout.split()[-1]))
    assert loaded == [0, 2]


SERVE = """
import json
import jax
import inkling_jax as ik
key = jax.random.key(0)  # the caller's own eager op, before counting
compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, **kw: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None)
cfg = ik.InklingConfig.tiny(num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,), num_mtp_layers=0,
                            mtp_local_layer_ids=())
params = ik.init_params(cfg, key, std=0.1)
engine = ik.Engine(cfg, params, ik.EngineConfig(max_running=2, num_slots=8, num_pages=24, page_size=4,
                                                track_interval=8, chunk_size=8, max_step_tokens=16,
                                                max_context=32, min_context_bucket=32, min_batch_bucket=2,
                                                warmup=True))
out = engine.generate([[1, 2, 3, 4, 5], [6, 7]], ik.SamplingParams(max_new_tokens=5, stop_at_eos=False))
print(json.dumps(dict(compiles=len(compiles), tokens=[c.tokens for c in out], stats=ik.programs.program_stats())))
"""


def test_a_process_served_from_the_cache_compiles_nothing(tmp_path):
    """The same program run twice in fresh processes: the first compiles and stores every
    program (init's, the engine's), the second loads them all and compiles nothing (XLA's
    compile events), with the same tokens."""
    env = dict(os.environ, PYTHONPATH=REPO, **{EXECUTABLE_CACHE_ENV: str(tmp_path)})
    runs = []
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", SERVE], env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        runs.append(json.loads(run.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["compiles"] > 0 and first["stats"]["stored"] == first["stats"]["compiled"] > 0
    assert second["compiles"] == 0 and second["stats"]["compiled"] == 0
    assert second["stats"]["loaded"] == first["stats"]["stored"]
    assert second["tokens"] == first["tokens"]

"""The serving engine on a device mesh (`Engine(..., mesh=)`, `inkling_jax/parallel/serving.py`):
greedy and sampled outputs equal the single-device engine's with prefix caching, speculative
decoding and compaction on; params and arena really sharded (shardings, per-device shapes
and bytes); no XLA compile after warm-up; read_slot gives the global fields.

Tests named `test_on_mesh_*` need 8 devices. The suite's process has one (conftest starts
jax first), so `test_mesh_cases_on_8_host_devices` runs all of them, and test_mesh.py's, in
one subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8; in a process started
with 8 devices they run directly. The rest run here, on a mesh of the one device.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import inkling_jax as ik
from inkling_jax import programs
from inkling_jax.engine import runner as runner_mod
from inkling_jax.model.params import flat_params
from inkling_jax.parallel.planner import plan_memory

from conftest import (ENGINE_KW, TWO_LAYER, assert_same_completions, count_xla_compiles, echo_model, on_mesh,
                      reference_logprobs, run_on_mesh_devices)


# conftest's TWO_LAYER: full layers have 2 kv heads, sliding layers 4, 8 routed experts, vocab
# 264: it splits over tp 2 and ep 4 without repeated kv heads.
CFG = TWO_LAYER
# ENGINE_KW's pool; max_context 64 keeps one page bucket, so an engine compiles two steps
# (extend + decode, or extend + verify), shared by every engine of the same mesh. The arena is
# the pool's own size (arena_units None): ARENA_BYTES below checks the per-device accounting.
KW = dict(ENGINE_KW, max_context=64, arena_units=None)
MESHES = [(2, 4)]  # tp x ep (tp or ep alone: test_mesh.py's forward parity, the one-device mesh below)
GREEDY = ik.SamplingParams(max_new_tokens=10, stop_at_eos=False)
_rng = np.random.RandomState(7)
_SHARED = list(_rng.randint(3, 256, 13))  # a shared prefix longer than one checkpoint interval (8)
PROMPTS = [_SHARED + list(_rng.randint(3, 256, n)) for n in (3, 6, 9)] + [list(_rng.randint(3, 256, 7)), _SHARED + [5]]
# Per-device arena bytes (float32) of KW's pool (16 slots, 64 pages of 4 tokens), by (tp, spec_steps):
# units x unit elements x 4. tp 2 halves the unit (one K/V page of the local kv heads), but a
# slot keeps its replicated H-channel attn / mlp windows (and MTP hidden carries), so it
# takes more of the smaller units: the arena shrinks by less than half, the pages by exactly half.
# (1, 0): 17 slots (the sink's included) of 10 units (conv windows 3 + 3, ring 4) + 64 pages + 1;
# (2, 0): 17 slots of 13 half units (conv 5 + 4, ring 4) + 64 pages of one half unit + 1
ARENA_BYTES = {(1, 0): 235 * 256 * 4, (2, 0): 286 * 128 * 4, (1, 2): 521 * 256 * 4, (2, 2): 623 * 128 * 4}
_CACHE: dict = {}


def _params():
    if "params" not in _CACHE:
        # echo_model: MTP heads whose drafts get accepted (random heads almost never draft right)
        _CACHE["params"] = echo_model(CFG, ik.init_params(CFG, jax.random.key(0), std=0.1))
    return _CACHE["params"]


def _engine(mesh=None, **overrides):
    return ik.Engine(CFG, _params(), ik.EngineConfig(**{**KW, **overrides}), mesh=mesh)


def _single(spec: int):
    """The single-device engine's greedy completions of PROMPTS (computed once)."""
    if ("single", spec) not in _CACHE:
        engine = _engine(spec_steps=spec)
        _CACHE["single", spec] = (engine.generate(PROMPTS, GREEDY), engine.layout)
    return _CACHE["single", spec]


# assert_same_completions' log-prob tolerance (1e-5): psums add the shards' partial sums in
# another order than one device's matmul


def test_mesh_cases_on_8_host_devices():
    """The `test_on_mesh_*` tests of this file and test_mesh.py (conftest.MESH_TEST_FILES)."""
    run_on_mesh_devices()


# ------------------------------------------------------------------- one device


def test_one_device_mesh_equals_no_mesh():
    """A mesh of one device runs the shard_map path (collectives over axes of size 1) and
    gives the single-device engine's outputs; its arena is [units, 1, unit_elems]. The mesh
    engine's arena is larger than its budget (ENGINE_KW's arena_units; the reference's is the
    budget): the same outputs."""
    want, layout = _single(0)
    engine = _engine(ik.make_mesh(), arena_units=ENGINE_KW["arena_units"])
    got = engine.generate(PROMPTS, GREEDY)
    assert_same_completions(got, want, atol=1e-6)
    # the same layout (its config is the plan's local one, whose vocab slice is set apart)
    assert dataclasses.replace(engine.layout, cfg=layout.cfg) == layout
    assert engine.state.arena.shape == (ENGINE_KW["arena_units"], 1, layout.unit_elems)
    assert engine.pool.budget_units == layout.arena_units(KW["num_slots"], KW["num_pages"]) < engine.pool.num_units
    engine.check_invariants()


def test_one_device_mesh_overlapped_decode():
    """Overlapped 4-step decode dispatches on a one-device mesh (the feed of each dispatch from
    the last one's outputs) give the single-device engine's greedy tokens. (On 8 devices:
    test_on_mesh_no_compile_after_warmup's overlapped 3-step dispatches.)"""
    engine = _engine(ik.make_mesh(), decode_steps=4, overlap=True)
    got = engine.generate(PROMPTS, GREEDY)
    # the decode loop and single steps round log-probs alike up to fusion order
    assert_same_completions(got, _single(0)[0])
    assert engine.stats()["overlapped_dispatches"] > 0
    engine.check_invariants()


def test_single_device_step_traces_no_collective():
    """Without a mesh the steps trace none of the mesh hooks (parallel=None is the
    single-device program: no psum, all_gather or axis index in the lowered step)."""
    from inkling_jax.cache.state import init_state
    from inkling_jax.steps import StepBatch, StepShape, compile_step

    shape = StepShape("verify", 2, 6, 3, 4)
    engine = _engine(spec_steps=2)
    state = init_state(engine.layout, 200, 8, 16, jnp.float32)
    text = compile_step(CFG, engine.layout, shape).lower(_params(), state, StepBatch.empty(shape, 2)).as_text()
    for op in ("all_reduce", "all_gather", "partition_id", "replica_id", "sdy.manual_computation"):
        assert op not in text, op


def test_mesh_arguments_are_checked():
    with pytest.raises(ValueError, match=r"mesh must be a jax.sharding.Mesh"):
        _engine(mesh="tp=2")
    bad_axes = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    with pytest.raises(ValueError, match=r"exactly the axes \('ep', 'tp'\)"):
        _engine(bad_axes)
    with pytest.raises(ValueError, match=r"params do not fit the config"):
        ik.Engine(CFG, {k: v for k, v in _params().items() if k != "final_norm"}, ik.EngineConfig(**KW),
                  mesh=ik.make_mesh())


def test_mesh_arena_must_fit_each_device(monkeypatch):
    """The per-device arena bytes (the planner's count) are checked against each device's
    free memory before anything of that size is built."""
    mesh = ik.make_mesh()
    per_device = plan_memory(CFG, jnp.float32, ik.ShardPlan(CFG, mesh), _pool_sizes()).arena
    assert per_device == ARENA_BYTES[1, 0]
    monkeypatch.setattr(runner_mod, "available_memory", lambda device=None: per_device - 1)
    with pytest.raises(ValueError, match=r"needs 0\.00 GiB per device \(16 slots x 10 \+ 64 pages x 1 units.* "
                                         r"tp=1 x ep=1\) but .* GiB free"):
        _engine(mesh)
    monkeypatch.setattr(runner_mod, "available_memory", lambda device=None: per_device)
    _engine(mesh)  # exactly enough


def _pool_sizes(spec_steps=0):
    from inkling_jax.parallel.planner import pool_sizes

    return pool_sizes(ik.EngineConfig(**KW, spec_steps=spec_steps))


# ---------------------------------------------------------------- on 8 host devices


def _check_placement(engine, tp: int, ep: int, spec: int, single_layout) -> None:
    """Params in the plan's shardings with each device holding its local tensors; the arena
    [units, tp, unit_elems_local] sharded over tp with the bytes ARENA_BYTES says per device."""
    plan, mesh = engine.plan, engine.mesh
    shardings, local = flat_params(plan.shardings()), flat_params(plan.local_params_shape())
    for path, x in flat_params(engine.params).items():
        assert x.sharding.is_equivalent_to(shardings[path], x.ndim), path
        assert len(x.addressable_shards) == tp * ep
        for shard in x.addressable_shards:
            assert shard.data.shape == local[path], path
    # the split is real: vocab rows over tp, experts over ep, q heads' columns over tp
    assert engine.params["embed"].addressable_shards[0].data.shape == (CFG.vocab_size // tp, CFG.hidden_size)
    assert engine.params["layers"][1]["mlp"]["w13"].addressable_shards[0].data.shape[0] == CFG.n_routed_experts // ep
    device0 = mesh.devices.flat[0]
    weights = sum(s.data.nbytes for x in jax.tree_util.tree_leaves(engine.params) for s in x.addressable_shards
                  if s.device == device0)
    assert weights == plan_memory(CFG, jnp.float32, plan).weights_total

    arena, lay = engine.state.arena, engine.layout
    units = engine.pool.num_units
    assert arena.shape == (units, tp, lay.unit_elems)
    assert arena.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec(None, "tp", None)), 3)
    assert len(arena.addressable_shards) == tp * ep
    for shard in arena.addressable_shards:
        assert shard.data.shape == (units, 1, lay.unit_elems)
        assert shard.data.nbytes == units * lay.unit_elems * 4 == ARENA_BYTES[tp, spec]
    assert ARENA_BYTES[tp, spec] == plan_memory(CFG, jnp.float32, plan, _pool_sizes(spec)).arena
    # a page per device is exactly 1/tp of one device's; the whole arena less than the single one's
    assert lay.page_units * lay.unit_elems * tp == single_layout.page_units * single_layout.unit_elems
    if tp > 1:
        assert ARENA_BYTES[tp, spec] < ARENA_BYTES[1, spec]
    # the ep replicas of a tp block are the same bits (every device ran the same program)
    blocks: dict[int, np.ndarray] = {}
    for shard in arena.addressable_shards:
        t = shard.index[1].start or 0
        data = np.asarray(shard.data)
        if t in blocks:
            np.testing.assert_array_equal(data, blocks[t])
        blocks[t] = data
    assert len(blocks) == tp
    for table in (engine.state.slot_v2p, engine.state.page_v2p):
        assert table.sharding.is_fully_replicated and table.sharding.mesh == mesh


@on_mesh
@pytest.mark.parametrize("tp,ep", MESHES)
def test_on_mesh_engine_equals_one_device(tp, ep):
    """Greedy generation with the prefix cache, eager compaction and MTP speculative decoding
    (spec_steps=2): the same tokens as the single-device engine, logprobs within 1e-5, the
    same cache hits. (Plain decode steps on a mesh: the warm-up test below, and the
    one-device mesh above.)"""
    want, single_layout = _single(2)
    engine = _engine(ik.make_mesh(tp=tp, ep=ep), spec_steps=2)
    got = engine.generate(PROMPTS, GREEDY)
    assert_same_completions(got, want)  # (speculative greedy = plain greedy: test_spec.py, single device)
    stats = engine.stats()
    assert sum(c.cached_tokens for c in got) > 0
    assert stats["compaction_moves"] > 0  # finished requests' slots and pages were moved on the devices
    assert stats["verify_steps"] > 0 and stats["accepted_draft_tokens"] > 0
    engine.check_invariants()
    _check_placement(engine, tp, ep, 2, single_layout)


@on_mesh
def test_on_mesh_pallas_kernels_repeated_kv_heads_and_lone_rows(monkeypatch):
    """tp 4 x ep 2 over a 16-expert tiny config: the full layers' 2 kv heads each sit on two
    tp shards (repeated in the params and in the arena); the Pallas kernels (interpret mode:
    conv-state updates, slot copies, the MoE mat-vecs) run on each device's arena block under
    shard_map; a batch-1 step's routed experts (n * k = 2 <= E_local / 3 = 8 / 3, the
    few-token kernel's bound) take the few-token kernel, the choices held by the other ep
    shard at weight 0 on local expert 0. Outputs equal the single-device jnp engine's, log-probs
    within 1e-5; read_slot keeps each kv head once. (One test for both: each engine here is
    a compile of its own on 8 devices.)"""
    from pallas_kernels.moe import pallas as moe_pallas

    import pallas_kernels as pk

    calls = []
    real = moe_pallas.moe_experts

    def spy(x, *a, **k):
        calls.append(x.shape)
        return real(x, *a, **k)

    monkeypatch.setattr(moe_pallas, "moe_experts", spy)
    pk._pallas_ops.cache_clear()
    try:
        cfg = CFG.replace(n_routed_experts=16)  # (CFG's 8: 4 a shard, 2 > 4 / 3 choices go dense)
        params = ik.init_params(cfg, jax.random.key(0), std=0.1)
        kw = dict(KW, max_running=1, min_batch_bucket=1)
        sampling = ik.SamplingParams(max_new_tokens=4, stop_at_eos=False)
        engine = ik.Engine(cfg, params, ik.EngineConfig(**kw, use_pallas=True, pallas_interpret=True),
                           mesh=ik.make_mesh(tp=4, ep=2))
        assert engine.runner.ops.pallas
        assert engine.plan.local_cfg.num_kv_heads == 1 and engine.plan.local_cfg.swa_num_kv_heads == 1
        single = ik.Engine(cfg, params, ik.EngineConfig(**kw))
        reads = []
        for e in (single, engine):
            out = e.generate(PROMPTS[:2], sampling)
            sid = e.open_session()
            out += e.generate([PROMPTS[2]], sampling, session=sid)
            reads.append((out, e.read_slot(e.sessions[sid].held.virtual_slot)))
    finally:
        monkeypatch.undo()
        pk._pallas_ops.cache_clear()
    assert (1, cfg.hidden_size) in calls
    (want, want_slot), (got, got_slot) = reads
    assert_same_completions(got, want)
    assert got_slot.keys() == want_slot.keys()
    for key in want_slot:
        assert got_slot[key].shape == want_slot[key].shape, key
        np.testing.assert_allclose(got_slot[key], want_slot[key], rtol=0, atol=1e-5, err_msg=key)


@on_mesh
def test_on_mesh_sampling_is_the_same_on_every_device():
    """Sampled generation (temperature, top-k, top-p; same seeds): every device's copy of a
    step's outputs holds the same tokens, and they are the single-device engine's."""
    sampling = ik.SamplingParams(max_new_tokens=8, temperature=0.9, top_k=50, top_p=0.95, seed=11, stop_at_eos=False)
    want = _engine(spec_steps=2).generate(PROMPTS[:3], sampling)
    engine = _engine(ik.make_mesh(tp=2, ep=4), spec_steps=2)
    run, seen = engine.runner.run, []

    def run_and_compare_shards(shape, batch, feed=None):
        out = run(shape, batch, feed)
        for leaf in jax.tree_util.tree_leaves(out):
            copies = [np.asarray(s.data) for s in leaf.addressable_shards]
            assert len(copies) == 8 and all(np.array_equal(c, copies[0]) for c in copies)
        seen.append(shape.mode)
        return out

    engine.runner.run = run_and_compare_shards
    got = engine.generate(PROMPTS[:3], sampling)
    assert {"extend", "verify"} <= set(seen)
    assert [c.tokens for c in got] == [c.tokens for c in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=1e-5)


@on_mesh
def test_on_mesh_read_slot_gives_global_fields():
    """A session's slot read on the mesh is assembled into the single-device shapes (all kv
    heads, all conv channels, MTP blocks) and equals the single-device engine's."""
    reads = []
    for mesh in (None, ik.make_mesh(tp=2, ep=4)):
        engine = _engine(mesh, spec_steps=2)
        sid = engine.open_session()
        engine.generate([PROMPTS[0]], GREEDY, session=sid)
        reads.append(engine.read_slot(engine.sessions[sid].held.virtual_slot))
    want, got = reads
    assert got.keys() == want.keys() and any(k.startswith("draft.") for k in want)
    assert any(k.endswith(".ring") for k in want) and any(k.endswith(".hidden") for k in want)
    for key in want:
        assert got[key].shape == want[key].shape, key
        np.testing.assert_allclose(got[key], want[key], rtol=0, atol=1e-5, err_msg=key)
        assert np.abs(want[key]).max() > 0, key  # the slot holds state (not a trivially equal zero field)


@on_mesh
def test_on_mesh_no_compile_after_warmup():
    """After warmup() nothing compiles (XLA backend compiles counted, not only the engine's
    step counter) over runs of varying batch sizes and lengths with prefix hits, lazy
    ping-pong, explicit compaction and a reset; the outputs equal the reference forward's
    greedy (plain decode steps on the mesh, three per dispatch, overlapped: the feed of each
    dispatch from the last one's replicated outputs is warmed up too)."""
    loaded = programs.program_stats()["loaded"]
    with count_xla_compiles() as warmup_compiles:
        engine = _engine(ik.make_mesh(tp=2, ep=4), ping_pong="lazy", warmup=True, decode_steps=3, overlap=True)
    # the counter sees compiles (the state, the moves, maybe the steps), unless every program
    # came from the run's executable cache
    assert warmup_compiles[0] + programs.program_stats()["loaded"] - loaded > 0
    steps_compiled = engine.stats()["compiles"]
    rng = np.random.RandomState(5)
    runs = []
    with count_xla_compiles() as compiles:
        for n in (3, 1, 2):
            prompts = [_SHARED + list(rng.randint(3, 256, rng.randint(1, 12))) for _ in range(n)]
            sampling = ik.SamplingParams(max_new_tokens=int(rng.randint(3, 12)), stop_at_eos=False)
            runs.append((prompts, engine.generate(prompts, sampling)))
            engine.compact()
            if n == 1:  # a rebuilt (zero) state on the mesh compiles nothing either
                engine.reset()
        prompts = [list(rng.randint(3, 256, 5))]  # one long generation alone: dispatches overlap
        runs.append((prompts, engine.generate(prompts, ik.SamplingParams(max_new_tokens=16, stop_at_eos=False))))
    assert compiles[0] == 0, f"{compiles[0]} XLA compiles after warm-up"
    stats = engine.stats()
    assert stats["compiles"] == steps_compiled
    assert stats["compaction_moves"] > 0 and stats["cache_hit_tokens"] > 0 and stats["decode_steps"] > 0
    assert stats["overlapped_dispatches"] > 0
    engine.check_invariants()
    _check_placement(engine, 2, 4, 0, _engine().layout)  # (an engine's layout needs no compiled step)
    for prompts, completions in runs:
        for p, c in zip(prompts, completions):
            ref_lp, ref_greedy = reference_logprobs(_params(), CFG, p, c.tokens)
            assert c.tokens == ref_greedy.tolist()
            np.testing.assert_allclose(c.logprobs, ref_lp, rtol=0, atol=1e-5)


@on_mesh
def test_on_mesh_params_placement_and_errors():
    mesh = ik.make_mesh(tp=2, ep=4)
    plan = ik.ShardPlan(CFG, mesh)
    placed = plan.shard_params(_params())
    engine = _engine_with(placed, mesh)
    # already-placed params are taken as they are (no copy through the host)
    assert all(a is b for a, b in zip(jax.tree_util.tree_leaves(engine.params), jax.tree_util.tree_leaves(placed)))
    other = ik.make_mesh(tp=2, ep=1)
    with pytest.raises(ValueError, match=r"sharded over another mesh"):
        _engine_with(placed, other)
    with pytest.raises(ValueError, match=r"num_heads=4 is not divisible by tp=3"):
        _engine(ik.make_mesh(tp=3))
    with pytest.raises(ValueError, match=r"n_routed_experts=8 is not divisible by ep=3"):
        _engine(ik.make_mesh(ep=3))
    assert math.prod(engine.mesh.devices.shape) == 8


def _engine_with(params, mesh):
    return ik.Engine(CFG, params, ik.EngineConfig(**KW), mesh=mesh)

"""Serving on a device mesh (inkling_jax.parallel): the split, the sharded layout, the
sharded reference forward against the single-device one, sharded loading, the memory planner.

Tests named `test_on_mesh_*` need 8 devices. The suite's process has one (conftest starts
jax first), so test_mesh_engine.py's `test_mesh_cases_on_8_host_devices` runs them, with
test_mesh_engine.py's, in one subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8;
in a process started with 8 devices they run directly.
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh

import inkling_jax as ik
from inkling_jax import parallel as par
from inkling_jax.model.params import flat_params, param_shapes
from inkling_jax.parallel.planner import H200_BYTES, SERVING_MEM_FRACTION, PoolSizes, main as planner_main, plan_memory

from conftest import PARITY_CONFIGS, on_mesh, random_tokens


# --------------------------------------------------------------- the split (no devices)


@pytest.mark.parametrize("name", sorted(PARITY_CONFIGS))
@pytest.mark.parametrize("tp,ep", [(2, 1), (2, 2), (4, 1)])
def test_local_config_is_one_shard(name, tp, ep):
    cfg = PARITY_CONFIGS[name]
    if cfg.n_routed_experts % ep:
        pytest.skip("experts not divisible")
    plan = par.ShardPlan(cfg, tp=tp, ep=ep)
    local = plan.local_cfg
    for i in range(cfg.num_layers):
        g, lg = cfg.layer_geometry(i), local.layer_geometry(i)
        assert lg.num_heads * tp == g.num_heads and lg.head_dim == g.head_dim
        assert lg.num_kv_heads == max(1, g.num_kv_heads // tp)
        assert lg.kv_dim == lg.num_kv_heads * g.head_dim and lg.q_dim * tp == g.q_dim
        assert (lg.window, lg.rel_extent, lg.log_scaling) == (g.window, g.rel_extent, g.log_scaling)
    for d in range(cfg.num_mtp_layers):
        assert local.mtp_geometry(d).num_heads * tp == cfg.mtp_geometry(d).num_heads
    assert local.vocab_size * tp == cfg.vocab_size
    assert local.n_routed_experts * ep == cfg.n_routed_experts
    assert local.dense_intermediate_size * tp == cfg.dense_intermediate_size
    assert local.expert_intermediate_size * tp == cfg.expert_intermediate_size
    # every leaf's device shape is the local config's, except the router (routing is
    # replicated: global shape) and MTP input_proj (row-parallel: rows / tp)
    got = flat_params(plan.local_params_shape())
    want = flat_params(param_shapes(local))
    glob = flat_params(param_shapes(cfg))
    assert got.keys() == want.keys()
    router = {k for k in got if k[-1].startswith("router")}
    input_proj = {k for k in got if k[-1] == "input_proj"}
    differ = {k for k in got if got[k] != want[k]}
    assert input_proj <= differ <= router | input_proj
    assert all(got[k] == glob[k] for k in router)
    assert all(got[k] == (glob[k][0] // tp, glob[k][1]) for k in input_proj)


def test_kv_heads_fewer_than_tp_are_repeated():
    cfg = PARITY_CONFIGS["tiny"]  # full layers: 4 q heads, 2 kv heads
    plan = par.ShardPlan(cfg, tp=4, ep=1)
    full = cfg.full_layer_ids[0]
    assert plan.local_cfg.layer_geometry(full).num_kv_heads == 1
    layout = plan.layouts["layers"][full]["attn"]["k_conv"].dims[1]
    hd = cfg.head_dim
    # shards 0, 1 hold kv head 0 (q heads 0, 1), shards 2, 3 kv head 1 (q heads 2, 3)
    for shard, head in ((0, 0), (1, 0), (2, 1), (3, 1)):
        np.testing.assert_array_equal(layout.shard_indices(shard), np.arange(head * hd, (head + 1) * hd))
    assert plan.sharded_params_shape()["layers"][full]["attn"]["k_conv"] == (cfg.conv_kernel_size, 4 * hd)


def test_plan_errors_name_the_field():
    tiny = PARITY_CONFIGS["tiny"]
    with pytest.raises(ValueError, match=r"num_heads=4 is not divisible by tp=3") as err:
        par.ShardPlan(tiny, tp=3)
    assert "vocab_size=264 is not divisible by tp=3" not in str(err.value)  # 264 = 3 * 88: fine
    with pytest.raises(ValueError, match=r"n_routed_experts=8 is not divisible by ep=3"):
        par.ShardPlan(tiny, tp=1, ep=3)
    with pytest.raises(ValueError, match=r"vocab_size=264 is not divisible by tp=16"):
        par.ShardPlan(tiny.replace(num_heads=16, swa_num_heads=16, swa_num_kv_heads=4, dense_intermediate_size=256),
                      tp=16)
    with pytest.raises(ValueError, match=r"swa_num_kv_heads=3 is not divisible by tp=2"):
        par.ShardPlan(tiny.replace(swa_num_heads=6, swa_num_kv_heads=3), tp=2)
    with pytest.raises(ValueError, match=r"num_kv_heads=3 is fewer than tp=4 but does not divide it"):
        par.ShardPlan(tiny.replace(num_heads=12, num_kv_heads=3, swa_num_heads=12, swa_num_kv_heads=12), tp=4)
    with pytest.raises(ValueError, match=r"expert_intermediate_size=32 .* not divisible by tp=64"):
        par.ShardPlan(tiny.replace(vocab_size=64 * 5, num_heads=64, swa_num_heads=64, swa_num_kv_heads=64), tp=64)
    with pytest.raises(ValueError, match=r"tp must be a positive int"):
        par.ShardPlan(tiny, tp=0)
    with pytest.raises(ValueError, match=r"ep must be a positive int"):
        par.ShardPlan(tiny, tp=1, ep=-2)


def test_make_mesh_errors():
    with pytest.raises(ValueError, match=r"tp must be a positive int, got 0"):
        par.make_mesh(tp=0)
    with pytest.raises(ValueError, match=r"ep must be a positive int, got 1.5"):
        par.make_mesh(ep=1.5)
    with pytest.raises(ValueError, match=r"tp must be a positive int, got True"):
        par.make_mesh(tp=True)
    n = len(jax.devices())
    with pytest.raises(ValueError, match=rf"needs {n + 1} devices, but only {n}"):
        par.make_mesh(tp=n + 1)
    with pytest.raises(ValueError, match=r"needs exactly 2 devices, got 1"):
        par.make_mesh(tp=2, devices=jax.devices()[:1])
    with pytest.raises(ValueError, match=r"listed twice"):
        par.make_mesh(tp=2, devices=[jax.devices()[0]] * 2)
    mesh = par.make_mesh()
    assert mesh.axis_names == ("ep", "tp") and mesh.devices.shape == (1, 1)
    with pytest.raises(ValueError, match=r"exactly the axes \('ep', 'tp'\)"):
        par.ShardPlan(PARITY_CONFIGS["tiny"], Mesh(np.array(jax.devices()[:1]), ("x",)))


@st.composite
def dim_layouts(draw):
    shards = draw(st.sampled_from([1, 2, 4, 8]))
    parts, start = [], 0
    for _ in range(draw(st.integers(1, 4))):
        pieces = draw(st.sampled_from([p for p in (1, 2, 4, 8) if shards % p == 0]))
        width = pieces * draw(st.integers(1, 3))
        parts.append(par.Part(start, width, pieces))
        start += width
    return par.DimLayout("tp", shards, tuple(parts))


@settings(max_examples=60, deadline=None)
@given(layout=dim_layouts(), lead=st.integers(1, 3))
def test_dim_layout_relayouts_agree_with_the_index_map(layout, lead):
    """The reshape relayouts (used on devices) and the index maps (used for reading shards
    from files and host memory) are the same permutation; shard j's block is its indices."""
    x = np.arange(lead * layout.original_size).reshape(lead, layout.original_size)
    sharded = layout.to_sharded(np, x, 1)
    np.testing.assert_array_equal(sharded, x[:, layout.layout_index()])
    np.testing.assert_array_equal(layout.from_sharded(np, sharded, 1), x)
    local = layout.local_size
    for j in range(layout.shards):  # shard j's contiguous block is its local tensor
        np.testing.assert_array_equal(sharded[:, j * local:(j + 1) * local], x[:, layout.shard_indices(j)])
    np.testing.assert_array_equal(layout.layout_index()[layout.first_position()], np.arange(layout.original_size))


def test_dim_layout_relayouts_in_jax():
    """The jnp relayouts (orbax restore onto a mesh) equal the numpy ones."""
    qkvr = par.DimLayout("tp", 4, (par.Part(0, 8, 4), par.Part(8, 4, 2), par.Part(12, 4, 2), par.Part(16, 4, 4)))
    for layout in (qkvr, par.DimLayout.even("tp", 2, 6)):
        x = np.arange(3 * layout.original_size).reshape(layout.original_size, 3)
        sharded = layout.to_sharded(np, x, 0)
        np.testing.assert_array_equal(np.asarray(layout.to_sharded(jnp, jnp.asarray(x), 0)), sharded)
        np.testing.assert_array_equal(np.asarray(layout.from_sharded(jnp, jnp.asarray(sharded), 0)), x)


# -------------------------------------------------------------------------- planner


def test_planner_weights_are_exact_on_one_device():
    cfg = PARITY_CONFIGS["heads"]
    for dtype in (jnp.float32, jnp.bfloat16):
        params = ik.init_params(cfg, jax.random.key(0), dtype=dtype)
        actual = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
        assert plan_memory(cfg, dtype).weights_total == actual


def test_planner_arena_is_the_local_layout():
    from inkling_jax.cache.layout import ArenaLayout

    cfg = PARITY_CONFIGS["tiny"]
    pool = PoolSizes(num_slots=10, num_pages=20, page_size=4, spec_steps=2)
    for tp in (1, 2):
        plan = par.ShardPlan(cfg, tp=tp)
        lay = ArenaLayout.build(plan.local_cfg, 4, 2)
        mem = plan_memory(cfg, jnp.bfloat16, {"tp": tp}, pool)
        assert mem.arena == (11 * lay.slot_units + 21 * lay.page_units) * lay.unit_elems * 2
    # the K/V page unit follows the local kv heads: tp=2 halves it
    local = ArenaLayout.build(par.ShardPlan(cfg, tp=2).local_cfg, 4)
    assert local.unit_elems * 2 == ArenaLayout.build(cfg, 4).unit_elems


def test_planner_real_inkling_on_8_h200():
    cfg = ik.InklingConfig.inkling()
    shapes = jax.tree_util.tree_leaves(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    count = sum(math.prod(s) for s in shapes)
    assert 9.0e11 < count < 1.0e12, count
    pool = PoolSizes(num_slots=64, num_pages=2048, page_size=16, max_running=16, chunk_size=64, max_step_tokens=512)
    device = int(SERVING_MEM_FRACTION * H200_BYTES)
    bf16 = plan_memory(cfg, jnp.bfloat16, {"tp": 8}, pool)
    fp8 = plan_memory(cfg, jnp.bfloat16, {"tp": 8}, pool, weight_bytes=1)
    assert not bf16.fits(device) and fp8.fits(device)
    with pytest.raises(ValueError, match=r"the weights alone need .* per device \(largest part: routed experts"):
        bf16.check(device)
    fp8.check(device)
    # tp=8 splits everything 8 ways: the per-device matrices are an eighth of the model
    assert fp8.weights["routed experts"] * 8 == 64 * 256 * 3 * 6144 * 3072
    ep8 = plan_memory(cfg, jnp.bfloat16, {"ep": 8}, pool, weight_bytes=1)
    assert ep8.weights["routed experts"] == fp8.weights["routed experts"]
    assert ep8.weights["attention"] == 8 * fp8.weights["attention"]  # replicated without tp
    big_pool = PoolSizes(num_slots=64, num_pages=400_000, page_size=16, max_context=32768)
    with pytest.raises(ValueError, match=r"for the arena, which needs .* fewer slots / pages, or more devices"):
        plan_memory(cfg, jnp.bfloat16, {"tp": 8}, big_pool, weight_bytes=1).check(device)
    assert "routed experts" in str(fp8) and "total" in str(fp8)
    with pytest.raises(ValueError, match=r"num_heads=64 is not divisible by tp=3"):
        plan_memory(cfg, jnp.bfloat16, {"tp": 3})


def test_planner_cli(capsys):
    assert planner_main(["--config", "inkling", "--tp", "8", "--weight-bytes", "1", "--num-pages", "1024"]) == 0
    out = capsys.readouterr().out
    assert "952,286,009,930 parameters" in out and "fits in" in out
    assert planner_main(["--config", "inkling", "--tp", "8"]) == 1
    assert "does not fit" in capsys.readouterr().out


# ---------------------------------------------------------------- on 8 host devices


# (config, tp, ep): each kind of mesh once: tp alone (heads 2 x 1), ep alone (pattern 1 x 8),
# both (tiny 2 x 4, heads 2 x 3: 6 of the 8 devices), fewer kv heads than tp (repeated kv heads:
# pattern's full layers at tp 4, heads' sliding layers at tp 2). Every case is an 8-device compile.
PARITY_MESHES = [("tiny", 2, 4), ("heads", 2, 1), ("heads", 2, 3), ("pattern", 4, 2), ("pattern", 1, 8)]
_PARAMS: dict = {}
_REFERENCE: dict = {}


def _params(name):
    if name not in _PARAMS:
        _PARAMS[name] = ik.init_params(PARITY_CONFIGS[name], jax.random.key(3), std=0.1)
    return _PARAMS[name]


def _reference(name, which):
    """The single-device functions, jitted once per config."""
    cfg = PARITY_CONFIGS[name]
    if (name, which) not in _REFERENCE:
        fn = {"forward": lambda p, t: ik.forward(p, cfg, t), "hidden": lambda p, t: ik.forward_hidden(p, cfg, t),
              "mtp": lambda p, h, t: ik.mtp_forward(p, cfg, h, t)}[which]
        _REFERENCE[name, which] = jax.jit(fn)
    return _REFERENCE[name, which]


@on_mesh
@pytest.mark.parametrize("name,tp,ep", PARITY_MESHES)
def test_on_mesh_forward_matches_one_device(name, tp, ep):
    cfg = PARITY_CONFIGS[name]
    params = _params(name)
    tokens = random_tokens(cfg, (2, 19), seed=tp * 10 + ep)  # longer than windows and rel_extents
    want = np.asarray(_reference(name, "forward")(params, tokens))
    plan = par.ShardPlan(cfg, par.make_mesh(tp=tp, ep=ep))
    got = par.forward_sharded(plan.shard_params(params), plan, tokens)
    assert got.shape == want.shape == (2, 19, cfg.unpadded_vocab_size)
    assert got.sharding.is_fully_replicated
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@on_mesh
@pytest.mark.parametrize("name,tp,ep", [("tiny", 2, 4), ("heads", 2, 3), ("pattern", 4, 2)])
def test_on_mesh_mtp_chain_matches_one_device(name, tp, ep):
    cfg = PARITY_CONFIGS[name]
    params = _params(name)
    tokens = random_tokens(cfg, (2, 11), seed=5)
    hidden = _reference(name, "hidden")(params, tokens)
    want_logits, want_hidden = _reference(name, "mtp")(params, hidden, tokens)
    plan = par.ShardPlan(cfg, par.make_mesh(tp=tp, ep=ep))
    logits, hid = par.mtp_forward_sharded(plan.shard_params(params), plan, hidden, tokens)
    scale = np.abs(np.asarray(want_logits)).max()
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), rtol=1e-5, atol=1e-5 * scale)
    np.testing.assert_allclose(np.asarray(hid), np.asarray(want_hidden), rtol=1e-5, atol=1e-5)


@on_mesh
def test_on_mesh_shards_are_the_local_tensors():
    """Each device's shard is its local tensor, checked against slices of the original
    params taken independently of the layout code; shapes and bytes per device."""
    cfg = PARITY_CONFIGS["tiny"]
    tp, ep = 2, 4
    params = _params("tiny")
    plan = par.ShardPlan(cfg, par.make_mesh(tp=tp, ep=ep))
    sharded = plan.shard_params(params)
    local_shapes = flat_params(plan.local_params_shape())
    for path, x in flat_params(sharded).items():
        spec = flat_params(plan.param_specs())[path]
        assert x.sharding.spec == spec, path
        assert len(x.addressable_shards) == tp * ep
        for shard in x.addressable_shards:
            assert shard.data.shape == local_shapes[path], path
            assert shard.data.nbytes == math.prod(local_shapes[path]) * x.dtype.itemsize
    mesh_index = {d: (e, t) for (e, t), d in np.ndenumerate(plan.mesh.devices)}

    def shard_of(x, device):
        return next(np.asarray(s.data) for s in x.addressable_shards if s.device == device)

    layer = cfg.full_layer_ids[0]  # full layer: 4 q heads, 2 kv heads of 16, d_rel 4
    g = cfg.layer_geometry(layer)
    w = np.asarray(params["layers"][layer]["attn"]["wqkvr"])
    q, k, v, r = np.split(w, np.cumsum([g.q_dim, g.kv_dim, g.kv_dim]), axis=1)
    e_w13 = np.asarray(params["layers"][1]["mlp"]["w13"])  # [E, H, 2F] gate | up
    e_w2 = np.asarray(params["layers"][1]["mlp"]["w2"])
    f, el = cfg.expert_intermediate_size // tp, cfg.n_routed_experts // ep
    embed = np.asarray(params["embed"])
    vl = cfg.vocab_size // tp
    for device, (e, t) in mesh_index.items():
        cols = lambda a, n: a[:, t * n:(t + 1) * n]
        want = np.concatenate([cols(q, g.q_dim // tp), cols(k, g.kv_dim // tp), cols(v, g.kv_dim // tp),
                               cols(r, g.num_heads * cfg.d_rel // tp)], axis=1)
        np.testing.assert_array_equal(shard_of(sharded["layers"][layer]["attn"]["wqkvr"], device), want)
        experts = e_w13[e * el:(e + 1) * el]
        want = np.concatenate([experts[..., t * f:(t + 1) * f], experts[..., cfg.expert_intermediate_size + t * f:]
                               [..., :f]], axis=-1)
        np.testing.assert_array_equal(shard_of(sharded["layers"][1]["mlp"]["w13"], device), want)
        np.testing.assert_array_equal(shard_of(sharded["layers"][1]["mlp"]["w2"], device),
                                      e_w2[e * el:(e + 1) * el, t * f:(t + 1) * f])
        np.testing.assert_array_equal(shard_of(sharded["embed"], device), embed[t * vl:(t + 1) * vl])
        np.testing.assert_array_equal(shard_of(sharded["layers"][1]["mlp"]["router"], device),
                                      np.asarray(params["layers"][1]["mlp"]["router"]))
    # planner: exact bytes per device
    device0 = plan.mesh.devices.flat[0]
    held = sum(s.data.nbytes for x in jax.tree_util.tree_leaves(sharded) for s in x.addressable_shards
               if s.device == device0)
    assert plan_memory(cfg, jnp.float32, plan).weights_total == held


@on_mesh
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_on_mesh_unshard_round_trip(dtype):
    cfg = PARITY_CONFIGS["heads"]
    params = ik.cast_params(_params("heads"), dtype)
    plan = par.ShardPlan(cfg, par.make_mesh(tp=4, ep=2))  # heads' kv heads (2 and 1) < 4: repeated
    sharded = plan.shard_params(params)
    back = plan.unshard_params(sharded)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves(back)):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8), err_msg=str(path))
    # a repeated kv head whose copies disagree is not one tensor
    full = cfg.full_layer_ids[0]
    bad = jax.tree_util.tree_map(lambda x: x, sharded)
    host = np.asarray(bad["layers"][full]["attn"]["k_conv"]).copy()
    host[0, -1] += 1  # last column: the last shard's copy of kv head 1
    bad["layers"][full]["attn"]["k_conv"] = jnp.asarray(host)
    with pytest.raises(ValueError, match=r"repeated copies of \['layers'\]\[\d\]\['attn'\]\['k_conv'\] disagree"):
        plan.unshard_params(bad)


@on_mesh
def test_on_mesh_bad_meshes():
    with pytest.raises(ValueError, match=r"tp=3 x ep=3 needs 9 devices, but only 8"):
        par.make_mesh(tp=3, ep=3)
    with pytest.raises(ValueError, match=r"num_heads=4 is not divisible by tp=8"):
        par.ShardPlan(PARITY_CONFIGS["tiny"], par.make_mesh(tp=8))
    with pytest.raises(ValueError, match=r"n_routed_experts=6 is not divisible by ep=4"):
        par.ShardPlan(PARITY_CONFIGS["heads"], par.make_mesh(ep=4))
    with pytest.raises(ValueError, match=r"tp=4 disagrees with the mesh's tp axis of 2"):
        par.ShardPlan(PARITY_CONFIGS["tiny"], par.make_mesh(tp=2), tp=4)
    with pytest.raises(ValueError, match=r"needs devices"):
        par.ShardPlan(PARITY_CONFIGS["tiny"], tp=2).shard_params(_params("tiny"))


class _SliceRecorder:
    """Wraps safetensors.safe_open: records the elements each read returns, refuses whole-tensor reads."""

    def __init__(self, real):
        self.real, self.reads = real, []

    def __call__(self, filename, framework):
        handle, recorder = self.real(filename, framework), self

        class Slice:
            def __init__(self, name):
                self.name, self.inner = name, handle.get_slice(name)

            def get_shape(self):
                return self.inner.get_shape()

            def __getitem__(self, index):
                out = self.inner[index]
                recorder.reads.append((self.name, out.size, math.prod(self.get_shape())))
                return out

        class Handle:
            keys = staticmethod(handle.keys)
            get_slice = staticmethod(Slice)

            def get_tensor(self, name):
                raise AssertionError(f"whole-tensor read of {name}")

        return Handle()


@on_mesh
@pytest.mark.parametrize("naming", ["hub", "transformers"])
def test_on_mesh_load_pretrained_reads_each_devices_slices(tmp_path, monkeypatch, naming):
    import inkling_jax.weights.safetensors_io as W

    cfg = PARITY_CONFIGS["tiny"]
    ik.save_pretrained(tmp_path, cfg, _params("tiny"), naming=naming, max_shard_bytes=150_000)
    _, full = ik.load_pretrained(tmp_path, dtype=jnp.bfloat16)
    mesh = par.make_mesh(tp=4, ep=2)
    plan = par.ShardPlan(cfg, mesh)
    recorder = _SliceRecorder(W.safe_open)
    monkeypatch.setattr(W, "safe_open", recorder)
    _, sharded = ik.load_pretrained(tmp_path, dtype=jnp.bfloat16, mesh=mesh)
    want = plan.shard_params(full)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(sharded), jax.tree_util.tree_leaves(want)):
        assert a.sharding == b.sharding and a.dtype == b.dtype, path
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=str(path))
    # each device read only its block: no read of a sharded leaf's source is the whole tensor,
    # and all reads together are at most every device's local leaves
    sharded_sources = {n for e in W.entries(cfg, naming) if plan.flat_layouts()[e.path].is_sharded for n in e.names}
    assert recorder.reads
    for name, got, whole in recorder.reads:
        assert got < whole or name not in sharded_sources, name
    local = sum(math.prod(s) for s in flat_params(plan.local_params_shape()).values())
    assert sum(n for _, n, _ in recorder.reads) <= local * len(mesh.devices.flat)


@on_mesh
def test_on_mesh_orbax_restores_onto_the_mesh(tmp_path):
    cfg = PARITY_CONFIGS["heads"]
    params = _params("heads")
    plan = par.ShardPlan(cfg, par.make_mesh(tp=2, ep=3))
    sharded = plan.shard_params(params)
    ik.save_checkpoint(tmp_path / "from_mesh", cfg, sharded, mesh=plan.mesh)
    ik.save_checkpoint(tmp_path / "plain", cfg, params)
    _, back = ik.load_checkpoint(tmp_path / "from_mesh")  # original layout, from the mesh save
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _, restored = ik.load_checkpoint(tmp_path / "plain", mesh=plan.mesh, dtype=jnp.bfloat16)
    want = plan.shard_params(ik.cast_params(params, jnp.bfloat16))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(restored), jax.tree_util.tree_leaves(want)):
        assert a.sharding == b.sharding and a.dtype == b.dtype, path
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=str(path))


def test_planner_json_free_of_devices():
    """plan_memory needs no devices (sizes only) and reports per-part bytes that add up."""
    cfg = PARITY_CONFIGS["pattern"]
    mem = plan_memory(cfg, "float32", {"tp": 4, "ep": 2}, PoolSizes(num_slots=8, num_pages=16, page_size=4))
    assert mem.total == mem.weights_total + mem.arena + mem.workspace_total
    json.dumps({"weights": mem.weights, "workspace": mem.workspace})
    # EngineConfig.arena_units: the arena's own size sets its bytes, whatever the budget
    wide = plan_memory(cfg, "float32", {"tp": 4, "ep": 2},
                       PoolSizes(num_slots=8, num_pages=16, page_size=4, arena_units=10**6))
    per_unit = wide.arena // 10**6
    assert wide.arena == 10**6 * per_unit and mem.arena % per_unit == 0 and mem.arena // per_unit < 10**6
    assert "in an arena of 1000000 units" in wide.arena_note and "in an arena" not in mem.arena_note
    with pytest.raises(ValueError, match=r"unknown mesh axes \['dp'\]"):
        plan_memory(cfg, "float32", {"dp": 2})

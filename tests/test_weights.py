"""Checkpoint I/O without the HF oracle: sharding, dtypes, error messages, orbax, layouts."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import inkling_jax as ik
from inkling_jax.weights.names import _deinterleave, _interleave


@pytest.fixture(scope="module")
def tiny():
    cfg = ik.InklingConfig.tiny()
    return cfg, ik.init_params(cfg, jax.random.key(1))


def assert_params_equal(a, b):
    la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
        assert x.dtype == y.dtype, path
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32), err_msg=str(path))


@pytest.mark.parametrize("naming", ["hub", "transformers"])
def test_round_trip_sharded(tiny, tmp_path, naming):
    cfg, params = tiny
    ik.save_pretrained(tmp_path, cfg, params, naming=naming, max_shard_bytes=200_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2 and all((tmp_path / s).exists() for s in shards)
    cfg2, params2 = ik.load_pretrained(tmp_path, dtype=jnp.float32)
    assert cfg2 == cfg
    assert_params_equal(params, params2)


def test_bf16_on_disk(tiny, tmp_path):
    cfg, params = tiny
    ik.save_pretrained(tmp_path, cfg, params, dtype=jnp.bfloat16)
    tensors = load_file(tmp_path / "model.safetensors")
    assert str(tensors["model.llm.layers.0.attn.wq_du.weight"].dtype) == "bfloat16"
    assert str(tensors["model.llm.layers.0.attn.k_sconv.weight"].dtype) == "float32"  # convs stay fp32
    _, params2 = ik.load_pretrained(tmp_path, dtype=jnp.bfloat16)
    assert_params_equal(ik.cast_params(params, jnp.bfloat16), params2)


def test_hub_gate_up_is_interleaved(tiny, tmp_path):
    """Even rows of w13 are the gate, odd rows the up projection (sglang's layout)."""
    cfg, params = tiny
    ik.save_pretrained(tmp_path, cfg, params)
    t = load_file(tmp_path / "model.safetensors")
    w13 = t["model.llm.layers.0.mlp.w13_dn.weight"]  # [2I, H]
    ours = np.asarray(params["layers"][0]["mlp"]["w13"])  # [H, 2I] = gate | up
    i = cfg.dense_intermediate_size
    np.testing.assert_array_equal(w13[0::2], ours[:, :i].T)
    np.testing.assert_array_equal(w13[1::2], ours[:, i:].T)
    e13 = t["model.llm.layers.1.mlp.experts.w13_weight"]  # [E, 2F, H]
    f = cfg.expert_intermediate_size
    np.testing.assert_array_equal(e13[3, 0::2], np.asarray(params["layers"][1]["mlp"]["w13"])[3, :, :f].T)


def test_split_gate_up_checkpoint(tiny, tmp_path):
    """A hub checkpoint whose config says inference_moe_w13_interleaved=false stores
    [gate | up] halves; the loader reads it to the same params."""
    cfg, params = tiny
    ik.save_pretrained(tmp_path, cfg, params)
    t = load_file(tmp_path / "model.safetensors")
    for name in list(t):
        if name.endswith(("w13_dn.weight", "w13_weight")):
            axis = t[name].ndim - 2
            g, u = _deinterleave(t[name], axis)
            t[name] = np.concatenate([g, u], axis=axis)
    save_file(t, tmp_path / "model.safetensors")
    conf = json.loads((tmp_path / "config.json").read_text())
    conf["text_config"]["inference_moe_w13_interleaved"] = False
    (tmp_path / "config.json").write_text(json.dumps(conf))
    _, params2 = ik.load_pretrained(tmp_path, dtype=jnp.float32)
    assert_params_equal(params, params2)


def test_interleave_inverse():
    x, y = np.arange(12).reshape(3, 4), -np.arange(12).reshape(3, 4)
    g, u = _deinterleave(_interleave(x, y, 0), 0)
    np.testing.assert_array_equal(g, x)
    np.testing.assert_array_equal(u, y)


def test_errors_name_the_tensor(tiny, tmp_path):
    cfg, params = tiny
    ik.save_pretrained(tmp_path, cfg, params)
    t = load_file(tmp_path / "model.safetensors")
    t.pop("model.llm.layers.2.attn.wk_dv.weight")
    t["model.llm.layers.1.attn.q_norm.weight"] = np.ones(17, np.float32)
    t["model.llm.layers.9.attn.extra.weight"] = np.ones(3, np.float32)
    save_file(t, tmp_path / "model.safetensors")
    with pytest.raises(ValueError) as err:
        ik.load_pretrained(tmp_path)
    msg = str(err.value)
    kv_dim = cfg.num_kv_heads * cfg.head_dim
    assert f"missing tensor model.llm.layers.2.attn.wk_dv.weight (expected shape ({kv_dim}, {cfg.hidden_size}))" in msg
    assert "model.llm.layers.1.attn.q_norm.weight has shape (17,), expected (16,)" in msg
    assert "unexpected tensor model.llm.layers.9.attn.extra.weight" in msg


def test_partial_mtp_is_an_error(tiny, tmp_path):
    cfg, params = tiny
    ik.save_pretrained(tmp_path, cfg, params)
    t = load_file(tmp_path / "model.safetensors")
    t.pop("model.mtp.layers.1.input_proj.weight")
    save_file(t, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensor model\.mtp\.layers\.1\.input_proj\.weight"):
        ik.load_pretrained(tmp_path)


def test_check_params_names_problems(tiny):
    cfg, params = tiny
    bad = jax.tree_util.tree_map(lambda x: x, params)
    bad["layers"][0]["attn"]["wo"] = jnp.zeros((3, 3))
    with pytest.raises(ValueError, match=r"\['layers'\]\[0\]\['attn'\]\['wo'\]: shape \(3, 3\), expected \(64, 64\)"):
        ik.check_params(cfg, bad)


def test_orbax_round_trip(tiny, tmp_path):
    cfg, params = tiny
    ik.save_checkpoint(tmp_path / "ckpt", cfg, params)
    cfg2, params2 = ik.load_checkpoint(tmp_path / "ckpt")
    assert cfg2 == cfg
    assert_params_equal(params, params2)


# ------------------------------------------------------- files: what save_pretrained touches


def _files(path):
    return sorted(p.name for p in path.iterdir())


def test_save_keeps_files_it_did_not_write(tiny, tmp_path):
    cfg, params = tiny
    save_file({"lora.weight": np.ones((2, 2), np.float32)}, tmp_path / "adapter.safetensors")
    (tmp_path / "README.md").write_text("notes")
    ik.save_pretrained(tmp_path, cfg, params)
    assert _files(tmp_path) == ["README.md", "adapter.safetensors", "config.json", "model.safetensors",
                                "model.safetensors.index.json"]
    assert load_file(tmp_path / "adapter.safetensors")["lora.weight"].shape == (2, 2)
    # with a foreign safetensors file beside it, the checkpoint is described by an index,
    # so the loader reads exactly our files
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    _, params2 = ik.load_pretrained(tmp_path, dtype=jnp.float32)
    assert_params_equal(params, params2)


def test_save_removes_only_its_own_stale_shards(tiny, tmp_path):
    cfg, params = tiny
    ik.save_pretrained(tmp_path, cfg, params, max_shard_bytes=100_000)
    ours = set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(ours) > 2
    ik.save_pretrained(tmp_path, cfg, params)  # one file now: our old shards and index go
    assert _files(tmp_path) == ["config.json", "model.safetensors"]
    # an index another tool wrote: its shards are not ours to delete, and ours replaces it
    save_file({"x": np.zeros(3, np.float32)}, tmp_path / "model-00001-of-00009.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"x": "model-00001-of-00009.safetensors"}}))
    ik.save_pretrained(tmp_path, cfg, params)
    assert "model-00001-of-00009.safetensors" in _files(tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    _, params2 = ik.load_pretrained(tmp_path, dtype=jnp.float32)
    assert_params_equal(params, params2)


def test_failed_save_leaves_the_old_checkpoint(tiny, tmp_path, monkeypatch):
    import inkling_jax.weights.safetensors_io as W

    cfg, params = tiny
    ik.save_pretrained(tmp_path, cfg, params, max_shard_bytes=100_000)
    before = {name: (tmp_path / name).read_bytes() for name in _files(tmp_path)}
    calls = []

    def failing_save(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError("disk full")
        save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(W, "save_file", failing_save)
    doubled = jax.tree_util.tree_map(lambda x: x * 2, params)
    with pytest.raises(OSError, match="disk full"):
        ik.save_pretrained(tmp_path, cfg, doubled, max_shard_bytes=100_000)
    assert {name: (tmp_path / name).read_bytes() for name in _files(tmp_path)} == before  # no temporaries left


# ------------------------------------------------------------- load errors name the file


def test_load_missing_path_says_so(tmp_path):
    with pytest.raises(ValueError, match=rf"{tmp_path / 'nope'} does not exist"):
        ik.load_pretrained(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"file is not a directory"):
        ik.load_pretrained(tmp_path / "file")
    with pytest.raises(ValueError, match=r"has no config.json"):
        ik.load_pretrained(tmp_path)


def test_truncated_safetensors_names_the_file(tiny, tmp_path):
    cfg, params = tiny
    ik.save_pretrained(tmp_path, cfg, params)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match=rf"{tmp_path / 'model.safetensors'} is not a readable safetensors file"):
        ik.load_pretrained(tmp_path)


def test_bad_config_json_names_the_file(tiny, tmp_path):
    cfg, params = tiny
    ik.save_pretrained(tmp_path, cfg, params)
    config = tmp_path / "config.json"
    config.write_text("{not json")
    with pytest.raises(ValueError, match=rf"{config} is not valid JSON"):
        ik.load_pretrained(tmp_path)
    config.write_text(json.dumps({"model_type": "inkling_text", "num_hidden_layers": 4, "n_routed_experts": 2,
                                  "num_experts_per_tok": 3, "mlp_layer_types": ["sparse"] * 4}))
    with pytest.raises(ValueError, match=rf"{config} does not describe an Inkling model: .*num_experts_per_tok"):
        ik.load_pretrained(tmp_path)
    config.unlink()
    config.mkdir()  # unreadable as a file
    with pytest.raises(ValueError, match=rf"cannot read {config}"):
        ik.load_pretrained(tmp_path)


def test_index_and_shard_disagreeing_names_file_and_tensor(tiny, tmp_path):
    cfg, params = tiny
    ik.save_pretrained(tmp_path, cfg, params, max_shard_bytes=100_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    gone, wrong = "model.llm.layers.2.attn.wk_dv.weight", "model.llm.layers.1.attn.q_norm.weight"
    for name, edit in ((gone, None), (wrong, np.ones(17, np.float32))):
        shard = tmp_path / index[name]
        t = load_file(shard)
        if edit is None:
            t.pop(name)
        else:
            t[name] = edit
        save_file(t, shard)
    with pytest.raises(ValueError) as err:
        ik.load_pretrained(tmp_path)
    msg = str(err.value)
    assert f"tensor {gone}: model.safetensors.index.json maps it to {index[gone]}, which does not contain it" in msg
    assert f"tensor {wrong} has shape (17,), expected (16,) (in {index[wrong]})" in msg
    (tmp_path / index[gone]).unlink()
    with pytest.raises(ValueError, match=rf"lists {index[gone]}, which does not exist"):
        ik.load_pretrained(tmp_path)


def test_flat_params_round_trip(tiny):
    from inkling_jax.weights import flat_params, nest_params

    _, params = tiny
    flat = flat_params(params)
    assert ("layers", 2, "attn", "wqkvr") in flat and ("mtp", "layers", 0, "input_proj") in flat
    assert jax.tree_util.tree_structure(nest_params(flat)) == jax.tree_util.tree_structure(params)

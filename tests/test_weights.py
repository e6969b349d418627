"""Checkpoint I/O without the HF oracle: sharding, dtypes, error messages, orbax, layouts."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import inkling_jax as ik
from inkling_jax.weights import _deinterleave, _interleave


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

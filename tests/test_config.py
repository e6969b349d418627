"""InklingConfig: the three dialects, presets, validation."""

from __future__ import annotations

import json

import pytest

import inkling_jax as ik


def test_presets_are_valid_and_hashable():
    for name in ("tiny", "small", "bench"):
        cfg = getattr(ik.InklingConfig, name)()
        hash(cfg)
        assert cfg.local_layer_ids and cfg.full_layer_ids, name  # both layer kinds
        assert cfg.dense_layer_ids and cfg.has_moe, name  # dense and MoE
        assert cfg.num_mtp_layers >= 3, name
    tiny = ik.InklingConfig.tiny()
    assert tiny.sliding_window < 16 and tiny.num_experts_per_tok > 1


def test_hub_mm_dialect_with_mtp_config():
    d = {
        "model_type": "inkling_mm_model",
        "text_config": {"hidden_size": 128, "num_hidden_layers": 12, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "head_dim": 32, "swa_num_attention_heads": 4,
                        "swa_num_key_value_heads": 4, "swa_head_dim": 32, "vocab_size": 1000,
                        "unpadded_vocab_size": 990, "intermediate_size": 256, "moe_intermediate_size": 64,
                        "n_routed_experts": 8, "n_shared_experts": 2, "num_experts_per_tok": 2,
                        "mlp_layer_types": ["dense", "dense"] + ["sparse"] * 10,
                        "logits_mup_width_multiplier": 24.0, "sconv_kernel_size": 4},
        "mtp_config": {"num_nextn_predict_layers": 8, "chain_hidden_post_norm": True,
                       "local_layer_ids": [0, 2, 4, 5, 6, 7]},
    }
    cfg = ik.InklingConfig.from_hf(d)
    # HF's default pattern when no layer list is given: local unless (i + 1) % 6 == 0
    assert cfg.full_layer_ids == (5, 11)
    assert cfg.dense_layer_ids == (0, 1)
    assert (cfg.dense_intermediate_size, cfg.expert_intermediate_size) == (256, 64)
    assert (cfg.vocab_size, cfg.unpadded_vocab_size) == (1000, 990)
    assert cfg.num_mtp_layers == 8 and cfg.mtp_local_layer_ids == (0, 2, 4, 5, 6, 7)
    assert cfg.chain_hidden_post_norm
    assert cfg.mtp_geometry(2).is_sliding and not cfg.mtp_geometry(1).is_sliding


def test_hf_text_dialect():
    d = {"model_type": "inkling_text", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding"],
         "num_mtp_layers": 2, "mtp_local_layer_ids": [1], "vocab_size": 300, "intermediate_size": 96,
         "moe_intermediate_size": 32, "n_routed_experts": 4, "n_shared_experts": 2, "num_experts_per_tok": 2,
         "mlp_layer_types": ["dense", "sparse", "sparse"], "swa_num_attention_heads": 4,
         "swa_num_key_value_heads": 4, "swa_head_dim": 16}
    cfg = ik.InklingConfig.from_hf(d)
    assert cfg.local_layer_ids == (0, 2) and cfg.full_layer_ids == (1,)
    assert cfg.num_mtp_layers == 2 and cfg.mtp_local_layer_ids == (1,)
    assert cfg.unpadded_vocab_size == cfg.vocab_size == 300
    assert cfg.dense_intermediate_size == 96 and cfg.expert_intermediate_size == 32


def test_sglang_dialect(tmp_path):
    d = {"model_type": "inkling_model", "hidden_size": 256, "num_hidden_layers": 6, "num_attention_heads": 8,
         "num_key_value_heads": 2, "head_dim": 32, "swa_num_attention_heads": 8, "swa_num_key_value_heads": 4,
         "local_layer_ids": [0, 1, 2, 3, 4], "sliding_window_size": 32, "d_rel": 8, "rel_extent": 64,
         "use_embed_norm": True, "use_sconv": True, "sconv_kernel_size": 4, "dense_mlp_idx": 2,
         "intermediate_size": 64, "dense_intermediate_size": 256, "n_routed_experts": 8, "n_shared_experts": 2,
         "num_experts_per_tok": 2, "route_scale": 8.0, "logits_mup_width_multiplier": 4.0,
         "vocab_size": 2000, "padded_vocab_size": 2048, "num_nextn_predict_layers": 3,
         "log_scaling_n_floor": 128000}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    cfg = ik.InklingConfig.from_hf(tmp_path)  # a directory works too
    assert (cfg.vocab_size, cfg.unpadded_vocab_size) == (2048, 2000)
    assert cfg.dense_layer_ids == (0, 1)
    assert (cfg.dense_intermediate_size, cfg.expert_intermediate_size) == (256, 64)
    assert cfg.num_mtp_layers == 3 and cfg.log_scaling_n_floor == 128000
    assert cfg.layer_geometry(5).log_scaling and not cfg.layer_geometry(0).log_scaling
    # an sglang config with no local_layer_ids is all full attention
    d.pop("local_layer_ids")
    assert ik.InklingConfig.from_hf(d).local_layer_ids == ()


def test_to_hf_round_trip():
    for cfg in (ik.InklingConfig.tiny(), ik.InklingConfig.small(),
                ik.InklingConfig.tiny(chain_hidden_post_norm=True, mtp_local_extent=4)):
        assert ik.InklingConfig.from_hf(cfg.to_hf()) == cfg


@pytest.mark.parametrize("bad, msg", [
    (dict(num_heads=6, num_kv_heads=4), "multiple of kv heads"),
    (dict(unpadded_vocab_size=999), "unpadded_vocab_size"),
    (dict(local_layer_ids=(7,)), "local_layer_ids out of range"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(mtp_local_layer_ids=(5,)), "mtp_local_layer_ids out of range"),
    (dict(use_sconv=False), "use_sconv"),
])
def test_validation(bad, msg):
    with pytest.raises(ValueError, match=msg):
        ik.InklingConfig.tiny(**bad)

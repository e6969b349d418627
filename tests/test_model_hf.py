"""The reference forward against HF transformers 5.24 (the independent oracle), through
both checkpoint namings and both save directions, and the in-memory HF model
(`hf_transformers.causal_lm`, the oracle of bench/decode/decode.py) against the saved checkpoint.

Tolerance: max |logit diff| <= 1e-4 * max |logit| (float32 on CPU; the two implementations
differ only in summation order, measured diffs are ~1e-7 relative)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import inkling_jax as ik
from conftest import PARITY_CONFIGS, hf_config, hf_text_config, perturb_, random_tokens

REL_TOL = 1e-4
SEQ = 40  # longer than every window (<= 8) and rel_extent (<= 16) of the parity configs

# The forward under jax.jit: one XLA compile per config and shape (~1.5 s), not one per jnp op
# (~100-200 eager compiles per config, ~3-5 s).
forward = jax.jit(ik.forward, static_argnums=1)


def assert_logits_close(ours, ref):
    ours, ref = np.asarray(ours), np.asarray(ref)
    assert ours.shape == ref.shape
    scale = np.abs(ref).max()
    assert scale > 0.5, "logits too small to be a meaningful comparison"
    err = np.abs(ours - ref).max()
    assert err <= REL_TOL * scale, f"max |diff| {err:.3g} > {REL_TOL} * logit scale {scale:.3g}"


@pytest.fixture(scope="module", params=sorted(PARITY_CONFIGS))
def hf_mm(request, tmp_path_factory, torch_threads):
    """An HF InklingForConditionalGeneration with random weights, saved in the hub naming."""
    from transformers.models.inkling import InklingForConditionalGeneration

    cfg = PARITY_CONFIGS[request.param]
    torch_threads.manual_seed(0)
    model = InklingForConditionalGeneration(hf_config(cfg)).eval()
    perturb_(model)
    path = tmp_path_factory.mktemp(f"hub_{request.param}")
    model.save_pretrained(path)
    return request.param, cfg, model, path


def test_hub_naming_parity(hf_mm, torch_threads):
    name, cfg, model, path = hf_mm
    loaded_cfg, params = ik.load_pretrained(path, dtype=jnp.float32)
    # HF saves no MTP tensors, so the loader returns the trunk (with a warning)
    assert loaded_cfg == cfg.replace(num_mtp_layers=0, mtp_local_layer_ids=())
    tokens = random_tokens(cfg, (2, SEQ), seed=1)
    with torch_threads.no_grad():
        ref = model(input_ids=torch_threads.tensor(tokens, dtype=torch_threads.long)).logits.numpy()
    assert_logits_close(forward(params, loaded_cfg, tokens), ref)


def test_our_save_loads_in_hf(hf_mm, tmp_path, torch_threads):
    """Our save_pretrained (hub naming, with MTP tensors) -> HF from_pretrained -> same logits."""
    from transformers.models.inkling import InklingForConditionalGeneration

    name, cfg, model, path = hf_mm
    _, params = ik.load_pretrained(path, dtype=jnp.float32)
    mtp = ik.init_params(cfg, jax.random.key(3))["mtp"]
    params = dict(params, mtp=mtp)
    ik.save_pretrained(tmp_path, cfg, params, naming="hub")
    reloaded = InklingForConditionalGeneration.from_pretrained(tmp_path).eval()
    tokens = random_tokens(cfg, (1, SEQ), seed=2)
    with torch_threads.no_grad():
        ref = reloaded(input_ids=torch_threads.tensor(tokens, dtype=torch_threads.long)).logits.numpy()
    assert_logits_close(forward(params, cfg, tokens), ref)
    # and our loader reads the MTP tensors back bit for bit
    cfg2, params2 = ik.load_pretrained(tmp_path, dtype=jnp.float32)
    assert cfg2 == cfg
    np.testing.assert_array_equal(params2["mtp"]["layers"][0]["input_proj"], mtp["layers"][0]["input_proj"])


@pytest.mark.parametrize("name", ["tiny", "heads"])
def test_transformers_naming_both_directions(name, tmp_path, torch_threads):
    from transformers.models.inkling import InklingForCausalLM

    cfg = PARITY_CONFIGS[name].replace(num_mtp_layers=0, mtp_local_layer_ids=())
    torch_threads.manual_seed(1)
    model = InklingForCausalLM(hf_text_config(cfg)).eval()
    perturb_(model, seed=1)
    model.save_pretrained(tmp_path / "hf")
    loaded_cfg, params = ik.load_pretrained(tmp_path / "hf", dtype=jnp.float32)
    assert loaded_cfg == cfg
    tokens = random_tokens(cfg, (2, SEQ), seed=3)
    with torch_threads.no_grad():
        ref = model(input_ids=torch_threads.tensor(tokens, dtype=torch_threads.long)).logits.numpy()
    ours = forward(params, cfg, tokens)
    assert_logits_close(ours, ref)

    ik.save_pretrained(tmp_path / "ours", cfg, params, naming="transformers")
    back = InklingForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch_threads.no_grad():
        ref2 = back(input_ids=torch_threads.tensor(tokens, dtype=torch_threads.long)).logits.numpy()
    assert_logits_close(ours, ref2)


@pytest.mark.parametrize("name, dtype", [("heads", "float32"), ("tiny", "bfloat16")])
def test_in_memory_hf_model_is_the_saved_checkpoint(name, dtype, tmp_path, torch_threads):
    """causal_lm(cfg, params, dtype) holds exactly the tensors (values and dtypes, keep-in-fp32
    modules included) that from_pretrained of our transformers-naming checkpoint loads, and
    gives our logits."""
    from transformers.models.inkling import InklingForCausalLM

    from inkling_jax.hf_transformers import causal_lm

    torch = torch_threads
    cfg = PARITY_CONFIGS[name]
    # cast on the host (cast_params does for numpy leaves): on the device a program per shape
    params = ik.cast_params(jax.tree.map(np.asarray, ik.init_params(cfg, jax.random.key(4), std=0.1)),
                            jnp.dtype(dtype))
    model = causal_lm(cfg, params, getattr(torch, dtype))
    trunk = cfg.replace(num_mtp_layers=0, mtp_local_layer_ids=())
    ik.save_pretrained(tmp_path, trunk, {k: v for k, v in params.items() if k != "mtp"}, naming="transformers")
    saved = InklingForCausalLM.from_pretrained(tmp_path, dtype=getattr(torch, dtype)).state_dict()
    got = model.state_dict()
    assert sorted(got) == sorted(saved)
    for k, v in saved.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert {str(v.dtype) for v in got.values()} >= {f"torch.{dtype}"}
    if dtype == "float32":
        tokens = random_tokens(cfg, (2, SEQ), seed=5)
        with torch.no_grad():
            ref = model(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.numpy()
        assert_logits_close(forward(params, cfg, tokens), ref)

"""Our model as HF transformers objects: its config classes, and an `InklingForCausalLM`
holding our weights in memory (the oracle of the parity tests, the comparison of
`bench/decode/decode.py`).

torch and transformers (the `test` extra) are imported when a function is called, so
importing this module costs nothing. The weight mapping is `weights.checkpoint_tensors` in
the transformers naming, the one `save_pretrained(naming="transformers")` writes: building
the model here and `InklingForCausalLM.from_pretrained` of that checkpoint give the same
tensors (`tests/test_model_hf.py` checks it).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from . import hf_config
from .config import InklingConfig
from .weights import checkpoint_tensors

Params = dict[str, Any]


def text_config(cfg: InklingConfig):
    """transformers' `InklingTextConfig` (the `inkling_text` dialect) of cfg."""
    from transformers.models.inkling import InklingTextConfig

    d = hf_config.to_transformers(cfg)
    d.pop("model_type")
    return InklingTextConfig(**d)


def mm_config(cfg: InklingConfig):
    """transformers' `InklingConfig` (`InklingForConditionalGeneration`, the hub dialect) of cfg."""
    from transformers.models.inkling import InklingConfig as HFConfig

    d = hf_config.to_hub(cfg)
    return HFConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})


def to_torch(x: np.ndarray):
    """A torch tensor with x's values and dtype, sharing x's memory where x is contiguous and
    writable (a copy otherwise). bfloat16 goes through its bits: numpy's bfloat16 is
    ml_dtypes', which torch.from_numpy does not take."""
    import torch

    x = np.require(x, requirements=["C", "W"])
    if x.dtype.name == "bfloat16":
        return torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def causal_lm(cfg: InklingConfig, params: Params, dtype: Any = None, device: Any = "cpu"):
    """`InklingForCausalLM` (eval mode) with the trunk of `params`, as `from_pretrained(...,
    dtype=dtype)` of our transformers-naming checkpoint loads it: tensors in `dtype` (default
    float32), the model's keep-in-fp32 modules in float32, on `device`. Built on the meta
    device and assigned, so the weights are held once on the host on their way.

    Raises ValueError when the mapped tensors and the model's disagree (names or shapes)."""
    import torch
    from transformers.models.inkling import InklingForCausalLM

    dtype = dtype or torch.float32
    trunk = cfg.replace(num_mtp_layers=0, mtp_local_layer_ids=())
    with torch.device("meta"):
        model = InklingForCausalLM(text_config(trunk))
    keep32 = list(getattr(model, "_keep_in_fp32_modules_strict", None) or []) + \
        list(getattr(model, "_keep_in_fp32_modules", None) or [])
    keep = re.compile("|".join(re.escape(k) for k in keep32)) if keep32 else None
    trunk_params = {k: v for k, v in params.items() if k != "mtp"}
    tensors = checkpoint_tensors(trunk, trunk_params, "transformers")
    expected = model.state_dict()
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    bad = [f"{k}: {tuple(tensors[k].shape)} vs {tuple(expected[k].shape)}" for k in tensors
           if k in expected and tuple(tensors[k].shape) != tuple(expected[k].shape)]
    if missing or extra or bad:
        raise ValueError(f"HF state dict mismatch: missing {missing[:5]}, unexpected {extra[:5]}, shapes {bad[:5]}")
    state = {}
    for name in list(tensors):
        dt = torch.float32 if keep is not None and keep.search(name) else dtype
        state[name] = to_torch(tensors.pop(name)).to(device=device, dtype=dt).contiguous()
    model.load_state_dict(state, strict=True, assign=True)
    left = [n for n, x in list(model.named_parameters()) + list(model.named_buffers()) if x.is_meta]
    if left:
        raise ValueError(f"HF model tensors left on the meta device: {left[:5]}")
    return model.eval()

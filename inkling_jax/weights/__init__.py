"""Checkpoint I/O (names.py, safetensors_io.py, orbax_io.py): safetensors in the hub naming and the HF
transformers naming, and orbax.

Hub naming (what HF `InklingForConditionalGeneration.save_pretrained` writes, and sglang
reads): `model.llm.embed.weight`, `model.llm.layers.N.attn.wq_du.weight`, fused and
*interleaved* gate/up tensors (`mlp.w13_dn.weight`, `mlp.experts.w13_weight`, ...: even rows
gate, odd rows up; a config with `inference_moe_w13_interleaved: false` says they are split
halves instead), `[D, 1, K]` conv weights, MTP depths under `model.mtp.layers.N.*`.

Transformers naming (`InklingForCausalLM`): `model.layers.N.self_attn.q_proj.weight`,
separate gate/up projections, `lm_head.weight`. It has no MTP tensors of its own; when
present we read and write them under the hub's `model.mtp.*` names.

Torch stores linear weights [out, in]; our params are [in, out] (see `model/params.py`).

Every param leaf has an `Entry`: its checkpoint tensors and a reader that produces any block
of the leaf from slices of them. A single-device load reads whole leaves; a mesh load
(`load_pretrained(path, mesh=)`) asks each device's block of the leaf's sharded layout
(`parallel/plan.py`) through `jax.make_array_from_callback`, so a device reads only its
slices of the files. Orbax checkpoints hold the original layout; with a mesh they are
restored per device and relaid out on the devices.

Nested parameter names go through `flat_params` / `nest_params` (`model/params.py`):
entries, layouts and orbax metadata meet as {("layers", 3, "attn", "wqkvr"): leaf}.
"""

from ..model.params import flat_params, nest_params
from .names import Entry, detect_naming, entries
from .orbax_io import load_checkpoint, save_checkpoint
from .safetensors_io import (
           CONFIG_FILE,
           INDEX_FILE,
           checkpoint_tensors,
           load_pretrained,
           save_pretrained,
)

__all__ = ["CONFIG_FILE", "INDEX_FILE", "Entry", "checkpoint_tensors", "detect_naming", "entries", "flat_params",
           "load_checkpoint", "load_pretrained", "nest_params", "save_checkpoint", "save_pretrained"]

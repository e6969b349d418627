"""Checkpoint I/O: safetensors in the hub naming and the HF transformers naming, and orbax.

Hub naming (what HF `InklingForConditionalGeneration.save_pretrained` writes, and sglang
reads): `model.llm.embed.weight`, `model.llm.layers.N.attn.wq_du.weight`, fused and
*interleaved* gate/up tensors (`mlp.w13_dn.weight`, `mlp.experts.w13_weight`, ...: even rows
gate, odd rows up; a config with `inference_moe_w13_interleaved: false` says they are split
halves instead), `[D, 1, K]` conv weights, MTP depths under `model.mtp.layers.N.*`.

Transformers naming (`InklingForCausalLM`): `model.layers.N.self_attn.q_proj.weight`,
separate gate/up projections, `lm_head.weight`. It has no MTP tensors of its own; when
present we read and write them under the hub's `model.mtp.*` names.

Torch stores linear weights [out, in]; our params are [in, out] (see `model/params.py`).
"""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from .config import AttentionGeometry, InklingConfig
from .model.params import cast_params, check_params, param_shapes

Params = dict[str, Any]
Array = np.ndarray


@dataclass(frozen=True)
class Entry:
    """One parameter leaf and the checkpoint tensor(s) it is made of."""

    path: tuple[Any, ...]  # path into the params pytree
    names: tuple[str, ...]  # checkpoint tensor names
    shapes: tuple[tuple[int, ...], ...]  # their expected shapes
    to_param: Callable[[list[Array]], Array]
    to_tensors: Callable[[Array], list[Array]]


# ------------------------------------------------------------------ array transforms


def _t(x: Array) -> Array:
    return np.ascontiguousarray(np.swapaxes(x, -1, -2))


def _interleave(gate: Array, up: Array, axis: int) -> Array:
    """[.., F, ..] gate and up -> [.., 2F, ..] with gate on even rows along axis."""
    stacked = np.stack([gate, up], axis=axis + 1)
    shape = list(gate.shape)
    shape[axis] *= 2
    return stacked.reshape(shape)


def _deinterleave(x: Array, axis: int) -> tuple[Array, Array]:
    return np.take(x, np.arange(0, x.shape[axis], 2), axis=axis), np.take(x, np.arange(1, x.shape[axis], 2), axis=axis)


def _conv_in(w: Array) -> Array:  # [D, 1, K] -> [K, D]
    return np.ascontiguousarray(w[:, 0, :].T)


def _conv_out(w: Array) -> Array:  # [K, D] -> [D, 1, K]
    return np.ascontiguousarray(w.T[:, None, :])


def _same(xs: list[Array]) -> Array:
    return xs[0]


def _one(x: Array) -> list[Array]:
    return [x]


# ------------------------------------------------------------------------ name tables


def _simple(path, name, shape, to_param=_same, to_tensors=_one) -> Entry:
    return Entry(tuple(path), (name,), (tuple(shape),), to_param, to_tensors)


def _linear(path, name, in_dim, out_dim) -> Entry:  # param [in, out] <-> torch [out, in]
    return Entry(tuple(path), (name,), ((out_dim, in_dim),), lambda xs: _t(xs[0]), lambda x: [_t(x)])


def _conv(path, name, k, d) -> Entry:
    return Entry(tuple(path), (name,), ((d, 1, k),), lambda xs: _conv_in(xs[0]), lambda x: [_conv_out(x)])


def _qkvr(path, names, cfg: InklingConfig, g: AttentionGeometry) -> Entry:
    h = cfg.hidden_size
    dims = (g.q_dim, g.kv_dim, g.kv_dim, g.num_heads * cfg.d_rel)

    def split(x):
        cuts = np.cumsum(dims)[:-1]
        return [_t(part) for part in np.split(x, cuts, axis=-1)]

    return Entry(tuple(path), tuple(names), tuple((d, h) for d in dims),
                 lambda xs: np.concatenate([_t(x) for x in xs], axis=-1), split)


def _gate_up_fused(path, name, lead: tuple[int, ...], f: int, h: int, interleaved: bool) -> Entry:
    """torch [*lead, 2F, H] (interleaved or split halves) <-> param [*lead, H, 2F] (gate | up)."""
    axis = len(lead)

    def to_param(xs):
        x = xs[0]
        gate, up = _deinterleave(x, axis) if interleaved else np.split(x, 2, axis=axis)
        return np.concatenate([_t(gate), _t(up)], axis=-1)

    def to_tensors(x):
        gate, up = _t(x[..., :f]), _t(x[..., f:])
        return [_interleave(gate, up, axis) if interleaved else np.concatenate([gate, up], axis=axis)]

    return Entry(tuple(path), (name,), ((*lead, 2 * f, h),), to_param, to_tensors)


def _gate_up_split(path, gate_name, up_name, lead: tuple[int, ...], f: int, h: int) -> Entry:
    """torch gate [*lead, F, H] and up [*lead, F, H] <-> param [*lead, H, 2F]."""
    return Entry(tuple(path), (gate_name, up_name), ((*lead, f, h), (*lead, f, h)),
                 lambda xs: np.concatenate([_t(xs[0]), _t(xs[1])], axis=-1),
                 lambda x: [_t(x[..., :f]), _t(x[..., f:])])


def _layer_entries(cfg: InklingConfig, path: tuple, prefix: str, g: AttentionGeometry, dense: bool,
                   naming: str, interleaved: bool) -> list[Entry]:
    h, k = cfg.hidden_size, cfg.conv_kernel_size
    hub = naming == "hub"
    a = "attn." if hub else "self_attn."
    out = [
        _simple((*path, "attn_norm"), prefix + ("attn_norm.weight" if hub else "input_layernorm.weight"), (h,)),
        _simple((*path, "mlp_norm"), prefix + ("mlp_norm.weight" if hub else "post_attention_layernorm.weight"), (h,)),
        _conv((*path, "attn_conv"), prefix + ("attn_sconv.weight" if hub else "attn_sconv.conv1d.weight"), k, h),
        _conv((*path, "mlp_conv"), prefix + ("mlp_sconv.weight" if hub else "mlp_sconv.conv1d.weight"), k, h),
        _qkvr((*path, "attn", "wqkvr"),
              [prefix + a + n for n in (("wq_du.weight", "wk_dv.weight", "wv_dv.weight", "wr_du.weight") if hub else
                                        ("q_proj.weight", "k_proj.weight", "v_proj.weight", "r_proj.weight"))], cfg, g),
        _linear((*path, "attn", "wo"), prefix + a + ("wo_ud.weight" if hub else "o_proj.weight"), g.q_dim, h),
        _simple((*path, "attn", "q_norm"), prefix + a + "q_norm.weight", (g.head_dim,)),
        _simple((*path, "attn", "k_norm"), prefix + a + "k_norm.weight", (g.head_dim,)),
        _conv((*path, "attn", "k_conv"), prefix + a + ("k_sconv.weight" if hub else "k_sconv.conv1d.weight"), k, g.kv_dim),
        _conv((*path, "attn", "v_conv"), prefix + a + ("v_sconv.weight" if hub else "v_sconv.conv1d.weight"), k, g.kv_dim),
        _simple((*path, "attn", "rel_proj"), prefix + a + "rel_logits_proj.proj", (cfg.d_rel, g.rel_extent)),
    ]
    m = (*path, "mlp")
    mp = prefix + "mlp."
    if dense:
        i = cfg.dense_intermediate_size
        if hub:
            out.append(_gate_up_fused((*m, "w13"), mp + "w13_dn.weight", (), i, h, interleaved))
            out.append(_linear((*m, "w2"), mp + "w2_md.weight", i, h))
        else:
            out.append(_gate_up_split((*m, "w13"), mp + "gate_proj.weight", mp + "up_proj.weight", (), i, h))
            out.append(_linear((*m, "w2"), mp + "down_proj.weight", i, h))
        if cfg.use_global_scale:
            out.append(_simple((*m, "global_scale"), mp + "global_scale", (1,)))
        return out
    e, s, f = cfg.n_routed_experts, cfg.n_shared_experts, cfg.expert_intermediate_size
    sink = cfg.shared_expert_sink and cfg.norm_after_topk
    out.append(_linear((*m, "router"), mp + "gate.weight", h, e + s if sink else e))
    if cfg.use_gate_bias:
        out.append(_simple((*m, "router_bias"), mp + ("gate.bias" if hub else "gate.e_score_correction_bias"), (e,)))
    if cfg.use_global_scale:
        out.append(_simple((*m, "router_scale"), mp + "gate.global_scale", (1,)))
    if hub:
        out.append(_gate_up_fused((*m, "w13"), mp + "experts.w13_weight", (e,), f, h, interleaved))
        out.append(Entry((*m, "w2"), (mp + "experts.w2_weight",), ((e, h, f),), lambda xs: _t(xs[0]), lambda x: [_t(x)]))
    else:
        out.append(_gate_up_fused((*m, "w13"), mp + "experts.gate_up_proj", (e,), f, h, interleaved=False))
        out.append(Entry((*m, "w2"), (mp + "experts.down_proj",), ((e, h, f),), lambda xs: _t(xs[0]), lambda x: [_t(x)]))
    if s > 0:
        ns, fs = (s, f) if sink else (1, s * cfg.shared_experts_size * f)
        if hub:
            out.append(_gate_up_fused((*m, "shared_w13"), mp + "shared_experts.shared_w13_weight", (ns,), fs, h,
                                      interleaved))
            out.append(Entry((*m, "shared_w2"), (mp + "shared_experts.shared_w2_weight",), ((ns, h, fs),),
                             lambda xs: _t(xs[0]), lambda x: [_t(x)]))
        else:
            out.append(_gate_up_split((*m, "shared_w13"), mp + "shared_experts.gate_proj",
                                      mp + "shared_experts.up_proj", (ns,), fs, h))
            out.append(Entry((*m, "shared_w2"), (mp + "shared_experts.down_proj",), ((ns, h, fs),),
                             lambda xs: _t(xs[0]), lambda x: [_t(x)]))
    return out


def entries(cfg: InklingConfig, naming: str, interleaved: bool = True, prefix: str = "") -> list[Entry]:
    """Every parameter leaf with its checkpoint tensors, for naming "hub" or "transformers".

    prefix: the transformers naming's model prefix ("model." for InklingForCausalLM,
    "model.language_model." for an in-memory InklingForConditionalGeneration)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    if naming == "hub":
        top = "model.llm."
        out = [
            _simple(("embed",), top + "embed.weight", (v, h)),
            _simple(("final_norm",), top + "norm.weight", (h,)),
            _linear(("unembed",), top + "unembed.weight", h, v),
        ]
        if cfg.use_embed_norm:
            out.append(_simple(("embed_norm",), top + "embed_norm.weight", (h,)))
        layer_prefix = top + "layers."
    elif naming == "transformers":
        top = prefix or "model."
        out = [
            _simple(("embed",), top + "embed_tokens.weight", (v, h)),
            _simple(("final_norm",), top + "norm.weight", (h,)),
            _linear(("unembed",), "lm_head.weight", h, v),
        ]
        if cfg.use_embed_norm:
            out.append(_simple(("embed_norm",), top + "embed_tokens.embed_norm.weight", (h,)))
        layer_prefix = top + "layers."
    else:
        raise ValueError(f"unknown naming {naming!r} (expected 'hub' or 'transformers')")
    for i in range(cfg.num_layers):
        out += _layer_entries(cfg, ("layers", i), f"{layer_prefix}{i}.", cfg.layer_geometry(i), cfg.is_dense(i),
                              naming, interleaved)
    # MTP depths: hub names under either naming (transformers has none of its own)
    mtp = "model.mtp."
    for d in range(cfg.num_mtp_layers):
        p = f"{mtp}layers.{d}."
        path = ("mtp", "layers", d)
        out += [
            _simple((*path, "hidden_norm"), p + "hidden_norm.weight", (h,)),
            _simple((*path, "embed_norm"), p + "embed_norm.weight", (h,)),
            _linear((*path, "input_proj"), p + "input_proj.weight", 2 * h, h),
        ]
        out += _layer_entries(cfg, (*path, "block"), p + "transformer_block.", cfg.mtp_geometry(d), True, "hub",
                              interleaved)
    if cfg.num_mtp_layers and cfg.chain_hidden_post_norm:
        out.append(_simple(("mtp", "chain_norm"), mtp + "chain_norm.weight", (h,)))
    return out


# Alternative spellings seen in checkpoints, mapped to the names the tables use.
_ALIASES = (
    (re.compile(r"^model\.llm\.embed_tokens\.embed_norm\.weight$"), "model.llm.embed_norm.weight"),
    (re.compile(r"^model\.llm\.embed_tokens\.weight$"), "model.llm.embed.weight"),
)


# ------------------------------------------------------------------------ safetensors


class _TensorFiles:
    """Lazy reader over a directory of (possibly sharded) safetensors files."""

    def __init__(self, path: str):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise ValueError(f"load_pretrained: no *.safetensors files in {path}")
            weight_map = {}
            for fname in files:
                with safe_open(os.path.join(path, fname), "np") as f:
                    for k in f.keys():
                        weight_map[k] = fname
        self.path = path
        self.location = {}
        for name, fname in weight_map.items():
            canonical = name
            for pattern, repl in _ALIASES:
                if pattern.match(name):
                    canonical = repl
            self.location[canonical] = (fname, name)
        self._handles: dict[str, Any] = {}

    def names(self) -> set[str]:
        return set(self.location)

    def shape(self, name: str) -> tuple[int, ...]:
        fname, stored = self.location[name]
        return tuple(self._open(fname).get_slice(stored).get_shape())

    def get(self, name: str) -> Array:
        fname, stored = self.location[name]
        return self._open(fname).get_tensor(stored)

    def _open(self, fname: str):
        if fname not in self._handles:
            self._handles[fname] = safe_open(os.path.join(self.path, fname), "np")
        return self._handles[fname]


def detect_naming(names: Iterable[str]) -> tuple[str, str]:
    """("hub", "") or ("transformers", model prefix) from the tensor names."""
    names = list(names)
    if any(n.startswith("model.llm.") for n in names):
        return "hub", ""
    if any(n.startswith("model.language_model.layers.") for n in names):
        return "transformers", "model.language_model."
    if any(n.startswith("model.layers.") for n in names):
        return "transformers", "model."
    raise ValueError("load_pretrained: cannot tell the tensor naming (no model.llm.* or model.layers.* tensors)")


_IGNORED = re.compile(r"^model\.(visual|vision_tower|audio|audio_tower)\.|^model\.vision|^model\.mm_")


def load_pretrained(path: str | os.PathLike, dtype: Any = jnp.bfloat16, cfg: InklingConfig | None = None
                    ) -> tuple[InklingConfig, Params]:
    """Read config.json and the safetensors of `path` (hub or transformers naming, sharded or
    not). Returns (cfg, params) with params in `dtype` (fp32 leaves stay fp32).

    Raises ValueError naming every missing, unexpected (text-model) or mis-shaped tensor."""
    path = os.fspath(path)
    raw = {}
    if os.path.exists(os.path.join(path, "config.json")):
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
    if cfg is None:
        cfg = InklingConfig.from_hf(raw)
    text_raw = raw.get("text_config", raw)
    interleaved = bool(text_raw.get("inference_moe_w13_interleaved", raw.get("inference_moe_w13_interleaved", True)))
    files = _TensorFiles(path)
    naming, prefix = detect_naming(files.names())
    if cfg.num_mtp_layers and not any(n.startswith("model.mtp.") for n in files.names()):
        # HF transformers saves no MTP tensors: the trunk loads, speculative decoding is off.
        warnings.warn(f"load_pretrained({path}): config declares {cfg.num_mtp_layers} MTP depths but the "
                      "checkpoint has no model.mtp.* tensors; loading the trunk only (num_mtp_layers=0)")
        cfg = cfg.replace(num_mtp_layers=0, mtp_local_layer_ids=())
    table = entries(cfg, naming, interleaved=interleaved, prefix=prefix)

    problems = []
    for e in table:
        for name, shape in zip(e.names, e.shapes):
            if name not in files.location:
                problems.append(f"missing tensor {name} (expected shape {shape})")
            elif files.shape(name) != shape:
                problems.append(f"tensor {name} has shape {files.shape(name)}, expected {shape}")
    known = {n for e in table for n in e.names}
    for name in sorted(files.names() - known):
        if _IGNORED.search(name):
            continue  # multimodal towers: not part of the text model
        problems.append(f"unexpected tensor {name}")
    if problems:
        raise ValueError(f"load_pretrained({path}): checkpoint does not match the config:\n  " + "\n  ".join(problems))

    params: Params = jax.tree_util.tree_map(lambda s: None, param_shapes(cfg),
                                            is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x))
    for e in table:
        value = e.to_param([np.asarray(files.get(n)) for n in e.names])
        _set(params, e.path, value)
    params = cast_params(params, dtype)
    check_params(cfg, params)
    return cfg, params


def _set(tree: Any, path: tuple, value: Any) -> None:
    node = tree
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _get(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _to_numpy(x: Any, dtype: Any) -> Array:
    x = jax.device_get(x)
    x = np.asarray(x)
    return x.astype(dtype) if dtype is not None else x


# fp32 leaves that stay fp32 when a checkpoint is written in a lower precision
KEEP_FP32 = frozenset({"k_conv", "v_conv", "attn_conv", "mlp_conv", "router", "router_bias", "router_scale"})


def checkpoint_tensors(cfg: InklingConfig, params: Params, naming: str = "hub", dtype: Any = None) -> dict[str, Array]:
    """The checkpoint tensors of `params` (numpy, torch layout) under `naming` ("hub" or
    "transformers"): what `save_pretrained` writes, and what HF's modules hold (see
    `hf_transformers.causal_lm`). dtype: the tensors' dtype (default: as the params are;
    fp32 conv and router leaves stay fp32)."""
    check_params(cfg, params)
    np_dtype = None if dtype is None else np.dtype(jnp.dtype(dtype))
    tensors: dict[str, Array] = {}
    for e in entries(cfg, naming):
        value = _get(params, e.path)
        keep32 = str(value.dtype) == "float32" and e.path[-1] in KEEP_FP32
        arr = _to_numpy(value, None if (np_dtype is None or keep32) else np_dtype)
        for name, t in zip(e.names, e.to_tensors(arr)):
            tensors[name] = np.ascontiguousarray(t)
    return tensors


def save_pretrained(path: str | os.PathLike, cfg: InklingConfig, params: Params, naming: str = "hub",
                    dtype: Any = None, max_shard_bytes: int = 4 << 30) -> None:
    """Write config.json and safetensors (sharded above `max_shard_bytes`, with an index).

    naming "hub" writes what HF's InklingForConditionalGeneration reads (with the
    `inkling_mm_model` config); "transformers" writes InklingForCausalLM's layout and config.
    dtype: the tensor dtype on disk (default: as the params are; fp32 leaves stay fp32)."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors = checkpoint_tensors(cfg, params, naming, dtype)
    np_dtype = None if dtype is None else np.dtype(jnp.dtype(dtype))
    config = cfg.to_hf()
    if naming == "transformers":
        config = dict(config["text_config"], architectures=["InklingForCausalLM"])
    torch_dtype = str(np.dtype(np_dtype or np.float32)) if np_dtype is not None else _dominant_dtype(tensors)
    config["dtype"] = torch_dtype
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    _write_shards(path, tensors, max_shard_bytes)


def _dominant_dtype(tensors: dict[str, Array]) -> str:
    sizes: dict[str, int] = {}
    for t in tensors.values():
        sizes[str(t.dtype)] = sizes.get(str(t.dtype), 0) + t.nbytes
    return max(sizes, key=sizes.get) if sizes else "float32"


def _write_shards(path: str, tensors: dict[str, Array], max_shard_bytes: int) -> None:
    shards: list[dict[str, Array]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name]
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    for stale in os.listdir(path):
        if stale.endswith(".safetensors") or stale == "model.safetensors.index.json":
            os.remove(os.path.join(path, stale))
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    n = len(shards)
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.nbytes for t in tensors.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


# ----------------------------------------------------------------------------- orbax


def save_checkpoint(path: str | os.PathLike, cfg: InklingConfig, params: Params) -> None:
    """Orbax checkpoint of the params, with the config beside it (config.json)."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf(), f, indent=2)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.join(path, "params"), params, force=True)
    ckptr.wait_until_finished()


def load_checkpoint(path: str | os.PathLike, dtype: Any = None) -> tuple[InklingConfig, Params]:
    """Inverse of save_checkpoint. dtype=None keeps the saved dtypes."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    cfg = InklingConfig.from_hf(os.path.join(path, "config.json"))
    params = ocp.StandardCheckpointer().restore(os.path.join(path, "params"))
    params = _relist(params, param_shapes(cfg))
    if dtype is not None:
        params = cast_params(params, dtype)
    check_params(cfg, params)
    return cfg, params


def _relist(tree: Any, like: Any) -> Any:
    """Orbax restores lists as dicts keyed '0', '1', ...; put the lists back."""
    if isinstance(like, list):
        items = tree if isinstance(tree, list) else [tree[str(i)] if str(i) in tree else tree[i] for i in range(len(like))]
        return [_relist(t, l) for t, l in zip(items, like)]
    if isinstance(like, dict):
        return {k: _relist(tree[k], v) for k, v in like.items()}
    return tree

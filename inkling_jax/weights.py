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

Every param leaf has an `Entry`: its checkpoint tensors and a reader that produces any block
of the leaf from slices of them. A single-device load reads whole leaves; a mesh load
(`load_pretrained(path, mesh=)`) asks each device's block of the leaf's sharded layout
(`parallel/plan.py`) through `jax.make_array_from_callback`, so a device reads only its
slices of the files. Orbax checkpoints hold the original layout; with a mesh they are
restored per device and relaid out on the devices.

Nested parameter names go through `flax.traverse_util` (`flat_params` / `nest_params`):
entries, layouts and orbax metadata meet as {("layers", 3, "attn", "wqkvr"): leaf}.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import uuid
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from jax.sharding import Mesh, NamedSharding
from safetensors import safe_open
from safetensors.numpy import save_file

from .config import AttentionGeometry, InklingConfig
from .model.params import cast_params, check_params, leaf_dtype, param_shapes
from .parallel.plan import ShardPlan

Params = dict[str, Any]
Array = np.ndarray


# A reader of checkpoint tensors: fetch(name, index) = tensor[np.ix_(*index)], with one
# array of indices per tensor dimension (reading only the slices that cover them).
Fetch = Callable[[str, tuple[np.ndarray, ...]], Array]


@dataclass(frozen=True)
class Entry:
    """One parameter leaf and the checkpoint tensor(s) it is made of.

    `read(index, fetch)` returns the block param[np.ix_(*index)] of the leaf (one array of
    param indices per dimension) by fetching only the source tensors' elements that block
    needs: the whole leaf for a single-device load, one device's shard for a mesh load."""

    path: tuple[Any, ...]  # path into the params pytree
    names: tuple[str, ...]  # checkpoint tensor names
    shapes: tuple[tuple[int, ...], ...]  # their expected shapes
    param_shape: tuple[int, ...]
    read: Callable[[tuple[np.ndarray, ...], Fetch], Array]
    to_tensors: Callable[[Array], list[Array]]

    def to_param(self, fetch: Fetch) -> Array:
        """The whole leaf."""
        return self.read(tuple(np.arange(n) for n in self.param_shape), fetch)


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


def _conv_out(w: Array) -> Array:  # [K, D] -> [D, 1, K]
    return np.ascontiguousarray(w.T[:, None, :])


# ------------------------------------------------------------------------ name tables


def _simple(path, name, shape) -> Entry:
    return Entry(tuple(path), (name,), (tuple(shape),), tuple(shape), lambda idx, fetch: fetch(name, idx),
                 lambda x: [x])


def _linear(path, name, in_dim, out_dim) -> Entry:  # param [in, out] <-> torch [out, in]
    return Entry(tuple(path), (name,), ((out_dim, in_dim),), (in_dim, out_dim),
                 lambda idx, fetch: fetch(name, (idx[1], idx[0])).T, lambda x: [_t(x)])


def _batched_linear(path, name, lead: tuple[int, ...], in_dim, out_dim) -> Entry:  # [*lead, in, out] <-> [*lead, out, in]
    return Entry(tuple(path), (name,), ((*lead, out_dim, in_dim),), (*lead, in_dim, out_dim),
                 lambda idx, fetch: np.swapaxes(fetch(name, (*idx[:-2], idx[-1], idx[-2])), -1, -2),
                 lambda x: [_t(x)])


def _conv(path, name, k, d) -> Entry:  # param [K, D] <-> torch [D, 1, K]
    return Entry(tuple(path), (name,), ((d, 1, k),), (k, d),
                 lambda idx, fetch: fetch(name, (idx[1], np.zeros(1, np.int64), idx[0]))[:, 0, :].T,
                 lambda x: [_conv_out(x)])


def _read_concat(idx: tuple[np.ndarray, ...], fetch: Fetch, names: tuple[str, ...], widths: tuple[int, ...]) -> Array:
    """A block of param [*lead, H, sum(widths)] whose last dimension concatenates sources
    stored torch-style [*lead, width_i, H]: each source is fetched for its own columns only."""
    cols = idx[-1]
    ends = np.cumsum(widths)
    source = np.searchsorted(ends, cols, side="right")
    out = None
    for s, name in enumerate(names):
        sel = np.nonzero(source == s)[0]
        if not len(sel):
            continue
        block = np.swapaxes(fetch(name, (*idx[:-2], cols[sel] - (ends[s] - widths[s]), idx[-2])), -1, -2)
        if out is None:
            out = np.empty(tuple(len(i) for i in idx), block.dtype)
        out[..., sel] = block
    return out


def _qkvr(path, names, cfg: InklingConfig, g: AttentionGeometry) -> Entry:
    h = cfg.hidden_size
    dims = (g.q_dim, g.kv_dim, g.kv_dim, g.num_heads * cfg.d_rel)

    def split(x):
        cuts = np.cumsum(dims)[:-1]
        return [_t(part) for part in np.split(x, cuts, axis=-1)]

    return Entry(tuple(path), tuple(names), tuple((d, h) for d in dims), (h, sum(dims)),
                 lambda idx, fetch: _read_concat(idx, fetch, tuple(names), dims), split)


def _gate_up_fused(path, name, lead: tuple[int, ...], f: int, h: int, interleaved: bool) -> Entry:
    """torch [*lead, 2F, H] (interleaved or split halves) <-> param [*lead, H, 2F] (gate | up)."""
    axis = len(lead)

    def read(idx, fetch):
        c = idx[-1]  # param column c: gate row c or up row c - F
        rows = np.where(c < f, 2 * c, 2 * (c - f) + 1) if interleaved else c
        return np.swapaxes(fetch(name, (*idx[:-2], rows, idx[-2])), -1, -2)

    def to_tensors(x):
        gate, up = _t(x[..., :f]), _t(x[..., f:])
        return [_interleave(gate, up, axis) if interleaved else np.concatenate([gate, up], axis=axis)]

    return Entry(tuple(path), (name,), ((*lead, 2 * f, h),), (*lead, h, 2 * f), read, to_tensors)


def _gate_up_split(path, gate_name, up_name, lead: tuple[int, ...], f: int, h: int) -> Entry:
    """torch gate [*lead, F, H] and up [*lead, F, H] <-> param [*lead, H, 2F]."""
    return Entry(tuple(path), (gate_name, up_name), ((*lead, f, h), (*lead, f, h)), (*lead, h, 2 * f),
                 lambda idx, fetch: _read_concat(idx, fetch, (gate_name, up_name), (f, f)),
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
        out.append(_batched_linear((*m, "w2"), mp + "experts.w2_weight", (e,), f, h))
    else:
        out.append(_gate_up_fused((*m, "w13"), mp + "experts.gate_up_proj", (e,), f, h, interleaved=False))
        out.append(_batched_linear((*m, "w2"), mp + "experts.down_proj", (e,), f, h))
    if s > 0:
        ns, fs = (s, f) if sink else (1, s * cfg.shared_experts_size * f)
        if hub:
            out.append(_gate_up_fused((*m, "shared_w13"), mp + "shared_experts.shared_w13_weight", (ns,), fs, h,
                                      interleaved))
            out.append(_batched_linear((*m, "shared_w2"), mp + "shared_experts.shared_w2_weight", (ns,), fs, h))
        else:
            out.append(_gate_up_split((*m, "shared_w13"), mp + "shared_experts.gate_proj",
                                      mp + "shared_experts.up_proj", (ns,), fs, h))
            out.append(_batched_linear((*m, "shared_w2"), mp + "shared_experts.down_proj", (ns,), fs, h))
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


INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
# Marks an index written by save_pretrained: only the shards such an index lists are ever
# deleted by a later save_pretrained into the same directory.
WRITER_TAG = "inkling_jax.save_pretrained"


class _TensorFiles:
    """Lazy reader over a directory of (possibly sharded) safetensors files.

    Every failure to read is a ValueError naming the file (and the tensor)."""

    def __init__(self, path: str):
        self.path = path
        self._handles: dict[str, Any] = {}
        index = os.path.join(path, INDEX_FILE)
        if os.path.exists(index):
            weight_map = _read_json(index, "load_pretrained").get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"load_pretrained: {index} has no 'weight_map' object")
            for fname in sorted(set(weight_map.values())):
                if not os.path.isfile(os.path.join(path, fname)):
                    raise ValueError(f"load_pretrained: {index} lists {fname}, which does not exist in {path}")
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise ValueError(f"load_pretrained: no *.safetensors files in {path}")
            weight_map = {}
            for fname in files:
                for k in self._open(fname).keys():
                    weight_map[k] = fname
        self.indexed = os.path.exists(index)
        self.location = {}
        for name, fname in weight_map.items():
            canonical = name
            for pattern, repl in _ALIASES:
                if pattern.match(name):
                    canonical = repl
            self.location[canonical] = (fname, name)

    def names(self) -> set[str]:
        return set(self.location)

    def file_of(self, name: str) -> str:
        return self.location[name][0]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def fetch(self, name: str, index: tuple[np.ndarray, ...]) -> Array:
        """tensor[np.ix_(*index)], reading one slice per block of contiguous indices (never the
        whole tensor unless every index is asked for)."""
        sl = self._slice(name)
        fname = self.location[name][0]
        wanted = [np.unique(i) for i in index]
        runs = [_contiguous_runs(u) for u in wanted]
        try:
            if all(len(r) == 1 for r in runs):  # one block: the common case
                block = np.asarray(sl[tuple(slice(lo, hi) for lo, hi in (r[0] for r in runs))])
            else:
                block = None
                for combo in itertools.product(*runs):
                    part = np.asarray(sl[tuple(slice(lo, hi) for lo, hi in combo)])
                    if block is None:
                        block = np.empty(tuple(len(u) for u in wanted), part.dtype)
                    where = tuple(slice(np.searchsorted(u, lo), np.searchsorted(u, lo) + (hi - lo))
                                  for u, (lo, hi) in zip(wanted, combo))
                    block[where] = part
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type
            raise ValueError(f"load_pretrained: cannot read tensor {name} from {os.path.join(self.path, fname)}: "
                             f"{exc}") from exc
        positions = [np.searchsorted(u, i) for u, i in zip(wanted, index)]
        if all(len(p) == n and (p == np.arange(n)).all() for p, n in zip(positions, block.shape)):
            return block
        return block[np.ix_(*positions)]

    def _slice(self, name: str):
        fname, stored = self.location[name]
        handle = self._open(fname)
        if stored not in handle.keys():
            raise _NotInFile(f"tensor {name}: {INDEX_FILE} maps it to {fname}, which does not contain it")
        return handle.get_slice(stored)

    def _open(self, fname: str):
        if fname not in self._handles:
            full = os.path.join(self.path, fname)
            try:
                self._handles[fname] = safe_open(full, "np")
            except Exception as exc:  # noqa: BLE001 - truncated / corrupt files raise SafetensorError
                raise ValueError(f"load_pretrained: {full} is not a readable safetensors file ({exc})") from exc
        return self._handles[fname]


class _NotInFile(ValueError):
    """The index names a file for a tensor that the file does not hold."""


def _contiguous_runs(sorted_unique: np.ndarray) -> list[tuple[int, int]]:
    """[lo, hi) runs of consecutive integers covering a sorted unique index array."""
    if not len(sorted_unique):
        return [(0, 0)]
    breaks = np.nonzero(np.diff(sorted_unique) != 1)[0] + 1
    return [(int(r[0]), int(r[-1]) + 1) for r in np.split(sorted_unique, breaks)]


def _read_json(path: str, who: str) -> dict:
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"{who}: cannot read {path}: {exc.strerror or exc}") from exc
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{who}: {path} is not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{who}: {path} does not hold a JSON object")
    return value


def _read_config(path: str, who: str) -> tuple[dict, InklingConfig]:
    """The raw config.json of a checkpoint directory and the InklingConfig it describes."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.exists(file):
        raise ValueError(f"{who}: {path} has no {CONFIG_FILE}")
    raw = _read_json(file, who)
    try:
        return raw, InklingConfig.from_hf(raw)
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{who}: {file} does not describe an Inkling model: {exc}") from exc


def _check_directory(path: str, who: str) -> None:
    if not os.path.exists(path):
        raise ValueError(f"{who}: {path} does not exist")
    if not os.path.isdir(path):
        raise ValueError(f"{who}: {path} is not a directory")


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


def load_pretrained(path: str | os.PathLike, dtype: Any = jnp.bfloat16, cfg: InklingConfig | None = None,
                    mesh: Mesh | None = None) -> tuple[InklingConfig, Params]:
    """Read config.json and the safetensors of `path` (hub or transformers naming, sharded or
    not). Returns (cfg, params) with params in `dtype` (fp32 leaves stay fp32).

    mesh: a `make_mesh` mesh. Then params are global arrays in the sharded layout of
    `ShardPlan(cfg, mesh)`, and each device's block is read straight from the files (only the
    slices it needs, `jax.make_array_from_callback`): the host holds one device's block of
    one leaf at a time, never a whole leaf of a sharded tensor, let alone the whole model.

    Raises ValueError naming the path, file and tensor: a missing path or config.json, a
    config.json that is not JSON or not an Inkling config, a file that is not safetensors
    (truncated, say), and every missing, unexpected (text-model) or mis-shaped tensor."""
    path = os.fspath(path)
    _check_directory(path, "load_pretrained")
    raw: dict = {}
    if cfg is None or os.path.exists(os.path.join(path, CONFIG_FILE)):
        raw, file_cfg = _read_config(path, "load_pretrained")
        cfg = cfg or file_cfg
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
                continue
            try:
                got = files.shape(name)
            except _NotInFile as exc:
                problems.append(str(exc))
                continue
            if got != shape:
                problems.append(f"tensor {name} has shape {got}, expected {shape} (in {files.file_of(name)})")
    known = {n for e in table for n in e.names}
    for name in sorted(files.names() - known):
        if _IGNORED.search(name):
            continue  # multimodal towers: not part of the text model
        problems.append(f"unexpected tensor {name} (in {files.file_of(name)})")
    if problems:
        raise ValueError(f"load_pretrained({path}): checkpoint does not match the config:\n  " + "\n  ".join(problems))

    if mesh is None:
        params = cast_params(nest_params({e.path: e.to_param(files.fetch) for e in table}), dtype)
        check_params(cfg, params)
        return cfg, params

    plan = ShardPlan(cfg, mesh)
    layouts = plan.flat_layouts()
    flat = {}
    for e in table:
        layout = layouts[e.path]
        leaf_np_dtype = np.dtype(leaf_dtype(e.path[-1], dtype))

        def read_block(index, e=e, layout=layout, leaf_np_dtype=leaf_np_dtype):
            return e.read(layout.original_indices(index), files.fetch).astype(leaf_np_dtype)

        flat[e.path] = jax.make_array_from_callback(layout.sharded_shape, NamedSharding(mesh, layout.spec), read_block)
    return cfg, nest_params(flat)


# ------------------------------------------------------------- nested parameter names


def flat_params(params: Params) -> dict[tuple, Any]:
    """{path: leaf} with paths like ("layers", 3, "attn", "wqkvr") (list positions as ints):
    the keys `Entry.path` and `ShardPlan.flat_layouts` use."""
    return traverse_util.flatten_dict(_lists_to_dicts(params))


def nest_params(flat: dict[tuple, Any]) -> Params:
    """Inverse of flat_params: nested dicts, with int-keyed levels turned back into lists."""
    return _int_dicts_to_lists(traverse_util.unflatten_dict(flat))


def _lists_to_dicts(tree: Any) -> Any:
    if isinstance(tree, list):
        return {i: _lists_to_dicts(v) for i, v in enumerate(tree)}
    if isinstance(tree, dict):
        return {k: _lists_to_dicts(v) for k, v in tree.items()}
    return tree


def _int_dicts_to_lists(tree: Any) -> Any:
    if isinstance(tree, dict):
        if tree and all(isinstance(k, int) for k in tree):
            if sorted(tree) != list(range(len(tree))):
                raise ValueError(f"parameter list positions {sorted(tree)} are not 0..{len(tree) - 1}")
            return [_int_dicts_to_lists(tree[i]) for i in range(len(tree))]
        return {k: _int_dicts_to_lists(v) for k, v in tree.items()}
    return tree


def _to_numpy(x: Any, dtype: Any) -> Array:
    x = jax.device_get(x)
    x = np.asarray(x)
    return x.astype(dtype) if dtype is not None else x


# ------------------------------------------------------------------------- saving

# fp32 leaves that stay fp32 when a checkpoint is written in a lower precision
KEEP_FP32 = frozenset({"k_conv", "v_conv", "attn_conv", "mlp_conv", "router", "router_bias", "router_scale"})


def checkpoint_tensors(cfg: InklingConfig, params: Params, naming: str = "hub", dtype: Any = None) -> dict[str, Array]:
    """The checkpoint tensors of `params` (numpy, torch layout) under `naming` ("hub" or
    "transformers"): what `save_pretrained` writes, and what HF's modules hold (see
    `hf_transformers.causal_lm`). dtype: the tensors' dtype (default: as the params are;
    fp32 conv and router leaves stay fp32)."""
    check_params(cfg, params)
    np_dtype = None if dtype is None else np.dtype(jnp.dtype(dtype))
    flat = flat_params(params)
    tensors: dict[str, Array] = {}
    for e in entries(cfg, naming):
        value = flat[e.path]
        keep32 = str(value.dtype) == "float32" and e.path[-1] in KEEP_FP32
        arr = _to_numpy(value, None if (np_dtype is None or keep32) else np_dtype)
        for name, t in zip(e.names, e.to_tensors(arr)):
            tensors[name] = np.ascontiguousarray(t)
    return tensors


def save_pretrained(path: str | os.PathLike, cfg: InklingConfig, params: Params, naming: str = "hub",
                    dtype: Any = None, max_shard_bytes: int = 4 << 30) -> None:
    """Write config.json and the weights: `model.safetensors` when one shard holds everything,
    else `model-0000i-of-0000n.safetensors` (split above `max_shard_bytes`) and
    model.safetensors.index.json listing them.

    naming "hub" writes what HF's InklingForConditionalGeneration reads (with the
    `inkling_mm_model` config); "transformers" writes InklingForCausalLM's layout and config.
    dtype: the tensor dtype on disk (default: as the params are; fp32 leaves stay fp32).

    Files in `path`: every file is first written under a temporary name in `path` and then
    renamed into place, so no reader sees a half-written file and a failed save leaves the
    old files as they were. The only files ever deleted are the ones a previous save_pretrained
    into `path` wrote and this one does not rewrite: the shards its index lists, and that
    index, recognised by the writer tag in its metadata (a single-file save leaves no index,
    so it is simply overwritten). Other files stay; when other *.safetensors files or an index
    we did not write are present, an index is written even for one shard, so that loaders
    read exactly this checkpoint's files."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"save_pretrained: {path} exists and is not a directory")
    os.makedirs(path, exist_ok=True)
    tensors = checkpoint_tensors(cfg, params, naming, dtype)
    np_dtype = None if dtype is None else np.dtype(jnp.dtype(dtype))
    config = cfg.to_hf()
    if naming == "transformers":
        config = dict(config["text_config"], architectures=["InklingForCausalLM"])
    torch_dtype = str(np.dtype(np_dtype or np.float32)) if np_dtype is not None else _dominant_dtype(tensors)
    config["dtype"] = torch_dtype
    _write_checkpoint_files(path, config, tensors, max_shard_bytes)


def _dominant_dtype(tensors: dict[str, Array]) -> str:
    sizes: dict[str, int] = {}
    for t in tensors.values():
        sizes[str(t.dtype)] = sizes.get(str(t.dtype), 0) + t.nbytes
    return max(sizes, key=sizes.get) if sizes else "float32"


def _our_previous_index(path: str) -> set[str] | None:
    """The shard files listed by the index in `path` if save_pretrained wrote that index;
    None when there is no index or another tool wrote it."""
    try:
        with open(os.path.join(path, INDEX_FILE)) as f:
            index = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(index, dict) or not isinstance(index.get("metadata"), dict) \
            or index["metadata"].get("writer") != WRITER_TAG:
        return None
    names = set((index.get("weight_map") or {}).values())
    # only plain file names of shards in this directory
    return {n for n in names if isinstance(n, str) and n.endswith(".safetensors") and os.path.basename(n) == n}


def _write_checkpoint_files(path: str, config: dict, tensors: dict[str, Array], max_shard_bytes: int) -> None:
    shards: list[dict[str, Array]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name]
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    n = len(shards)
    shard_names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    ours = _our_previous_index(path)
    index_exists = os.path.exists(os.path.join(path, INDEX_FILE))
    others = {f for f in os.listdir(path) if f.endswith(".safetensors")} - (ours or set()) - set(shard_names)
    write_index = n > 1 or bool(others) or (index_exists and ours is None)
    stale = (ours or set()) - set(shard_names)
    if ours is not None and not write_index:
        stale.add(INDEX_FILE)
    outputs: list[tuple[str, Any]] = list(zip(shard_names, shards))
    if write_index:
        outputs.append((INDEX_FILE, {
            "metadata": {"total_size": sum(t.nbytes for t in tensors.values()), "writer": WRITER_TAG},
            "weight_map": {name: fname for fname, shard in zip(shard_names, shards) for name in shard}}))
    outputs.append((CONFIG_FILE, config))

    token = uuid.uuid4().hex[:12]
    temp = lambda final: os.path.join(path, f".{final}.{token}.tmp")
    written: list[tuple[str, str]] = []  # (temporary, final)
    try:
        for fname, payload in outputs:
            written.append((temp(fname), fname))
            if fname.endswith(".safetensors"):
                save_file(payload, temp(fname), metadata={"format": "pt"})
            else:
                with open(temp(fname), "w") as f:
                    json.dump(payload, f, indent=2)
        # shards first, then the index naming them, then the config
        for tmp, final in written:
            os.replace(tmp, os.path.join(path, final))
    finally:
        for tmp, _ in written:
            if os.path.exists(tmp):
                os.remove(tmp)
    for fname in sorted(stale):
        full = os.path.join(path, fname)
        if os.path.isfile(full):
            os.remove(full)


# ----------------------------------------------------------------------------- orbax


def save_checkpoint(path: str | os.PathLike, cfg: InklingConfig, params: Params, mesh: Mesh | None = None) -> None:
    """Orbax checkpoint of the params in the original layout, with the config beside it
    (config.json).

    mesh: params are in the sharded layout of ShardPlan(cfg, mesh) (as `load_pretrained(...,
    mesh=)` or `ShardPlan.shard_params` give them); they are put back in the original layout on
    the devices and each device writes its part (nothing is gathered to one host)."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    if mesh is not None:
        params = ShardPlan(cfg, mesh).from_sharded_on_devices(params)
    check_params(cfg, params)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(cfg.to_hf(), f, indent=2)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.join(path, "params"), params, force=True)
    ckptr.wait_until_finished()


def load_checkpoint(path: str | os.PathLike, dtype: Any = None, mesh: Mesh | None = None
                    ) -> tuple[InklingConfig, Params]:
    """Inverse of save_checkpoint. dtype=None keeps the saved dtypes (fp32 leaves stay fp32).

    mesh: restore onto the mesh. Orbax reads each leaf with a target sharding (every device
    reads only its slice of the original layout), then one jitted relayout per reordered leaf
    (fused q|k|v|r and gate|up columns, repeated kv heads) moves columns between devices into
    the sharded layout of ShardPlan(cfg, mesh). Same result as shard_params(load_checkpoint(path))."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    _check_directory(path, "load_checkpoint")
    _, cfg = _read_config(path, "load_checkpoint")
    ckpt = os.path.join(path, "params")
    if not os.path.isdir(ckpt):
        raise ValueError(f"load_checkpoint: {path} has no orbax 'params' directory")
    ckptr = ocp.StandardCheckpointer()
    if mesh is None:
        params = _relist(ckptr.restore(ckpt), param_shapes(cfg))
        if dtype is not None:
            params = cast_params(params, dtype)
        check_params(cfg, params)
        return cfg, params

    plan = ShardPlan(cfg, mesh)
    saved = flat_params(_relist(_tree_metadata(ckptr.metadata(ckpt)), param_shapes(cfg)))
    layouts = plan.flat_layouts()
    if set(saved) != set(layouts):
        raise ValueError(f"load_checkpoint: {ckpt} does not hold this config's parameters "
                         f"(differences: {sorted(map(str, set(saved) ^ set(layouts)))[:5]})")
    targets = {}
    for key, layout in layouts.items():
        if tuple(saved[key].shape) != layout.shape:
            raise ValueError(f"load_checkpoint: {ckpt}: {key} has shape {tuple(saved[key].shape)}, "
                             f"expected {layout.shape}")
        leaf = saved[key].dtype if dtype is None else leaf_dtype(key[-1], dtype)
        targets[key] = jax.ShapeDtypeStruct(layout.shape, leaf, sharding=NamedSharding(mesh, layout.original_spec()))
    restored = ckptr.restore(ckpt, nest_params(targets))
    return cfg, plan.to_sharded_on_devices(restored)


def _tree_metadata(meta: Any) -> Any:
    """The per-leaf metadata tree (shape, dtype) of an orbax checkpoint, across orbax versions."""
    tree = getattr(meta, "item_metadata", meta)
    return getattr(tree, "tree", tree)


def _relist(tree: Any, like: Any) -> Any:
    """Orbax may restore lists as dicts keyed '0', '1', ...; put the lists back."""
    if isinstance(like, list):
        items = tree if isinstance(tree, list) else [tree[str(i)] if str(i) in tree else tree[i] for i in range(len(like))]
        return [_relist(t, l) for t, l in zip(items, like)]
    if isinstance(like, dict):
        return {k: _relist(tree[k], v) for k, v in like.items()}
    return tree

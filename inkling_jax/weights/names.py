"""Checkpoint tensor names: one `Entry` per param leaf (its tensors in the hub or the
transformers naming, and the transforms between them), and the naming a set of tensors uses."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from ..config import AttentionGeometry, InklingConfig

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


def _batched_linear(path, name, lead: tuple[int, ...], in_dim, out_dim) -> Entry:
    # [*lead, in, out] <-> [*lead, out, in]
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
        *(_conv((*path, "attn", f"{x}_conv"), prefix + a + (f"{x}_sconv.weight" if hub else f"{x}_sconv.conv1d.weight"),
                k, g.kv_dim) for x in "kv"),
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

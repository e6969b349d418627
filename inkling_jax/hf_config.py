"""The three config.json dialects of Inkling, read into and written from `InklingConfig`.

Dialects (`model_type`):

- `inkling_mm_model`: the hub / HF `InklingForConditionalGeneration` config, a `text_config`
  (itself in one of the two dialects below) plus a top-level `mtp_config`
  (`num_nextn_predict_layers`, `local_layer_ids`, ...). Read by `parse_hub`, written by `to_hub`.
- `inkling_text` (HF transformers `InklingForCausalLM`; `inkling` is accepted as the same):
  `layer_types`, `mlp_layer_types`, `num_mtp_layers`, `mtp_local_layer_ids`,
  `unpadded_vocab_size`; `intermediate_size` is the dense width. Read by `parse_transformers`,
  written by `to_transformers`.
- `inkling_model` (sglang): `local_layer_ids` (missing: all layers full), `dense_mlp_idx`,
  `padded_vocab_size` (then `vocab_size` is the unpadded size), `num_nextn_predict_layers`;
  `intermediate_size` is the expert width. Read by `parse_sglang`.

`InklingConfig.from_hf` / `to_hf` delegate here (`parse`, `to_hub`). The parsers take the
config class as an argument, so this module needs nothing from `config.py` at import time.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:
    from .config import InklingConfig

HUB = "inkling_mm_model"
TRANSFORMERS = ("inkling_text", "inkling")
SGLANG = "inkling_model"

Getter = Callable[..., Any]


def load_dict(d: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """A config dict from a dict, a config.json path, or the directory holding it."""
    if isinstance(d, Mapping):
        return dict(d)
    path = os.fspath(d)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        return json.load(f)


def parse(d: Mapping[str, Any] | str | os.PathLike, cls: type) -> "InklingConfig":
    """Any of the three dialects (by `model_type`; a dict with a `text_config` is the hub's)."""
    d = load_dict(d)
    if d.get("model_type", "inkling_text") == HUB or "text_config" in d:
        return parse_hub(d, cls)
    return _parse_text(d, cls, {})


def parse_hub(d: Mapping[str, Any], cls: type) -> "InklingConfig":
    """`inkling_mm_model`: the text model from `text_config`, the MTP depths from `mtp_config`
    where the text config does not say."""
    text = dict(d.get("text_config") or {})
    text.setdefault("model_type", "inkling_text")
    return _parse_text(text, cls, dict(d.get("mtp_config") or {}))


def parse_transformers(d: Mapping[str, Any], cls: type, mtp: Mapping[str, Any] | None = None) -> "InklingConfig":
    """`inkling_text` (HF transformers); `mtp`: a hub `mtp_config` to fall back on."""
    return cls(**_fields(dict(d), dict(mtp or {}), sglang=False))


def parse_sglang(d: Mapping[str, Any], cls: type, mtp: Mapping[str, Any] | None = None) -> "InklingConfig":
    """`inkling_model` (sglang); `mtp`: a hub `mtp_config` to fall back on."""
    return cls(**_fields(dict(d), dict(mtp or {}), sglang=True))


def _parse_text(d: dict[str, Any], cls: type, mtp: dict[str, Any]) -> "InklingConfig":
    model_type = d.get("model_type", "inkling_text")
    if model_type == SGLANG:
        return parse_sglang(d, cls, mtp)
    if model_type in TRANSFORMERS:
        return parse_transformers(d, cls, mtp)
    raise ValueError(f"from_hf: unsupported model_type {model_type!r}")


# ------------------------------------------------------------------- reading fields


def _getter(d: Mapping[str, Any]) -> Getter:
    """get(*names, default=None): the first of `names` that d holds and is not None."""
    def get(*names: str, default: Any = None) -> Any:
        for n in names:
            if n in d and d[n] is not None:
                return d[n]
        return default
    return get


def _layer_kinds(d: Mapping[str, Any], get: Getter, num_layers: int, sglang: bool) -> dict[str, Any]:
    """Sliding and dense layers. HF's layer_types wins; then an explicit local_layer_ids; then
    HF's default pattern (every layer with (i+1) % 6 != 0 is local). sglang lists
    local_layer_ids explicitly and treats a missing list as "all full"."""
    if d.get("layer_types") is not None:
        local = tuple(i for i, t in enumerate(d["layer_types"]) if t in ("hybrid_sliding", "sliding_attention"))
    elif d.get("local_layer_ids") is not None:
        local = tuple(d["local_layer_ids"])
    elif sglang:
        local = ()
    else:
        local = tuple(i for i in range(num_layers) if (i + 1) % 6)
    if d.get("mlp_layer_types") is not None:
        dense = tuple(i for i, t in enumerate(d["mlp_layer_types"]) if t == "dense")
    else:
        dense = tuple(range(int(get("dense_mlp_idx", default=0))))
    return dict(local_layer_ids=local, dense_layer_ids=dense)


def _widths(d: Mapping[str, Any], get: Getter, sglang: bool) -> dict[str, int]:
    """MLP widths. sglang: intermediate_size = expert width, dense_intermediate_size = dense
    width. HF: intermediate_size = dense width, moe_intermediate_size = expert width."""
    if sglang or d.get("dense_intermediate_size") is not None:
        expert_w = int(get("moe_intermediate_size", "intermediate_size", default=3072))
        dense_w = int(get("dense_intermediate_size", default=get("intermediate_size", default=expert_w)))
        if d.get("moe_intermediate_size") is None:
            expert_w = int(get("intermediate_size", default=3072))
    else:
        dense_w = int(get("intermediate_size", default=24576))
        expert_w = int(get("moe_intermediate_size", default=3072))
    return dict(dense_intermediate_size=dense_w, expert_intermediate_size=expert_w)


def _vocab(d: Mapping[str, Any], get: Getter) -> dict[str, int]:
    padded = int(get("padded_vocab_size", "vocab_size", default=201024))
    # sglang resets vocab_size to the unpadded size when padded_vocab_size is present
    sglang_unpadded = d.get("vocab_size") if "padded_vocab_size" in d else None
    unpadded = int(get("unpadded_vocab_size", default=sglang_unpadded or padded))
    return dict(vocab_size=padded, unpadded_vocab_size=unpadded)


def _mtp_fields(get: Getter, mtp: Mapping[str, Any]) -> dict[str, Any]:
    """MTP depths: the text config's fields, else the hub's mtp_config."""
    num_mtp = get("num_mtp_layers", "num_nextn_predict_layers")
    if num_mtp is None:
        num_mtp = mtp.get("num_nextn_predict_layers", mtp.get("num_mtp_layers"))
    local = get("mtp_local_layer_ids")
    if local is None:
        local = mtp.get("local_layer_ids", mtp.get("mtp_local_layer_ids"))
    chain_norm = get("chain_hidden_post_norm")
    if chain_norm is None:
        chain_norm = mtp.get("chain_hidden_post_norm", False)

    def mtp_get(name: str) -> Any:
        v = get("mtp_" + name)
        return v if v is not None else mtp.get(name, mtp.get("mtp_" + name))

    return dict(num_mtp_layers=int(num_mtp or 0), mtp_local_layer_ids=tuple(local or ()),
                mtp_local_extent=mtp_get("local_extent"), mtp_swa_num_heads=mtp_get("swa_num_attention_heads"),
                mtp_swa_num_kv_heads=mtp_get("swa_num_key_value_heads"), mtp_swa_head_dim=mtp_get("swa_head_dim"),
                chain_hidden_post_norm=bool(chain_norm),
                mtp_hidden_states_first=bool(get("mtp_hidden_states_first", default=True)))


def _fields(d: dict[str, Any], mtp: dict[str, Any], sglang: bool) -> dict[str, Any]:
    """InklingConfig's keyword arguments from a text config dict of one dialect."""
    get = _getter(d)
    num_layers = int(get("num_hidden_layers", "num_layers", default=66))
    num_heads = int(get("num_attention_heads", default=64))
    num_kv = int(get("num_key_value_heads", default=num_heads))
    hidden = int(get("hidden_size", default=6144))
    head_dim = int(get("head_dim", default=hidden // num_heads))
    return dict(
        **_vocab(d, get), hidden_size=hidden, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv, head_dim=head_dim,
        swa_num_heads=int(get("swa_num_attention_heads", default=num_heads)),
        swa_num_kv_heads=int(get("swa_num_key_value_heads", default=num_kv)),
        swa_head_dim=int(get("swa_head_dim", default=head_dim)),
        **_layer_kinds(d, get, num_layers, sglang),
        sliding_window=int(get("sliding_window_size", "sliding_window", default=512)),
        d_rel=int(get("d_rel", default=16)),
        rel_extent=int(get("rel_extent", default=1024)),
        log_scaling_n_floor=get("log_scaling_n_floor"),
        log_scaling_alpha=float(get("log_scaling_alpha", default=0.1)),
        rms_norm_eps=float(get("rms_norm_eps", default=1e-6)),
        use_embed_norm=bool(get("use_embed_norm", default=not sglang)),
        use_sconv=bool(get("use_sconv", default=True)),
        conv_kernel_size=int(get("sconv_kernel_size", "conv_kernel_size", default=4)),
        **_widths(d, get, sglang),
        n_routed_experts=int(get("n_routed_experts", "num_local_experts", default=0)),
        n_shared_experts=int(get("n_shared_experts", default=0)),
        num_experts_per_tok=int(get("num_experts_per_tok", default=1)),
        route_scale=float(get("route_scale", default=1.0)),
        use_gate_bias=bool(get("use_gate_bias", default=True)),
        use_global_scale=bool(get("use_global_scale", default=True)),
        norm_after_topk=bool(get("norm_after_topk", default=True)),
        gate_activation=str(get("gate_activation", default="sigmoid")),
        shared_expert_sink=bool(get("shared_expert_sink", default=True)),
        shared_experts_size=int(get("shared_experts_size", default=1)),
        logits_mup_width_multiplier=float(get("logits_mup_width_multiplier", "embedding_multiplier", default=1.0)),
        final_logit_softcapping=get("final_logit_softcapping"),
        tie_word_embeddings=bool(get("tie_word_embeddings", default=False)),
        **_mtp_fields(get, mtp),
        bos_token_id=get("bos_token_id"),
        eos_token_id=_first(get("eos_token_id")),
    )


def _first(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return v[0] if v else None
    return v


# ------------------------------------------------------------------------- writing


# InklingConfig fields that the inkling_text dialect spells as we do
_SAME_NAMES = ("vocab_size", "unpadded_vocab_size", "hidden_size", "head_dim", "swa_head_dim", "d_rel", "rel_extent",
               "log_scaling_n_floor", "log_scaling_alpha", "rms_norm_eps", "conv_kernel_size", "n_routed_experts",
               "n_shared_experts", "num_experts_per_tok", "route_scale", "shared_expert_sink",
               "logits_mup_width_multiplier", "chain_hidden_post_norm", "mtp_hidden_states_first", "bos_token_id",
               "eos_token_id")
# fields HF does not model; written so that our own loader round-trips them
_OURS_ONLY = ("use_embed_norm", "use_gate_bias", "use_global_scale", "norm_after_topk", "gate_activation",
              "shared_experts_size", "final_logit_softcapping")


def to_transformers(cfg: "InklingConfig") -> dict[str, Any]:
    """The `inkling_text` config dict (HF `InklingForCausalLM`; the hub's `text_config`)."""
    d = dict(
        model_type="inkling_text",
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        swa_num_attention_heads=cfg.swa_num_heads,
        swa_num_key_value_heads=cfg.swa_num_kv_heads,
        local_layer_ids=list(cfg.local_layer_ids),
        layer_types=["hybrid_sliding" if cfg.is_sliding(i) else "hybrid" for i in range(cfg.num_layers)],
        sliding_window_size=cfg.sliding_window,
        mlp_layer_types=["dense" if cfg.is_dense(i) else "sparse" for i in range(cfg.num_layers)],
        intermediate_size=cfg.dense_intermediate_size,
        moe_intermediate_size=cfg.expert_intermediate_size,
        mtp_local_layer_ids=list(cfg.mtp_local_layer_ids) or None,
        num_mtp_layers=cfg.num_mtp_layers or None,
    )
    d.update({name: getattr(cfg, name) for name in _SAME_NAMES + _OURS_ONLY})
    return d


def to_hub(cfg: "InklingConfig") -> dict[str, Any]:
    """The `inkling_mm_model` config.json dict (hub layout, loadable by HF transformers)."""
    mtp = dict(num_nextn_predict_layers=cfg.num_mtp_layers, chain_hidden_post_norm=cfg.chain_hidden_post_norm,
               local_layer_ids=list(cfg.mtp_local_layer_ids))
    for name, value in (("local_extent", cfg.mtp_local_extent),
                        ("swa_num_attention_heads", cfg.mtp_swa_num_heads),
                        ("swa_num_key_value_heads", cfg.mtp_swa_num_kv_heads),
                        ("swa_head_dim", cfg.mtp_swa_head_dim)):
        if value is not None:
            mtp[name] = value
    return dict(
        architectures=["InklingForConditionalGeneration"],
        model_type=HUB,
        text_config=to_transformers(cfg),
        mtp_config=mtp,
        vision_config=dict(model_type="inkling_vision", text_hidden_size=cfg.hidden_size,
                           hidden_size=64, n_layers=2, num_attention_heads=2),
        audio_config=dict(model_type="inkling_audio", text_hidden_size=cfg.hidden_size),
    )

"""Inkling model configuration: one frozen dataclass, its derived geometry, presets.

The field set follows Inkling's model definition. Names are ours where the config dialects
disagree (HF's `intermediate_size` is the dense width, sglang's is the expert width; we say
`dense_intermediate_size` and `expert_intermediate_size`). `InklingConfig.from_hf` / `to_hf`
read and write the three config.json dialects (hub `inkling_mm_model`, transformers
`inkling_text`, sglang `inkling_model`); the parsers live in `hf_config.py`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping

from . import hf_config


# the fields that describe the MTP draft depths (`InklingConfig.trunk` resets them)
MTP_FIELDS = ("num_mtp_layers", "mtp_local_layer_ids", "mtp_local_extent", "mtp_swa_num_heads", "mtp_swa_num_kv_heads",
              "mtp_swa_head_dim", "chain_hidden_post_norm", "mtp_hidden_states_first")


@dataclass(frozen=True)
class AttentionGeometry:
    """Head geometry of one attention layer (trunk layer or MTP depth)."""

    is_sliding: bool
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rel_extent: int  # span of the learned relative bias, in tokens
    window: int | None  # sliding window in tokens (current token included); None = full
    log_scaling: bool  # full layers with log_scaling_n_floor set

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class InklingConfig:
    # vocabulary: module shapes use the padded size, logits are sliced to the unpadded one
    vocab_size: int = 201024
    unpadded_vocab_size: int = 200058
    hidden_size: int = 6144
    num_layers: int = 66
    # full (global) attention layers
    num_heads: int = 64
    num_kv_heads: int = 8
    head_dim: int = 128
    # sliding-window (local) attention layers
    swa_num_heads: int = 64
    swa_num_kv_heads: int = 16
    swa_head_dim: int = 128
    local_layer_ids: tuple[int, ...] = ()
    sliding_window: int = 512
    # learned relative position bias (no RoPE)
    d_rel: int = 16
    rel_extent: int = 1024
    # long-context q scaling on full layers
    log_scaling_n_floor: int | None = None
    log_scaling_alpha: float = 0.1
    rms_norm_eps: float = 1e-6
    use_embed_norm: bool = True
    use_sconv: bool = True
    conv_kernel_size: int = 4
    # MLPs: dense_layer_ids use the dense SwiGLU MLP, the others MoE
    dense_layer_ids: tuple[int, ...] = (0, 1)
    dense_intermediate_size: int = 24576
    expert_intermediate_size: int = 3072
    n_routed_experts: int = 256
    n_shared_experts: int = 2
    num_experts_per_tok: int = 6
    route_scale: float = 8.0
    use_gate_bias: bool = True
    use_global_scale: bool = True
    norm_after_topk: bool = True
    gate_activation: str = "sigmoid"  # "sigmoid" or "softmax"
    shared_expert_sink: bool = True
    shared_experts_size: int = 1
    # head
    logits_mup_width_multiplier: float = 24.0
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = False
    # MTP draft depths
    num_mtp_layers: int = 0
    mtp_local_layer_ids: tuple[int, ...] = ()
    mtp_local_extent: int | None = None  # window and rel_extent of banded depths; None = trunk window
    mtp_swa_num_heads: int | None = None  # None = trunk swa values
    mtp_swa_num_kv_heads: int | None = None
    mtp_swa_head_dim: int | None = None
    chain_hidden_post_norm: bool = False
    mtp_hidden_states_first: bool = True
    # tokens
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2

    def __post_init__(self):
        # Tuples keep the dataclass hashable (it is a static jit argument).
        for name in ("local_layer_ids", "dense_layer_ids", "mtp_local_layer_ids"):
            object.__setattr__(self, name, tuple(sorted(int(i) for i in getattr(self, name))))
        self.validate()

    # ------------------------------------------------------------------ checks

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"InklingConfig: {msg}")

        need(self.hidden_size > 0 and self.num_layers > 0, "hidden_size and num_layers must be positive")
        need(0 < self.unpadded_vocab_size <= self.vocab_size,
             f"unpadded_vocab_size {self.unpadded_vocab_size} must be in (0, vocab_size={self.vocab_size}]")
        for heads, kv, tag in ((self.num_heads, self.num_kv_heads, "full"),
                               (self.swa_num_heads, self.swa_num_kv_heads, "sliding")):
            need(kv > 0 and heads % kv == 0, f"{tag} layers: num_heads {heads} must be a multiple of kv heads {kv}")
        need(all(0 <= i < self.num_layers for i in self.local_layer_ids), "local_layer_ids out of range")
        need(all(0 <= i < self.num_layers for i in self.dense_layer_ids), "dense_layer_ids out of range")
        need(self.conv_kernel_size >= 2, "conv_kernel_size must be >= 2")
        need(self.use_sconv, "use_sconv=False is not an Inkling model (every layer has short convolutions)")
        need(self.sliding_window >= 1 and self.rel_extent >= 1 and self.d_rel >= 1, "window / rel_extent / d_rel")
        need(self.gate_activation in ("sigmoid", "softmax"), f"gate_activation {self.gate_activation!r}")
        need(not self.tie_word_embeddings, "tied embeddings are not an Inkling layout")
        need(self.final_logit_softcapping is None or self.final_logit_softcapping > 0, "softcapping must be > 0")
        if self.has_moe:
            need(self.n_routed_experts >= self.num_experts_per_tok >= 1, "num_experts_per_tok must be in [1, experts]")
        need(self.num_mtp_layers >= 0, "num_mtp_layers must be >= 0")
        need(all(0 <= i < max(self.num_mtp_layers, 0) for i in self.mtp_local_layer_ids),
             "mtp_local_layer_ids out of range")
        if self.mtp_local_layer_ids:
            g = self.mtp_geometry(self.mtp_local_layer_ids[0])
            need(g.num_heads % g.num_kv_heads == 0, "mtp swa heads must be a multiple of mtp swa kv heads")

    # ---------------------------------------------------------------- derived

    @property
    def has_moe(self) -> bool:
        return any(not self.is_dense(i) for i in range(self.num_layers))

    def is_dense(self, layer: int) -> bool:
        return layer in self.dense_layer_ids

    def is_sliding(self, layer: int) -> bool:
        return layer in self.local_layer_ids

    def layer_geometry(self, layer: int) -> AttentionGeometry:
        if self.is_sliding(layer):
            return AttentionGeometry(True, self.swa_num_heads, self.swa_num_kv_heads, self.swa_head_dim,
                                     rel_extent=self.sliding_window, window=self.sliding_window, log_scaling=False)
        return AttentionGeometry(False, self.num_heads, self.num_kv_heads, self.head_dim,
                                 rel_extent=self.rel_extent, window=None,
                                 log_scaling=self.log_scaling_n_floor is not None)

    def mtp_geometry(self, depth: int) -> AttentionGeometry:
        if depth in self.mtp_local_layer_ids:
            extent = self.mtp_local_extent or self.sliding_window
            return AttentionGeometry(
                True,
                self.mtp_swa_num_heads or self.swa_num_heads,
                self.mtp_swa_num_kv_heads or self.swa_num_kv_heads,
                self.mtp_swa_head_dim or self.swa_head_dim,
                rel_extent=extent, window=extent, log_scaling=False)
        return AttentionGeometry(False, self.num_heads, self.num_kv_heads, self.head_dim,
                                 rel_extent=self.rel_extent, window=None,
                                 log_scaling=self.log_scaling_n_floor is not None)

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if not self.is_sliding(i))

    @property
    def max_window(self) -> int:
        """Largest sliding window over trunk layers and MTP depths (0 if none)."""
        ws = [self.layer_geometry(i).window for i in range(self.num_layers)]
        ws += [self.mtp_geometry(d).window for d in range(self.num_mtp_layers)]
        return max([w for w in ws if w] or [0])

    def replace(self, **changes: Any) -> "InklingConfig":
        return dataclasses.replace(self, **changes)

    def trunk(self) -> "InklingConfig":
        """This config without its MTP depths (every MTP field at its default): what a plain,
        non-speculative engine runs, so that its programs are those of the same model without
        MTP weights (its ring holds the trunk's windows only)."""
        return self.replace(**{f.name: f.default for f in dataclasses.fields(self) if f.name in MTP_FIELDS})

    # ---------------------------------------------------------------- presets

    @classmethod
    def tiny(cls, **overrides: Any) -> "InklingConfig":
        """CPU test model: both layer kinds, dense and MoE, a small window, 3 MTP depths (one banded)."""
        base = dict(
            vocab_size=264, unpadded_vocab_size=256, hidden_size=64, num_layers=4,
            num_heads=4, num_kv_heads=2, head_dim=16,
            swa_num_heads=4, swa_num_kv_heads=4, swa_head_dim=16,
            local_layer_ids=(0, 1, 3), sliding_window=8, d_rel=4, rel_extent=16,
            log_scaling_n_floor=8, log_scaling_alpha=0.1,
            dense_layer_ids=(0,), dense_intermediate_size=128, expert_intermediate_size=32,
            n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2, route_scale=8.0,
            logits_mup_width_multiplier=4.0,
            num_mtp_layers=3, mtp_local_layer_ids=(1,), chain_hidden_post_norm=False,
            bos_token_id=1, eos_token_id=2,
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def small(cls, **overrides: Any) -> "InklingConfig":
        """A few-million-parameter model with Inkling's layer pattern (the tokenspeed tiny shape)."""
        base = dict(
            vocab_size=2048, unpadded_vocab_size=2000, hidden_size=256, num_layers=6,
            num_heads=8, num_kv_heads=2, head_dim=32,
            swa_num_heads=8, swa_num_kv_heads=4, swa_head_dim=32,
            local_layer_ids=(0, 1, 2, 3, 4), sliding_window=32, d_rel=8, rel_extent=64,
            log_scaling_n_floor=256,
            dense_layer_ids=(0, 1), dense_intermediate_size=256, expert_intermediate_size=64,
            n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2, route_scale=8.0,
            logits_mup_width_multiplier=4.0,
            num_mtp_layers=3, mtp_local_layer_ids=(1,),
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def shakespeare(cls, **overrides: Any) -> "InklingConfig":
        """The shipped byte-level model (`inkling_jax/models/shakespeare`, trained by `inkling-train`):
        every Inkling feature at about 7.6 M parameters (14.5 MiB in bf16).

        8 layers of width 256, 3 sliding : 1 full (full layers 3 and 7, with log scaling past
        position 128 and a 512-token relative bias; sliding window 128), GQA 4 heads / 2 kv of
        width 64, 2 dense layers (SwiGLU 512) then 6 MoE layers (8 experts of width 64, top-2,
        one shared sink expert), 3 MTP depths, depth 1 banded. Byte vocabulary (256 real ids
        padded to 264); eos is byte 2, which never occurs in the corpus. route_scale 2 rather
        than Inkling's 8: the routed and sink weights sum to route_scale, and a tiny model trained
        from scratch has no reason to start its MoE branch 8x louder than its dense one."""
        base = dict(
            vocab_size=264, unpadded_vocab_size=256, hidden_size=256, num_layers=8,
            num_heads=4, num_kv_heads=2, head_dim=64,
            swa_num_heads=4, swa_num_kv_heads=2, swa_head_dim=64,
            local_layer_ids=(0, 1, 2, 4, 5, 6), sliding_window=128, d_rel=16, rel_extent=512,
            log_scaling_n_floor=128, log_scaling_alpha=0.1,
            dense_layer_ids=(0, 1), dense_intermediate_size=512, expert_intermediate_size=64,
            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, route_scale=2.0,
            logits_mup_width_multiplier=2.0,
            num_mtp_layers=3, mtp_local_layer_ids=(1,),
            bos_token_id=1, eos_token_id=2,
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def bench(cls, **overrides: Any) -> "InklingConfig":
        """GPU benchmark model: Inkling's proportions (5 local : 1 full, GQA 8/4, 2 dense layers,
        sigmoid MoE with 2 sink experts, 128-wide heads, 512 window) at about 2.4 B parameters
        (about 4.8 GB in bf16)."""
        base = dict(
            vocab_size=65536, unpadded_vocab_size=65000, hidden_size=2048, num_layers=12,
            num_heads=16, num_kv_heads=2, head_dim=128,
            swa_num_heads=16, swa_num_kv_heads=4, swa_head_dim=128,
            local_layer_ids=tuple(i for i in range(12) if (i + 1) % 6), sliding_window=512,
            d_rel=16, rel_extent=1024, log_scaling_n_floor=128000,
            dense_layer_ids=(0, 1), dense_intermediate_size=8192, expert_intermediate_size=1024,
            n_routed_experts=32, n_shared_experts=2, num_experts_per_tok=4, route_scale=8.0,
            logits_mup_width_multiplier=8.0,
            num_mtp_layers=3, mtp_local_layer_ids=(1,),
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def inkling(cls, **overrides: Any) -> "InklingConfig":
        """The real Inkling's shape (`reference/inkling-model.md` §1): hidden 6144, 66 layers
        (local unless (i+1) % 6 == 0), 64 q heads of 128 with 8 kv heads on full layers and 16
        on sliding ones (window 512), 2 dense layers of width 24576, then 256 routed experts
        (top-6, width 3072) with 2 sink shared experts, vocab 201024 (200058 real), 8 MTP
        depths (banded: 0, 2, 4, 5, 6, 7). For memory planning and sharding checks; its
        weights are not in the repo. log_scaling_n_floor 128000 comes from third-party copies
        of config.json (unverified, like the MTP fields)."""
        layers = 66
        base = dict(
            vocab_size=201024, unpadded_vocab_size=200058, hidden_size=6144, num_layers=layers,
            num_heads=64, num_kv_heads=8, head_dim=128,
            swa_num_heads=64, swa_num_kv_heads=16, swa_head_dim=128,
            local_layer_ids=tuple(i for i in range(layers) if (i + 1) % 6), sliding_window=512,
            d_rel=16, rel_extent=1024, log_scaling_n_floor=128000, log_scaling_alpha=0.1,
            dense_layer_ids=(0, 1), dense_intermediate_size=24576, expert_intermediate_size=3072,
            n_routed_experts=256, n_shared_experts=2, num_experts_per_tok=6, route_scale=8.0,
            shared_expert_sink=True, logits_mup_width_multiplier=24.0,
            num_mtp_layers=8, mtp_local_layer_ids=(0, 2, 4, 5, 6, 7), chain_hidden_post_norm=False,
        )
        base.update(overrides)
        return cls(**base)

    # ------------------------------------------------------------ HF dialects

    @classmethod
    def from_hf(cls, d: Mapping[str, Any] | str | os.PathLike) -> "InklingConfig":
        """Parse an `inkling_mm_model`, `inkling_text` (HF) or `inkling_model` (sglang) config.

        `d` is a dict or a path to a config.json (or to the directory holding it)."""
        return hf_config.parse(d, cls)

    def to_hf(self) -> dict[str, Any]:
        """The `inkling_mm_model` config.json dict (hub layout, loadable by HF transformers)."""
        return hf_config.to_hub(self)

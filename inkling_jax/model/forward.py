"""Reference forward: whole sequences, no cache, differentiable. The oracle the serving
steps are tested against (and itself tested against HF transformers).

Every function takes an optional `parallel` (`inkling_jax.parallel.ParallelAxes`): inside a
`shard_map` over a mesh, with cfg the plan's local config and params one device's shard, it
computes the same values as the unsharded call (see `layers.py` for the collectives and
`inkling_jax.parallel.forward_sharded` for the wrapper). None: the single-device program."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int

from ..config import AttentionGeometry, InklingConfig
from . import layers as L

Params = dict[str, Any]


@dataclass
class DenseContext(L.LayerContext):
    """Layer context for dense [B, T] sequences starting at position 0 (no past state); the
    jnp ops (`LayerContext.ops`)."""

    cfg: InklingConfig
    positions: Int[Array, "b t"]
    parallel: Any = None  # ParallelAxes when running as one shard of a mesh (read by layers.py)

    def conv(self, stream: str, x: Array, weight: Array) -> Array:
        return L.causal_conv(x, weight)[0]

    def attend(self, q: Array, k: Array, v: Array, r: Array, rel_proj: Array, geom: AttentionGeometry) -> Array:
        valid = jnp.ones(self.positions.shape, bool)
        return L.attention_core(q, k, v, r, rel_proj, self.positions, self.positions, valid, geom, self.cfg)


def forward_hidden(params: Params, cfg: InklingConfig, tokens: Int[ArrayLike, "b t"], parallel: Any = None
                   ) -> Float[Array, "b t h"]:
    """Final-normed hidden states (the tensor the LM head and MTP depth 0 read), model dtype."""
    tokens = jnp.asarray(tokens, jnp.int32)
    dtype = params["unembed"].dtype
    b, t = tokens.shape
    ctx = DenseContext(cfg, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), parallel)
    x = L.embed(params, cfg, tokens, dtype, parallel)
    return run_trunk(params, cfg, ctx, x)


def run_trunk(params: Params, cfg: InklingConfig, ctx: Any, x: Array, bind: Any = None) -> Array:
    """The decoder layers and the final norm: the final-normed hidden states. Each layer hands
    the norm after it to the next (`decoder_layer`'s h / next_norm: the next layer's attn_norm,
    after the last the final norm), so a context that fuses a residual conv with the norm after
    it (`LayerContext.conv_residual_norm`: the serving steps) computes every norm but the first
    inside a conv; the default computes exactly the unfused ops. bind(i): called before layer i (the
    serving steps bind the layer's state fields)."""
    layers, eps = params["layers"], cfg.rms_norm_eps
    if not layers:
        return L.rms_norm(x, params["final_norm"], eps)
    h = L.rms_norm(x, layers[0]["attn_norm"], eps)
    for i, p in enumerate(layers):
        if bind is not None:
            bind(i)
        next_norm = layers[i + 1]["attn_norm"] if i + 1 < len(layers) else params["final_norm"]
        x, h = L.decoder_layer(p, cfg, cfg.layer_geometry(i), cfg.is_dense(i), x, ctx, h=h, next_norm=next_norm)
    return h


def forward(params: Params, cfg: InklingConfig, tokens: Int[ArrayLike, "b t"], parallel: Any = None
            ) -> Float[Array, "b t v"]:
    """Logits (fp32, unpadded vocab) for every position of tokens [B, T]."""
    return L.lm_head(params, cfg, forward_hidden(params, cfg, tokens, parallel), parallel)


def mtp_depth_input(params: Params, cfg: InklingConfig, depth: int, h_prev: Array, tokens: Array,
                    parallel: Any = None) -> Array:
    """z = input_proj([hidden_norm(h_prev), enorm(embed_norm(E[tok]))]) for one MTP depth."""
    p = params["mtp"]["layers"][depth]
    e = L.embed(params, cfg, tokens, h_prev.dtype, parallel)  # the target's embedding and embed_norm
    e = L.rms_norm(e, p["embed_norm"], cfg.rms_norm_eps)
    hn = L.rms_norm(h_prev, p["hidden_norm"], cfg.rms_norm_eps)
    z = jnp.concatenate([hn, e] if cfg.mtp_hidden_states_first else [e, hn], axis=-1)
    return L.row_parallel_linear(z, p["input_proj"], parallel)


def mtp_depth_output(params: Params, cfg: InklingConfig, y: Array) -> Array:
    """The hidden state a depth hands on (chain_norm'd if chain_hidden_post_norm)."""
    if cfg.chain_hidden_post_norm:
        return L.rms_norm(y, params["mtp"]["chain_norm"], cfg.rms_norm_eps)
    return y


def mtp_depth_block(params: Params, cfg: InklingConfig, depth: int, z: Array, ctx: Any) -> Array:
    """One MTP depth's decoder block on its input z, then `mtp_depth_output`: the hidden state
    the depth hands on. With chain_hidden_post_norm the chain norm is the block's next_norm (a
    fusing context computes it inside the block's last conv); without, the block's output as is."""
    block = params["mtp"]["layers"][depth]["block"]
    geom = cfg.mtp_geometry(depth)
    if cfg.chain_hidden_post_norm:
        return L.decoder_layer(block, cfg, geom, True, z, ctx, next_norm=params["mtp"]["chain_norm"])[1]
    return L.decoder_layer(block, cfg, geom, True, z, ctx)


def mtp_forward(
    params: Params, cfg: InklingConfig, hidden: Float[Array, "b t h"], tokens: Int[ArrayLike, "b t"],
    num_depths: int | None = None, parallel: Any = None,
) -> tuple[Float[Array, "d b t v"], Float[Array, "d b t h"]]:
    """The chain of MTP depths over whole sequences (the draft-prefill computation).

    hidden: the target's final-normed hidden states for tokens t_0..t_{T-1}.
    Depth i at row j reads the previous depth's hidden (the target's for i = 0) and token
    t_{j+i+1}, and predicts t_{j+i+2}. Tokens past the known sequence are the greedy
    predictions of the previous depth (of the target for depth 0) at the same row.
    Returns (logits [D, B, T, V] fp32, hidden states handed down the chain [D, B, T, H])."""
    if not cfg.num_mtp_layers:
        raise ValueError("mtp_forward: the config has no MTP depths (num_mtp_layers = 0)")
    num_depths = cfg.num_mtp_layers if num_depths is None else num_depths
    tokens = jnp.asarray(tokens, jnp.int32)
    b, t = tokens.shape
    ctx = DenseContext(cfg, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), parallel)
    # stream[j] = t_{j+i+1} for depth i; starts as the target's view (shift by 1) and the
    # last slot is filled with the previous predictor's greedy token at that row.
    prev_logits = L.lm_head(params, cfg, hidden, parallel)
    h_prev, known = hidden, tokens
    all_logits, all_hidden = [], []
    for d in range(num_depths):
        pred_last = jnp.argmax(prev_logits[:, -1], axis=-1).astype(jnp.int32)  # predicts t_{T+d}
        known = jnp.concatenate([known, pred_last[:, None]], axis=1)  # t_0 .. t_{T+d}
        step_tokens = known[:, d + 1:d + 1 + t]  # t_{j+d+1}
        z = mtp_depth_input(params, cfg, d, h_prev, step_tokens, parallel)
        h_prev = mtp_depth_block(params, cfg, d, z, ctx)
        prev_logits = L.lm_head(params, cfg, h_prev, parallel)
        all_logits.append(prev_logits)
        all_hidden.append(h_prev)
    return jnp.stack(all_logits), jnp.stack(all_hidden)

"""Training losses: next-token cross-entropy of the trunk and of every MTP depth, teacher forced.

For a window of tokens t_0 .. t_{T+D} (T = seq_len, D = num_mtp_layers), row j in 0..T-1:

    trunk        reads t_0..t_j                      -> h_j (final-normed)  predicts t_{j+1}
    MTP depth 0  reads h_j and the true t_{j+1}      -> g0_j                 predicts t_{j+2}
    MTP depth d  reads g{d-1}_j and the true t_{j+d+1} -> gd_j               predicts t_{j+d+2}

which is `model.forward.mtp_forward`'s chain with the true tokens where serving would use
greedy guesses (the window holds D more tokens than the trunk reads, so none is a guess).
All heads share the trunk's embedding and unembedding. Losses are mean nats per token.

total = trunk + mtp_weight * mean over depths. With Adam the weight hardly changes how the
MTP depths' own parameters learn (Adam is invariant to a loss's scale, per parameter); it sets
how much the shared trunk and embeddings bend towards multi-token prediction.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int

from ..config import InklingConfig
from ..model import layers as L
from ..model.forward import mtp_depth_input, mtp_depth_output
from ..model.params import cast_params
from .attention import SequenceContext

Params = dict[str, Any]


def cross_entropy(logits: Float[Array, "b t v"], targets: Int[Array, "b t"]) -> Float[Array, ""]:
    """Mean next-token cross-entropy in nats (fp32)."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


def head_logits(params: Params, cfg: InklingConfig, window: Int[Array, "b w"]
                ) -> tuple[Float[Array, "b t v"], Float[Array, "d b t v"]]:
    """(trunk logits [B, T, V], MTP logits [D, B, T, V]) for windows of T + 1 + D tokens, in
    the params' dtype (fp32 logits). Trunk row j predicts t_{j+1}; depth d row j predicts t_{j+d+2}."""
    depths = cfg.num_mtp_layers
    t = window.shape[1] - 1 - depths
    if t < 1:
        raise ValueError(f"head_logits: a window of {window.shape[1]} tokens leaves no rows for {depths} MTP depths")
    dtype = params["unembed"].dtype
    ctx = SequenceContext(cfg, t)
    x = L.embed(params, cfg, window[:, :t], dtype)
    for i, p in enumerate(params["layers"]):
        x = L.decoder_layer(p, cfg, cfg.layer_geometry(i), cfg.is_dense(i), x, ctx)
    h = L.rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    trunk = L.lm_head(params, cfg, h)
    mtp = []
    for d in range(depths):
        z = mtp_depth_input(params, cfg, d, h, window[:, d + 1:d + 1 + t])  # the true t_{j+d+1}
        y = L.decoder_layer(params["mtp"]["layers"][d]["block"], cfg, cfg.mtp_geometry(d), True, z, ctx)
        h = mtp_depth_output(params, cfg, y)
        mtp.append(L.lm_head(params, cfg, h))
    return trunk, (jnp.stack(mtp) if mtp else jnp.zeros((0, *trunk.shape), trunk.dtype))


def window_losses(params: Params, cfg: InklingConfig, window: Int[Array, "b w"]
                  ) -> tuple[Float[Array, ""], Float[Array, " d"]]:
    """(trunk loss, MTP loss per depth [D]) on windows of T + 1 + D tokens."""
    depths = cfg.num_mtp_layers
    t = window.shape[1] - 1 - depths
    trunk_logits, mtp_logits = head_logits(params, cfg, window)
    trunk = cross_entropy(trunk_logits, window[:, 1:t + 1])
    mtp = jnp.stack([cross_entropy(mtp_logits[d], window[:, d + 2:d + 2 + t]) for d in range(depths)]) \
        if depths else jnp.zeros((0,), jnp.float32)
    return trunk, mtp


def training_loss(params: Params, cfg: InklingConfig, window: Int[Array, "b w"], compute_dtype: Any,
                  mtp_weight: float) -> tuple[Float[Array, ""], dict[str, Array]]:
    """Scalar loss to differentiate, and its parts. params are the fp32 masters; the forward
    runs on a `compute_dtype` copy (fp32 leaves stay fp32), so gradients arrive in fp32."""
    trunk, mtp = window_losses(cast_params(params, compute_dtype), cfg, window)
    total = trunk + mtp_weight * mtp.mean() if mtp.size else trunk
    return total, {"loss": total, "trunk": trunk, "mtp": mtp}

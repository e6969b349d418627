"""The layer context for training: dense [B, T] windows from position 0, with the relative
bias laid out by a shift instead of a gather.

`model.forward.DenseContext` builds the bias [B, Tq, heads, Tk] of `attention_core` by
gathering `rel = r @ rel_proj` [B, Tq, heads, E] at the distance q - k of every (q, k) pair.
Under `jax.grad` that gather becomes a scatter-add of B*T*T*heads values into rel, most of
them onto the clipped indices of masked pairs: the slowest part of a training step on a GPU.
Here every query and key position is its row number, so the bias is a Toeplitz band of rel,
and `toeplitz_bias` lays it out with a pad, a reshape and a slice, whose gradients are the
same cheap copies. The rest is `attention_core`'s math, operation for operation (the same
casts, 1/head_dim scale, log scaling, causal and window masks, fp32 softmax), so the trained
weights serve unchanged; `tests/test_train.py` checks both paths agree, values and gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ..config import AttentionGeometry, InklingConfig
from ..model import layers as L


def toeplitz_bias(rel: Float[Array, "... t e"], t: int) -> Float[Array, "... t t"]:
    """out[..., q, k] = rel[..., q, q - k] where 0 <= q - k < e, else 0.

    rel holds, for each query row, the bias at distances 0..e-1. The band is made by the
    "relative shift": reverse the distances, pad each row to 2t-1, flatten, and re-read the
    flat array with a row stride one shorter, which slides row q left by t-1-q."""
    e = rel.shape[-1]
    lead = rel.shape[:-2]
    by_distance = rel[..., :t] if e >= t else jnp.pad(rel, [(0, 0)] * len(lead) + [(0, 0), (0, t - e)])
    if t == 1:
        return by_distance
    rows = jnp.pad(jnp.flip(by_distance, -1), [(0, 0)] * len(lead) + [(0, 0), (0, t - 1)])  # [..., t, 2t-1]
    flat = rows.reshape(*lead, t * (2 * t - 1))[..., t - 1:t - 1 + t * (2 * t - 2)]
    return flat.reshape(*lead, t, 2 * t - 2)[..., :t]


@dataclass
class SequenceContext(L.LayerContext):
    """Layer context for whole windows: tokens at positions 0..T-1 in every row, no padding;
    the jnp ops (`LayerContext.ops`)."""

    cfg: InklingConfig
    seq_len: int

    def conv(self, stream: str, x: Array, weight: Array) -> Array:
        return L.causal_conv(x, weight)[0]

    def attend(self, q: Float[Array, "b t nh hd"], k: Float[Array, "b t nkv hd"], v: Float[Array, "b t nkv hd"],
               r: Float[Array, "b t nh dr"], rel_proj: Float[Array, "dr e"], geom: AttentionGeometry
               ) -> Float[Array, "b t nh hd"]:
        cfg = self.cfg
        dtype = q.dtype
        b, t, nh, hd = q.shape
        nkv = k.shape[2]
        group = nh // nkv
        pos = jnp.arange(t, dtype=jnp.int32)

        rel = jnp.einsum("bqhr,re->bhqe", r, rel_proj.astype(r.dtype), preferred_element_type=jnp.float32)
        bias = toeplitz_bias(rel.astype(dtype), t)  # [b, nh, tq, tk]
        if geom.log_scaling:
            tau = L.log_scaling_tau(pos, cfg)  # [t]
            q = (q.astype(jnp.float32) * tau[None, :, None, None]).astype(dtype)
            bias = (bias.astype(jnp.float32) * tau[None, None, :, None]).astype(dtype)
        qg = q.reshape(b, t, nkv, group, hd)
        scores = jnp.einsum("bqngd,bknd->bngqk", qg, k, preferred_element_type=jnp.float32) * (1.0 / hd)
        scores = scores + bias.astype(jnp.float32).reshape(b, nkv, group, t, t)
        dist = pos[:, None] - pos[None, :]
        allowed = dist >= 0
        if geom.window is not None:
            allowed = allowed & (dist < geom.window)
        scores = jnp.where(allowed, scores, -jnp.inf)  # every query sees itself: no empty rows
        probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
        out = jnp.einsum("bngqk,bknd->bqngd", probs, v, preferred_element_type=jnp.float32)
        return out.astype(dtype).reshape(b, t, nh, hd)

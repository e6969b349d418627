"""Inkling attention with a relative-position bias: the jnp reference (the Pallas kernel mirrors it).

    attention(q, k, v, rel, q_pos, k_pos, k_valid, *, window) -> out [B, Q, H, D] in q's dtype

    q        [B, Q, H, D]    queries (the caller has RMS-normed them and, on log-scaling layers,
                             multiplied them by tau)
    k, v     [B, K, Hkv, D]  keys and values; H % Hkv == 0, query head h reads kv head h // (H // Hkv)
    rel      [B, Q, H, E]    relative-bias table (the caller has tau-scaled it): the bias of a key at
                             distance d = q_pos - k_pos is rel[b, q, h, d] for 0 <= d < E, else 0
    q_pos    [B, Q] int32    query positions
    k_pos    [B, K] int32    key positions, in any order (a sliding-window ring is not sorted);
                             anything (negative too) for invalid keys
    k_valid  [B, K] bool     key present
    window   int | None      sliding window in tokens (the current token included), None = full

    score[b, h, q, j] = dot(q[b, q, h], k[b, j, h // g]) / D + bias (fp32: the input dtype's
    products accumulated in fp32; the bias value is rel's element, in rel's dtype, as fp32);
    allowed = k_valid & (d >= 0) & (window is None or d < window); softmax over the allowed
    keys in fp32; the probabilities are rounded to q's dtype and out = sum_j p * v accumulated
    in fp32, cast to q's dtype. A query with no allowed key gives zeros.

This is `inkling_jax.model.layers.attention_core` for a single key block with the bias table
and tau applied by the caller (the kernel package does not import the library; the tests
check the two agree). It materialises the fp32 scores [B, H, Q, K] and the gathered bias.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def allowed_mask(q_pos: Int[Array, "B Q"], k_pos: Int[Array, "B K"], k_valid: Bool[Array, "B K"],
                 window: int | None) -> tuple[Array, Array]:
    """(allowed [B, Q, K] bool, d [B, Q, K] int32 = q_pos - k_pos)."""
    d = q_pos.astype(jnp.int32)[:, :, None] - k_pos.astype(jnp.int32)[:, None, :]
    allowed = k_valid.astype(bool)[:, None, :] & (d >= 0)
    if window is not None:
        allowed = allowed & (d < window)
    return allowed, d


def attention(q: Float[Array, "B Q H D"], k: Float[Array, "B K Hkv D"], v: Float[Array, "B K Hkv D"],
              rel: Float[Array, "B Q H E"], q_pos: Int[Array, "B Q"], k_pos: Int[Array, "B K"],
              k_valid: Bool[Array, "B K"], *, window: int | None) -> Float[Array, "B Q H D"]:
    """See the module docstring."""
    dtype = q.dtype
    b, nq, h, dh = q.shape
    hkv = k.shape[2]
    if h % hkv:
        raise ValueError(f"query heads {h} not a multiple of kv heads {hkv}")
    g = h // hkv
    e = rel.shape[-1]
    kr = jnp.repeat(k, g, axis=2)  # [B, K, H, D]: head h reads kv head h // g
    vr = jnp.repeat(v, g, axis=2)

    allowed, d = allowed_mask(q_pos, k_pos, k_valid, window)  # [B, Q, K]
    idx = jnp.broadcast_to(jnp.clip(d, 0, e - 1)[:, :, None, :], (b, nq, h, d.shape[-1]))
    bias = jnp.take_along_axis(rel, idx, axis=-1).astype(jnp.float32)  # [B, Q, H, K]
    bias = jnp.where(((d >= 0) & (d < e))[:, :, None, :], bias, 0.0)

    s = jnp.einsum("bqhd,bkhd->bhqk", q, kr, preferred_element_type=jnp.float32,
                   precision=jax.lax.Precision.HIGHEST) * (1.0 / dh)
    s = s + bias.transpose(0, 2, 1, 3)
    mask = allowed[:, None, :, :]  # [B, 1, Q, K]
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # rows with no allowed key: exp(-inf) = 0 everywhere
    p = jnp.exp(s - m)
    den = jnp.sum(p, axis=-1, keepdims=True)
    p = jnp.where(den > 0, p / jnp.where(den > 0, den, 1.0), 0.0).astype(dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, vr, preferred_element_type=jnp.float32,
                     precision=jax.lax.Precision.HIGHEST)
    return out.astype(dtype)


__all__ = ["allowed_mask", "attention"]

"""Inkling attention with a relative-position bias in jnp: the model's attention math (what the
CPU serves: `inkling_jax.model.layers.attention_core` is `tables` + `attention`) and the oracle,
the fallback and the backward of the flash kernel (`pallas.py`).

    attention(q, k, v, rel, q_pos, k_pos, k_valid, *, window) -> out [B, Q, H, D] in q's dtype
    tables(q, r, rel_proj, tau=None) -> (q * tau, rel [B, Q, H, E]) in q's dtype

    q        [B, Q, H, D]    queries (the caller has RMS-normed them and, on log-scaling layers,
                             multiplied them by tau: `tables`)
    k, v     [B, K, Hkv, D]  keys and values; H % Hkv == 0, query head h reads kv head h // (H // Hkv);
                             or tuples of key blocks [B, K_i, Hkv, D] (e.g. the cached context
                             and the step's own tokens: the scores are concatenated, not the
                             much larger keys and values), k_pos / k_valid likewise
    rel      [B, Q, H, E]    relative-bias table (`tables`: r @ rel_proj, tau-scaled): the bias of
                             a key at distance d = q_pos - k_pos is rel[b, q, h, d] for
                             0 <= d < E, else 0
    q_pos    [B, Q] int32    query positions
    k_pos    [B, K] int32    key positions, in any order (a sliding-window ring is not sorted);
                             anything (negative too) for invalid keys
    k_valid  [B, K] bool     key present
    window   int | None      sliding window in tokens (the current token included), None = full

    score[b, h, q, j] = dot(q[b, q, h], k[b, j, h // g]) / D + bias (fp32: the input dtype's
    products accumulated in fp32; the bias value is rel's element, in rel's dtype, as fp32);
    allowed = k_valid & (d >= 0) & (window is None or d < window); softmax over the allowed
    keys in fp32; the probabilities are rounded to q's dtype and out = sum_j p * v accumulated
    in fp32 (per key block, the blocks' sums added in order), cast to q's dtype. A query with
    no allowed key gives zeros. Invalid keys' values never reach the sum, whatever they hold
    (selected away, not multiplied by 0: NaN or inf there must not poison the row, nor
    another row whose tokens the keys are). It materialises the fp32 scores [B, H, Q, K] and the gathered
    bias.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def tables(q: Float[Array, "B Q H D"], r: Float[Array, "B Q H R"], rel_proj: Float[Array, "R E"],
           tau: Float[Array, "B Q"] | None = None) -> tuple[Array, Array]:
    """(q * tau, rel = (r @ rel_proj) * tau) in q's dtype: rel accumulated in fp32 and rounded to
    q's dtype, then both times tau in fp32 and rounded again (tau None: neither scaled)."""
    dtype = q.dtype
    rel = jnp.einsum("bqhr,re->bqhe", r, rel_proj.astype(r.dtype), preferred_element_type=jnp.float32).astype(dtype)
    if tau is None:
        return q, rel
    t = tau.astype(jnp.float32)[:, :, None, None]
    return (q.astype(jnp.float32) * t).astype(dtype), (rel.astype(jnp.float32) * t).astype(dtype)


def attention(q: Float[Array, "B Q H D"], k: Float[Array, "B K Hkv D"] | tuple[Array, ...],
              v: Float[Array, "B K Hkv D"] | tuple[Array, ...], rel: Float[Array, "B Q H E"], q_pos: Int[Array, "B Q"],
              k_pos: Int[Array, "B K"] | tuple[Array, ...], k_valid: Bool[Array, "B K"] | tuple[Array, ...], *,
              window: int | None) -> Float[Array, "B Q H D"]:
    """See the module docstring."""
    if not isinstance(k, tuple):
        k, v, k_pos, k_valid = (k,), (v,), (k_pos,), (k_valid,)
    dtype = q.dtype
    b, tq, nh, hd = q.shape
    nkv = k[0].shape[2]
    if nh % nkv:
        raise ValueError(f"query heads {nh} not a multiple of kv heads {nkv}")
    group = nh // nkv
    e = rel.shape[-1]
    qg = q.reshape(b, tq, nkv, group, hd)

    scores, masks = [], []
    for kb, pb, vb in zip(k, k_pos, k_valid):
        dist = q_pos[:, :, None] - pb[:, None, :]  # [b, tq, tk]
        in_extent = (dist >= 0) & (dist < e)
        gather_idx = jnp.clip(dist, 0, e - 1)
        bias = jnp.take_along_axis(rel, jnp.broadcast_to(gather_idx[:, :, None, :], (b, tq, nh, dist.shape[-1])),
                                   axis=-1)
        bias = jnp.where(in_extent[:, :, None, :], bias, jnp.zeros((), rel.dtype))  # [b, tq, nh, tk]
        allowed = vb[:, None, :] & (dist >= 0)
        if window is not None:
            allowed = allowed & (dist < window)
        sc = jnp.einsum("bqngd,bknd->bngqk", qg, kb, preferred_element_type=jnp.float32) * (1.0 / hd)
        scores.append(sc + bias.astype(jnp.float32).reshape(b, tq, nkv, group, -1).transpose(0, 2, 3, 1, 4))
        masks.append(allowed[:, None, None, :, :])
    sizes = [sc.shape[-1] for sc in scores]
    scores = jnp.concatenate(scores, axis=-1)
    mask = jnp.concatenate(masks, axis=-1)
    scores = jnp.where(mask, scores, -jnp.inf)
    any_valid = jnp.any(mask, axis=-1, keepdims=True)
    scores = jnp.where(any_valid, scores, 0.0)
    probs = jnp.where(mask, jax.nn.softmax(scores, axis=-1), 0.0).astype(dtype)
    out = None
    start = 0
    for vb, valid, n in zip(v, k_valid, sizes):
        # an invalid key's value is selected away, not multiplied by its zero probability: it may
        # be anything (another row's token, a stale page or ring row, NaN), and 0 * NaN is NaN
        vb = jnp.where(valid[:, :, None, None], vb, jnp.zeros((), vb.dtype))
        part = jnp.einsum("bngqk,bknd->bqngd", probs[..., start:start + n], vb, preferred_element_type=jnp.float32)
        out = part if out is None else out + part
        start += n
    return out.astype(dtype).reshape(b, tq, nh, hd)


__all__ = ["attention", "tables"]

"""The per-head q / k RMSNorms of `inkling_jax.model.layers.attention_block` in jnp: what the
CPU serves (`pallas_kernels.REFERENCE_OPS.qk_norm`) and the oracle of `pallas.qk_norm`.

    qk_norm(q, kv, q_weight, k_weight, *, num_heads, num_kv_heads, head_dim, eps)
        -> (q_normed [T, nh, hd], k_normed [T, nkv, hd])

        q         [T, Wq], Wq >= nh * hd: the q heads are its first nh * hd columns, head-major
                  (q itself, or the whole fused q|k|v|r projection, whose first columns are q)
        kv        [T, Wk], Wk >= nkv * hd: the k heads are its first nkv * hd columns (the
                  k|v conv output [T, 2 * nkv * hd]: k is its first half)
        q_weight, k_weight [hd]: the norms' weights (any float dtype; cast to x's dtype)
        q_normed  rms_norm of each q head, q's dtype; k_normed likewise, kv's dtype

`rms_norm` is `pallas_kernels._common.rms_norm`, the model's norm (`layers.rms_norm` is the same
function): fp32 math, the normalised value rounded to x's dtype, then times the weight
(rounded to x's dtype) in x's dtype.
"""

from __future__ import annotations

from jaxtyping import Array, Float

from .._common import rms_norm


def qk_norm(q: Float[Array, "t wq"], kv: Float[Array, "t wk"], q_weight: Float[Array, " hd"],
            k_weight: Float[Array, " hd"], *, num_heads: int, num_kv_heads: int, head_dim: int, eps: float
            ) -> tuple[Float[Array, "t nh hd"], Float[Array, "t nkv hd"]]:
    """(rms_norm of q's nh heads, rms_norm of kv's first nkv heads): see the module docstring."""
    t = q.shape[0]
    qd, kd = num_heads * head_dim, num_kv_heads * head_dim
    qn = rms_norm(q[:, :qd].reshape(t, num_heads, head_dim), q_weight, eps)
    kn = rms_norm(kv[:, :kd].reshape(t, num_kv_heads, head_dim), k_weight, eps)
    return qn, kn


__all__ = ["qk_norm", "rms_norm"]

"""Per-head RMSNorms: `ref` (jnp) and `pallas` (Triton kernel), same signatures: the q and k
norms of the attention block in one launch (`qk_norm`)."""

from . import pallas, ref

__all__ = ["pallas", "ref"]

"""Flash-style attention with Inkling's relative-position bias: `ref` (jnp) and `pallas` (Triton
kernel), same signatures."""

from . import pallas, ref

__all__ = ["pallas", "ref"]

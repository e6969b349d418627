"""Routed-expert kernels for a few decoding tokens: `ref` (jnp) and `pallas` (Triton), same signatures."""

from . import pallas, ref

__all__ = ["pallas", "ref"]

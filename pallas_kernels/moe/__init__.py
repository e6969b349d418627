"""Routed-expert kernels: `ref` (jnp), `pallas` (Triton grouped mat-vec, a few decoding tokens) and
`grouped` (Triton sorted-block grouped GEMMs, many tokens), same signatures."""

from . import grouped, pallas, ref

__all__ = ["grouped", "pallas", "ref"]

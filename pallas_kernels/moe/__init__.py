"""Routed-expert kernels: `ref` (jnp), `pallas` (Triton grouped mat-vec, a few decoding tokens) and
`grouped` (Triton sorted-block grouped GEMMs, many tokens), same signatures; `router` (the
router's epilogue after its matmul: top-k and sink-normalised weights, one launch)."""

from . import grouped, pallas, ref, router

__all__ = ["grouped", "pallas", "ref", "router"]

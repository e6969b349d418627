"""Whole-unit arena operations: `ref` (jnp) and `pallas` (Triton kernels), same signatures."""

from . import pallas, ref

__all__ = ["pallas", "ref"]

"""Short-conv state kernels: `ref` (jnp) and `pallas` (Triton kernels), same signatures."""

from . import pallas, ref
from .ref import PackedRows

__all__ = ["PackedRows", "pallas", "ref"]

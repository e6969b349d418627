"""Attention with Inkling's relative-position bias: `ref` (jnp) and `pallas` (flash-style Triton
kernel for many queries, prefill / extend), same signatures; `decode_ref` and `decode` (few
queries per row against the serving arena's sliding rings or pages, read in place), same
signatures."""

from . import decode, decode_ref, pallas, ref

__all__ = ["decode", "decode_ref", "pallas", "ref"]

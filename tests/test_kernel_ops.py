"""The kernel seam (`pallas_kernels.KernelOps`): both implementations fill every field with a
function, and each Pallas op takes exactly its jnp counterpart's arguments, so a caller never
asks whether a kernel exists or how to call it."""

from __future__ import annotations

import dataclasses
import inspect

import jax
import pytest

import pallas_kernels as pk
from inkling_jax.model import layers

OPS = [f.name for f in dataclasses.fields(pk.KernelOps) if f.name not in ("pallas", "interpret")]


def params(fn) -> list[tuple[str, str, object]]:
    """(name, kind, default) of each parameter (annotations aside)."""
    return [(p.name, p.kind.name, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.fixture(scope="module")
def pallas_ops():
    return pk.kernel_ops(True, interpret=jax.default_backend() != "gpu")


def test_every_field_is_a_function(pallas_ops):
    assert len(OPS) == 11
    for ops in (pk.REFERENCE_OPS, pallas_ops):
        for name in OPS:
            assert callable(getattr(ops, name)), name
    assert not pk.REFERENCE_OPS.pallas and pallas_ops.pallas


@pytest.mark.parametrize("name", OPS)
def test_pallas_op_has_the_jnp_signature(pallas_ops, name):
    assert params(getattr(pallas_ops, name)) == params(getattr(pk.REFERENCE_OPS, name))


def test_the_jnp_ops_are_the_references():
    """The jnp record is the ref.py functions (each kernel's oracle), and what the layers' own
    contexts (the reference forward, training) run by default."""
    ref = pk.REFERENCE_OPS
    assert (ref.conv_update, ref.conv_write, ref.conv_residual_norm) == (
        pk.conv_state.ref.conv_update, pk.conv_state.ref.conv_write, pk.conv_state.ref.conv_update_residual_norm)
    assert (ref.copy_units, ref.clear_units) == (pk.slot_ops.ref.copy_units, pk.slot_ops.ref.clear_units)
    assert ref.matmul is layers.matmul and ref.qk_norm is pk.norm.ref.qk_norm
    assert ref.router_epilogue is pk.moe.router.router_epilogue_ref and ref.experts is pk.moe.ref.experts
    assert ref.ring_attention is pk.attention.decode_ref.ring_attention
    assert ref.paged_attention is pk.attention.decode_ref.paged_attention
    assert layers.LayerContext.ops is ref and layers.LayerContext.parallel is None


def test_names():
    assert pk.conv_ops is pk.kernel_ops and pk.ConvOps is pk.KernelOps
    assert pk.kernel_ops(False) is pk.REFERENCE_OPS

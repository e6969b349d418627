"""The compiled steps update the donated arena in place: no whole-arena `copy` in the
optimized HLO (the jnp ops, compiled for the CPU).

Each layer reads the old arena (sliding ring, pages) and then writes the new tokens' K/V
into it; unless the write is ordered after the reads, XLA's copy insertion copies the whole
arena ahead of the write, once per layer. Batch-1 steps are left out: XLA:CPU copies the
arena around its dynamic-update-slice fusions whatever the order (the GPU compiler does not).
Verify steps are left out: their draft layers' conv writes still copy it twice (not these
attention writes).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import inkling_jax as ik
from inkling_jax.cache.layout import ArenaLayout
from inkling_jax.cache.state import ServingState
from inkling_jax.steps import StepBatch, StepShape, compile_step

PAGE_SIZE, SLOTS, PAGES = 4, 8, 32


def arena_copies(hlo: str, num_units: int) -> list[str]:
    """HLO `copy` instructions whose result has the arena's leading dimension (as
    bench/profile/decode.py counts them)."""
    return [line.strip()[:200] for line in hlo.split("\n")
            if re.search(r"= [a-z0-9]+\[%d[,\]]" % num_units, line) and re.search(r"\bcopy\(", line)]


@pytest.mark.parametrize("shape", [
    StepShape("extend", 2, 128, 64, 4),  # several tokens per row: the prefill step
    StepShape("extend", 2, 128, 64, 4, tracks=2),
    StepShape("decode", 8, 8, 1, 4),
], ids=lambda s: f"{s.mode}-B{s.batch}-Q{s.query}-M{s.tracks}")
def test_no_arena_copy(shape):
    cfg = ik.InklingConfig.tiny()
    layout = ArenaLayout.build(cfg, PAGE_SIZE)
    num_units = layout.arena_units(SLOTS, PAGES)
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), ik.param_shapes(cfg),
                          is_leaf=lambda x: isinstance(x, tuple))
    state = ServingState(arena=jax.ShapeDtypeStruct((num_units, layout.unit_elems), jnp.float32),
                         slot_v2p=jax.ShapeDtypeStruct((SLOTS + 1,), jnp.int32),
                         page_v2p=jax.ShapeDtypeStruct((PAGES + 1,), jnp.int32))
    step = compile_step(cfg, layout, shape, use_pallas=False)
    hlo = step.lower(params, state, StepBatch.empty(shape)).compile().as_text()
    assert arena_copies(hlo, num_units) == []


def test_gpu_step_options_yield_to_xla_flags(monkeypatch):
    """The steps compile CONCURRENT command buffers on a GPU unless the user's XLA_FLAGS set the
    scheduling mode themselves (a per-compile option would silently override their flag)."""
    from inkling_jax.steps import program

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    assert program.gpu_step_options() == program.GPU_STEP_OPTIONS
    assert program.GPU_STEP_OPTIONS["xla_gpu_command_buffer_scheduling_mode"] == "CONCURRENT"
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_command_buffer_scheduling_mode=SERIALIZE")
    options = program.gpu_step_options()
    assert "xla_gpu_command_buffer_scheduling_mode" not in options
    assert options["xla_gpu_enable_cub_radix_sort"] is False

"""The serving state and the compiled serving steps on a mesh (`Engine(..., mesh=mesh)`).

Every device runs the single-device step (`steps.run_step`) on the plan's local config,
its own param shards and its own block of the arena, inside `shard_map`, with the layer
collectives on (`parallel=plan.axes`). The host side of the engine (pool, prefix tree,
admission, scheduler) is unchanged: it plans in the *local* layout's units, and a unit row
means the same object on every device.

Placement, global array -> what device (e, t) of the ("ep", "tp") mesh holds:

    params     sharded layout (`ShardPlan.shard_params`)        its local tensors
               specs `plan.param_specs()`
    arena      [num_units, tp, unit_elems_local]                 [num_units, 1, unit_elems_local]:
               NamedSharding P(None, "tp", None)                 block t, the arena of the
               (replicated over "ep")                            single-device program on
                                                                 `plan.local_cfg`
    slot_v2p   [num_virtual_slots + 1] int32, replicated         all of it
    page_v2p   [num_virtual_pages + 1] int32, replicated         all of it
    counts     [rows, vocab] int32 (penalties), replicated     all of it (every device counts the same tokens)
    batch      StepBatch of numpy arrays, replicated             all of it
    outputs    StepOutput, replicated                            all of it (same on every device)

Block t of the arena is laid out by `ArenaLayout.build(plan.local_cfg, ...)`: its K/V pages
and sliding rings hold the kv heads of tp shard t (the heads its q heads read; repeated
on several shards when kv heads < tp), its conv fields hold the k / v windows of those
heads *and* the full H-channel attn / mlp windows (the residual stream is replicated, so
those windows are too), and an MTP depth's carried hidden state [H] is replicated the same
way. So per device a page is 1/tp of the single-device one, a slot somewhat more than 1/tp.

One step: `jit(shard_map(local_step, in_specs=(param specs, state specs, P()),
out_specs=(P(), state specs)), donate the state)`. `local_step` views its arena block
[U, 1, E_l] as [U, E_l], runs `run_step`, and views it back. Copy-on-write restores run
inside the step, per device, on the same rows; compaction moves are one more shard_map of
the unit copy. The Pallas kernels (which take arena rows) run unchanged on the local block.

The all-gathered logits are replicated, so every device samples the same tokens with the
same keys: outputs are claimed replicated (out_specs=P()) with the replication check off
(the check types an all_gather result as varying over "tp"; see `forward.py`). The ep
replicas of the arena stay identical for the same reason (their inputs are replicated and
the psums give every participant the same sum).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .. import programs
from ..cache.layout import ArenaLayout
from ..cache.state import ServingState
from ..model.params import Params, check_params
from ..steps import StepShape, run_step
from .axes import TP_AXIS
from .compat import shard_map
from .plan import ShardPlan

REPLICATED = PartitionSpec()
ARENA_SPEC = PartitionSpec(None, TP_AXIS, None)  # [num_units, tp, unit_elems_local]


def state_specs() -> ServingState:
    """PartitionSpecs of the serving state (a ServingState of specs, for shard_map)."""
    return ServingState(ARENA_SPEC, REPLICATED, REPLICATED, REPLICATED)


def state_shardings(mesh: Mesh) -> ServingState:
    return jax.tree_util.tree_map(lambda spec: NamedSharding(mesh, spec), state_specs(),
                                  is_leaf=lambda x: isinstance(x, PartitionSpec))


# ------------------------------------------------------------------------- params


def place_params(plan: ShardPlan, params: Params) -> Params:
    """params on the plan's mesh in its sharded layout.

    Accepted: params already placed by the plan (every leaf a jax.Array carrying the plan's
    sharding, e.g. from `load_pretrained(path, mesh=mesh)` or `plan.shard_params`), returned
    as they are; or params in the original layout (numpy, or arrays on any device), which
    `plan.shard_params` places (each device's block gathered from host memory).

    Raises ValueError if the params do not fit the config, or if they carry the plan's
    partition specs on another mesh (their layout would be another plan's)."""
    shardings = plan.shardings()
    leaves, treedef = jax.tree_util.tree_flatten(params)
    want, want_def = jax.tree_util.tree_flatten(shardings)
    if treedef == want_def and all(isinstance(x, jax.Array) for x in leaves):
        placed = [x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(leaves, want)]
        if all(placed):
            shapes = jax.tree_util.tree_leaves(plan.sharded_params_shape(), is_leaf=lambda x: isinstance(x, tuple))
            for (path, x), shape in zip(jax.tree_util.tree_leaves_with_path(params), shapes):
                if tuple(x.shape) != tuple(shape):
                    raise ValueError(f"params do not fit the config: {jax.tree_util.keystr(path)} has shape "
                                     f"{tuple(x.shape)}, the plan's sharded layout has {tuple(shape)}")
            return params
        if any(_placed_elsewhere(x, s) for x, s in zip(leaves, want)):
            raise ValueError("params are sharded over another mesh (a ShardPlan's layout for other devices or "
                             "another tp / ep): load or shard them for this mesh, or pass unsharded params")
    try:
        check_params(plan.cfg, params)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"params do not fit the config: {exc}") from None
    return plan.shard_params(params)


def _placed_elsewhere(x: jax.Array, want: NamedSharding) -> bool:
    """x is sharded like a plan's leaf (same non-trivial spec) but over a different mesh."""
    s = x.sharding
    return (isinstance(s, NamedSharding) and any(p is not None for p in want.spec)
            and tuple(s.spec) == tuple(want.spec) and s.mesh != want.mesh)


# -------------------------------------------------------------------------- state


def init_sharded_state(plan: ShardPlan, layout: ArenaLayout, num_units: int, num_virtual_slots: int,
                       num_virtual_pages: int, dtype: Any, count_rows: int = 1, vocab: int = 0,
                       cache: str | None = "auto") -> ServingState:
    """A zero serving state on the mesh: arena [num_units, tp, layout.unit_elems] (layout: the
    local one), each device allocating only its block; id tables and the count table
    [count_rows, vocab] (`steps/counts.py`) replicated. The program is `inkling_jax.programs`'
    (an engine's reset, or another engine of the same geometry, compiles nothing); cache: its
    executable cache setting."""
    shapes = ((num_units, plan.tp, layout.unit_elems), (num_virtual_slots + 1,), (num_virtual_pages + 1,),
              (count_rows, vocab))
    dtype = jnp.dtype(dtype)
    return programs.get("sharded_zero_state", dict(mesh=plan.mesh, shapes=shapes, dtype=dtype),
                        partial(_zero_state_fn, plan.mesh, shapes, dtype), cache=cache)()


def _zero_state_fn(mesh: Mesh, shapes: tuple[tuple[int, ...], ...], dtype: Any):
    """jit of a zero state placed by `state_shardings`."""
    arena, slots, pages, counts = shapes
    return jax.jit(lambda: ServingState(jnp.zeros(arena, dtype), jnp.zeros(slots, jnp.int32),
                                        jnp.zeros(pages, jnp.int32), jnp.zeros(counts, jnp.int32)),
                   out_shardings=state_shardings(mesh))


def replicated_table(mesh: Mesh, table: np.ndarray) -> jax.Array:
    """A host id table as a replicated global array (each process supplies its own devices'
    copies, so this works on several hosts as on one)."""
    table = np.asarray(table)
    return jax.make_array_from_callback(table.shape, NamedSharding(mesh, REPLICATED), lambda index: table[index])


# ----------------------------------------------------------------- compiled steps


def compile_sharded_step(plan: ShardPlan, layout: ArenaLayout, shape: StepShape, use_pallas: bool = False,
                         interpret: bool = False):
    """The jitted mesh step for one (mode, bucket): (params, state, batch) -> (outputs, state),
    the state donated; params in the plan's sharded layout, the state as `state_specs()`.
    layout: the local arena layout (`ArenaLayout.build(plan.local_cfg, ...)`)."""
    if plan.mesh is None:
        raise ValueError("compile_sharded_step needs a plan built with a mesh (make_mesh)")

    def local_step(params, state: ServingState, batch):
        units, _, elems = state.arena.shape
        local = state.replace(arena=state.arena.reshape(units, elems))
        out, new = run_step(params, local, batch, cfg=plan.local_cfg, layout=layout, shape=shape,
                            use_pallas=use_pallas, interpret=interpret, parallel=plan.axes)
        return out, new.replace(arena=new.arena.reshape(units, 1, elems))

    specs = state_specs()
    # check=False: the outputs come from the all-gathered logits, replicated but typed as
    # varying over "tp" (see forward.py); the replication is tested.
    mapped = shard_map(local_step, plan.mesh, in_specs=(plan.param_specs(), specs, REPLICATED),
                       out_specs=(REPLICATED, specs), check=False)
    return jax.jit(mapped, donate_argnums=(1,))


def sharded_unit_copy(plan: ShardPlan, ops: Any):
    """jit of arena[dst] = arena[src] (unit rows) on every device's block, the arena donated:
    the compaction move of the mesh (the same rows on every device)."""

    def local_copy(arena, src, dst):
        units, _, elems = arena.shape
        return ops.copy_units(arena.reshape(units, elems), src, dst, num_units=1).reshape(units, 1, elems)

    mapped = shard_map(local_copy, plan.mesh, in_specs=(ARENA_SPEC, REPLICATED, REPLICATED), out_specs=ARENA_SPEC,
                       check=False)
    return jax.jit(mapped, donate_argnums=(0,))


# ------------------------------------------------------------------ reading a slot


def read_slot_global(plan: ShardPlan, layout: ArenaLayout, arena: jax.Array, physical_slot: int
                     ) -> dict[str, np.ndarray]:
    """A slot's fields assembled from every tp block into the *global* (single-device) shapes,
    the same keys and shapes `StepRunner.read_slot` returns without a mesh:

        "<target|draft>.<i>.conv"    [K-1, 2 kv_dim + 2 H]: every shard's k windows (distinct
                                     kv heads, in head order), then the v windows, then the
                                     attn and mlp windows (replicated: tp block 0's)
        "<target|draft>.<i>.ring"    [ring, 2, kv_heads, head_dim]: the shards' kv heads
        "draft.<i>.hidden"           [H] (replicated: tp block 0's)

    layout: the local layout; arena: the global [num_units, tp, unit_elems_local] arena."""
    cfg, tp = plan.cfg, plan.tp
    first = physical_slot * layout.slot_units
    rows = _slot_rows(plan.mesh, layout.slot_units)(arena, jnp.int32(first))  # [slot_units, tp, E_l]
    rows = np.asarray(jax.device_get(rows))
    geoms = [("target", i, fs, cfg.layer_geometry(i)) for i, fs in enumerate(layout.target)]
    geoms += [("draft", d, fs, cfg.mtp_geometry(d)) for d, fs in enumerate(layout.draft)]
    out = {}
    for tag, i, fs, g in geoms:
        # shards holding distinct kv heads (kv heads fewer than tp are repeated on tp / kv shards)
        distinct = range(0, tp, max(1, tp // g.num_kv_heads))
        if fs.conv is not None:
            local = [_field(rows[:, t], fs.conv, layout.unit_elems) for t in range(tp)]
            kv = fs.kv_dim
            out[f"{tag}.{i}.conv"] = np.concatenate([local[t][:, :kv] for t in distinct]
                                                    + [local[t][:, kv:2 * kv] for t in distinct]
                                                    + [local[0][:, 2 * kv:]], axis=1)
        if fs.ring is not None:
            out[f"{tag}.{i}.ring"] = np.concatenate([_field(rows[:, t], fs.ring, layout.unit_elems) for t in distinct],
                                                    axis=2)
        if fs.hidden is not None:
            out[f"{tag}.{i}.hidden"] = _field(rows[:, 0], fs.hidden, layout.unit_elems)
    return out


def _field(slot_rows: np.ndarray, f, unit_elems: int) -> np.ndarray:
    """Field f of one slot from its [slot_units, unit_elems] rows (as `slot_ops.ref.read_field`)."""
    flat = slot_rows[f.unit_offset:f.unit_offset + f.units].reshape(-1)
    return flat[:f.elems].reshape(f.shape)


_SLOT_READERS: dict[tuple, Any] = {}


def _slot_rows(mesh: Mesh, slot_units: int):
    """jit: the slot_units arena rows from a first row, replicated (one small gather)."""
    key = (mesh, slot_units)
    if key not in _SLOT_READERS:
        _SLOT_READERS[key] = jax.jit(partial(jax.lax.dynamic_slice_in_dim, slice_size=slot_units, axis=0),
                                     out_shardings=NamedSharding(mesh, REPLICATED))
    return _SLOT_READERS[key]

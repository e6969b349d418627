"""The device side of the engine: the serving state, the step shapes (buckets), the compiled
steps, and applying the pool's compaction moves.

The host policy (`scheduler.py`) decides *what* runs; the runner runs it:

    shape = runner.shape(mode, rows, tokens, pages)   # the bucket a step of that size uses
    runner.apply_pool(pool)                            # compaction moves + id tables -> device (atomic)
    out = runner.run(shape, batch)                     # one compiled step (state donated)

Compiled steps are cached per engine (`compiled`) and process-wide (engines with the same
model, layout and state geometry share executables). `warmup()` compiles every bucket the
scheduler can pick, and the compaction copy for every move count it pads to; `stats` counts
the step executables this engine needed and their compile time.

With a `ShardPlan` (`Engine(..., mesh=)`) the runner holds the mesh's serving state (the
arena [num_units, tp, unit_elems_local] sharded over "tp", the id tables replicated; see
`inkling_jax/parallel/serving.py`), compiles the `shard_map`ped step, and applies moves to
every device's block. Its `layout` is then the local (per-device) one; the host side of
the engine plans in its units, which mean the same rows on every device.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from pallas_kernels import conv_ops
from pallas_kernels._common import pow2_ceil

from ..cache.layout import ArenaLayout
from ..cache.pool import UnitPool
from ..cache.state import ServingState, init_state, read_slot_field
from ..compile_cache import enable_compile_cache
from ..config import InklingConfig
from ..parallel import serving
from ..parallel.plan import ShardPlan
from ..parallel.planner import MemoryPlan
from ..steps import StepBatch, StepOutput, StepShape, check_batch, compile_lowered, compile_step, feed_decode
from .config import EngineConfig
from .interrupts import critical

# Compiled steps shared by engines of the same model, layout and state geometry (a process-wide
# jit cache: an engine rebuilt with the same shapes does not compile again). Compaction copies
# likewise, per padded move count.
_COMPILED: dict[Any, Any] = {}
_MOVES: dict[Any, Any] = {}


@dataclass
class DecodeFeed:
    """Where a decode dispatch's rows continue the previous dispatch's (`steps/feed.py`)."""

    prev: StepOutput  # the previous dispatch's outputs, still on the device
    rows: np.ndarray  # [rows] int32: the previous dispatch's row each row continues
    steps: np.ndarray  # [rows] int32: the steps that row was planned for


@lru_cache(maxsize=None)
def _zeros_probe(shape: tuple[int, ...], sharding) -> Callable:
    """jit(params, state) -> int32 zeros [shape]: see Runner._like_step_outputs."""
    # keep_unused: a pruned argument would not count towards the outputs' commitment
    return jax.jit(lambda params, state: jnp.zeros(shape, jnp.int32), out_shardings=sharding, keep_unused=True)


def pad_to(x: np.ndarray, n: int, value: int) -> np.ndarray:
    """x (1-D int32) padded with `value` to length n."""
    return np.concatenate([np.asarray(x, np.int32), np.full(n - len(x), value, np.int32)])


def ladder(top: int, start: int = 1) -> list[int]:
    """start, 2 start, 4 start, ... below top, then top."""
    out, v = [], start
    while v < top:
        out.append(v)
        v *= 2
    return out + [top]


def available_memory(device: jax.Device | None = None) -> int | None:
    """Bytes `device` (default: the first device) can still allocate (GPU: its allocator's
    limit minus what is in use; CPU: the host's available physical memory), or None when
    unknown."""
    device = jax.devices()[0] if device is None else device
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_arena_fits(num_units: int, layout: ArenaLayout, dtype: Any) -> None:
    """ValueError naming the sizes when an arena of num_units units cannot be allocated."""
    arena_bytes = num_units * layout.unit_elems * np.dtype(dtype).itemsize
    free = available_memory()
    if free is not None and arena_bytes > free:
        raise ValueError(f"the serving arena needs {arena_bytes / 2**30:.2f} GiB ({num_units} units of "
                         f"{layout.unit_elems} elements) but the device has {free / 2**30:.2f} GiB free: "
                         f"lower num_pages, num_slots or max_context (or max_new_tokens)")


def check_arena_fits_per_device(memory: MemoryPlan, devices: list[jax.Device]) -> None:
    """ValueError naming the sizes when the arena's share of one device (`memory.arena`, the
    planner's count) exceeds what any of `devices` (this process's devices of the mesh) has
    free. CPU devices of one host share its memory: each gets an equal part of it."""
    shared = [d for d in devices if not (d.memory_stats() if hasattr(d, "memory_stats") else None)]
    for device in devices:
        free = available_memory(device)
        if free is None:
            continue
        if device in shared:
            free //= len(shared)
        if memory.arena > free:
            raise ValueError(f"the serving arena needs {memory.arena / 2**30:.2f} GiB per device ({memory.arena_note}; "
                             f"tp={memory.tp} x ep={memory.ep}) but {device} has {free / 2**30:.2f} GiB free: lower "
                             f"num_pages, num_slots or max_context (or max_new_tokens), or use more devices "
                             f"(python -m inkling_jax.parallel.planner prints the whole budget)")


def resolve_use_pallas(config: EngineConfig) -> bool:
    if config.use_pallas == "auto":
        return jax.default_backend() == "gpu"
    if isinstance(config.use_pallas, bool):
        if config.use_pallas and jax.default_backend() != "gpu" and not config.pallas_interpret:
            raise ValueError("use_pallas=True needs a GPU (or pallas_interpret=True for interpret mode)")
        return config.use_pallas
    raise ValueError(f"use_pallas must be True, False or 'auto', got {config.use_pallas!r}")


# Decode steps per dispatch on an accelerator ("auto"): 8 measured 1.7x faster than one step
# per dispatch at batch 1 and 1.5x at batch 32 in the engine loop (BENCHMARKS.md). On the CPU
# the host round trip is small next to a step, and tests read every step.
AUTO_DECODE_STEPS = 8


def resolve_overlap(config: EngineConfig, decode_steps: int) -> bool:
    """Whether the engine overlaps decode dispatches (`steps/feed.py`); "auto": on a GPU or
    TPU, with multi-step decode and without speculative decoding."""
    if config.overlap == "auto":
        return jax.default_backend() in ("gpu", "tpu") and decode_steps > 1 and not config.spec_steps
    if config.overlap and decode_steps < 2:
        raise ValueError("EngineConfig: overlap needs multi-step decode (decode_steps > 1; 'auto' is 1 on the CPU)")
    return bool(config.overlap)


def resolve_decode_steps(config: EngineConfig) -> int:
    if config.decode_steps == "auto":
        return AUTO_DECODE_STEPS if jax.default_backend() in ("gpu", "tpu") else 1
    return int(config.decode_steps)


class StepRunner:
    """The device side of one engine.

    cfg: the model's (global) config. layout: the arena layout of one device (with a plan:
    `ArenaLayout.build(plan.local_cfg, ...)`). params: on one device, or (with a plan) in the
    plan's sharded layout on its mesh (`parallel.serving.place_params`)."""

    def __init__(self, cfg: InklingConfig, params: Any, config: EngineConfig, layout: ArenaLayout, pool: UnitPool,
                 max_context: int, extend_checkpoints: int = 1, plan: ShardPlan | None = None):
        self.cfg, self.params, self.config, self.layout = cfg, params, config, layout
        self.plan = plan
        self.use_pallas = resolve_use_pallas(config)
        self.decode_steps = resolve_decode_steps(config)
        self.overlap = resolve_overlap(config, self.decode_steps)
        self.compile_cache_dir = enable_compile_cache(config.compile_cache_dir)
        self.ops = conv_ops(self.use_pallas, config.pallas_interpret)
        self.dtype = params["unembed"].dtype
        self.state: ServingState = self._zero_state(pool)
        self.tables_on_device = (np.zeros(len(pool.slots.v2p), np.int32), np.zeros(len(pool.pages.v2p), np.int32))
        top_b = pow2_ceil(config.max_running)
        self.batch_buckets = ladder(top_b, min(top_b, pow2_ceil(config.min_batch_bucket)))
        top_t = pow2_ceil(config.max_step_tokens)
        self.token_buckets = ladder(top_t, min(top_t, pow2_ceil(max(config.min_token_bucket, config.max_running))))
        top_p = pow2_ceil(math.ceil(max_context / config.page_size))
        self.page_buckets = ladder(top_p, min(top_p, pow2_ceil(math.ceil(config.min_context_bucket / config.page_size))))
        self.extend_checkpoints = extend_checkpoints  # M of extend steps (decode / verify: 1)
        self.compiled: dict[StepShape, Any] = {}
        self._move_fns: dict[int, Any] = {}
        self.stats = dict(compiles=0, compile_seconds=0.0)

    def _zero_state(self, pool: UnitPool) -> ServingState:
        slots, pages = len(pool.slots.v2p) - 1, len(pool.pages.v2p) - 1
        if self.plan is None:
            return init_state(self.layout, pool.num_units, slots, pages, self.dtype)
        return serving.init_sharded_state(self.plan, self.layout, pool.num_units, slots, pages, self.dtype)

    def _device_table(self, table: np.ndarray) -> jax.Array:
        """An id table as the step takes it (replicated over the mesh with a plan)."""
        # device_put, not jnp.asarray: the latter compiles a staging program per table size
        return jax.device_put(table) if self.plan is None else serving.replicated_table(self.plan.mesh, table)

    # ------------------------------------------------------------------ shapes

    def shape(self, mode: str, rows: int, tokens: int, pages: int) -> StepShape:
        """The bucket a step of `rows` rows, `tokens` packed tokens and `pages` page columns uses."""
        b = next(x for x in self.batch_buckets if x >= rows)
        p = next(x for x in self.page_buckets if x >= pages)
        if mode == "decode":
            return StepShape("decode", b, b, 1, p, steps=self.decode_steps)
        if mode == "verify":
            q = self.config.spec_steps + 1
            return StepShape("verify", b, b * q, q, p)
        t = next(x for x in self.token_buckets if x >= max(tokens, b))
        return StepShape("extend", b, t, min(self.config.chunk_size, t), p, self.extend_checkpoints)

    def all_shapes(self) -> list[StepShape]:
        """Every shape the scheduler can pick."""
        shapes = []
        for b in self.batch_buckets:
            for p in self.page_buckets:
                shapes.append(self.shape("verify" if self.config.spec_steps else "decode", b, b, p))
                shapes += [self.shape("extend", b, t, p) for t in self.token_buckets if t >= b]
        return shapes

    def empty_batch(self, shape: StepShape) -> StepBatch:
        return StepBatch.empty(shape, self.config.spec_steps, self.config.max_stop_ids)

    # --------------------------------------------------------------- compiling

    def compiled_step(self, shape: StepShape):
        fn = self.compiled.get(shape)
        if fn is None:
            key = (self.cfg, self.layout, shape, self.use_pallas, self.config.pallas_interpret,
                   None if self.plan is None else self.plan.mesh,
                   jax.tree_util.tree_structure(self.params),
                   tuple((x.shape, str(x.dtype)) for x in jax.tree_util.tree_leaves((self.params, self.state))))
            fn = _COMPILED.get(key)
            if fn is None:
                t0 = time.perf_counter()
                if self.plan is None:
                    jitted = compile_step(self.cfg, self.layout, shape, self.use_pallas, self.config.pallas_interpret)
                else:
                    jitted = serving.compile_sharded_step(self.plan, self.layout, shape, self.use_pallas,
                                                          self.config.pallas_interpret)
                fn = compile_lowered(jitted.lower(self.params, self.state, self.empty_batch(shape)))
                self.stats["compile_seconds"] += time.perf_counter() - t0
                _COMPILED[key] = fn
            self.stats["compiles"] += 1  # executables this engine needed (process-wide cache hits included)
            self.compiled[shape] = fn
        return fn

    def warmup(self, max_move_units: int, overlap: bool = False) -> None:
        """Compile every bucket the scheduler can pick, and the compaction copy for every
        padded move count up to max_move_units (with overlap, the decode feed for every pair
        of batch buckets too): nothing compiles while serving."""
        for shape in self.all_shapes():
            self.compiled_step(shape)
        if overlap:
            ns, k = self.config.max_stop_ids, self.decode_steps
            i32 = lambda *n: np.zeros(n, np.int32)
            for b in self.batch_buckets:
                for bp in self.batch_buckets:
                    ran = self._like_step_outputs(bp)
                    feed_decode(i32(b), i32(b), i32(b), i32(b, ns), self._like_step_outputs(bp, k), ran, i32(b),
                                i32(b), ran == 0)
        n = 1
        while True:
            self._move_fn(n)
            if n >= max_move_units:
                break
            n *= 2

    # ---------------------------------------------------------------- running

    def _like_step_outputs(self, *shape: int) -> jax.Array:
        """int32 zeros [shape] placed and committed as a step's outputs are (one device, or
        replicated over the mesh): what warm-up feeds the decode feed in place of a step's
        outputs. A jit compiles per input placement *and* commitment, and a jit's outputs are
        committed when one of its inputs is (params placed by the caller, say): the probe takes
        the step's params and state, so it follows the same rule. (Committing uncommitted outputs
        at serving time instead copies them: 1.9 ms of host time per call on a 2-core CPU.)"""
        sharding = None if self.plan is None else NamedSharding(self.plan.mesh, PartitionSpec())
        return _zeros_probe(shape, sharding)(self.params, self.state)

    def run(self, shape: StepShape, batch: StepBatch, feed: "DecodeFeed | None" = None) -> StepOutput:
        """Run one compiled step (the state is donated and replaced); device outputs.

        feed: a multi-step decode dispatched before the previous one's outputs were read
        (the engine's overlap): its rows' tokens and activity come from `feed.prev` on the
        device (`steps/feed.py`)."""
        check_batch(batch, shape, self.config.spec_steps, self.config.max_stop_ids)
        fn = self.compiled_step(shape)
        if feed is not None:
            if shape.mode != "decode" or shape.steps < 2:
                raise ValueError("only multi-step decode dispatches are fed from the previous one")
            tokens, num_new, num_steps = feed_decode(batch.layout.tokens, batch.layout.num_new, batch.layout.num_steps, batch.sampling.stop_ids,
                                                     feed.prev.tokens, feed.prev.num_accepted,
                                                     pad_to(feed.rows, shape.batch, -1),
                                                     pad_to(feed.steps, shape.batch, 0), feed.prev.row_ok)
            batch = dataclasses.replace(batch, layout=dataclasses.replace(batch.layout, tokens=tokens, num_new=num_new,
                                                                          num_steps=num_steps))
        out, self.state = fn(self.params, self.state, batch)
        return out

    def apply_pool(self, pool: UnitPool) -> None:
        """Apply the pool's planned compaction moves and its id tables to the device state, as
        one transaction: the moves are acknowledged (and the tables recorded as the device's)
        only with the new arena in place. A failed copy leaves them pending."""
        src, dst = pool.pending_moves()
        if not len(src) and not pool.tables_dirty:
            return
        slot_table, page_table = pool.tables()
        arena = self.state.arena
        with critical():
            if len(src):
                arena = self.move_units(arena, src, dst)
            self.state = ServingState(arena, self._device_table(slot_table), self._device_table(page_table))
            self.tables_on_device = (slot_table, page_table)
            pool.ack_moves()
            pool.tables_dirty = False

    def move_units(self, arena, src: np.ndarray, dst: np.ndarray):
        """arena[dst] = arena[src] (unit rows, one gather then one scatter); the arena is donated.
        With a plan, every device copies the same rows of its own block."""
        n = pow2_ceil(len(src))
        pad = n - len(src)
        src = np.concatenate([src, np.zeros(pad, np.int32)])  # sink -> sink: inert
        dst = np.concatenate([dst, np.zeros(pad, np.int32)])
        return self._move_fn(n)(arena, src, dst)

    def _move_fn(self, n: int):
        """The compiled copy of n (padded) unit rows for this runner's arena."""
        fn = self._move_fns.get(n)
        if fn is None:
            arena = self.state.arena
            key = (self.use_pallas, self.config.pallas_interpret, None if self.plan is None else self.plan.mesh,
                   n, arena.shape, str(arena.dtype))
            fn = _MOVES.get(key)
            if fn is None:
                if self.plan is None:
                    ops = self.ops
                    jitted = jax.jit(lambda a, s, d: ops.copy_units(a, s, d, num_units=1), donate_argnums=(0,))
                else:
                    jitted = serving.sharded_unit_copy(self.plan, self.ops)
                rows = jax.ShapeDtypeStruct((n,), jnp.int32)
                target = jax.ShapeDtypeStruct(arena.shape, arena.dtype, sharding=arena.sharding)
                fn = _MOVES[key] = jitted.lower(target, rows, rows).compile()
            self._move_fns[n] = fn
        return fn

    def state_lost(self) -> bool:
        """The arena was donated to a computation whose result never arrived."""
        return self.state.arena.is_deleted()

    def rebuild_state(self, pool: UnitPool) -> None:
        """A zero arena and the pool's tables (after a reset: nothing live holds device state)."""
        self.state = self._zero_state(pool)
        pool.ack_moves()
        pool.tables_dirty = True
        self.apply_pool(pool)

    def read_slot(self, physical_slot: int) -> dict[str, np.ndarray]:
        """A slot's fields: {"target.3.conv": [K-1, C], "target.0.ring": [ring, 2, kv_heads,
        head_dim], "draft.1.hidden": [H], ...}.

        With a plan the fields are assembled from every device's block into these same global
        shapes (all kv heads, all k / v channels), so they compare with a single-device
        engine's (`parallel.serving.read_slot_global`)."""
        lay = self.layout
        if self.plan is not None:
            return serving.read_slot_global(self.plan, lay, self.state.arena, physical_slot)
        phys = jnp.asarray([physical_slot], jnp.int32)
        out = {}
        for tag, blocks in (("target", lay.target), ("draft", lay.draft)):
            for i, fs in enumerate(blocks):
                for name in ("conv", "ring", "hidden"):
                    f = getattr(fs, name)
                    if f is not None:
                        out[f"{tag}.{i}.{name}"] = np.asarray(read_slot_field(self.state.arena, lay, phys, f))[0]
        return out

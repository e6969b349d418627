"""The device side of the engine: the serving state, the step shapes (buckets), the compiled
steps, and applying the pool's compaction moves.

The host policy (`scheduler.py`) decides *what* runs; the runner runs it:

    shape = runner.shape(mode, rows, tokens, pages)   # the bucket a step of that size uses
                                                       # (verify: rounds=R, `verify_rounds`)
    runner.apply_pool(pool)                            # compaction moves + id tables -> device (atomic)
    out = runner.run(shape, batch)                     # one compiled step (state donated)

Every program (the steps, the compaction copies, the zero state, the count-table writes, the
decode feed) comes from `inkling_jax/programs.py`: the process's bounded program table, then
the executable cache on disk, else a compile. The runner holds the programs it uses
(`compiled`, its moves, count-table writes and feeds) for as long as it lives: a dropped
engine's programs are freed once they also fall out of the table. `warmup()` makes every
bucket the scheduler can pick, the count-table write of every batch bucket and the compaction
copy for every move count it pads to, concurrently in the compile pool (`wait=False`: in the
background, a step then waits only for its own program); `stats` counts the step executables
this engine needed and the seconds it waited for those not already in the process.

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
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from pallas_kernels import conv_ops
from pallas_kernels._common import pow2_ceil

from .. import programs
from ..cache.layout import ArenaLayout
from ..cache.pool import UnitPool
from ..cache.state import ServingState, init_state, read_slot_field
from ..compile_cache import enable_compile_cache
from ..config import InklingConfig
from ..parallel import serving
from ..parallel.plan import ShardPlan
from ..parallel.planner import MemoryPlan
from ..steps import StepBatch, StepOutput, StepShape, check_batch, compile_lowered, compile_step, feed_decode
from ..steps import counts as counts_lib
from ..steps.program import gpu_step_options
from .config import EngineConfig
from .interrupts import critical
from .stats import CompileStats

# The process-wide program table (`programs.TABLE`; an alias for scripts that read or clear
# it: `ik.clear_program_cache()` is the public way).
_COMPILED = programs.TABLE


@dataclass
class DecodeFeed:
    """Where a decode dispatch's rows continue the previous dispatch's (`steps/feed.py`)."""

    prev: StepOutput  # the previous dispatch's outputs, still on the device
    rows: np.ndarray  # [rows] int32: the previous dispatch's row each row continues
    steps: np.ndarray  # [rows] int32: the steps that row was planned for


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
        # R of a verify dispatch whose drafts are the MTP heads' own (rounds > 0 check the drafts
        # the round before proposed, on the device): decode_steps is "model steps per dispatch"
        # in both modes. The engine sets 1 when a `drafts_for` hook supplies the drafts.
        self.verify_rounds = self.decode_steps if config.spec_steps else 1
        self.overlap = resolve_overlap(config, self.decode_steps)
        self.compile_cache_dir = enable_compile_cache(config.compile_cache_dir)
        self.executable_cache = config.executable_cache  # programs.request's cache setting
        self.ops = conv_ops(self.use_pallas, config.pallas_interpret)
        self.dtype = params["unembed"].dtype
        self.state: ServingState = self._zero_state(pool)
        self.tables_on_device = (np.zeros(len(pool.slots.v2p), np.int32), np.zeros(len(pool.pages.v2p), np.int32))
        top_b = pow2_ceil(config.max_running)
        self.batch_buckets = ladder(top_b, min(top_b, pow2_ceil(config.min_batch_bucket)))
        top_t = pow2_ceil(config.max_step_tokens)
        self.token_buckets = ladder(top_t, min(top_t, pow2_ceil(max(config.min_token_bucket, config.max_running))))
        top_p = pow2_ceil(math.ceil(max_context / config.page_size))
        bottom_p = pow2_ceil(math.ceil(config.min_context_bucket / config.page_size))
        self.page_buckets = ladder(top_p, min(top_p, bottom_p))
        self.extend_checkpoints = extend_checkpoints  # M of extend steps (decode / verify: 1)
        # the programs this engine uses, by kind: steps by StepShape, unit copies by padded
        # move count, count-table writes by batch bucket, decode feeds by (batch bucket,
        # previous batch bucket), arena row reads / writes of durable state by ("gather" or
        # "scatter", padded row count)
        self._programs: dict[str, dict[Any, Any]] = {"step": {}, "move": {}, "counts": {}, "feed": {}, "rows": {}}
        self.compiled: dict[StepShape, Any] = self._programs["step"]
        self._pending: dict[tuple[str, Any], Future] = {}  # asked for by warmup(wait=False), not taken yet
        self.stats = CompileStats()

    def _zero_state(self, pool: UnitPool) -> ServingState:
        slots, pages = len(pool.slots.v2p) - 1, len(pool.pages.v2p) - 1
        rows, vocab = self.config.max_running + 1, self.cfg.unpadded_vocab_size  # the count table (penalties)
        if self.plan is not None:
            return serving.init_sharded_state(self.plan, self.layout, pool.num_units, slots, pages, self.dtype, rows,
                                              vocab, cache=self.executable_cache)
        shapes = (self.layout, pool.num_units, slots, pages, jnp.dtype(self.dtype), rows, vocab)
        spec = dict(shapes=shapes, device=getattr(jax.config, "jax_default_device", None))
        zeros = programs.get("zero_state", spec, lambda: jax.jit(partial(init_state, *shapes)),
                             cache=self.executable_cache)
        return zeros()

    def _device_table(self, table: np.ndarray) -> jax.Array:
        """An id table as the step takes it (replicated over the mesh with a plan)."""
        # device_put, not jnp.asarray: the latter compiles a staging program per table size
        return jax.device_put(table) if self.plan is None else serving.replicated_table(self.plan.mesh, table)

    # ------------------------------------------------------------------ shapes

    def shape(self, mode: str, rows: int, tokens: int, pages: int, score: bool = False,
              rounds: int | None = None) -> StepShape:
        """The bucket a step of `rows` rows, `tokens` packed tokens and `pages` page columns uses
        (`score`: an extend step that scores its tokens, compiled when first used; `rounds`: a
        verify dispatch's rounds, default `verify_rounds`)."""
        b = next(x for x in self.batch_buckets if x >= rows)
        p = next(x for x in self.page_buckets if x >= pages)
        top = self.config.max_logprobs
        if mode == "decode":
            return StepShape("decode", b, b, 1, p, steps=self.decode_steps, top_logprobs=top)
        if mode == "verify":
            q = self.config.spec_steps + 1
            return StepShape("verify", b, b * q, q, p, steps=self.verify_rounds if rounds is None else rounds,
                             top_logprobs=top)
        t = next(x for x in self.token_buckets if x >= max(tokens, b))
        return StepShape("extend", b, t, min(self.config.chunk_size, t), p, self.extend_checkpoints, top_logprobs=top,
                         score=score)

    def all_shapes(self) -> list[StepShape]:
        """Every shape the scheduler can pick."""
        shapes = []
        for b in self.batch_buckets:
            for p in self.page_buckets:
                shapes.append(self.shape("verify" if self.config.spec_steps else "decode", b, b, p))
                shapes += [self.shape("extend", b, t, p) for t in self.token_buckets if t >= b]
        return shapes

    def empty_batch(self, shape: StepShape) -> StepBatch:
        return StepBatch.empty(shape, self.config.spec_steps, self.config.max_stop_ids, self.config.max_logit_bias)

    # --------------------------------------------------------------- compiling

    def _requester(self, kind: str, key: Any):
        """request(background) -> a future of the program of that kind and key."""
        if kind == "step":
            return partial(self._request_step, key)
        if kind == "move":
            return partial(self._request_move, key)
        if kind == "counts":
            return partial(self._request_counts, key)
        if kind == "rows":
            return partial(self._request_rows, *key)
        return partial(self._request_feed, *key)

    def _program(self, kind: str, key: Any) -> Any:
        """This engine's program of that kind and key: its own, the one warmup asked for, or
        one made now; the wait for a step not in the process's table counts in
        stats.compile_seconds."""
        table = self._programs[kind]
        fn = table.get(key)
        if fn is None:
            t0 = time.perf_counter()
            future = self._pending.pop((kind, key), None) or self._requester(kind, key)(background=False)
            fn = table[key] = future.result()
            if kind == "step" and getattr(future, "source", None) != "memory":
                self.stats.compile_seconds += time.perf_counter() - t0
        return fn

    def compiled_step(self, shape: StepShape):
        if shape not in self.compiled:
            self.stats.compiles += 1
        return self._program("step", shape)

    def _request_step(self, shape: StepShape, background: bool) -> Future:
        args = (self.cfg, self.layout, shape, self.use_pallas, self.config.pallas_interpret)
        if self.plan is None:
            make = partial(compile_step, *args)
        else:
            make = partial(serving.compile_sharded_step, self.plan, *args[1:])
        spec = dict(cfg=self.cfg, layout=self.layout, shape=shape, use_pallas=self.use_pallas,
                    interpret=self.config.pallas_interpret, mesh=None if self.plan is None else self.plan.mesh)
        options = gpu_step_options() if jax.default_backend() == "gpu" else {}
        return programs.request("step", spec, make, (self.params, self.state, self.empty_batch(shape)),
                                options=options, compile=compile_lowered, cache=self.executable_cache,
                                background=background)

    def warmup(self, max_move_units: int, overlap: bool = False, wait: bool = True) -> None:
        """Make every bucket the scheduler can pick (scoring extend steps excepted: they are
        made when first used), the count-table write of every batch bucket, and the compaction
        copy for every padded move count up to max_move_units (with overlap, the decode feed
        for every pair of batch buckets too), concurrently in the compile pool (extend steps
        first: a prefill comes first). wait: return once all are ready (nothing compiles while
        serving); False: return at once, each step waiting only for the program it runs."""
        wanted = [("step", shape) for shape in sorted(self.all_shapes(), key=lambda s: s.mode != "extend")]
        wanted += [("counts", b) for b in self.batch_buckets]  # count-table writes (penalties)
        n = 1
        while True:
            wanted.append(("move", n))
            if n >= max_move_units:
                break
            n *= 2
        if overlap:
            wanted += [("feed", (b, bp)) for b in self.batch_buckets for bp in self.batch_buckets]
        for kind, key in wanted:
            if key not in self._programs[kind] and (kind, key) not in self._pending:
                self._pending[(kind, key)] = self._requester(kind, key)(background=True)
        if wait:
            for kind, key in wanted:
                if kind == "step":
                    self.compiled_step(key)
                else:
                    self._program(kind, key)

    # ---------------------------------------------------------------- running

    def _request_feed(self, b: int, bp: int, background: bool) -> Future:
        """The decode feed of a batch of b rows from a previous dispatch of bp rows, whose
        outputs are placed as a step's are (one device, or replicated over the mesh)."""
        placed = self.state.arena.sharding if self.plan is None else NamedSharding(self.plan.mesh, PartitionSpec())
        host = lambda *n: jax.ShapeDtypeStruct(n, jnp.int32)
        dev = lambda *n, dtype=jnp.int32: jax.ShapeDtypeStruct(n, dtype, sharding=placed)
        args = (host(b), host(b), host(b), host(b, self.config.max_stop_ids), dev(bp, self.decode_steps), dev(bp),
                host(b), host(b), dev(bp, dtype=jnp.bool_))
        return programs.request("feed_decode", {}, lambda: feed_decode, args, cache=self.executable_cache,
                                background=background)

    def run(self, shape: StepShape, batch: StepBatch, feed: "DecodeFeed | None" = None) -> StepOutput:
        """Run one compiled step (the state is donated and replaced); device outputs.

        feed: a multi-step decode dispatched before the previous one's outputs were read
        (the engine's overlap): its rows' tokens and activity come from `feed.prev` on the
        device (`steps/feed.py`)."""
        check_batch(batch, shape, self.config.spec_steps, self.config.max_stop_ids, self.config.max_logit_bias)
        fn = self.compiled_step(shape)
        if feed is not None:
            if shape.mode != "decode" or shape.steps < 2:
                raise ValueError("only multi-step decode dispatches are fed from the previous one")
            bp = feed.prev.tokens.shape[0]
            feed_fn = self._program("feed", (shape.batch, bp))
            lay = batch.layout
            tokens, num_new, num_steps = feed_fn(lay.tokens, lay.num_new, lay.num_steps, batch.sampling.stop_ids,
                                                 feed.prev.tokens, feed.prev.num_accepted,
                                                 pad_to(feed.rows, shape.batch, -1), pad_to(feed.steps, shape.batch, 0),
                                                 feed.prev.row_ok)
            batch = dataclasses.replace(batch, layout=dataclasses.replace(lay, tokens=tokens, num_new=num_new,
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
            self.state = ServingState(arena, self._device_table(slot_table), self._device_table(page_table),
                                      self.state.counts)
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
        return self._program("move", n)

    def _request_move(self, n: int, background: bool) -> Future:
        ops, plan = self.ops, self.plan
        if plan is None:
            make = lambda: jax.jit(lambda a, s, d: ops.copy_units(a, s, d, num_units=1), donate_argnums=(0,))
        else:
            make = lambda: serving.sharded_unit_copy(plan, ops)
        rows = jax.ShapeDtypeStruct((n,), jnp.int32)
        spec = dict(use_pallas=self.use_pallas, interpret=self.config.pallas_interpret,
                    mesh=None if plan is None else plan.mesh)
        return programs.request("move_units", spec, make, (self.state.arena, rows, rows),
                                cache=self.executable_cache, background=background)

    def reset_counts(self, rows: np.ndarray, values: np.ndarray) -> None:
        """Write count-table rows (`steps/counts.py`: requests with penalties, before their first
        step); rows padded to a batch bucket, so there is one program per bucket."""
        n = next(x for x in self.batch_buckets if x >= len(rows))
        rows = pad_to(rows, n, self.config.max_running + 1)
        values = np.concatenate([values, np.zeros((n - len(values), values.shape[1]), np.int32)])
        fn = self._program("counts", n)
        with critical():
            self.state = self.state.replace(counts=fn(self.state.counts, rows, values))

    def _request_counts(self, n: int, background: bool) -> Future:
        """The count-table write of n (padded) rows (the table donated)."""
        rows = jax.ShapeDtypeStruct((n,), jnp.int32)
        values = jax.ShapeDtypeStruct((n, self.state.counts.shape[1]), jnp.int32)
        return programs.request("reset_counts", {}, lambda: counts_lib.reset_rows, (self.state.counts, rows, values),
                                cache=self.executable_cache, background=background)

    # ------------------------------------------------- durable state (engine/persist.py)

    def read_rows(self, rows: np.ndarray) -> np.ndarray:
        """arena[rows] on the host (single device): one gather, its row count padded to a power
        of two (one program per padded count, made when first used)."""
        self._single_device("read_rows")
        n = pow2_ceil(max(len(rows), 1))
        fn = self._program("rows", ("gather", n))
        return np.asarray(jax.device_get(fn(self.state.arena, pad_to(rows, n, 0))))[:len(rows)]

    def write_rows(self, rows: np.ndarray, data: np.ndarray) -> None:
        """arena[rows] = data (single device): one scatter, the arena donated; the padding rows
        point past the arena (dropped)."""
        self._single_device("write_rows")
        n = pow2_ceil(max(len(rows), 1))
        fn = self._program("rows", ("scatter", n))
        data = np.concatenate([data, np.zeros((n - len(rows), *data.shape[1:]), data.dtype)])
        with critical():
            self.state = self.state.replace(arena=fn(self.state.arena, pad_to(rows, n, self.state.arena.shape[0]),
                                                     data))

    def _single_device(self, what: str) -> None:
        if self.plan is not None:
            raise ValueError(f"{what}: durable state is single-device "
                             "(an engine on a mesh cannot be saved or restored)")

    def _request_rows(self, how: str, n: int, background: bool) -> Future:
        arena = self.state.arena
        rows = jax.ShapeDtypeStruct((n,), jnp.int32)
        if how == "gather":
            make, args = (lambda: jax.jit(lambda a, r: a[r])), (arena, rows)
        else:
            data = jax.ShapeDtypeStruct((n, *arena.shape[1:]), arena.dtype)
            make = lambda: jax.jit(lambda a, r, d: a.at[r].set(d, mode="drop"), donate_argnums=(0,))
            args = (arena, rows, data)
        return programs.request(f"{how}_rows", {}, make, args, cache=self.executable_cache, background=background)

    def state_lost(self) -> bool:
        """The arena was donated to a computation whose result never arrived."""
        counts = self.state.counts
        return self.state.arena.is_deleted() or (counts is not None and counts.is_deleted())

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

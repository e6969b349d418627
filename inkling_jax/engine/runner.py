"""The device side of the engine: the serving state, the step shapes (buckets), the compiled
steps, and applying the pool's compaction moves.

The host policy (`scheduler.py`) decides *what* runs; the runner runs it:

    shape = runner.shape(mode, rows, tokens, pages)   # the bucket a step of that size uses
    runner.apply_pool(pool)                            # compaction moves + id tables -> device
    out = runner.run(shape, batch)                     # one compiled step (state donated)

Compiled steps are cached per engine (`compiled`) and process-wide (engines with the same
model, layout and state geometry share executables). `warmup()` compiles every bucket the
scheduler can pick; `stats` counts the executables this engine needed and their compile time.
"""

from __future__ import annotations

import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from pallas_kernels import conv_ops

from ..cache.layout import ArenaLayout
from ..cache.pool import UnitPool
from ..cache.state import ServingState, init_state, read_slot_field
from ..config import InklingConfig
from ..steps import StepBatch, StepOutput, StepShape, check_batch, compile_lowered, compile_step
from .config import EngineConfig

# Compiled steps shared by engines of the same model, layout and state geometry (a process-wide
# jit cache: an engine rebuilt with the same shapes does not compile again).
_COMPILED: dict[Any, Any] = {}


def pow2_ceil(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def ladder(top: int, start: int = 1) -> list[int]:
    """start, 2 start, 4 start, ... below top, then top."""
    out, v = [], start
    while v < top:
        out.append(v)
        v *= 2
    return out + [top]


def resolve_use_pallas(config: EngineConfig) -> bool:
    if config.use_pallas == "auto":
        return jax.default_backend() == "gpu"
    if isinstance(config.use_pallas, bool):
        if config.use_pallas and jax.default_backend() != "gpu" and not config.pallas_interpret:
            raise ValueError("use_pallas=True needs a GPU (or pallas_interpret=True for interpret mode)")
        return config.use_pallas
    raise ValueError(f"use_pallas must be True, False or 'auto', got {config.use_pallas!r}")


class StepRunner:
    def __init__(self, cfg: InklingConfig, params: Any, config: EngineConfig, layout: ArenaLayout, pool: UnitPool,
                 max_context: int, extend_checkpoints: int = 1):
        self.cfg, self.params, self.config, self.layout = cfg, params, config, layout
        self.use_pallas = resolve_use_pallas(config)
        self.ops = conv_ops(self.use_pallas, config.pallas_interpret)
        self.dtype = params["unembed"].dtype
        self.state: ServingState = init_state(layout, pool.num_units, len(pool.slots.v2p) - 1,
                                              len(pool.pages.v2p) - 1, self.dtype)
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

    # ------------------------------------------------------------------ shapes

    def shape(self, mode: str, rows: int, tokens: int, pages: int) -> StepShape:
        """The bucket a step of `rows` rows, `tokens` packed tokens and `pages` page columns uses."""
        b = next(x for x in self.batch_buckets if x >= rows)
        p = next(x for x in self.page_buckets if x >= pages)
        if mode == "decode":
            return StepShape("decode", b, b, 1, p)
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
                   jax.tree_util.tree_structure(self.params),
                   tuple((x.shape, str(x.dtype)) for x in jax.tree_util.tree_leaves((self.params, self.state))))
            fn = _COMPILED.get(key)
            if fn is None:
                t0 = time.perf_counter()
                jitted = compile_step(self.cfg, self.layout, shape, self.use_pallas, self.config.pallas_interpret)
                fn = compile_lowered(jitted.lower(self.params, self.state, self.empty_batch(shape)))
                self.stats["compile_seconds"] += time.perf_counter() - t0
                _COMPILED[key] = fn
            self.stats["compiles"] += 1  # executables this engine needed (process-wide cache hits included)
            self.compiled[shape] = fn
        return fn

    def warmup(self) -> None:
        """Compile every bucket the scheduler can pick."""
        for shape in self.all_shapes():
            self.compiled_step(shape)

    # ---------------------------------------------------------------- running

    def run(self, shape: StepShape, batch: StepBatch) -> StepOutput:
        """Run one compiled step (the state is donated and replaced); device outputs."""
        check_batch(batch, shape, self.config.spec_steps, self.config.max_stop_ids)
        fn = self.compiled_step(shape)
        out, self.state = fn(self.params, self.state, batch)
        return out

    def apply_pool(self, pool: UnitPool) -> None:
        """Apply the pool's planned compaction moves and refreshed id tables to the device state."""
        src, dst = pool.take_moves()
        if len(src):
            n = pow2_ceil(len(src))
            pad = n - len(src)
            src = np.concatenate([src, np.zeros(pad, np.int32)])  # sink -> sink: inert
            dst = np.concatenate([dst, np.zeros(pad, np.int32)])
            fn = self._move_fns.get(n)
            if fn is None:
                fn = jax.jit(lambda a, s, d: self.ops.copy_units(a, s, d, num_units=1), donate_argnums=(0,))
                self._move_fns[n] = fn
            self.state = self.state.replace(arena=fn(self.state.arena, src, dst))
        if pool.tables_dirty:
            slot_table, page_table = pool.tables()
            self.state = self.state.replace(slot_v2p=jnp.asarray(slot_table), page_v2p=jnp.asarray(page_table))

    def read_slot(self, physical_slot: int) -> dict[str, np.ndarray]:
        """A slot's fields: {"target.3.conv": [K-1, C], "target.0.ring": [ring, 2, kv_heads,
        head_dim], "draft.1.hidden": [H], ...}."""
        lay = self.layout
        phys = jnp.asarray([physical_slot], jnp.int32)
        out = {}
        for tag, blocks in (("target", lay.target), ("draft", lay.draft)):
            for i, fs in enumerate(blocks):
                for name in ("conv", "ring", "hidden"):
                    f = getattr(fs, name)
                    if f is not None:
                        out[f"{tag}.{i}.{name}"] = np.asarray(read_slot_field(self.state.arena, lay, phys, f))[0]
        return out

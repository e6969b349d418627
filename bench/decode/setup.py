"""The setup of bench.decode.decode: command line, sizes, the serving state, the request rows'
ids, the step shapes and their compiles. Nothing here runs a step."""

from __future__ import annotations

import argparse
import os
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

import inkling_jax as ik
from inkling_jax.cache.layout import ArenaLayout
from inkling_jax.cache.state import ServingState
from inkling_jax.steps import RowPlan, StepBatch, StepShape, compile_lowered, compile_step

from bench.common.helpers import log


def parse_args(argv=None, description: str = ""):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--smoke", action="store_true", help="tiny config, fp32, on CPU (jnp steps; HF on CPU)")
    p.add_argument("--out", default="", help="also write the markdown tables to this file")
    p.add_argument("--batches", default="", help="decode batch sizes (default 1,8,32,128)")
    p.add_argument("--contexts", default="", help="decode contexts in tokens (default 1024,4096)")
    p.add_argument("--iters", type=int, default=0, help="timed decode steps per shape (default 100)")
    p.add_argument("--hf-new", type=int, default=0, help="tokens HF (and the correctness run) generate (default 24)")
    p.add_argument("--jnp-decode", default=None, help="BxL decode shapes also timed on the jnp path (default 8x1024)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers section")
    p.add_argument("--smoke-pallas", action="store_true",
                   help="smoke: also run the Pallas-vs-jnp decode check (interpret mode: slow to compile on a CPU)")
    p.add_argument("--workers", type=int, default=0, help="compile threads (default min(shapes, cpus))")
    p.add_argument("--budget", type=float, default=0,
                   help="seconds; HF speed runs are skipped past it, the eager-experts ones 120 s before (default 480)")
    p.add_argument("--cache-dir", default="", help="jax persistent compilation cache (compile times: cache hits)")
    p.add_argument("--trace", default="", help="write a jax profiler trace of a few decode steps per shape here")
    return p.parse_args(argv)


def apply_jax_options(args) -> None:
    """--smoke: the CPU; --cache-dir: the persistent compilation cache (caching every entry).
    Environment variables the caller set win. Call before anything touches a device."""
    if args.smoke and not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")
    if args.cache_dir:
        for name, value in (("jax_compilation_cache_dir", args.cache_dir),
                            ("jax_persistent_cache_min_compile_time_secs", 0),
                            ("jax_persistent_cache_min_entry_size_bytes", 0)):
            if os.environ.get(name.upper()) is None:
                jax.config.update(name, value)


@dataclass
class Setup:
    cfg: ik.InklingConfig
    dtype: object
    page_size: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    prefill_long: int  # one long prompt, prefilled in chunks
    prefill_chunk: int
    prefill_batch: int  # rows of the batched prefill (= the correctness / HF batch)
    hf_context: int  # context of the correctness / HF runs (prompt + new tokens)
    hf_new: int
    hf_batches: tuple[int, ...]
    iters: int
    warmup: int
    copy_elems: int
    interpret: bool
    jnp_decode: tuple[tuple[int, int], ...]
    budget: float
    smoke: bool
    main_pallas: bool  # the path of the timed steps (Pallas on GPU; jnp in the CPU smoke run)

    @property
    def pages_per_row(self) -> int:
        return max(max(self.contexts), self.prefill_long) // self.page_size

    @property
    def path(self) -> str:
        return "Pallas" if self.main_pallas else "jnp"


def make_setup(args) -> Setup:
    if args.smoke:
        cfg = ik.InklingConfig.tiny(num_mtp_layers=0, mtp_local_layer_ids=())
        # Pallas interpret mode compiles slowly on a CPU: the smoke run times the jnp steps and
        # runs Pallas (interpret) only in the Pallas-vs-jnp decode check
        s = Setup(cfg, jnp.float32, 4, (1, 2), (16,), prefill_long=32, prefill_chunk=8, prefill_batch=2,
                  hf_context=16, hf_new=6, hf_batches=(1, 2), iters=3, warmup=1, copy_elems=1 << 22,
                  interpret=True, jnp_decode=(), budget=600, smoke=True, main_pallas=False)
    else:
        cfg = ik.InklingConfig.bench(num_mtp_layers=0, mtp_local_layer_ids=())
        s = Setup(cfg, jnp.bfloat16, 64, (1, 8, 32, 128), (1024, 4096), prefill_long=4096, prefill_chunk=1024,
                  prefill_batch=8, hf_context=1024, hf_new=24, hf_batches=(1, 8), iters=100, warmup=3,
                  copy_elems=1 << 30, interpret=False, jnp_decode=((8, 1024),), budget=480, smoke=False,
                  main_pallas=True)
    if args.batches:
        s.batches = tuple(int(b) for b in args.batches.split(","))
    if args.contexts:
        s.contexts = tuple(int(c) for c in args.contexts.split(","))
    if args.iters:
        s.iters = args.iters
    if args.hf_new:
        s.hf_new = args.hf_new
    if args.jnp_decode is not None:
        s.jnp_decode = tuple(tuple(int(v) for v in x.split("x")) for x in args.jnp_decode.split(",") if x)
    if args.budget:
        s.budget = args.budget
    need = [(s.prefill_batch in s.batches, "prefill_batch must be one of the decode batches"),
            (s.hf_context in s.contexts, "the HF context must be one of the decode contexts"),
            (all(c % s.page_size == 0 for c in s.contexts + (s.prefill_long, s.prefill_chunk)), "page multiples"),
            (s.prefill_long % s.prefill_chunk == 0, "prefill_long must be a multiple of prefill_chunk"),
            (max(s.hf_batches) == s.prefill_batch and 1 in s.hf_batches, "hf batches: 1 and prefill_batch"),
            (all(b in s.batches and c in s.contexts for b, c in s.jnp_decode), "jnp shapes must be in the sweep")]
    for ok, msg in need:
        if not ok:
            raise SystemExit(f"bad setup: {msg}")
    return s


# ------------------------------------------------------------------------ state and rows


@dataclass
class RowIds:
    """Virtual ids of the bench's request rows in its one state (identity id tables, so
    virtual == physical): row r owns slot r + 1 and pages_per_row pages of its own."""

    layout: ArenaLayout
    num_slots: int
    num_pages: int
    pages_per_row: int

    def slot(self, row: int) -> int:  # 0 is the sink
        return row + 1

    def pages(self, row: int, n: int) -> np.ndarray:
        """The first n of row r's pages (covering n * page_size tokens)."""
        return (1 + row * self.pages_per_row + np.arange(n)).astype(np.int32)

    def row(self, row: int, seq_start: int, tokens, shape: StepShape) -> RowPlan:
        """Row r feeding `tokens` from position seq_start (greedy, no checkpoint), its page
        table as wide as the shape's page bucket."""
        return RowPlan(tokens=list(tokens), seq_start=seq_start, virtual_slot=self.slot(row),
                       virtual_pages=self.pages(row, shape.pages))


def make_state(s: Setup) -> tuple[RowIds, ServingState]:
    """One state for every shape: slots 1..max(B), pages for max(B) rows of the longest
    context, identity id tables (virtual == physical), random contents (no NaN/inf)."""
    lay = ArenaLayout.build(s.cfg, s.page_size)
    rows = max(s.batches)
    ids = RowIds(lay, rows, rows * s.pages_per_row, s.pages_per_row)
    num_units = lay.arena_units(ids.num_slots, ids.num_pages)

    @jax.jit
    def build(key):
        return jax.random.normal(key, (num_units, lay.unit_elems), jnp.float32).astype(s.dtype)

    state = ServingState(arena=build(jax.random.key(7)),
                         slot_v2p=jnp.arange(ids.num_slots + 1, dtype=jnp.int32),
                         page_v2p=jnp.arange(ids.num_pages + 1, dtype=jnp.int32))
    return ids, state


# ------------------------------------------------------------------------ shapes and compiles


def decode_shape(s: Setup, b: int, ctx: int) -> StepShape:
    return StepShape("decode", b, b, 1, ctx // s.page_size)


def extend_long_shape(s: Setup) -> StepShape:
    return StepShape("extend", 1, s.prefill_chunk, s.prefill_chunk, s.prefill_long // s.page_size)


def extend_batch_shape(s: Setup) -> StepShape:
    c = s.hf_context
    return StepShape("extend", s.prefill_batch, s.prefill_batch * c, c, c // s.page_size)


def label(shape: StepShape, pallas: bool) -> str:
    path = "Pallas" if pallas else "jnp"
    if shape.mode == "decode":
        return f"decode B={shape.batch} P={shape.pages} ({path})"
    return f"extend B={shape.batch} T={shape.tokens} Q={shape.query} P={shape.pages} ({path})"


@dataclass
class Compiled:
    fn: object  # None when lowering or compiling failed (error says why)
    lower_s: float
    compile_s: float
    temp_bytes: float | None = None  # XLA's temp buffer size (a full arena copy would show here)
    xla_bytes: float | None = None  # XLA's cost-analysis estimate of bytes accessed
    error: str = ""


def _compile_one(key: tuple[StepShape, bool], lowered, lower_s: float) -> tuple[tuple, Compiled]:
    t0 = time.perf_counter()
    try:
        fn = compile_lowered(lowered)
    except Exception as exc:  # noqa: BLE001 - report; the sections needing it say so
        traceback.print_exc()
        log(f"  FAILED to compile {label(*key)}: {type(exc).__name__}: {exc}")
        return key, Compiled(None, lower_s, time.perf_counter() - t0, error=f"{type(exc).__name__}: {exc}"[:200])
    dt = time.perf_counter() - t0
    temp = xla = None
    try:
        temp = float(fn.memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend reports it
        pass
    try:
        ca = fn.cost_analysis()
        ca = ca[0] if isinstance(ca, (list, tuple)) else ca
        xla = float(ca.get("bytes accessed")) if ca and ca.get("bytes accessed") is not None else None
    except Exception:  # noqa: BLE001
        pass
    log(f"  compiled {label(*key)} in {dt:.1f}s")
    return key, Compiled(fn, lower_s, dt, temp, xla)


def compile_all(s: Setup, params, state, specs: list[tuple[StepShape, bool]], workers: int) -> dict:
    """{(shape, pallas): Compiled}: lowered one by one on this thread, each handed to a
    compile thread as soon as it is lowered (XLA compiles release the GIL)."""
    lay = ArenaLayout.build(s.cfg, s.page_size)
    futures, failed = [], []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for shape, pallas in specs:
            t0 = time.perf_counter()
            try:
                jitted = compile_step(s.cfg, lay, shape, use_pallas=pallas, interpret=s.interpret and pallas)
                low = jitted.lower(params, state, StepBatch.empty(shape))
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                log(f"  FAILED to lower {label(shape, pallas)}: {type(exc).__name__}: {exc}")
                failed.append(((shape, pallas), Compiled(None, time.perf_counter() - t0, 0.0,
                                                          error=f"{type(exc).__name__}: {exc}"[:200])))
                continue
            dt = time.perf_counter() - t0
            log(f"  lowered {label(shape, pallas)} in {dt:.1f}s")
            futures.append(pool.submit(_compile_one, (shape, pallas), low, dt))
        return dict([f.result() for f in futures] + failed)


def compiled_step(compiled: dict, shape: StepShape, pallas: bool):
    """The compiled step of (shape, pallas), or RuntimeError saying why there is none."""
    c = compiled.get((shape, pallas))
    if c is None or c.fn is None:
        raise RuntimeError(f"{label(shape, pallas)} did not compile: {c.error if c else 'not requested'}")
    return c.fn

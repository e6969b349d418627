"""Timing one arena op for bench.kernels.kernels: `reps` calls unrolled in one jit, an L2 flush
kernel between calls on the GPU, the op's device time from a profiler trace (the flush
kernels left out); wall time / reps on a CPU (smoke)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from bench.common.device_time import traced_device_events

FLUSH_COLS = 2048  # uint32 per flush program (8 KB)
FLUSH_BYTES = 256 << 20  # > 5x the H200's L2


def l2_flush(buf: jax.Array) -> jax.Array:
    """buf + 1 in place: a pass over FLUSH_BYTES that evicts the op's data from L2.

    Its kernel is named `l2_flush`, so the trace can leave it out of the op's time."""
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + jnp.uint32(1)

    spec = pl.BlockSpec((1, FLUSH_COLS), lambda i: (i, 0))
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(buf.shape, buf.dtype), grid=(buf.shape[0],),
                          in_specs=[spec], out_specs=spec, input_output_aliases={0: 0}, name="l2_flush",
                          compiler_params=plt.CompilerParams(num_warps=4, num_stages=1))(buf)


@dataclass
class Timing:
    seconds: float  # per op: median device time (GPU) or wall time / reps (CPU smoke)
    kernels: float | None  # kernel launches per op (GPU), median


def op_samples(events, flush_kernels: frozenset[str]) -> list[tuple[int, int]]:
    """(device ns, kernels) of each op: the non-flush events between consecutive flushes."""
    out, ns, n = [], 0, 0
    for ev in events:
        name, dur = ev.kernel, ev.duration_ns
        if name in flush_kernels:
            if n:
                out.append((ns, n))
            ns, n = 0, 0
        else:
            ns, n = ns + dur, n + 1
    if n:
        out.append((ns, n))
    return out


class Timer:
    """Times ops of one dtype: `iters` calls of `reps` ops each; `flush` (GPU): L2 flushed
    between ops and device time from a trace."""

    def __init__(self, dtype, iters: int, reps: int, flush: bool):
        self.dtype, self.iters, self.reps, self.flush = dtype, iters, reps, flush
        self.flush_buf = None
        self.flush_kernels: frozenset[str] = frozenset()
        self.copy_cache: dict[int, Timing] = {}

    def start_flushes(self) -> None:
        """Allocate the flush buffer and learn the flush kernels' names (GPU only)."""
        self.flush_buf = jnp.zeros((FLUSH_BYTES // (4 * FLUSH_COLS), FLUSH_COLS), jnp.uint32)
        f = jax.jit(l2_flush, donate_argnums=0)
        box = [f(self.flush_buf)]

        def run():
            box[0] = f(box[0])
            jax.block_until_ready(box)

        self.flush_kernels = frozenset(e.kernel for e in traced_device_events(run))
        self.flush_buf = box[0]
        if not self.flush_kernels:
            raise RuntimeError("the trace shows no kernel for l2_flush")

    def rep_loop(self, op):
        """jit(fn)(state, flush_buf, *args) -> (state, flush_buf): `reps` calls of op(state, *args)
        -> state, unrolled, with an L2 flush between calls on the GPU (optimization barriers keep
        the order op, flush, op, ...). state and flush_buf are donated."""
        def fn(state, buf, *args):
            for _ in range(self.reps):
                state = op(state, *args)
                if self.flush:
                    state, buf = jax.lax.optimization_barrier((state, buf))
                    buf = l2_flush(buf)
                    state, buf = jax.lax.optimization_barrier((state, buf))
            return state, buf
        return jax.jit(fn, donate_argnums=(0, 1))

    def _wall(self, fn, state, args) -> Timing:
        times = []
        for _ in range(self.iters):
            t0 = time.perf_counter()
            state, self.flush_buf = fn(state, self.flush_buf, *args)
            jax.block_until_ready(state)
            times.append(time.perf_counter() - t0)
        return Timing(statistics.median(times) / self.reps, None)

    def timed(self, op, state, args) -> Timing:
        """Time op(state, *args) -> state: two warm-up calls of the rep loop, then `iters` calls;
        on the GPU traced, per-op device time = median over the iters * reps ops of the kernel
        time between flushes (the mean where the flushes did not split the ops)."""
        fn = self.rep_loop(op)
        for _ in range(2):
            state, self.flush_buf = fn(state, self.flush_buf, *args)
        jax.block_until_ready((state, self.flush_buf))
        if not self.flush:
            return self._wall(fn, state, args)
        box = [state, self.flush_buf]

        def run():
            for _ in range(self.iters):
                box[0], box[1] = fn(box[0], box[1], *args)
            jax.block_until_ready(box)

        events = traced_device_events(run)
        self.flush_buf = box[1]
        samples = op_samples(events, self.flush_kernels)
        if len(samples) != self.iters * self.reps:
            print(f"  warning: trace has {len(samples)} op samples, expected {self.iters * self.reps}; "
                  f"kernels {sorted({e.kernel[:40] for e in events})[:8]}", flush=True)
            busy = sum(e.duration_ns for e in events if e.kernel not in self.flush_kernels)
            return Timing(busy * 1e-9 / (self.iters * self.reps), None)
        return Timing(statistics.median(ns for ns, _ in samples) * 1e-9, statistics.median(n for _, n in samples))

    def same_size_copy(self, nbytes: int) -> Timing:
        """A device copy that moves nbytes (read + write): y = -x on nbytes / 2 bytes of the
        dtype, in place, timed like the ops (L2 flushed between calls). What the device's own
        copy reaches at an op's size: small ops cannot leave the launch and latency floor."""
        if nbytes not in self.copy_cache:
            n = max(1, nbytes // 2 // jnp.dtype(self.dtype).itemsize)
            x = jax.random.normal(jax.random.key(n), (n,), jnp.float32).astype(self.dtype)
            self.copy_cache[nbytes] = self.timed(jnp.negative, x, ())
        return self.copy_cache[nbytes]

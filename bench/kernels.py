"""Pallas conv-state / slot / MoE kernels against their jnp (XLA) references, on the GPU.

    python bench/kernels.py [--out kernels.md]   # InklingConfig.bench() streams, K=4, bf16 arena, batch 1/32/256
    python bench/kernels.py --sweep [grid|default] [--compare-module M] [--moe-sweep]
    python bench/kernels.py --smoke    # tiny sizes, interpret mode: runs anywhere (CPU) in about a minute

For every (kernel, stream, batch) it first checks the kernel against the reference on random
batches (random slot permutations, padded rows, rows without state, commit_len 0, checkpoints)
and prints PASS / FAIL, then times both: jitted, state donated, `reps` ops unrolled in one jit
with an L2 flush kernel (`l2_flush`, 256 MB) between ops, `iters` calls under the jax
profiler. The time of an op is its device (kernel) time from the trace, the flush kernels
left out, median over the iters * reps ops; so launches and host dispatch are not in it, and
every op finds its data in HBM as a decode step does. Reported per op: the time, launches,
bytes that must move / time as a fraction of the device copy bandwidth (a 2 GB copy, device
time), and the time of a device copy of the same byte count (`same_size_copy`: what any
kernel of that size can reach). With --smoke (CPU, no trace) times are wall time / reps.

--sweep grid times the conv_update kernel over channel blocks and warps on the cases that
matter (--sweep default: the default plan only), and on the extend cases over tokens per
program (tile 1-8); --compare-module M also times M.conv_update
(e.g. an earlier pallas_kernels/conv_state.py copied beside it). --moe-sweep times the MoE
grouped mat-vec kernel's tiles.

check: `exact` = arena (outside the sink) and y bit for bit; `y~ e` = arena exact, y within
e (max |diff| / max |y|; the reference's fp32 accumulation order on GPU is XLA's choice);
`FAIL ...` otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from device_time import traced_device_events  # noqa: E402
from inkling_jax.model import layers as L  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plt  # noqa: E402
from inkling_jax.cache import conv_state as ref_conv  # noqa: E402
from inkling_jax.cache.conv_state import ConvMeta  # noqa: E402
from inkling_jax.cache.layout import ArenaLayout, Field  # noqa: E402
from inkling_jax.config import InklingConfig  # noqa: E402

VERIFY_Q = 3  # tokens per row in the conv_write (speculative verify) case
EXTEND_L = 64  # new tokens per row in the extend case


@dataclass
class Setup:
    cfg: InklingConfig
    lay: ArenaLayout
    k: int
    dtype: object
    batches: tuple[int, ...]
    extend_batches: tuple[int, ...]
    streams: dict  # name -> (field, (c0, c1))
    interpret: bool
    iters: int
    reps: int
    copy_elems: int
    moe_tokens: tuple[int, ...]
    flush: bool  # GPU: L2 flush between timed ops, device time from a trace
    flush_buf: object = None
    flush_kernels: frozenset = frozenset()
    copy_cache: dict = dataclasses.field(default_factory=dict)
    lay_shape: tuple[int, int] = (0, 0)


def make_setup(args) -> Setup:
    if args.smoke:
        cfg, page_size, batches, ext = InklingConfig.tiny(), 4, (3,), (2,)
    else:
        cfg, page_size, batches, ext = InklingConfig.bench(), 64, (1, 32, 256), (1, 32)
    if args.batches:
        batches = tuple(int(b) for b in args.batches.split(","))
    lay = ArenaLayout.build(cfg, page_size)
    full = next(i for i in range(cfg.num_layers) if not cfg.is_sliding(i))
    slide = next(i for i in range(cfg.num_layers) if cfg.is_sliding(i))
    h = cfg.hidden_size

    def chans(layer, stream):
        f = lay.target[layer].conv
        kv = (f.shape[1] - 2 * h) // 2
        c0, w = {"k": (0, kv), "attn": (2 * kv, h)}[stream]
        return f, (c0, c0 + w)

    streams = {f"k (full, W={cfg.num_kv_heads * cfg.head_dim})": chans(full, "k"),
               f"k (sliding, W={cfg.swa_num_kv_heads * cfg.swa_head_dim})": chans(slide, "k"),
               f"attn (W={h})": chans(slide, "attn")}
    if args.smoke:
        streams = dict(list(streams.items())[::2])
    return Setup(cfg, lay, cfg.conv_kernel_size, jnp.bfloat16, batches, ext, streams, interpret=args.smoke,
                 iters=args.iters or (2 if args.smoke else 20), reps=args.reps or (1 if args.smoke else 10),
                 copy_elems=(1 << 22) if args.smoke else (1 << 30), moe_tokens=(1,) if args.smoke else (1, 2),
                 flush=not args.smoke, lay_shape=(1, lay.unit_elems))


# ---------------------------------------------------------------------------- inputs


def make_arena(s: Setup, num_slots: int, seed: int) -> jax.Array:
    """Random arena of num_slots slots with the conv fields' padding tails zero (as in any
    arena the library builds: the reference rewrites them as zeros)."""
    lay = s.lay
    e = lay.unit_elems
    mask = np.ones((lay.slot_units, e), np.float32)
    for fs in lay.target + lay.draft:
        f = fs.conv
        flat = mask[f.unit_offset:f.unit_offset + f.units].reshape(-1)
        flat[f.elems:] = 0
        mask[f.unit_offset:f.unit_offset + f.units] = flat.reshape(f.units, e)

    @jax.jit
    def build(key, m):
        a = jnp.where(m > 0, jax.random.normal(key, (num_slots, lay.slot_units, e), jnp.float32), 0.0)  # +0, not -0
        return a.astype(s.dtype).reshape(num_slots * lay.slot_units, e)

    return build(jax.random.key(seed), jnp.asarray(mask))


def make_meta(rng, rows: int, q: int, km1: int, *, padded: bool, track: bool, mixed: bool) -> tuple[ConvMeta, int]:
    """(meta, T = rows * q): `rows` requests of up to q new tokens each (decode: q = 1),
    packed as steps.py packs them. Physical slots: actives from a random permutation of 1..2*rows+1,
    checkpoint slots disjoint from them.

    mixed: random lengths, commit_len (0, partial), has_state and checkpoints, as a checker
    wants; otherwise every row is real, full, with state and without a checkpoint (timing).
    padded: some rows are padding (sink slot, no tokens; padding tokens point at them)."""
    slots = rng.permutation(np.arange(1, 2 * rows + 2))
    real = np.ones(rows, bool)
    if padded and rows > 1:
        real[rng.rand(rows) < 0.25] = False
        real[0] = True
        real[-1] = q == 1  # extend: a padded row for the padding tokens to point at
    num_new = np.where(real, rng.randint(1, q + 1, rows) if mixed and not real.all() else q, 0)
    if q == 1:  # decode: token b is row b's (padding tokens: their own padded row)
        num_tokens = rows
        token_row = np.arange(rows)
        token_offset = np.zeros(rows, np.int64)
        query_start = np.arange(rows)
    else:
        num_tokens = rows * q  # the token bucket: every batch of a case compiles once
        token_row = np.zeros(num_tokens, np.int64)
        token_offset = np.zeros(num_tokens, np.int64)
        query_start = rng.randint(0, num_tokens, rows)  # padded rows: anywhere
        t = 0
        for b in np.flatnonzero(real):
            query_start[b] = t
            token_row[t:t + num_new[b]] = b
            token_offset[t:t + num_new[b]] = np.arange(num_new[b])
            t += num_new[b]
        if t < num_tokens:  # padding tokens: a padded row, offsets past its (zero) new tokens
            token_row[t:] = rng.choice(np.flatnonzero(~real), num_tokens - t)
            token_offset[t:] = rng.randint(0, q, num_tokens - t)
    row_tokens = np.clip(query_start[:, None] + np.arange(q)[None, :], 0, num_tokens - 1)
    has_state = real & (rng.rand(rows) < 0.8) if mixed else real
    commit = num_new.copy()
    if mixed:
        u = rng.rand(rows)
        commit = np.where(u < 0.2, 0, np.where(u < 0.5, np.minimum(num_new, rng.randint(0, q + 1, rows)), commit))
    track_dest = np.zeros(rows, np.int64)
    track_len = np.zeros(rows, np.int64)
    if track:
        tracking = real & (rng.rand(rows) < 0.3)
        track_dest = np.where(tracking, slots[rows:2 * rows], 0)
        track_len = np.where(tracking, np.minimum(num_new, rng.randint(0, km1 + 2, rows)), 0)
    i32 = lambda a: jnp.asarray(a, jnp.int32)
    meta = ConvMeta(token_row=i32(token_row), token_offset=i32(token_offset), row_tokens=i32(row_tokens),
                    has_state=jnp.asarray(has_state), commit_len=i32(commit), active=i32(np.where(real, slots[:rows], 0)),
                    track_dest=i32(track_dest), track_len=i32(track_len))
    return meta, num_tokens


# ---------------------------------------------------------------------------- checks


def _bits(a):
    return jax.lax.bitcast_convert_type(a, {2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize])


@jax.jit
def _same_bits(a, b):
    return jnp.all(_bits(a) == _bits(b))


@jax.jit
def _rel_err(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30)


def compare(s: Setup, arena0, got_arena, want_arena, got_y=None, want_y=None) -> str:
    su = s.lay.slot_units
    if not bool(_same_bits(got_arena[su:], want_arena[su:])):
        return "FAIL arena"
    if not bool(_same_bits(got_arena[:su], arena0[:su])):
        return "FAIL sink written"
    if got_y is None or bool(_same_bits(got_y, want_y)):
        return "exact"
    err = float(_rel_err(got_y, want_y))
    tol = 1e-2 if got_y.dtype == jnp.bfloat16 else 1e-5
    return f"y~ {err:.1e}" if err <= tol else f"FAIL y {err:.1e}"


# ---------------------------------------------------------------------------- timing

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


def rep_loop(op, s: Setup):
    """jit(fn)(state, flush_buf, *args) -> (state, flush_buf): s.reps calls of op(state, *args) -> state,
    unrolled, with an L2 flush between calls on the GPU (optimization barriers keep the order
    op, flush, op, ...). state and flush_buf are donated."""
    def fn(state, buf, *args):
        for _ in range(s.reps):
            state = op(state, *args)
            if s.flush:
                state, buf = jax.lax.optimization_barrier((state, buf))
                buf = l2_flush(buf)
                state, buf = jax.lax.optimization_barrier((state, buf))
        return state, buf
    return jax.jit(fn, donate_argnums=(0, 1))


@dataclass
class Timing:
    seconds: float  # per op: median device time (GPU) or wall time / reps (CPU smoke)
    kernels: float | None  # kernel launches per op (GPU), median


def flush_kernel_names(s: Setup) -> frozenset[str]:
    """The kernel names a traced l2_flush call shows (so op_samples can tell them apart)."""
    f = jax.jit(l2_flush, donate_argnums=0)
    s.flush_buf = f(s.flush_buf)
    box = [s.flush_buf]

    def run():
        box[0] = f(box[0])
        jax.block_until_ready(box)

    names = frozenset(e.kernel for e in traced_device_events(run))
    s.flush_buf = box[0]
    if not names:
        raise RuntimeError("the trace shows no kernel for l2_flush")
    return names


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


def time_fn(fn, state, args, s: Setup, flush_buf) -> tuple[Timing, object]:
    """Time fn = rep_loop(...): two warm-up calls, then s.iters calls; on the GPU traced, per-op
    device time = median over the s.iters * s.reps ops of the kernel time between flushes.
    Returns (timing, flush_buf)."""
    for _ in range(2):
        state, flush_buf = fn(state, flush_buf, *args)
    jax.block_until_ready((state, flush_buf))
    if not s.flush:
        times = []
        for _ in range(s.iters):
            t0 = time.perf_counter()
            state, flush_buf = fn(state, flush_buf, *args)
            jax.block_until_ready(state)
            times.append(time.perf_counter() - t0)
        return Timing(statistics.median(times) / s.reps, None), flush_buf

    box = [state, flush_buf]

    def run():
        for _ in range(s.iters):
            box[0], box[1] = fn(box[0], box[1], *args)
        jax.block_until_ready(box)

    events = traced_device_events(run)
    samples = op_samples(events, s.flush_kernels)
    if len(samples) != s.iters * s.reps:  # the flushes did not split the ops: report the mean
        print(f"  warning: trace has {len(samples)} op samples, expected {s.iters * s.reps}; "
              f"kernels {sorted({e.kernel[:40] for e in events})[:8]}", flush=True)
        busy = sum(e.duration_ns for e in events if e.kernel not in s.flush_kernels)
        return Timing(busy * 1e-9 / (s.iters * s.reps), None), box[1]
    return Timing(statistics.median(ns for ns, _ in samples) * 1e-9,
                  statistics.median(n for _, n in samples)), box[1]


def same_size_copy(s: Setup, nbytes: int) -> Timing:
    """A device copy that moves nbytes (read + write): y = -x on nbytes / 2 bytes of the arena
    dtype, in place, timed like the ops (L2 flushed between calls). What the device's own
    copy reaches at an op's size: small ops cannot leave the launch and latency floor."""
    if nbytes not in s.copy_cache:
        n = max(1, nbytes // 2 // jnp.dtype(s.dtype).itemsize)
        x = jax.random.normal(jax.random.key(n), (n,), jnp.float32).astype(s.dtype)
        s.copy_cache[nbytes] = timed(s, jnp.negative, x, ())
    return s.copy_cache[nbytes]


def copy_bandwidth(s: Setup) -> float:
    """Device copy bandwidth in bytes (read + write) per second: a copy of copy_elems elements."""
    x = jnp.ones((s.copy_elems,), s.dtype)
    f = jax.jit(lambda a: a.copy())
    jax.block_until_ready(f(x))
    n = max(s.iters, 5)
    if s.flush:
        events = traced_device_events(lambda: jax.block_until_ready([f(x) for _ in range(n)]))
        return 2 * x.nbytes / (sum(e.duration_ns for e in events) * 1e-9 / n)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        times.append(time.perf_counter() - t0)
    return 2 * x.nbytes / statistics.median(times)


# ---------------------------------------------------------------------------- cases


@dataclass
class Row:
    kernel: str
    shape: str
    check: str
    t_pallas: Timing | None = None
    t_ref: Timing | None = None
    nbytes: int = 0
    error: str = ""
    t_copy: Timing | None = None  # a copy of the same bytes (same_size_copy)


def timed(s: Setup, op, state, args) -> Timing:
    t, s.flush_buf = time_fn(rep_loop(op, s), state, args, s, s.flush_buf)
    return t


def conv_update_case(s: Setup, ops, name, f: Field, ch, rows: int, q: int, rng, trials: int = 2,
                     time_ref: bool = True, **tuning) -> Row:
    """tuning: block / num_warps / tile for the Pallas kernel (the sweep); the default plan otherwise."""
    w_ = ch[1] - ch[0]
    k, km1, item = s.k, s.k - 1, jnp.dtype(s.dtype).itemsize
    lay = s.lay
    label = f"{name}, B={rows}" + (f", {q} tok/row" if q > 1 else "")
    kind = "conv_update " + ("decode" if q == 1 else "extend")
    arena0 = make_arena(s, 2 * rows + 2, seed=rows)
    weight = jnp.asarray(0.5 * rng.standard_normal((k, w_)), s.dtype)
    kern_op = (lambda a, *xs: pk.conv_state.conv_update(a, *xs, interpret=s.interpret, **tuning)) if tuning \
        else ops.conv_update

    # check, on random batches
    checks = []
    for trial in range(trials):
        meta, t = make_meta(rng, rows, q, km1, padded=True, track=True, mixed=True)
        x = jnp.asarray(rng.standard_normal((t, w_)), s.dtype)
        kern = jax.jit(lambda a, x, w, m: kern_op(a, lay, f, ch, x, w, m), donate_argnums=0)
        refj = jax.jit(lambda a, x, w, m: ref_conv.conv_update(a, lay, f, ch, x, w, m), donate_argnums=0)
        y_k, a_k = kern(arena0.copy(), x, weight, meta)
        y_r, a_r = refj(arena0.copy(), x, weight, meta)
        checks.append(compare(s, arena0, a_k, a_r, y_k, y_r))
        del a_k, a_r
    check = next((c for c in checks if c.startswith("FAIL")), next((c for c in checks if c != "exact"), "exact"))

    # timing, on a clean batch: every row real, with state, no checkpoint
    meta, t = make_meta(rng, rows, q, km1, padded=False, track=False, mixed=False)
    x = jnp.asarray(rng.standard_normal((t, w_)), s.dtype)

    def op(update):
        def fn(carry, w, m):
            a, xx = carry
            y, a = update(a, lay, f, ch, xx, w, m)
            return a, y  # the next op reads this op's y: every y stays live
        return fn

    t_p = timed(s, op(kern_op), (arena0.copy(), x.copy()), (weight, meta))
    t_r = timed(s, op(ref_conv.conv_update), (arena0.copy(), x.copy()), (weight, meta)) if time_ref else None
    nbytes = item * (rows * 2 * km1 * w_ + 2 * t * w_ + k * w_)  # window in + out, x in, y out, weights
    return Row(kind, label, check, t_p, t_r, nbytes)


def conv_write_case(s: Setup, ops, name, f: Field, ch, rows: int, rng) -> Row:
    w_ = ch[1] - ch[0]
    km1, item = s.k - 1, jnp.dtype(s.dtype).itemsize
    lay = s.lay
    arena0 = make_arena(s, 2 * rows + 2, seed=rows + 1)
    checks = []
    kern = jax.jit(lambda a, x, win, m: ops.conv_write(a, lay, f, ch, x, win, m), donate_argnums=0)
    refj = jax.jit(lambda a, x, win, m: ref_conv.conv_write(a, lay, f, ch, x, win, m), donate_argnums=0)
    for trial in range(2):
        meta, t = make_meta(rng, rows, VERIFY_Q, km1, padded=True, track=True, mixed=True)
        x = jnp.asarray(rng.standard_normal((t, w_)), s.dtype)
        win = jnp.asarray(rng.standard_normal((rows, km1, w_)), s.dtype)
        checks.append(compare(s, arena0, kern(arena0.copy(), x, win, meta), refj(arena0.copy(), x, win, meta)))
    check = next((c for c in checks if c != "exact"), "exact")

    meta, t = make_meta(rng, rows, VERIFY_Q, km1, padded=False, track=False, mixed=False)
    meta = dataclasses.replace(meta, commit_len=jnp.full((rows,), 2, jnp.int32))  # 2 of 3 accepted
    x = jnp.asarray(rng.standard_normal((t, w_)), s.dtype)
    win = jnp.asarray(rng.standard_normal((rows, km1, w_)), s.dtype)
    op = lambda write: lambda a, x, win, m: write(a, lay, f, ch, x, win, m)
    t_p = timed(s, op(ops.conv_write), arena0.copy(), (x, win, meta))
    t_r = timed(s, op(ref_conv.conv_write), arena0.copy(), (x, win, meta))
    nbytes = item * rows * w_ * (2 * km1 + min(km1, 2))  # window in, accepted x in, window out
    return Row("conv_write verify", f"{name}, B={rows}, {VERIFY_Q} tok/row", check, t_p, t_r, nbytes)


def slot_cases(s: Setup, ops, rows: int, rng) -> list[Row]:
    lay = s.lay
    su, e, item = lay.slot_units, lay.unit_elems, jnp.dtype(s.dtype).itemsize
    arena0 = make_arena(s, 2 * rows + 2, seed=rows + 2)
    perm = rng.permutation(np.arange(1, 2 * rows + 2))
    src, dst = jnp.asarray(perm[:rows], jnp.int32), jnp.asarray(perm[rows:2 * rows], jnp.int32)
    dst_chk = dst.at[::3].set(0)  # pairs aimed at the sink: inert
    src_rows = (src[:, None] * su + jnp.arange(su)[None, :]).reshape(-1).astype(jnp.int32)
    dst_rows = (dst[:, None] * su + jnp.arange(su)[None, :]).reshape(-1).astype(jnp.int32)
    slot_bytes = su * e * item
    out = []
    specs = [
        ("copy_slot_units", lambda o: lambda a, s_, d: o.copy_slot_units(a, lay, s_, d), (src, dst), (src, dst_chk),
         2 * rows * slot_bytes),
        ("clear_slot_units", lambda o: lambda a, d: o.clear_slot_units(a, lay, d), (dst,), (dst_chk,),
         rows * slot_bytes),
        ("move_units", lambda o: lambda a, s_, d: o.move_units(a, s_, d), (src_rows, dst_rows), (src_rows, dst_rows),
         2 * rows * slot_bytes),
    ]
    for kind, make, args, chk_args, nbytes in specs:
        try:
            kfn, rfn = make(ops), make(pk.REFERENCE_OPS)
            got = jax.jit(kfn, donate_argnums=0)(arena0.copy(), *chk_args)
            want = jax.jit(rfn, donate_argnums=0)(arena0.copy(), *chk_args)
            check = compare(s, arena0, got, want)
            del got, want
            t_p = timed(s, kfn, arena0.copy(), args)
            t_r = timed(s, rfn, arena0.copy(), args)
            shape = f"B={rows} entries ({su} units)" if kind != "move_units" else f"{rows * su} units"
            out.append(Row(kind, shape, check, t_p, t_r, nbytes))
        except Exception as exc:  # report and carry on
            traceback.print_exc()
            out.append(Row(kind, f"B={rows}", "ERROR", error=f"{type(exc).__name__}: {exc}"[:120]))
    return out


def moe_case(s: Setup, ops, n: int, rng) -> Row:
    """Routed experts of n tokens (top-k of E): the grouped mat-vec kernel (`ops.moe_experts`)
    against the slices path XLA runs without it (one dynamic slice + product per choice)."""
    cfg = s.cfg
    e, h, f, k = cfg.n_routed_experts, cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts_per_tok
    key = jax.random.key(n)
    w13 = (0.02 * jax.random.normal(key, (e, h, 2 * f), jnp.float32)).astype(s.dtype)
    w2 = (0.02 * jax.random.normal(jax.random.fold_in(key, 1), (e, f, h), jnp.float32)).astype(s.dtype)
    x = jax.random.normal(jax.random.fold_in(key, 2), (n, h), jnp.float32).astype(s.dtype)
    idx = jnp.asarray(rng.permutation(e)[:n * k].reshape(n, k), jnp.int32)  # n * k distinct experts
    wt = jnp.asarray(rng.dirichlet(np.ones(k), n), jnp.float32)
    got = jax.jit(ops.moe_experts)(x, idx, wt, w13, w2)
    with jax.default_matmul_precision("highest"):
        want = jax.jit(L.moe_experts_slices)(x.astype(jnp.float32), idx, wt, w13.astype(jnp.float32),
                                             w2.astype(jnp.float32))
    err = float(_rel_err(got, want))
    check = f"y~ {err:.1e}" if err <= 1e-2 else f"FAIL y {err:.1e}"
    op = lambda fn: lambda xx, i, w, a, b: fn(xx, i, w, a, b)
    t_p = timed(s, op(ops.moe_experts), x.copy(), (idx, wt, w13, w2))
    t_r = timed(s, op(L.moe_experts_slices), x.copy(), (idx, wt, w13, w2))
    nbytes = n * k * 3 * h * f * jnp.dtype(s.dtype).itemsize  # the chosen experts' weights, once
    return Row("moe_experts (grouped mat-vec)", f"n={n} tokens, top-{k} of {e}, h={h}, f={f}", check, t_p, t_r,
               nbytes)


# ---------------------------------------------------------------------------- sweep


def sweep(s: Setup, rng, compare_module: str = "", grid: bool = True) -> list[tuple[str, int, int, Row]]:
    """The conv_update kernel's (block, num_warps) choices on the cases that missed a target;
    with compare_module (a module with conv_update's signature, e.g. an earlier version of
    pallas_kernels/conv_state.py copied beside it) also that module's default plan."""
    cases = [("attn", 256, 1), ("attn", 32, 1), ("k (full", 256, 1), ("k (full", 1, EXTEND_L),
             ("attn", 32, EXTEND_L), ("k (full", 32, EXTEND_L), ("k (sliding", 32, EXTEND_L)]
    out = []
    for prefix, b, q in cases:
        name, (f, ch) = next((nm, v) for nm, v in s.streams.items() if nm.startswith(prefix))
        width = ch[1] - ch[0]
        default = pk.conv_state.conv_plan(s.lay_shape, s.lay, f, ch, width, s.k, max(b, b * q))
        if compare_module:
            other = importlib.import_module(compare_module)
            ops_other = dataclasses.replace(pk.conv_ops(True, s.interpret),
                                            conv_update=functools.partial(other.conv_update, interpret=s.interpret))
            row = conv_update_case(s, ops_other, name, f, ch, b, q, rng, trials=1, time_ref=False)
            out.append((f"{row.shape} [{compare_module}]", default.block, default.num_warps, row))
            print(f"sweep {row.shape} [{compare_module}]: {row.check} {row.t_pallas.seconds * 1e6:.2f} us", flush=True)
        for block in (b_ for b_ in (16, 32, 64, 128, 256, 512, 1024, 2048) if width // 16 <= b_ <= width):
            for warps in (1, 2, 4, 8):
                if not 64 <= block // warps <= 512 and warps != 1:
                    continue
                if not grid and (block, warps) != (default.block, default.num_warps):
                    continue
                try:
                    row = conv_update_case(s, None, name, f, ch, b, q, rng, trials=1, time_ref=False, block=block,
                                           num_warps=warps)
                except Exception as exc:  # report and carry on
                    row = Row("conv_update", f"{name}, B={b}", "ERROR", error=f"{type(exc).__name__}: {exc}"[:100])
                mark = " (default)" if (default.block, default.num_warps) == (block, warps) else ""
                out.append((row.shape + mark, block, warps, row))
                print(f"sweep {row.shape}{mark} block={block} warps={warps}: {row.check} "
                      f"{row.t_pallas.seconds * 1e6 if row.t_pallas else float('nan'):.2f} us", flush=True)
        if q > 1:  # extend: tokens per program, at the default block and warps
            default_tile = pk.conv_state.token_tile(b * q, b, default.nblocks, default.num_warps)
            for tile in (1, 2, 4, 8):
                try:
                    row = conv_update_case(s, None, name, f, ch, b, q, rng, trials=1, time_ref=False,
                                           block=default.block, num_warps=default.num_warps, tile=tile)
                except Exception as exc:  # report and carry on
                    row = Row("conv_update", f"{name}, B={b}", "ERROR", error=f"{type(exc).__name__}: {exc}"[:100])
                mark = " (default)" if tile == default_tile else ""
                out.append((f"{row.shape}, tile {tile}{mark}", default.block, default.num_warps, row))
                print(f"sweep {row.shape} tile={tile}{mark}: {row.check} "
                      f"{row.t_pallas.seconds * 1e6 if row.t_pallas else float('nan'):.2f} us", flush=True)
    return out


def moe_sweep(s: Setup, rng, n: int = 1) -> list[tuple[str, Row]]:
    """The grouped mat-vec kernel's tiles on the gate|up product of n tokens' routed experts
    (x [n*k, h] @ w13[idx], F = 2f): tf x bh x num_warps (splits: the default rule)."""
    cfg = s.cfg
    e, h, f, k = cfg.n_routed_experts, cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts_per_tok
    m, two_f = n * k, 2 * f
    key = jax.random.key(7)
    w13 = (0.02 * jax.random.normal(key, (e, h, two_f), jnp.float32)).astype(s.dtype)
    x = jax.random.normal(jax.random.fold_in(key, 2), (m, h), jnp.float32).astype(s.dtype)
    idx = jnp.asarray(rng.permutation(e)[:m], jnp.int32)
    with jax.default_matmul_precision("highest"):
        want = jnp.einsum("mh,mhf->mf", x.astype(jnp.float32), w13[idx].astype(jnp.float32))
    out = []
    for tf in (64, 128, 256):
        for bh in (32, 64, 128):
            for warps in (2, 4, 8):
                kw = dict(tf=tf, bh=bh, num_warps=warps, interpret=s.interpret)
                grid = pk.moe.grid_for(m, h, two_f, tf=tf, bh=bh)
                label = f"gate|up, m={m}, tf={tf} bh={bh} warps={warps} grid={grid}"
                try:
                    got = jax.jit(lambda x_: pk.moe.grouped_matvec(x_, idx, w13, **kw))(x)
                    err = float(_rel_err(got, want))
                    check = f"y~ {err:.1e}" if err <= 1e-2 else f"FAIL y {err:.1e}"
                    if two_f == h:  # y feeds the next call's x
                        op = lambda x_: pk.moe.grouped_matvec(x_, idx, w13, **kw).astype(x_.dtype)
                        row = Row("grouped_matvec", label, check, timed(s, op, x.copy(), ()), None,
                                  m * h * two_f * jnp.dtype(s.dtype).itemsize)
                    else:
                        row = Row("grouped_matvec", label, check)
                except Exception as exc:  # report and carry on
                    row = Row("grouped_matvec", label, "ERROR", error=f"{type(exc).__name__}: {exc}"[:100])
                out.append((label, row))
                t = row.t_pallas.seconds * 1e6 if row.t_pallas else float("nan")
                print(f"moe sweep {label}: {row.check} {t:.2f} us", flush=True)
    return out


# ---------------------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, interpret mode (CPU)")
    p.add_argument("--batches", default="", help="comma-separated batch sizes (default 1,32,256)")
    p.add_argument("--iters", type=int, default=0)
    p.add_argument("--reps", type=int, default=0)
    p.add_argument("--sweep", nargs="?", const="grid", default="", choices=["grid", "default"],
                   help="also time the conv_update kernel on the sweep cases: every block / warp choice (grid), "
                        "or the default plan only (with --compare-module: side by side)")
    p.add_argument("--moe-sweep", action="store_true", help="also time the MoE kernel's tile choices")
    p.add_argument("--compare-module", default="", help="with --sweep: also time this module's conv_update")
    p.add_argument("--out", default="", help="also write the table(s) to this markdown file")
    args = p.parse_args()
    if not args.smoke and jax.default_backend() != "gpu":
        print(f"backend is {jax.default_backend()!r}: run on a GPU, or pass --smoke", file=sys.stderr)
        return 2
    s = make_setup(args)
    ops = pk.conv_ops(True, interpret=s.interpret)
    rng = np.random.RandomState(0)
    head = (f"jax {jax.__version__}, {jax.devices()[0].device_kind}, interpret={s.interpret}; "
            f"K={s.k}, {jnp.dtype(s.dtype).name} arena; {s.lay.describe()}")
    print(head, flush=True)
    if s.flush:
        s.flush_buf = jnp.zeros((FLUSH_BYTES // (4 * FLUSH_COLS), FLUSH_COLS), jnp.uint32)
        s.flush_kernels = flush_kernel_names(s)
        print(f"L2 flush: {FLUSH_BYTES >> 20} MB pass between timed ops, kernels {sorted(s.flush_kernels)}")
    bw = copy_bandwidth(s)
    print(f"device copy bandwidth: {bw / 1e9:.0f} GB/s (read + write)", flush=True)

    rows: list[Row] = []

    def run(label, fn):
        t0 = time.perf_counter()
        try:
            out = fn()
        except Exception as exc:  # report and carry on
            traceback.print_exc()
            out = [Row(label[0], label[1], "ERROR", error=f"{type(exc).__name__}: {exc}"[:120])]
        out = out if isinstance(out, list) else [out]
        for r in out:
            if r.t_pallas is not None and r.nbytes:
                r.t_copy = same_size_copy(s, r.nbytes)
            status = "PASS" if r.check == "exact" or r.check.startswith("y~") else "FAIL"
            us = f"Pallas {r.t_pallas.seconds * 1e6:.2f} us, XLA {r.t_ref.seconds * 1e6:.2f} us" if r.t_pallas else ""
            print(f"{status} {r.kernel} [{r.shape}]: {r.check} {us} ({time.perf_counter() - t0:.1f}s)", flush=True)
        rows.extend(out)

    for b in s.batches:
        for name, (f, ch) in s.streams.items():
            run(("conv_update decode", f"{name}, B={b}"), lambda: conv_update_case(s, ops, name, f, ch, b, 1, rng))
        for name, (f, ch) in s.streams.items():
            run(("conv_write verify", f"{name}, B={b}"), lambda: conv_write_case(s, ops, name, f, ch, b, rng))
        run(("slot ops", f"B={b}"), lambda: slot_cases(s, ops, b, rng))
    for b in s.extend_batches:
        for name, (f, ch) in s.streams.items():
            q = 4 if s.interpret else EXTEND_L
            run(("conv_update extend", f"{name}, B={b}"), lambda: conv_update_case(s, ops, name, f, ch, b, q, rng))
    for n in s.moe_tokens:
        run(("moe_experts", f"n={n}"), lambda: moe_case(s, ops, n, rng))
    swept = sweep(s, rng, args.compare_module, grid=args.sweep == "grid") if args.sweep else []
    moe_swept = moe_sweep(s, rng) if args.moe_sweep else []

    unit = "device µs (kernels only, L2 flushed between ops)" if s.flush else "wall µs / op"
    lines = [head, "", f"Pallas vs XLA reference; copy bandwidth {bw / 1e9:.0f} GB/s; {jax.devices()[0].device_kind}; "
             f"{unit}, median of {s.iters} x {s.reps} ops", "",
             "| kernel | shape | check | Pallas µs | XLA µs | speedup | kernels (Pallas / XLA) | MB moved "
             "| Pallas % copy BW | XLA % copy BW | same-size copy µs | Pallas % of same-size copy |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.t_pallas is None:
            lines.append(f"| {r.kernel} | {r.shape} | {r.check} {r.error} | | | | | | | | | |")
            continue
        tp, tr = r.t_pallas.seconds, r.t_ref.seconds
        frac = lambda t: 100 * r.nbytes / t / bw
        kern = f"{r.t_pallas.kernels:g} / {r.t_ref.kernels:g}" if r.t_pallas.kernels is not None else ""
        tc = r.t_copy.seconds if r.t_copy else float("nan")
        lines.append(f"| {r.kernel} | {r.shape} | {r.check} | {tp * 1e6:.2f} | {tr * 1e6:.2f} | {tr / tp:.2f}x | "
                     f"{kern} | {r.nbytes / 1e6:.3f} | {frac(tp):.1f}% | {frac(tr):.1f}% | {tc * 1e6:.2f} | "
                     f"{100 * tc / tp:.0f}% |")
    if swept:
        lines += ["", "conv_update kernel: channel block and warps (Pallas only)", "",
                  "| case | block | warps | check | Pallas µs | % copy BW |", "|---|---:|---:|---|---:|---:|"]
        for shape, block, warps, r in swept:
            t = r.t_pallas.seconds if r.t_pallas else float("nan")
            lines.append(f"| {shape} | {block} | {warps} | {r.check} | {t * 1e6:.2f} | "
                         f"{100 * r.nbytes / t / bw:.1f}% |")
    if moe_swept:
        lines += ["", "MoE grouped mat-vec kernel: tiles (Pallas only)", "",
                  "| case | check | Pallas µs | % copy BW |", "|---|---|---:|---:|"]
        for label, r in moe_swept:
            t = r.t_pallas.seconds if r.t_pallas else float("nan")
            lines.append(f"| {label} | {r.check} | {t * 1e6:.2f} | {100 * r.nbytes / t / bw:.1f}% |")
    failed = [r for r in rows + [x[3] for x in swept] + [x[1] for x in moe_swept] if not (r.check == "exact" or r.check.startswith("y~"))]
    lines += ["", "ALL PASS" if not failed else f"{len(failed)} FAILED"]
    print()
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Pallas conv-state / slot kernels against their jnp (XLA) references, on the GPU.

    python bench/kernels.py            # InklingConfig.bench() streams, K=4, bf16 arena, batch 1/32/256
    python bench/kernels.py --smoke    # tiny sizes, interpret mode: runs anywhere (CPU) in about a minute

For every (kernel, stream, batch) it first checks the kernel against the reference on random
batches (random slot permutations, padded rows, rows without state, commit_len 0, checkpoints)
and prints PASS / FAIL, then times both (jitted, arena donated, `reps` calls unrolled in one
jit, warm-up, median of `iters` runs) and reports the bytes that must move per call / time as
a fraction of the measured device copy bandwidth. Output: one markdown table.

check: `exact` = arena (outside the sink) and y bit for bit; `y~ e` = arena exact, y within
e (max |diff| / max |y|; the reference's fp32 accumulation order on GPU is XLA's choice);
`FAIL ...` otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels as pk  # noqa: E402
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
                 copy_elems=(1 << 22) if args.smoke else (1 << 30))


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


def time_fn(fn, state, args, s: Setup) -> float:
    """Median seconds per op: fn(state, *args) -> state runs s.reps ops; state is donated."""
    for _ in range(2):
        state = fn(state, *args)
    jax.block_until_ready(state)
    times = []
    for _ in range(s.iters):
        t0 = time.perf_counter()
        state = fn(state, *args)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / s.reps


def copy_bandwidth(s: Setup) -> float:
    """Device copy bandwidth in bytes (read + write) per second."""
    x = jnp.ones((s.copy_elems,), s.dtype)
    f = jax.jit(lambda a: a.copy())
    jax.block_until_ready(f(x))
    times = []
    for _ in range(max(s.iters, 5)):
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
    t_pallas: float | None = None
    t_ref: float | None = None
    nbytes: int = 0
    error: str = ""


def conv_update_case(s: Setup, ops, name, f: Field, ch, rows: int, q: int, rng) -> Row:
    w_ = ch[1] - ch[0]
    k, km1, item = s.k, s.k - 1, jnp.dtype(s.dtype).itemsize
    lay = s.lay
    label = f"{name}, B={rows}" + (f", {q} tok/row" if q > 1 else "")
    kind = "conv_update " + ("decode" if q == 1 else "extend")
    arena0 = make_arena(s, 2 * rows + 2, seed=rows)
    weight = jnp.asarray(0.5 * rng.standard_normal((k, w_)), s.dtype)

    # check, on random batches
    checks = []
    for trial in range(2):
        meta, t = make_meta(rng, rows, q, km1, padded=True, track=True, mixed=True)
        x = jnp.asarray(rng.standard_normal((t, w_)), s.dtype)
        kern = jax.jit(lambda a, x, w, m: ops.conv_update(a, lay, f, ch, x, w, m), donate_argnums=0)
        refj = jax.jit(lambda a, x, w, m: ref_conv.conv_update(a, lay, f, ch, x, w, m), donate_argnums=0)
        y_k, a_k = kern(arena0.copy(), x, weight, meta)
        y_r, a_r = refj(arena0.copy(), x, weight, meta)
        checks.append(compare(s, arena0, a_k, a_r, y_k, y_r))
        del a_k, a_r
    check = next((c for c in checks if c.startswith("FAIL")), next((c for c in checks if c != "exact"), "exact"))

    # timing, on a clean batch: every row real, with state, no checkpoint
    meta, t = make_meta(rng, rows, q, km1, padded=False, track=False, mixed=False)
    x = jnp.asarray(rng.standard_normal((t, w_)), s.dtype)

    def loop(update):
        def fn(carry, w, m):
            a, xx = carry
            for _ in range(s.reps):
                y, a = update(a, lay, f, ch, xx, w, m)
                xx = y  # keeps every op's y live
            return a, xx
        return jax.jit(fn, donate_argnums=0)

    t_p = time_fn(loop(ops.conv_update), (arena0.copy(), x.copy()), (weight, meta), s)
    t_r = time_fn(loop(ref_conv.conv_update), (arena0.copy(), x.copy()), (weight, meta), s)
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

    def loop(write):
        def fn(a, x, win, m):
            for _ in range(s.reps):
                a = write(a, lay, f, ch, x, win, m)
            return a
        return jax.jit(fn, donate_argnums=0)

    t_p = time_fn(loop(ops.conv_write), arena0.copy(), (x, win, meta), s)
    t_r = time_fn(loop(ref_conv.conv_write), arena0.copy(), (x, win, meta), s)
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

            def loop(fn):
                def body(a, *xs):
                    for _ in range(s.reps):
                        a = fn(a, *xs)
                    return a
                return jax.jit(body, donate_argnums=0)

            t_p = time_fn(loop(kfn), arena0.copy(), args, s)
            t_r = time_fn(loop(rfn), arena0.copy(), args, s)
            shape = f"B={rows} entries ({su} units)" if kind != "move_units" else f"{rows * su} units"
            out.append(Row(kind, shape, check, t_p, t_r, nbytes))
        except Exception as exc:  # report and carry on
            traceback.print_exc()
            out.append(Row(kind, f"B={rows}", "ERROR", error=f"{type(exc).__name__}: {exc}"[:120]))
    return out


# ---------------------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, interpret mode (CPU)")
    p.add_argument("--batches", default="", help="comma-separated batch sizes (default 1,32,256)")
    p.add_argument("--iters", type=int, default=0)
    p.add_argument("--reps", type=int, default=0)
    args = p.parse_args()
    if not args.smoke and jax.default_backend() != "gpu":
        print(f"backend is {jax.default_backend()!r}: run on a GPU, or pass --smoke", file=sys.stderr)
        return 2
    s = make_setup(args)
    ops = pk.conv_ops(True, interpret=s.interpret)
    rng = np.random.RandomState(0)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, interpret={s.interpret}; "
          f"K={s.k}, {jnp.dtype(s.dtype).name} arena; {s.lay.describe()}", flush=True)
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
            status = "PASS" if r.check == "exact" or r.check.startswith("y~") else "FAIL"
            print(f"{status} {r.kernel} [{r.shape}]: {r.check}  ({time.perf_counter() - t0:.1f}s)", flush=True)
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

    print()
    print(f"Pallas vs XLA reference; copy bandwidth {bw / 1e9:.0f} GB/s; {jax.devices()[0].device_kind}; "
          f"time per op, median of {s.iters} x {s.reps} ops")
    print()
    print("| kernel | shape | check | Pallas µs | XLA µs | speedup | MB moved | Pallas % copy BW | XLA % copy BW |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if r.t_pallas is None:
            print(f"| {r.kernel} | {r.shape} | {r.check} {r.error} | | | | | | |")
            continue
        frac = lambda t: 100 * r.nbytes / t / bw
        print(f"| {r.kernel} | {r.shape} | {r.check} | {r.t_pallas * 1e6:.1f} | {r.t_ref * 1e6:.1f} | "
              f"{r.t_ref / r.t_pallas:.2f}x | {r.nbytes / 1e6:.3f} | {frac(r.t_pallas):.1f}% | {frac(r.t_ref):.1f}% |")
    failed = [r for r in rows if not (r.check == "exact" or r.check.startswith("y~"))]
    print()
    print("ALL PASS" if not failed else f"{len(failed)} FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

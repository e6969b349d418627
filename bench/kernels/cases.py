"""The cases of bench.kernels.kernels: sizes, random arenas and packed rows, and one function
per kernel that checks the Pallas kernel against its jnp reference and times both.

Kernels take arena rows: a request row's conv field starts at `layout.slot_row(physical_slot,
field)`, its slot at `layout.slot_row(physical_slot)` (`inkling_jax.cache.layout`).
"""

from __future__ import annotations

import dataclasses
import traceback
from functools import partial
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pallas_kernels as pk
from pallas_kernels.conv_state import pallas as conv_pallas
from pallas_kernels.conv_state import ref as conv_ref
from pallas_kernels.conv_state.ref import PackedRows
from pallas_kernels.moe import ref as moe_ref
from pallas_kernels.slot_ops.ref import unit_rows

from inkling_jax.cache.layout import ArenaLayout, Field
from inkling_jax.config import InklingConfig


from bench.kernels.timing import Timer, Timing

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
    timer: Timer
    copy_elems: int
    moe_tokens: tuple[int, ...]

    @property
    def arena_shape(self) -> tuple[int, int]:
        """The arena shape conv_plan sees for its addressing (one unit row: the int32 limit is
        not what a plan choice depends on)."""
        return (1, self.lay.unit_elems)


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
    stream = lambda layer, name: (lay.target[layer].conv, lay.target[layer].channels(name))
    streams = {f"k (full, W={cfg.num_kv_heads * cfg.head_dim})": stream(full, "k"),
               f"k (sliding, W={cfg.swa_num_kv_heads * cfg.swa_head_dim})": stream(slide, "k"),
               f"attn (W={cfg.hidden_size})": stream(slide, "attn")}
    if args.smoke:
        streams = dict(list(streams.items())[::2])
    timer = Timer(jnp.bfloat16, iters=args.iters or (2 if args.smoke else 20),
                  reps=args.reps or (1 if args.smoke else 10), flush=not args.smoke)
    return Setup(cfg, lay, cfg.conv_kernel_size, jnp.bfloat16, batches, ext, streams, interpret=args.smoke,
                 timer=timer, copy_elems=(1 << 22) if args.smoke else (1 << 30),
                 moe_tokens=(1,) if args.smoke else (1, 2))


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


@jax.tree_util.register_dataclass
@dataclass
class KernelRows:
    """A step's packed rows and each row's physical active / checkpoint slot (0: the sink)."""

    rows: PackedRows
    active: jax.Array  # [B]
    track_dest: jax.Array  # [B, 1]: one checkpoint column


def _token_layout(rng, real: np.ndarray, num_new: np.ndarray, q: int):
    """(token_row, token_offset, query_start) of the rows' new tokens packed as the steps pack
    them; decode (q = 1): token b is row b's; extend: a T = rows * q bucket, padding tokens on
    a padded row at offsets past its (zero) new tokens, padded rows' query_start anywhere."""
    rows = len(real)
    if q == 1:
        return np.arange(rows), np.zeros(rows, np.int64), np.arange(rows)
    num_tokens = rows * q  # the token bucket: every batch of a case compiles once
    token_row = np.zeros(num_tokens, np.int64)
    token_offset = np.zeros(num_tokens, np.int64)
    query_start = rng.randint(0, num_tokens, rows)
    t = 0
    for b in np.flatnonzero(real):
        query_start[b] = t
        token_row[t:t + num_new[b]] = b
        token_offset[t:t + num_new[b]] = np.arange(num_new[b])
        t += num_new[b]
    if t < num_tokens:
        token_row[t:] = rng.choice(np.flatnonzero(~real), num_tokens - t)
        token_offset[t:] = rng.randint(0, q, num_tokens - t)
    return token_row, token_offset, query_start


def make_rows(rng, rows: int, q: int, km1: int, *, padded: bool, track: bool, mixed: bool) -> tuple[KernelRows, int]:
    """(rows, T = rows * q): `rows` requests of up to q new tokens each (decode: q = 1).
    Physical slots: actives from a random permutation of 1..2*rows+1, checkpoint slots
    disjoint from them.

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
    token_row, token_offset, query_start = _token_layout(rng, real, num_new, q)
    num_tokens = len(token_row)
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
    packed = PackedRows(token_row=i32(token_row), token_offset=i32(token_offset), row_tokens=i32(row_tokens),
                        has_state=jnp.asarray(has_state), commit_len=i32(commit), track_len=i32(track_len[:, None]))
    return KernelRows(packed, i32(np.where(real, slots[:rows], 0)), i32(track_dest[:, None])), num_tokens


def conv_call(op, s: Setup, f: Field, ch: tuple[int, int]):
    """op(arena, x, weight_or_window, kernel_rows) with the kernels' arena-row addressing."""
    lay = s.lay

    def call(arena, x, w, m: KernelRows):
        return op(arena, x, w, m.rows, lay.slot_row(m.active, f), lay.slot_row(m.track_dest, f),
                  window_shape=f.shape, channels=ch, sink_rows=lay.sink_rows)
    return call


# ---------------------------------------------------------------------------- checks


def _bits(a):
    return jax.lax.bitcast_convert_type(a, {2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize])


@jax.jit
def _same_bits(a, b):
    return jnp.all(_bits(a) == _bits(b))


@jax.jit
def rel_err(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30)


def compare(s: Setup, arena0, got_arena, want_arena, got_y=None, want_y=None) -> str:
    """`exact`, `y~ e` (arena exact, y within e) or `FAIL ...` (the sink: left as it was)."""
    su = s.lay.sink_rows
    if not bool(_same_bits(got_arena[su:], want_arena[su:])):
        return "FAIL arena"
    if not bool(_same_bits(got_arena[:su], arena0[:su])):
        return "FAIL sink written"
    if got_y is None or bool(_same_bits(got_y, want_y)):
        return "exact"
    err = float(rel_err(got_y, want_y))
    tol = 1e-2 if got_y.dtype == jnp.bfloat16 else 1e-5
    return f"y~ {err:.1e}" if err <= tol else f"FAIL y {err:.1e}"


@dataclass
class Row:
    kernel: str
    shape: str
    check: str
    t_pallas: Timing | None = None
    t_ref: Timing | None = None
    nbytes: int = 0
    error: str = ""
    t_copy: Timing | None = None  # a copy of the same bytes (Timer.same_size_copy)

    @property
    def passed(self) -> bool:
        return self.check == "exact" or self.check.startswith("y~")


# ---------------------------------------------------------------------------- cases


def conv_update_case(s: Setup, ops, name, f: Field, ch, rows: int, q: int, rng, trials: int = 2,
                     time_ref: bool = True, **tuning) -> Row:
    """tuning: block / num_warps / tile for the Pallas kernel (the sweep); the default plan otherwise."""
    w_ = ch[1] - ch[0]
    k, km1, item = s.k, s.k - 1, jnp.dtype(s.dtype).itemsize
    label = f"{name}, B={rows}" + (f", {q} tok/row" if q > 1 else "")
    kind = "conv_update " + ("decode" if q == 1 else "extend")
    arena0 = make_arena(s, 2 * rows + 2, seed=rows)
    weight = jnp.asarray(0.5 * rng.standard_normal((k, w_)), s.dtype)
    kernel = (lambda *a, **kw: conv_pallas.conv_update(*a, **kw, interpret=s.interpret, **tuning)) if tuning \
        else ops.conv_update
    kern, ref = conv_call(kernel, s, f, ch), conv_call(conv_ref.conv_update, s, f, ch)

    checks = []  # on random batches
    for _ in range(trials):
        meta, t = make_rows(rng, rows, q, km1, padded=True, track=True, mixed=True)
        x = jnp.asarray(rng.standard_normal((t, w_)), s.dtype)
        y_k, a_k = jax.jit(kern, donate_argnums=0)(arena0.copy(), x, weight, meta)
        y_r, a_r = jax.jit(ref, donate_argnums=0)(arena0.copy(), x, weight, meta)
        checks.append(compare(s, arena0, a_k, a_r, y_k, y_r))
        del a_k, a_r
    check = next((c for c in checks if c.startswith("FAIL")), next((c for c in checks if c != "exact"), "exact"))

    # timing, on a clean batch: every row real, with state, no checkpoint
    meta, t = make_rows(rng, rows, q, km1, padded=False, track=False, mixed=False)
    x = jnp.asarray(rng.standard_normal((t, w_)), s.dtype)

    def op(update):
        def fn(carry, w, m):
            a, xx = carry
            y, a = update(a, xx, w, m)
            return a, y  # the next op reads this op's y: every y stays live
        return fn

    t_p = s.timer.timed(op(kern), (arena0.copy(), x.copy()), (weight, meta))
    t_r = s.timer.timed(op(ref), (arena0.copy(), x.copy()), (weight, meta)) if time_ref else None
    nbytes = item * (rows * 2 * km1 * w_ + 2 * t * w_ + k * w_)  # window in + out, x in, y out, weights
    return Row(kind, label, check, t_p, t_r, nbytes)


def conv_write_case(s: Setup, ops, name, f: Field, ch, rows: int, rng) -> Row:
    w_ = ch[1] - ch[0]
    km1, item = s.k - 1, jnp.dtype(s.dtype).itemsize
    arena0 = make_arena(s, 2 * rows + 2, seed=rows + 1)
    write, ref = conv_call(ops.conv_write, s, f, ch), conv_call(conv_ref.conv_write, s, f, ch)
    kern_j, ref_j = jax.jit(write, donate_argnums=0), jax.jit(ref, donate_argnums=0)
    checks = []
    for _ in range(2):
        meta, t = make_rows(rng, rows, VERIFY_Q, km1, padded=True, track=True, mixed=True)
        x = jnp.asarray(rng.standard_normal((t, w_)), s.dtype)
        win = jnp.asarray(rng.standard_normal((rows, km1, w_)), s.dtype)
        checks.append(compare(s, arena0, kern_j(arena0.copy(), x, win, meta), ref_j(arena0.copy(), x, win, meta)))
    check = next((c for c in checks if c != "exact"), "exact")

    meta, t = make_rows(rng, rows, VERIFY_Q, km1, padded=False, track=False, mixed=False)
    meta = dataclasses.replace(meta, rows=dataclasses.replace(meta.rows, commit_len=jnp.full((rows,), 2, jnp.int32)))
    x = jnp.asarray(rng.standard_normal((t, w_)), s.dtype)  # 2 of 3 accepted, above
    win = jnp.asarray(rng.standard_normal((rows, km1, w_)), s.dtype)
    t_p = s.timer.timed(write, arena0.copy(), (x, win, meta))
    t_r = s.timer.timed(ref, arena0.copy(), (x, win, meta))
    nbytes = item * rows * w_ * (2 * km1 + min(km1, 2))  # window in, accepted x in, window out
    return Row("conv_write verify", f"{name}, B={rows}, {VERIFY_Q} tok/row", check, t_p, t_r, nbytes)


def slot_cases(s: Setup, ops, rows: int, rng) -> list[Row]:
    """Whole-slot copies and clears (copy-on-write restores; clears), and single-unit copies
    (the pool's compaction moves), through copy_units / clear_units."""
    lay = s.lay
    su, e, item = lay.slot_units, lay.unit_elems, jnp.dtype(s.dtype).itemsize
    arena0 = make_arena(s, 2 * rows + 2, seed=rows + 2)
    perm = rng.permutation(np.arange(1, 2 * rows + 2))
    src, dst = jnp.asarray(perm[:rows], jnp.int32), jnp.asarray(perm[rows:2 * rows], jnp.int32)
    dst_chk = dst.at[::3].set(0)  # pairs aimed at the sink: inert
    src_units = unit_rows(lay.slot_row(src), su).reshape(-1)  # every unit of the slots, one by one
    dst_units = unit_rows(lay.slot_row(dst), su).reshape(-1)
    slot_bytes = su * e * item
    kw = dict(sink_rows=lay.sink_rows)
    specs = [
        ("copy_units (slots)", lambda o: lambda a, s_, d: o.copy_units(a, lay.slot_row(s_), lay.slot_row(d),
                                                                        num_units=su, **kw),
         (src, dst), (src, dst_chk), 2 * rows * slot_bytes),
        ("clear_units (slots)", lambda o: lambda a, d: o.clear_units(a, lay.slot_row(d), num_units=su, **kw),
         (dst,), (dst_chk,), rows * slot_bytes),
        ("copy_units (unit moves)", lambda o: lambda a, s_, d: o.copy_units(a, s_, d, num_units=1, **kw),
         (src_units, dst_units), (src_units, dst_units), 2 * rows * slot_bytes),
    ]
    out = []
    for kind, make, args, chk_args, nbytes in specs:
        try:
            kfn, rfn = make(ops), make(pk.REFERENCE_OPS)
            got = jax.jit(kfn, donate_argnums=0)(arena0.copy(), *chk_args)
            want = jax.jit(rfn, donate_argnums=0)(arena0.copy(), *chk_args)
            check = compare(s, arena0, got, want)
            del got, want
            t_p = s.timer.timed(kfn, arena0.copy(), args)
            t_r = s.timer.timed(rfn, arena0.copy(), args)
            shape = f"B={rows} entries ({su} units)" if "slots" in kind else f"{rows * su} units"
            out.append(Row(kind, shape, check, t_p, t_r, nbytes))
        except Exception as exc:  # noqa: BLE001 - report and carry on
            traceback.print_exc()
            out.append(Row(kind, f"B={rows}", "ERROR", error=f"{type(exc).__name__}: {exc}"[:120]))
    return out


def moe_weights(s: Setup, n: int, seed: int):
    """(w13 [E, h, 2f], w2 [E, f, h], x [n, h]) of the config's routed experts, random."""
    cfg = s.cfg
    e, h, f = cfg.n_routed_experts, cfg.hidden_size, cfg.expert_intermediate_size
    key = jax.random.key(seed)
    w13 = (0.02 * jax.random.normal(key, (e, h, 2 * f), jnp.float32)).astype(s.dtype)
    w2 = (0.02 * jax.random.normal(jax.random.fold_in(key, 1), (e, f, h), jnp.float32)).astype(s.dtype)
    x = jax.random.normal(jax.random.fold_in(key, 2), (n, h), jnp.float32).astype(s.dtype)
    return w13, w2, x


def moe_case(s: Setup, ops, n: int, rng) -> Row:
    """Routed experts of n tokens (top-k of E): the grouped mat-vec kernel (`moe.pallas.moe_experts`)
    against the slices path XLA runs without it (one dynamic slice + product per choice)."""
    cfg = s.cfg
    e, h, f, k = cfg.n_routed_experts, cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts_per_tok
    w13, w2, x = moe_weights(s, n, n)
    idx = jnp.asarray(rng.permutation(e)[:n * k].reshape(n, k), jnp.int32)  # n * k distinct experts
    wt = jnp.asarray(rng.dirichlet(np.ones(k), n), jnp.float32)
    kernel = pk.moe.pallas.moe_experts if not ops.interpret else partial(pk.moe.pallas.moe_experts, interpret=True)
    got = jax.jit(kernel)(x, idx, wt, w13, w2)
    with jax.default_matmul_precision("highest"):
        want = jax.jit(moe_ref.moe_experts_slices)(x.astype(jnp.float32), idx, wt, w13.astype(jnp.float32),
                                             w2.astype(jnp.float32))
    err = float(rel_err(got, want))
    check = f"y~ {err:.1e}" if err <= 1e-2 else f"FAIL y {err:.1e}"
    op = lambda fn: lambda xx, i, w, a, b: fn(xx, i, w, a, b)
    t_p = s.timer.timed(op(kernel), x.copy(), (idx, wt, w13, w2))
    t_r = s.timer.timed(op(moe_ref.moe_experts_slices), x.copy(), (idx, wt, w13, w2))
    nbytes = n * k * 3 * h * f * jnp.dtype(s.dtype).itemsize  # the chosen experts' weights, once
    return Row("moe_experts (grouped mat-vec)", f"n={n} tokens, top-{k} of {e}, h={h}, f={f}", check, t_p, t_r,
               nbytes)

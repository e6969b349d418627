"""Pallas kernels for the short-conv state on the arena: fused conv + window writes.

Mirrors `ref.py` (the reference; read its docstrings for the semantics) with the same
signatures plus `interpret` and the sink's extent:

    conv_update(arena, x, weight, rows, active_row, track_row, *, window_shape, channels,
                sink_rows) -> (y, arena)
    conv_write(arena, x, window, rows, active_row, track_row, *, window_shape, channels,
               sink_rows) -> arena
    conv_update_residual_norm(arena, x, weight, rows, active_row, track_row, residual,
               norm_weight, *, eps, window_shape, channels, sink_rows)
               -> (residual + y, rms_norm(residual + y), arena)

All update the arena in place (`input_output_aliases`; donate the arena to the enclosing
jit), have a `jax.custom_vjp` whose backward is the reference's VJP, and run on CPU with
`interpret=True`.

Addressing. The arena `[U, E]` is viewed as `[U * E / g, g]` for a power-of-two granule g
that divides E, the field width C, the stream offset c0 and the stream width W. Window row
r, channel c of the field starting at arena row `row` is then granule row

    row * E/g + (r * C + c0) / g + (c - c0) / g

so a program loads a contiguous `[nb, g]` block (nb * g channels, a power of two) with
int32 row indices, also where a window row straddles a unit boundary. Offsets are 64-bit in
the Triton lowering once the arena passes 4 GiB; only the granule row index must fit int32.

Semantics mirrored, per row b: the padded inputs are [old window (zeros without state) ++
x[row_tokens[b]]] (in x's dtype); token t's output is the conv of row token_row[t] at new-token
index token_offset[t] (jnp gather rules: a negative index wraps, then indices clamp); the
windows written are rows n .. n+K-2 of the padded inputs (NaN past its end, as the
reference's take_along_axis "fill" mode gives), cast to the window's then the arena's dtype.
The fp32 accumulation is the reference's: acc = fma(tap_i, w_i, acc) from zero, i = 0..K-1,
then x + acc (see `conv_combine`).

Work split (one flat grid of max(T, B) programs x channel blocks):

* program p < B does row p's state: it loads the row's old window (zeros without state) once,
  computes y for the row's first K-1 new tokens (the only tokens that read the window: token
  row_tokens[b, j], j < K-1, when its token_row / token_offset say it is (b, j)), then writes
  the active window (commit_len != 0) and the row's M checkpoint windows;
* program p < T computes y[p] for every other token (token_offset >= K-1: from x alone).

Decode (T == B, Q == 1) is thus one program per row that reads its window once and writes
y, the active window and the checkpoint in one pass: the fused decode kernel, without a
separate dispatch. Extend (and any other T, B, Q) uses the same kernel.

conv_update_residual_norm runs the same kernel body with one channel block (the whole
stream, so a program holds a token's whole row) and one token per program; where the body
computes token t's y it stores residual[t] + y and that row's RMSNorm instead of y (the
decoder layer's add and next norm, which were XLA launches of their own after each conv).

Deviations from the reference, all confined to state that never matters:

* the sink (arena rows below `sink_rows`: physical slot 0) is never written: writes aimed at
  it (padded rows, rows that do not checkpoint) are skipped, and its contents are left as
  they were. The reference
  writes it, in an unspecified order where several rows aim at it.
* only the stream's channel range [c0, c1) of a field is written; the reference rewrites the
  whole field and so also zeroes the field's padding tail in the last unit. That tail is
  zero in any arena built by the library (`init_state` zeros it, every field write keeps it
  zero, slot copies move whole units).

Preconditions (true for every batch the step builds; the kernel does not check them):

* fields written in one call (active fields of rows with commit_len != 0, checkpoint fields
  outside the sink) are pairwise distinct and are not another row's active field;
* a token that is not its row's j-th new token for j < K-1 reads no window of a row whose
  window is written in the same call: padding tokens point at padded rows (sink slot), as
  the library packs them, or have token_offset >= K-1. (A padding token aimed at a real row
  with token_offset < K-1 would race with that row's window write: its y, which nothing
  reads, could differ from the reference's.)

Fallback to the reference (never a silently different result): K < 2, a window shape that
is not `[K-1, C]`, a stream width other than c1 - c0, empty batches, or an arena whose
granule row count reaches 2^31 (more than 2^31 * g elements).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float

from .._common import INT32_MAX, pallas_call, pow2_factor, pow2_floor, with_ref_vjp
from . import ref
from .ref import PackedRows, conv_from_taps


def _fma_f32_gpu(a: jax.Array, b: jax.Array, c: jax.Array) -> jax.Array:
    """round(a * b + c), one rounding (PTX fma.rn.f32), elementwise on f32 blocks."""
    (out,) = plt.elementwise_inline_asm("fma.rn.f32 $0, $1, $2, $3;", args=[a, b, c], constraints="=r,r,r,r",
                                        pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])
    return out


def conv_combine(x_tok: jax.Array, taps: list[jax.Array], weights: list[jax.Array], interpret: bool) -> jax.Array:
    """y = x + sum_i w[i] * tap[i] in fp32, cast to x's dtype: `conv_from_taps` for one token block.

    Bit-exactness: XLA (CPU) evaluates the reference's einsum as a forward chain of fused
    multiply-adds from zero, acc = fma(tap_i, w_i, acc). On GPU the kernel issues exactly that
    chain (`fma.rn.f32`, so it does not depend on Triton's contraction settings); in interpret
    mode it calls the reference's own einsum (`ref.conv_from_taps`) on the block, which XLA
    lowers the same way."""
    if interpret:
        shape = x_tok.shape
        flat = lambda a: a.reshape(-1)
        y = conv_from_taps(flat(x_tok), jnp.stack([flat(t) for t in taps]), jnp.stack([flat(w) for w in weights]))
        return y.reshape(shape)
    acc = jnp.zeros(x_tok.shape, jnp.float32)
    for tap, w in zip(taps, weights):
        acc = _fma_f32_gpu(tap.astype(jnp.float32), w.astype(jnp.float32), acc)
    return (x_tok.astype(jnp.float32) + acc).astype(x_tok.dtype)


MAX_BLOCK = 1024  # channels per program at most
MIN_BLOCK = 256  # channels per program at least (when the stream is that wide)
TARGET_PROGRAMS = 512  # shrink blocks (down to MIN_BLOCK) until the grid has about this many
MAX_TILE = 8  # tokens per extend program at most
TILE_WARPS = 2048  # grow extend token tiles while the grid keeps this many warps (16 per H200 SM)


@dataclass(frozen=True)
class ConvPlan:
    """Static addressing of one stream of one conv field (see the module docstring)."""

    km1: int  # window rows
    granule: int  # g: elements per granule row of the arena view
    nb: int  # granules per channel block (a program handles nb * g channels)
    nblocks: int  # channel blocks per stream
    row_stride: int  # C / g: granules between consecutive window rows
    chan0: int  # c0 / g
    unit_stride: int  # E / g: granules per arena row
    sink_rows: int  # arena rows below this belong to the sink: never written
    num_warps: int

    @property
    def block(self) -> int:
        return self.nb * self.granule


def conv_plan(arena_shape: tuple[int, ...], window_shape: tuple[int, ...], channels: tuple[int, int], width: int,
              k: int, programs: int, sink_rows: int = 0, block: int | None = None,
              num_warps: int | None = None) -> ConvPlan | None:
    """The kernel's addressing for this stream, or None when the config needs the reference.

    `block` (channels per program, a power of two dividing the width) and `num_warps`
    override the defaults below (`python -m bench.kernels.kernels --sweep` tries them)."""
    if len(arena_shape) != 2 or len(window_shape) != 2:
        return None
    num_units, e = arena_shape
    km1, c = window_shape
    c0, c1 = channels
    if k < 2 or km1 != k - 1 or width != c1 - c0 or not 0 <= c0 < c1 <= c:
        return None
    if programs <= 0:
        return None
    g = pow2_factor(math.gcd(e, c, width, c0))
    if block is None:
        block = min(pow2_factor(width), MAX_BLOCK, max(MIN_BLOCK, pow2_floor(width * programs // TARGET_PROGRAMS)))
    elif block <= 0 or block & (block - 1) or width % block:
        raise ValueError(f"block must be a power of two dividing the stream width {width}, not {block}")
    g = min(g, block)
    if num_units * (e // g) > INT32_MAX:
        return None
    return ConvPlan(km1=km1, granule=g, nb=block // g, nblocks=width // block, row_stride=c // g, chan0=c0 // g,
                    unit_stride=e // g, sink_rows=sink_rows, num_warps=num_warps or max(1, min(8, block // 256)))


def _masked_load(view, cond, shape, dtype):
    """view's block where cond (a scalar) holds, else zeros; no memory traffic when not."""
    return plt.load(view, mask=jnp.broadcast_to(cond, shape), other=jnp.zeros((), dtype))


def _when(static_true: bool, cond):
    """pl.when, dropped where the condition is statically true."""
    return (lambda fn: fn()) if static_true else pl.when(cond)


def _index(i, size: int):
    """What jnp's gather does with index i into an axis of `size`: negative wraps, then clamps."""
    return jnp.clip(jnp.where(i < 0, i + size, i), 0, size - 1)


def _select_row(rows: list, idx):
    """rows[idx] for a traced idx in [0, len(rows))."""
    out = rows[0]
    for r in range(1, len(rows)):
        out = jnp.where(idx == r, rows[r], out)
    return out


def _window_after(plan: ConvPlan, old_x: list, x_of, n, q: int, x_dtype, win_dtype, arena_dtype) -> list:
    """`ref.window_after` for one row and channel block: the K-1 rows to store.

    Row r is row m = n + r of the row's padded inputs [old window ++ new tokens] (length
    K-1+Q, in x's dtype); take_along_axis's "fill" mode gives NaN outside it."""
    km1 = plan.km1
    size = km1 + q
    out = []
    for r in range(km1):
        m = n + r
        m = jnp.where(m < 0, m + size, m)
        v = jnp.where(m < km1, _select_row(old_x, jnp.clip(m, 0, km1 - 1)), x_of(jnp.clip(m - km1, 0, q - 1)))
        v = jnp.where((m >= 0) & (m < size), v, jnp.full((), jnp.nan, x_dtype))
        out.append(v.astype(win_dtype).astype(arena_dtype))
    return out


def _store_window(plan: ConvPlan, arena_out, base, rows: list) -> None:
    for r, v in enumerate(rows):
        arena_out[pl.ds(base + r * plan.row_stride, plan.nb), :] = v


def _split_pid(plan: ConvPlan):
    pid = pl.program_id(0)
    if plan.nblocks == 1:
        return pid, 0
    return pid // plan.nblocks, pid % plan.nblocks


# ----------------------------------------------------------------------------- conv_update


def _update_kernel(plan: ConvPlan, num_tokens: int, num_rows: int, q: int, k: int, tile: int, x_dtype,
                   arena_dtype, interpret: bool, norm_eps: float | None = None):
    """conv_update's kernel; with `norm_eps` the conv_update_residual_norm variant: two more
    inputs (residual, norm weight) after the weights, and each token's y, instead of being
    stored, is added to its residual row and normalised (`_residual_norm_store`: one channel
    block per program, plan.nblocks == 1)."""
    km1, nb, g = plan.km1, plan.nb, plan.granule
    blk = (nb, g)
    row_owned = min(km1, q)  # new tokens per row that read the row's window
    token_programs = -(-num_tokens // tile)
    # x rows a token program reads by guess: its tile and the K-1 rows before it (none for
    # one token per program: a guess saves no load there, and measured slower on the H200)
    span = tile + km1 if tile > 1 else 0

    def kernel(tok_row, tok_off, row_tok, has_state, commit, t_len, active, t_dest, x_ref, w_ref, *refs):
        if norm_eps is None:
            arena_in, y_ref, arena_out = refs
        else:
            res_ref, nw_ref, arena_in, res_out, normed_out, arena_out = refs
        p, cb = _split_pid(plan)
        cblk = pl.ds(cb * nb, nb)

        def emit(t, y):  # token t's conv output (every token's is computed by exactly one program)
            if norm_eps is None:
                y_ref[t, cblk, :] = y
            else:
                _residual_norm_store(res_ref, nw_ref, res_out, normed_out, t, y, norm_eps, interpret)

        def x_at(t):  # x[t] for an index already in [0, T)
            return x_ref[t, cblk, :]

        def field_base(row):
            return row * plan.unit_stride + plan.chan0 + cb * nb

        # The token part's loads that depend on no other load are issued here, before the
        # row part (inside the token branch they would wait behind the row part's stores):
        # per token its scalars, in two dependent rounds (by token, then by the token's row),
        # and with tiles of several tokens the x rows t0-K+1 .. t0+tile-1 by guess: where a
        # row's tokens are packed in order (as the library packs them) those are the tile's taps,
        # so each x row and the weights are read once per program rather than once per tap and
        # token. A tap whose row_tokens entry names another x row reloads it (masked: no
        # traffic when the guess was right). Indices are clamped into range; a token past T
        # stores nothing.
        t0 = p * tile if num_tokens >= num_rows else jnp.minimum(p, num_tokens - 1)

        def tap_row(tb, tj, i):  # x row of tap i of new token tj of row tb: token tj + i - (K-1)
            return _index(row_tok[tb, jnp.clip(tj + i - km1, 0, q - 1)], num_tokens)

        toks = []
        for u in range(tile):
            t = jnp.minimum(t0 + u, num_tokens - 1) if tile > 1 else t0
            tb, tj = _index(tok_row[t], num_rows), _index(tok_off[t], q)
            # the token's own x row (tap K-1) always; the other taps' rows here only with a guess
            x_idx = [tap_row(tb, tj, i) if (span or i == km1) else None for i in range(k)]
            toks.append((t0 + u, t, tb, tj, x_idx, has_state[tb] != 0, active[tb]))
        guess_rows = [jnp.clip(t0 + j - km1, 0, num_tokens - 1) for j in range(span)]
        x_guess = [x_at(r) for r in guess_rows]

        @_when(num_rows >= token_programs, p < num_rows)
        def _row():
            b = p
            slot, hs, n = active[b], has_state[b] != 0, commit[b]
            dests = [(t_dest[b, m], t_len[b, m]) for m in range(t_dest.shape[1])]  # checkpoints
            own_tok = [_index(row_tok[b, j], num_tokens) for j in range(row_owned)]
            base = field_base(slot)
            old = [_masked_load(arena_in.at[pl.ds(base + r * plan.row_stride, nb), :], hs, blk, arena_dtype)
                   for r in range(km1)]
            old_x = [o.astype(x_dtype) for o in old]
            new_x = [x_at(own_tok[j]) for j in range(row_owned)]

            def x_of(j):  # the row's j-th new token (static j: already loaded)
                if isinstance(j, int) and j < row_owned:
                    return new_x[j]
                return x_at(_index(row_tok[b, j], num_tokens))

            w = [w_ref[i, cblk, :] for i in range(k)]
            # y of the row's first K-1 new tokens: the tokens that read this window
            for j in range(row_owned):
                tj_ = own_tok[j]
                owned = (_index(tok_row[tj_], num_rows) == b) & (_index(tok_off[tj_], q) == j)

                @pl.when(owned)
                def _(j=j, tj_=tj_):
                    taps = [old_x[j + i] if j + i < km1 else x_of(j + i - km1) for i in range(k)]
                    emit(tj_, conv_combine(new_x[j], taps, w, interpret))

            @pl.when((n != 0) & (slot >= plan.sink_rows))
            def _():
                _store_window(plan, arena_out, base,
                              _window_after(plan, old_x, x_of, n, q, x_dtype, arena_dtype, arena_dtype))

            for dest, dest_len in dests:
                @pl.when(dest >= plan.sink_rows)
                def _(dest=dest, dest_len=dest_len):
                    _store_window(plan, arena_out, field_base(dest),
                                  _window_after(plan, old_x, x_of, dest_len, q, x_dtype, arena_dtype, arena_dtype))

        @_when(token_programs >= num_rows, p < token_programs)
        def _token():
            # a tile's weights once for all its tokens; one token's only where it computes (a
            # decode program's token part computes nothing: the row part wrote its y)
            w_tile = [w_ref[i, cblk, :] for i in range(k)] if tile > 1 else None

            def x_tap(u, i, tb, tj, x_idx):  # x row of tap i for token u of the tile
                if not span:
                    return x_at(x_idx[i] if x_idx[i] is not None else tap_row(tb, tj, i))
                hit = x_idx[i] == guess_rows[u + i]
                miss = _masked_load(x_ref.at[x_idx[i], cblk, :], jnp.logical_not(hit), blk, x_dtype)
                return jnp.where(hit, x_guess[u + i], miss)

            for u, (t_raw, t, tb, tj, x_idx, hs_t, slot_t) in enumerate(toks):
                # token t's output, unless it is its row's j-th new token for j < K-1 (the
                # row's program writes that one)
                owned = (tj < km1) & (x_idx[km1] == t)
                keep = jnp.logical_not(owned)
                if tile > 1 and num_tokens % tile:
                    keep = keep & (t_raw < num_tokens)

                @pl.when(keep)
                def _(u=u, t=t, tb=tb, tj=tj, x_idx=x_idx, hs_t=hs_t, slot_t=slot_t):
                    base = field_base(slot_t)
                    taps = []
                    for i in range(k):
                        m = tj + i  # row of the padded inputs [old window ++ new tokens]
                        from_w = _masked_load(
                            arena_in.at[pl.ds(base + jnp.minimum(m, km1 - 1) * plan.row_stride, nb), :],
                            (m < km1) & hs_t, blk, arena_dtype)
                        taps.append(jnp.where(m < km1, from_w.astype(x_dtype), x_tap(u, i, tb, tj, x_idx)))
                    # taps[K-1] is x[row_tokens[tb, tj]]: the token's own input
                    w = w_tile or [w_ref[i, cblk, :] for i in range(k)]
                    emit(t, conv_combine(taps[km1], taps, w, interpret))

    return kernel


def _index_arrays(rows: PackedRows, active_row, track_row) -> list[Array]:
    return [jnp.asarray(a).astype(jnp.int32) for a in (
        rows.token_row, rows.token_offset, rows.row_tokens, rows.has_state, rows.commit_len, rows.track_len,
        active_row, track_row)]


def token_tile(num_tokens: int, num_rows: int, nblocks: int, num_warps: int, tile: int | None = None) -> int:
    """Tokens per program of the extend token part (1 where T <= B, as on decode): a power of
    two up to MAX_TILE, as large as keeps TILE_WARPS warps in the grid.

    A tile reads each x row and the weights once instead of once per tap and token (L2
    traffic); fewer, longer programs cost memory parallelism. On the H200 (2026-12-03):
    attn W=2048, B=32 x 64 tokens (2 blocks x 4 warps) took 16.4 / 13.6 / 13.9 / 13.0 /
    18.5 µs at tiles 1 / 2 / 4 / 8 / 16; k W=256 (1 block x 1 warp) 4.9 µs at tile 1 and
    5.4 at 4 (512 warps in the grid)."""
    if tile is not None:
        if not isinstance(tile, int) or tile < 1:
            raise ValueError(f"token_tile must be a positive int, not {tile!r}")
        return tile if num_tokens > num_rows else 1
    if num_tokens <= num_rows:
        return 1
    return max(1, min(MAX_TILE, pow2_floor(num_tokens * nblocks * num_warps // TILE_WARPS)))


def _update_pallas(plan: ConvPlan, arena, x, weight, rows: PackedRows, active_row, track_row, interpret: bool,
                   tile: int):
    num_tokens, width = x.shape
    num_rows, q = rows.row_tokens.shape
    k = weight.shape[0]
    g = plan.granule
    programs = max(-(-num_tokens // tile), num_rows) * plan.nblocks
    arena2 = arena.reshape(-1, g)
    args = _index_arrays(rows, active_row, track_row) + [x.reshape(num_tokens, width // g, g),
                                                         weight.reshape(k, width // g, g), arena2]
    y, arena2 = pallas_call(
        _update_kernel(plan, num_tokens, num_rows, q, k, tile, x.dtype, arena.dtype, interpret),
        out_shape=(jax.ShapeDtypeStruct((num_tokens, width // g, g), x.dtype),
                   jax.ShapeDtypeStruct(arena2.shape, arena2.dtype)),
        grid=(programs,), aliases={len(args) - 1: 1}, interpret=interpret, num_warps=plan.num_warps,
        name="conv_update")(*args)
    return y.reshape(num_tokens, width), arena2.reshape(arena.shape)


def conv_update(arena: Array, x: Float[Array, "t c"], weight: Float[Array, "k c"], rows: PackedRows,
                active_row: Array, track_row: Array, *, window_shape: tuple[int, int], channels: tuple[int, int],
                sink_rows: int = 0, interpret: bool = False, block: int | None = None, num_warps: int | None = None,
                tile: int | None = None) -> tuple[Float[Array, "t c"], Array]:
    """Fused conv + active / checkpoint window writes for one stream (extend and decode).

    Same contract and result as `ref.conv_update` (see the module docstring for the sink and
    padding-tail deviations and the preconditions). `block`, `num_warps` and `tile` (tokens
    per extend program, see `token_tile`) override the defaults."""
    num_tokens = x.shape[0]
    num_rows, q = rows.row_tokens.shape
    ok_shapes = x.ndim == 2 and weight.ndim == 2 and weight.shape[1] == x.shape[1] and q > 0
    programs = max(num_tokens, num_rows) if num_tokens and num_rows else 0
    plan = conv_plan(arena.shape, window_shape, channels, x.shape[1], weight.shape[0], programs, sink_rows, block,
                     num_warps) if ok_shapes else None
    ref_fn = lambda a, xx, w, r, ar, tr: ref.conv_update(a, xx, w, r, ar, tr, window_shape=window_shape,
                                                         channels=channels)
    if plan is None:
        return ref_fn(arena, x, weight, rows, active_row, track_row)
    tokens_per_program = token_tile(num_tokens, num_rows, plan.nblocks, plan.num_warps, tile)
    kernel_fn = lambda a, xx, w, r, ar, tr: _update_pallas(plan, a, xx, w, r, ar, tr, interpret, tokens_per_program)
    return with_ref_vjp(kernel_fn, ref_fn)(arena, x, weight, rows, active_row, track_row)


# ---------------------------------------------------------------- conv_update_residual_norm

MAX_NORM_WIDTH = 8192  # channels of one program's row at most (the norm variant has no channel blocks)


def rms_norm_tile(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """`ref.rms_norm` of one row held as a [nb, g] block (weight likewise): the compiled
    kernel's formula. The same ops as the reference, but the mean's sum runs over the block in
    the reduction order Triton picks (XLA picks its own): within a few fp32 ulps of the
    reference's mean, so the normed row within an ulp of its dtype (tests/test_conv_norm_kernel.py
    runs this formula on CPU against the reference)."""
    xf = x.astype(jnp.float32)
    ms = jnp.sum(xf * xf) / float(x.size)
    xf = xf * jax.lax.rsqrt(ms + eps)
    return (weight.astype(x.dtype) * xf.astype(x.dtype)).astype(x.dtype)


def _residual_norm_store(res_ref, nw_ref, res_out, normed_out, t, y, eps: float, interpret: bool) -> None:
    """Token t's new residual row (residual + y, y rounded to the residual's dtype first) and
    its RMSNorm, stored. Interpret mode calls the reference's own `rms_norm` on the flat row
    (XLA reduces it as it reduces the reference's rows: bit for bit); compiled, `rms_norm_tile`."""
    res = res_ref[t, :, :]
    new = res + y.astype(res.dtype)
    res_out[t, :, :] = new
    w = nw_ref[...]
    if interpret:
        normed = ref.rms_norm(new.reshape(1, -1), w.reshape(-1), eps).reshape(new.shape)
    else:
        normed = rms_norm_tile(new, w, eps)
    normed_out[t, :, :] = normed


def _update_norm_pallas(plan: ConvPlan, arena, x, weight, rows: PackedRows, active_row, track_row, residual,
                        norm_weight, eps: float, interpret: bool):
    num_tokens, width = x.shape
    num_rows, q = rows.row_tokens.shape
    k = weight.shape[0]
    g = plan.granule
    arena2 = arena.reshape(-1, g)
    tiles = lambda a: a.reshape(*a.shape[:-1], width // g, g)
    args = _index_arrays(rows, active_row, track_row) + [tiles(x), tiles(weight), tiles(residual),
                                                         tiles(norm_weight), arena2]
    row_shape = jax.ShapeDtypeStruct((num_tokens, width // g, g), residual.dtype)
    new, normed, arena2 = pallas_call(
        _update_kernel(plan, num_tokens, num_rows, q, k, 1, x.dtype, arena.dtype, interpret, eps),
        out_shape=(row_shape, row_shape, jax.ShapeDtypeStruct(arena2.shape, arena2.dtype)),
        grid=(max(num_tokens, num_rows),), aliases={len(args) - 1: 2}, interpret=interpret,
        num_warps=plan.num_warps, name="conv_update_residual_norm")(*args)
    return new.reshape(num_tokens, width), normed.reshape(num_tokens, width), arena2.reshape(arena.shape)


def conv_update_residual_norm(arena: Array, x: Float[Array, "t c"], weight: Float[Array, "k c"], rows: PackedRows,
                              active_row: Array, track_row: Array, residual: Float[Array, "t c"],
                              norm_weight: Float[Array, " c"], *, eps: float, window_shape: tuple[int, int],
                              channels: tuple[int, int], sink_rows: int = 0, interpret: bool = False,
                              num_warps: int | None = None
                              ) -> tuple[Float[Array, "t c"], Float[Array, "t c"], Array]:
    """`conv_update` with the decoder layer's residual add and next RMSNorm fused in: returns
    (new_residual, normed, arena) as `ref.conv_update_residual_norm` does.

    The kernel is conv_update's with one program per token row over all the stream's channels
    (the norm reads the whole row: the plan has one channel block, and no token tiles) and
    `max(T, B)` programs; each token's y goes straight into residual + y and its norm, and is
    never written out. The arena writes are conv_update's (same deviations, same
    preconditions). Residual and normed rows take residual's dtype.

    Falls back to this module's `conv_update` followed by the reference's add and norm (the
    same result) where the kernel's one row per program cannot run: a stream width that is not
    a power of two (Triton blocks are) or above MAX_NORM_WIDTH, or any case conv_update's plan
    refuses."""
    num_tokens, width = x.shape if x.ndim == 2 else (0, 0)
    num_rows, q = rows.row_tokens.shape
    ok_shapes = (x.ndim == 2 and weight.ndim == 2 and weight.shape[1] == width and q > 0
                 and residual.shape == x.shape and norm_weight.shape == (width,)
                 and 0 < width <= MAX_NORM_WIDTH and width & (width - 1) == 0)
    programs = max(num_tokens, num_rows) if num_tokens and num_rows else 0
    plan = conv_plan(arena.shape, window_shape, channels, width, weight.shape[0], programs, sink_rows, width,
                     num_warps) if ok_shapes else None
    kw = dict(window_shape=window_shape, channels=channels)
    if plan is None:
        y, arena = conv_update(arena, x, weight, rows, active_row, track_row, sink_rows=sink_rows,
                               interpret=interpret, **kw)
        return (*ref.residual_norm(y, residual, norm_weight, eps), arena)
    ref_fn = lambda a, xx, w, r, ar, tr, res, nw: ref.conv_update_residual_norm(a, xx, w, r, ar, tr, res, nw, eps=eps,
                                                                                **kw)
    kernel_fn = lambda a, xx, w, r, ar, tr, res, nw: _update_norm_pallas(plan, a, xx, w, r, ar, tr, res, nw, eps,
                                                                         interpret)
    return with_ref_vjp(kernel_fn, ref_fn)(arena, x, weight, rows, active_row, track_row, residual, norm_weight)


# ------------------------------------------------------------------------------ conv_write


def _write_kernel(plan: ConvPlan, num_tokens: int, q: int, x_dtype, win_dtype, arena_dtype):
    km1, nb, g = plan.km1, plan.nb, plan.granule
    blk = (nb, g)

    def kernel(row_tok, has_state, commit, t_len, active, t_dest, x_ref, win_ref, arena_in, arena_out):
        del arena_in  # aliased to arena_out; only written
        b, cb = _split_pid(plan)
        cblk = pl.ds(cb * nb, nb)

        def x_of(j):  # x[row_tokens[b, j]]
            return x_ref[_index(row_tok[b, j], num_tokens), cblk, :]

        def field_base(row):
            return row * plan.unit_stride + plan.chan0 + cb * nb

        hs = has_state[b] != 0
        old_x = [_masked_load(win_ref.at[b * km1 + r, cblk, :], hs, blk, win_dtype).astype(x_dtype) for r in range(km1)]
        slot = active[b]
        n = commit[b]

        @pl.when((n != 0) & (slot >= plan.sink_rows))
        def _():
            _store_window(plan, arena_out, field_base(slot),
                          _window_after(plan, old_x, x_of, n, q, x_dtype, win_dtype, arena_dtype))

        for m in range(t_dest.shape[1]):  # the checkpoints
            dest, dest_len = t_dest[b, m], t_len[b, m]

            @pl.when(dest >= plan.sink_rows)
            def _(dest=dest, dest_len=dest_len):
                _store_window(plan, arena_out, field_base(dest),
                              _window_after(plan, old_x, x_of, dest_len, q, x_dtype, win_dtype, arena_dtype))

    return kernel


def _write_pallas(plan: ConvPlan, arena, x, window, rows: PackedRows, active_row, track_row, interpret: bool):
    num_tokens, width = x.shape
    num_rows, q = rows.row_tokens.shape
    g = plan.granule
    arena2 = arena.reshape(-1, g)
    args = _index_arrays(rows, active_row, track_row)[2:] + [x.reshape(num_tokens, width // g, g),
                                     window.reshape(num_rows * plan.km1, width // g, g), arena2]
    arena2 = pallas_call(
        _write_kernel(plan, num_tokens, q, x.dtype, window.dtype, arena.dtype),
        out_shape=jax.ShapeDtypeStruct(arena2.shape, arena2.dtype),
        grid=(num_rows * plan.nblocks,), aliases={len(args) - 1: 0}, interpret=interpret,
        num_warps=plan.num_warps, name="conv_write")(*args)
    return arena2.reshape(arena.shape)


def conv_write(arena: Array, x: Float[Array, "t c"], window: Float[Array, "b km1 c"], rows: PackedRows,
               active_row: Array, track_row: Array, *, window_shape: tuple[int, int], channels: tuple[int, int],
               sink_rows: int = 0, interpret: bool = False, block: int | None = None,
               num_warps: int | None = None) -> Array:
    """Write the active (commit_len != 0) and checkpoint windows of one stream.

    Same contract and result as `ref.conv_write`; `window` is the stream's old window (any
    float dtype; the reference's casts are mirrored). Reads nothing from the arena."""
    num_tokens = x.shape[0]
    num_rows = window.shape[0]
    ok_shapes = (x.ndim == 2 and window.ndim == 3 and window.shape[1:] == (window_shape[0], x.shape[1])
                 and rows.row_tokens.shape[0] == num_rows and rows.row_tokens.shape[1] > 0)
    plan = conv_plan(arena.shape, window_shape, channels, x.shape[1], window.shape[1] + 1,
                     num_rows if num_tokens and num_rows else 0, sink_rows, block, num_warps) if ok_shapes else None
    ref_fn = lambda a, xx, w, r, ar, tr: ref.conv_write(a, xx, w, r, ar, tr, window_shape=window_shape,
                                                        channels=channels)
    if plan is None:
        return ref_fn(arena, x, window, rows, active_row, track_row)
    kernel_fn = lambda a, xx, w, r, ar, tr: _write_pallas(plan, a, xx, w, r, ar, tr, interpret)
    return with_ref_vjp(kernel_fn, ref_fn)(arena, x, window, rows, active_row, track_row)

"""Pallas kernels (interpret mode on CPU, compiled on a GPU) against their jnp references, bit for bit.

Every case compiles the kernel and the reference once and replays several random batches:
random slot permutations, padded rows and padding tokens on the sink, rows without state,
commit_len 0 (and partial commits), checkpoints with track_len 0, < K-1 and >= K-1, rows that
do not checkpoint (sink destination, any track_len). The kernels never write the sink while
the reference does (its contents never matter), so the sink is compared as "kernel left it
alone" and everything else bit for bit.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ENGINE_KW, TRUNK, device_array, has_cuda_device

import inkling_jax as ik
import pallas_kernels as pk
from inkling_jax.cache.layout import ArenaLayout, Field
from inkling_jax.config import InklingConfig
from pallas_kernels.conv_state import pallas as pconv
from pallas_kernels.conv_state import ref as ref_conv
from pallas_kernels.conv_state.ref import PackedRows
from pallas_kernels.slot_ops import pallas as pslot
from pallas_kernels.slot_ops import ref as ref_units

# On a GPU the same tests run the compiled Triton kernels; elsewhere interpret mode.
INTERPRET = jax.default_backend() != "gpu"

NUM_SLOTS = 16  # physical slots in the test arenas (slot 0 is the sink)
EXTRA_UNITS = 3  # units past the slots (pages), which must stay untouched


# ------------------------------------------------------------------------- fixtures


def rand(rng, shape, dtype, scale=1.0):
    """scale * standard normal draws (float64) rounded to float32, then to dtype (as jnp.asarray did)."""
    return device_array(np.asarray(scale * rng.standard_normal(shape), np.float32), dtype)


def tiny_layout(k: int, page_size: int = 4, spec_steps: int = 0) -> ArenaLayout:
    return ArenaLayout.build(InklingConfig.tiny(conv_kernel_size=k), page_size, spec_steps)


def odd_layout() -> tuple[ArenaLayout, Field]:
    """A hand-built layout: 48-element units, a [3, 40] conv field at unit 1 of 5-unit slots,
    so window rows straddle unit boundaries and the granule is 8 elements."""
    base = tiny_layout(4)
    lay = dataclasses.replace(base, unit_elems=48, slot_units=5)
    return lay, Field(1, 3, (3, 40))


def conv_fields(lay: ArenaLayout) -> list[Field]:
    return [fs.conv for fs in lay.target + lay.draft]


def random_arena(rng, lay: ArenaLayout, fields: list[Field], dtype) -> jax.Array:
    """Random arena with the conv fields' padding tails zero (as in any arena the library builds)."""
    e = lay.unit_elems
    a = rng.standard_normal((lay.slot_row(NUM_SLOTS) + EXTRA_UNITS, e)).astype(np.float32)
    for slot in range(NUM_SLOTS):
        for f in fields:
            rows = slice(lay.slot_row(slot, f), lay.slot_row(slot, f) + f.units)
            flat = a[rows].reshape(-1)
            flat[f.elems:] = 0
            a[rows] = flat.reshape(f.units, e)
    return device_array(a, dtype)


@jax.tree_util.register_dataclass
@dataclass
class Meta:
    """A step's conv metadata: the packed rows, and each row's physical active / checkpoint slot."""

    rows: PackedRows
    active: jax.Array  # [B]
    track_dest: jax.Array  # [B, M]


def conv_call(op, lay: ArenaLayout, f: Field, ch: tuple[int, int], **kw):
    """op(arena, x, w_or_window, meta) with the kernels' row addressing (`layout.slot_row`)."""
    def call(arena, x, w, meta: Meta):
        return op(arena, x, w, meta.rows, lay.slot_row(meta.active, f), lay.slot_row(meta.track_dest, f),
                  window_shape=f.shape, channels=ch, sink_rows=lay.sink_rows, **kw)
    return call


# conv_call(op, lay, f, ch, **kw) under jax.jit with the data as arguments: one XLA compile per
# op, layout, field, channels, options and shapes, shared by the calls that repeat them (the
# reference of several kernel options); eagerly every jnp op of the glue is its own compile.
# (A test that monkeypatches what the op calls jits its own function: this one caches traces.)
@partial(jax.jit, static_argnames=("op", "lay", "f", "ch", "kw"))
def jit_conv(arena, x, w, meta: Meta, *, op, lay: ArenaLayout, f: Field, ch: tuple[int, int], kw: tuple = ()):
    return conv_call(op, lay, f, ch, **dict(kw))(arena, x, w, meta)


def random_meta(rng, num_rows: int, num_tokens: int, km1: int, decode: bool, q: int = 0,
                shuffle: bool = False, tracks: int = 1) -> Meta:
    """A step's conv metadata as the steps build it, with physical slots drawn at random.

    q: the step's Q (max new tokens of a row; decode: 1); extend default: num_tokens.
    shuffle: the tokens' x rows in a random order instead of packed row by row (the
    contract allows any row_tokens; the kernel's extend path guesses the packed order).
    tracks: M, the checkpoint columns per row (several boundaries inside one chunk)."""
    slots = rng.permutation(np.arange(1, NUM_SLOTS))
    num_real = rng.randint(1, num_rows) if num_rows > 1 else 1  # leave padded rows when there is room
    real = np.sort(rng.choice(num_rows, num_real, replace=False))
    padded = np.setdiff1d(np.arange(num_rows), real)
    active = np.zeros(num_rows, np.int32)
    active[real] = slots[:num_real]
    spare = list(slots[num_real:])
    num_new = np.zeros(num_rows, np.int32)
    token_row = np.zeros(num_tokens, np.int32)
    token_offset = np.zeros(num_tokens, np.int32)
    q = 1 if decode else (q or num_tokens)
    if decode:
        assert num_tokens == num_rows
        num_new[real] = 1
        query_start = np.arange(num_rows)
        token_row[:] = np.arange(num_tokens)  # padding tokens: their own (padded) row
        q = 1
    else:
        budget = num_tokens - num_real
        for b in real:
            extra = rng.randint(0, min(budget, 2 * km1 + 2, q - 1) + 1)
            num_new[b] = 1 + extra
            budget -= extra
        query_start = rng.randint(0, num_tokens, num_rows)  # padded rows: anywhere
        t = 0
        for b in real:
            query_start[b] = t
            token_row[t:t + num_new[b]] = b
            token_offset[t:t + num_new[b]] = np.arange(num_new[b])
            t += num_new[b]
        if t < num_tokens:  # padding tokens: a padded row, token_offset >= its num_new (0)
            assert len(padded)
            token_row[t:] = rng.choice(padded, num_tokens - t)
            token_offset[t:] = rng.randint(0, km1 + 3, num_tokens - t)
    row_tokens = np.clip(query_start[:, None] + np.arange(q)[None, :], 0, num_tokens - 1)
    has_state = rng.rand(num_rows) < 0.7
    commit_len = num_new.copy()
    for b in real:
        u = rng.rand()
        if u < 0.2:
            commit_len[b] = 0
        elif u < 0.4:
            commit_len[b] = rng.randint(1, num_new[b] + 1)
    commit_len[padded] = np.where(rng.rand(len(padded)) < 0.3, 1, 0)  # aimed at the sink: inert
    track_dest = np.zeros((num_rows, tracks), np.int32)
    track_len = rng.randint(0, km1 + 3, (num_rows, tracks))  # columns that do not checkpoint: anything
    for b in real:
        for m in range(tracks):
            if spare and rng.rand() < 0.6:
                track_dest[b, m] = spare.pop()
                track_len[b, m] = rng.choice([0, min(1, num_new[b]), min(km1 - 1, num_new[b]), num_new[b], q])
    if shuffle:  # x row n holds the token packed at old_of[n]
        old_of = rng.permutation(num_tokens)
        new_of = np.argsort(old_of)
        token_row, token_offset, row_tokens = token_row[old_of], token_offset[old_of], new_of[row_tokens]
    i32 = lambda a: device_array(a, np.int32)
    rows = PackedRows(token_row=i32(token_row), token_offset=i32(token_offset), row_tokens=i32(row_tokens),
                      has_state=device_array(has_state), commit_len=i32(commit_len), track_len=i32(track_len))
    return Meta(rows, i32(active), i32(track_dest))


def bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def assert_y(got, want, what: str) -> None:
    """Conv outputs: bit for bit in interpret mode. Compiled on a GPU, the fp32 accumulation
    order is XLA's choice for the reference and an FMA chain in the kernel, so within 4 ulps
    of the output dtype (relative to the largest |y|); the state writes stay bit for bit."""
    if INTERPRET:
        return assert_bits(got, want, what)
    eps = float(jnp.finfo(jnp.asarray(got).dtype).eps)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    tol = 4 * eps * max(1.0, float(np.abs(want).max()))
    err = float(np.abs(got - want).max())
    assert err <= tol, f"{what}: max |diff| {err:.3g} > {tol:.3g}"


def assert_bits(got, want, what: str) -> None:
    got, want = bits(got), bits(want)
    assert got.shape == want.shape, what
    bad = np.argwhere(got != want)
    assert bad.size == 0, f"{what}: {len(bad)} elements differ, first at {bad[:5].tolist()}"


def assert_arena(got, want, before, lay: ArenaLayout, what: str) -> None:
    """Bit for bit outside the sink; the kernel leaves the sink as it was."""
    s = lay.sink_rows
    got, want, before = np.asarray(got), np.asarray(want), np.asarray(before)  # slicing a device array compiles
    assert_bits(got[s:], want[s:], f"{what}: arena outside the sink")
    assert_bits(got[:s], before[:s], f"{what}: sink")


# ------------------------------------------------------------------------ conv_update

# (K, arena dtype, x dtype, layer, streams, decode, rows B, tokens T, Q, checkpoints per row M)
UPDATE_CASES = {
    "k4-f32-decode": (4, jnp.float32, jnp.float32, 2, ("attn",), True, 4, 4, 1, 1),
    "k4-bf16-extend-4streams": (4, jnp.bfloat16, jnp.bfloat16, 0, ("k", "v", "attn", "mlp"), False, 4, 16, 7, 2),
    "k2-f32arena-bf16x-extend": (2, jnp.float32, jnp.bfloat16, 2, ("mlp",), False, 3, 12, 5, 3),
    "k3-bf16arena-f32x-decode": (3, jnp.bfloat16, jnp.float32, 1, ("v",), True, 5, 5, 1, 1),
    "k4-f32-extend-T<B": (4, jnp.float32, jnp.float32, 1, ("k",), False, 6, 5, 3, 2),
    "k4-bf16-extend-shuffled": (4, jnp.bfloat16, jnp.bfloat16, 2, ("attn", "mlp"), False, 3, 16, 9, 1),
}


@pytest.mark.parametrize("case", list(UPDATE_CASES))
def test_conv_update_matches_reference(case):
    k, adt, xdt, layer, streams, decode, num_rows, num_tokens, q, tracks = UPDATE_CASES[case]
    rng = np.random.RandomState(sum(map(ord, case)))
    lay = tiny_layout(k)
    f = lay.target[layer].conv
    chans = [lay.target[layer].channels(s) for s in streams]

    def step(update, arena, xs, ws, meta):  # the streams of one layer, as the steps call them
        ys = []
        for ch, x, w in zip(chans, xs, ws):
            y, arena = conv_call(update, lay, f, ch)(arena, x, w, meta)
            ys.append(y)
        return ys, arena

    for c0, c1 in chans:  # the kernel runs (no fallback to the reference)
        assert pconv.conv_plan((NUM_SLOTS * lay.slot_units + EXTRA_UNITS, lay.unit_elems), f.shape, (c0, c1),
                               c1 - c0, k, max(num_rows, num_tokens)) is not None
    kern = jax.jit(lambda *a: step(pk.conv_ops(True, interpret=INTERPRET).conv_update, *a))
    want_fn = jax.jit(lambda *a: step(ref_conv.conv_update, *a))
    for trial in range(3):
        arena = random_arena(rng, lay, conv_fields(lay), adt)
        xs = [rand(rng, (num_tokens, c1 - c0), xdt) for c0, c1 in chans]
        ws = [rand(rng, (k, c1 - c0), xdt, scale=0.5) for c0, c1 in chans]
        meta = random_meta(rng, num_rows, num_tokens, k - 1, decode, q, shuffle=case.endswith("shuffled"),
                           tracks=tracks)
        ys, got = kern(arena, xs, ws, meta)
        ys_ref, want = want_fn(arena, xs, ws, meta)
        for s, y, y_ref in zip(streams, ys, ys_ref):
            assert_y(y, y_ref, f"{case} trial {trial} y[{s}]")
        assert_arena(got, want, arena, lay, f"{case} trial {trial}")
        # slots neither active nor checkpointed this step are untouched
        written = set(np.asarray(meta.active).tolist()) | set(np.asarray(meta.track_dest).reshape(-1).tolist())
        got, arena = np.asarray(got), np.asarray(arena)
        for slot in set(range(1, NUM_SLOTS)) - written:
            units = slice(lay.slot_row(slot), lay.slot_row(slot + 1))
            assert_bits(got[units], arena[units], f"{case}: untouched slot {slot}")
        past = lay.slot_row(NUM_SLOTS)
        assert_bits(got[past:], arena[past:], f"{case}: units past the slots")


def test_conv_update_odd_field():
    """Window rows straddling unit boundaries, an 8-element granule, one 8-channel block."""
    lay, f = odd_layout()
    rng = np.random.RandomState(1)
    ch = (8, 32)
    kern = jax.jit(conv_call(pconv.conv_update, lay, f, ch, interpret=INTERPRET))
    want_fn = jax.jit(conv_call(ref_conv.conv_update, lay, f, ch))
    plan = pconv.conv_plan((NUM_SLOTS * lay.slot_units + EXTRA_UNITS, 48), f.shape, ch, 24, 4, 10)
    assert plan is not None and plan.granule == 8 and plan.nb * plan.granule == 8 and plan.nblocks == 3
    for trial in range(3):
        arena = random_arena(rng, lay, [f], jnp.float32)
        x = rand(rng, (10, 24), np.float32)
        w = rand(rng, (4, 24), np.float32)
        meta = random_meta(rng, 3, 10, 3, decode=False, q=6)
        y, got = kern(arena, x, w, meta)
        y_ref, want = want_fn(arena, x, w, meta)
        assert_y(y, y_ref, f"odd y {trial}")
        assert_arena(got, want, arena, lay, f"odd {trial}")


def test_conv_update_block_override():
    """Every channel block the bench sweep may pick (block / num_warps overrides) gives the
    reference's result; a block that is not a power of two dividing the width is refused."""
    lay = tiny_layout(4)
    f = lay.target[2].conv
    ch = lay.target[2].channels("attn")
    width = ch[1] - ch[0]
    rng = np.random.RandomState(11)
    arena = random_arena(rng, lay, conv_fields(lay), jnp.bfloat16)
    x = rand(rng, (4, width), jnp.bfloat16)
    w = rand(rng, (4, width), jnp.bfloat16, scale=0.5)
    meta = random_meta(rng, 4, 4, 3, decode=True)
    y_ref, want = jit_conv(arena, x, w, meta, op=ref_conv.conv_update, lay=lay, f=f, ch=ch)
    blocks = [b for b in (8, 16, 32, 64) if width % b == 0]
    assert len(blocks) >= 3
    for block in blocks:
        plan = pconv.conv_plan((NUM_SLOTS * lay.slot_units + EXTRA_UNITS, lay.unit_elems), f.shape, ch, width, 4, 4,
                               block=block, num_warps=2)
        assert (plan.block, plan.nblocks, plan.num_warps) == (block, width // block, 2)
        y, got = jit_conv(arena, x, w, meta, op=pconv.conv_update, lay=lay, f=f, ch=ch,
                          kw=(("interpret", INTERPRET), ("block", block), ("num_warps", 2)))
        assert_y(y, y_ref, f"block {block} y")
        assert_arena(got, want, arena, lay, f"block {block}")
    for bad in (0, 3 * blocks[0], 2 * width):
        with pytest.raises(ValueError, match="block must be a power of two"):  # (raised while tracing)
            jit_conv(arena, x, w, meta, op=pconv.conv_update, lay=lay, f=f, ch=ch,
                     kw=(("interpret", INTERPRET), ("block", bad)))


@pytest.mark.parametrize("shuffle", [False, True], ids=["packed", "shuffled"])
def test_conv_update_token_tiles(shuffle):
    """Extend with several tokens per program (the tile reads its x rows by guess of the
    packed order): tiles that divide T, that leave a partial last tile, and that exceed a
    row's token count give the reference's result, with tokens packed in order and out of
    order (every guess may miss); a tile below 1 is refused."""
    lay = tiny_layout(4)
    f = lay.target[1].conv
    chans = [lay.target[1].channels(s) for s in ("k", "attn")]
    rng = np.random.RandomState(12 + shuffle)
    arena = random_arena(rng, lay, conv_fields(lay), jnp.bfloat16)
    num_rows, num_tokens = 4, 22
    assert pconv.token_tile(num_tokens, num_rows, 1, 1) == 1  # default at this size: one token each
    # packed: a tile dividing T and one past most rows' token counts, on both streams; shuffled:
    # a partial last tile on one stream (each case compiles two programs in interpret mode)
    for tile in (5,) if shuffle else (2, 8):
        meta = random_meta(rng, num_rows, num_tokens, 3, decode=False, q=9, shuffle=shuffle)
        for c0, c1 in chans[:1] if shuffle else chans:
            x = rand(rng, (num_tokens, c1 - c0), jnp.bfloat16)
            w = rand(rng, (4, c1 - c0), jnp.bfloat16, scale=0.5)
            y_ref, want = jit_conv(arena, x, w, meta, op=ref_conv.conv_update, lay=lay, f=f, ch=(c0, c1))
            y, got = jit_conv(arena, x, w, meta, op=pconv.conv_update, lay=lay, f=f, ch=(c0, c1),
                              kw=(("interpret", INTERPRET), ("tile", tile)))
            assert_y(y, y_ref, f"tile {tile} y ({c0}, {c1})")
            assert_arena(got, want, arena, lay, f"tile {tile} ({c0}, {c1})")
    for bad in (0, -2):
        with pytest.raises(ValueError, match="token_tile must be a positive int"):  # (raised while tracing)
            jit_conv(arena, x, w, meta, op=pconv.conv_update, lay=lay, f=f, ch=chans[0],
                     kw=(("interpret", INTERPRET), ("tile", bad)))


def test_token_tile_rule():
    """Tiles grow with T while the grid keeps TILE_WARPS warps, up to MAX_TILE; never on
    decode (T <= B)."""
    assert pconv.token_tile(256, 256, 2, 4) == 1
    assert pconv.token_tile(64, 1, 1, 1) == 1
    assert pconv.token_tile(2048, 32, 1, 1) == 1  # 2048 one-warp programs: no tile
    assert pconv.token_tile(2048, 32, 1, 2) == 2
    assert pconv.token_tile(2048, 32, 2, 4) == 8
    assert pconv.token_tile(65536, 8, 4, 4) == pconv.MAX_TILE
    assert pconv.token_tile(4, 4, 1, 1, tile=3) == 1  # decode: one token per program whatever the override


# ------------------------------------------------------------------------- conv_write


@pytest.mark.parametrize("k,adt,wdt,xdt", [(4, jnp.bfloat16, jnp.float32, jnp.float32),
                                            (2, jnp.float32, jnp.float32, jnp.bfloat16)])
def test_conv_write_matches_reference(k, adt, wdt, xdt):
    rng = np.random.RandomState(k)
    lay = tiny_layout(k)
    f = lay.target[3].conv
    ch = lay.target[3].channels("attn")
    num_rows, num_tokens, width = 4, 12, ch[1] - ch[0]
    assert pconv.conv_plan((NUM_SLOTS * lay.slot_units + EXTRA_UNITS, lay.unit_elems), f.shape, ch, width, k,
                           num_rows) is not None
    kern = jax.jit(conv_call(pconv.conv_write, lay, f, ch, interpret=INTERPRET))
    want_fn = jax.jit(conv_call(ref_conv.conv_write, lay, f, ch))
    for trial in range(3):
        arena = random_arena(rng, lay, conv_fields(lay), adt)
        x = rand(rng, (num_tokens, width), xdt)
        window = rand(rng, (num_rows, k - 1, width), wdt)
        meta = random_meta(rng, num_rows, num_tokens, k - 1, decode=False, q=5, tracks=1 + trial)
        got = kern(arena, x, window, meta)
        assert_arena(got, want_fn(arena, x, window, meta), arena, lay, f"conv_write trial {trial}")


# -------------------------------------------------------------------------- slot ops


# A slot op (kernel or reference) under jax.jit: one XLA compile per op, options and shapes;
# eagerly every jnp op of the reference is its own compile.
@partial(jax.jit, static_argnames=("op", "kw"))
def jit_slot_op(arena, *rows, op, kw: tuple = ()):
    return op(arena, *rows, **dict(kw))


def test_slot_ops_match_reference():
    rng = np.random.RandomState(7)
    lay = tiny_layout(4, spec_steps=2)
    arena = random_arena(rng, lay, conv_fields(lay), jnp.bfloat16)
    ops = pk.conv_ops(True, interpret=INTERPRET)
    perm = rng.permutation(np.arange(1, NUM_SLOTS))
    src = np.asarray([perm[0], perm[1], perm[2], perm[3]], np.int32)
    dst = np.asarray([perm[4], 0, perm[5], 0], np.int32)  # pairs aimed at the sink are inert

    # whole slots, the draft block alone, a run inside the slot (rows from layout.slot_row)
    for first, n in [(0, lay.slot_units), (lay.draft_unit_start, lay.draft_units), (2, 3)]:
        kw = (("num_units", n), ("sink_rows", lay.sink_rows))
        src_rows = device_array(lay.slot_row(src) + first, np.int32)
        dst_rows = device_array(lay.slot_row(dst) + first, np.int32)
        got = jit_slot_op(arena, src_rows, dst_rows, op=ops.copy_units, kw=kw)
        want = jit_slot_op(arena, src_rows, dst_rows, op=ref_units.copy_units, kw=kw)
        assert_arena(got, want, arena, lay, f"copy first={first} n={n}")
        got = jit_slot_op(arena, dst_rows, op=ops.clear_units, kw=kw)
        want = jit_slot_op(arena, dst_rows, op=ref_units.clear_units, kw=kw)
        assert_arena(got, want, arena, lay, f"clear first={first} n={n}")

    units = rng.permutation(arena.shape[0])[:10]  # compaction moves: single units anywhere, no sink
    src_rows, dst_rows = device_array(units[:5], np.int32), device_array(units[5:], np.int32)
    got = jit_slot_op(arena, src_rows, dst_rows, op=ops.copy_units)
    assert_bits(got, jit_slot_op(arena, src_rows, dst_rows, op=ref_units.copy_units), "move units")


# ------------------------------------------------------------------------- gradients


def _grad_check(fn_kernel, fn_ref, primals, argnums, what):
    # both gradients in one jitted program: one compile, not two
    g_k, g_r = jax.jit(lambda *p: (jax.grad(fn_kernel, argnums)(*p), jax.grad(fn_ref, argnums)(*p)))(*primals)
    for i, (a, b) in enumerate(zip(g_k, g_r)):
        if INTERPRET:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{what}: grad {i}")
        else:  # compiled on a GPU, the two backward programs are scheduled (and rounded) separately
            scale = max(1.0, float(np.abs(np.asarray(b)).max()))
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5 * scale,
                                       err_msg=f"{what}: grad {i}")


def attn_stream_case(rng):
    """Layer 2's attn stream of tiny_layout(4) and a random fp32 arena: (layout, field,
    channels, width, arena), the gradient tests' setting."""
    lay = tiny_layout(4)
    f = lay.target[2].conv
    ch = lay.target[2].channels("attn")
    return lay, f, ch, ch[1] - ch[0], random_arena(rng, lay, conv_fields(lay), jnp.float32)


def test_gradients_match_reference():
    rng = np.random.RandomState(3)
    lay, f, ch, width, arena = attn_stream_case(rng)
    x = rand(rng, (10, width), np.float32)
    w = rand(rng, (4, width), np.float32)
    meta = random_meta(rng, 3, 10, 3, decode=False, q=6, tracks=2)
    probe_y = rand(rng, x.shape, np.float32)
    # the sink's contents are arbitrary (padded rows race for it): the loss ignores it
    probe_a = np.asarray(rng.standard_normal(arena.shape), np.float32)
    probe_a[:lay.slot_units] = 0.0
    probe_a = device_array(probe_a)

    def loss(update):
        def fn(a, xx, ww):
            y, out = conv_call(update, lay, f, ch)(a, xx, ww, meta)
            return jnp.sum(y * probe_y) + jnp.sum(out * probe_a)
        return fn

    ops = pk.conv_ops(True, interpret=INTERPRET)
    _grad_check(loss(ops.conv_update), loss(ref_conv.conv_update), (arena, x, w), (0, 1, 2), "conv_update")

    window = rand(rng, (3, 3, width), np.float32)

    def wloss(write):
        return lambda a, xx, win: jnp.sum(conv_call(write, lay, f, ch)(a, xx, win, meta) * probe_a)

    _grad_check(wloss(ops.conv_write), wloss(ref_conv.conv_write), (arena, x, window), (0, 1, 2), "conv_write")

    src = device_array(lay.slot_row(np.asarray([1, 2])), np.int32)
    dst = device_array(lay.slot_row(np.asarray([3, 4])), np.int32)
    kw = dict(num_units=lay.slot_units, sink_rows=lay.sink_rows)
    _grad_check(lambda a: jnp.sum(ops.copy_units(a, src, dst, **kw) * probe_a),
                lambda a: jnp.sum(ref_units.copy_units(a, src, dst, **kw) * probe_a), (arena,), (0,), "copy")


# --------------------------------------------------------------- dispatch and fallbacks


def test_conv_ops_dispatch():
    assert pk.conv_ops(False) is pk.REFERENCE_OPS
    assert pk.conv_ops(False).conv_update is ref_conv.conv_update
    if jax.default_backend() != "gpu":
        assert pk.conv_ops("auto") is pk.REFERENCE_OPS
        with pytest.raises(ValueError):
            pk.conv_ops(True)
    ops = pk.conv_ops(True, interpret=True)
    assert ops.pallas and ops.interpret
    with pytest.raises(ValueError):
        pk.conv_ops("yes")


def test_plan_constraints_and_fallback():
    lay = tiny_layout(4)
    f = lay.target[2].conv
    ch = lay.target[2].channels("mlp")
    width = ch[1] - ch[0]
    plan = pconv.conv_plan((100, lay.unit_elems), f.shape, ch, width, 4, 4)
    assert plan is not None and plan.block % plan.granule == 0 and width % plan.block == 0
    assert (plan.block & (plan.block - 1)) == 0 and (plan.granule & (plan.granule - 1)) == 0
    # granule rows past int32, a kernel size that does not match the field, K = 1: the reference
    assert pconv.conv_plan((2**31 // (lay.unit_elems // plan.granule) + 1, lay.unit_elems), f.shape, ch, width, 4,
                           4) is None
    assert pconv.conv_plan((100, lay.unit_elems), f.shape, ch, width, 3, 4) is None
    assert pslot._tile((2**40, 64)) is None
    assert pconv.conv_plan((100, lay.unit_elems), (3, f.shape[1], 1), ch, width, 4, 4) is None  # not [K-1, C]


def test_fallback_returns_reference(monkeypatch):
    monkeypatch.setattr(pconv, "conv_plan", lambda *a, **k: None)
    rng = np.random.RandomState(5)
    lay = tiny_layout(4)
    f = lay.target[2].conv
    ch = lay.target[2].channels("mlp")
    width = ch[1] - ch[0]
    arena = random_arena(rng, lay, conv_fields(lay), jnp.float32)
    x = rand(rng, (4, width), np.float32)
    w = rand(rng, (4, width), np.float32)
    meta = random_meta(rng, 4, 4, 3, decode=True)

    @jax.jit  # both, as one program traced here under the patch (not jit_conv: its cached traces predate it)
    def run(arena, x, w, meta):
        return (conv_call(pconv.conv_update, lay, f, ch, interpret=INTERPRET)(arena, x, w, meta),
                conv_call(ref_conv.conv_update, lay, f, ch)(arena, x, w, meta))

    (y, a), (y_ref, a_ref) = run(arena, x, w, meta)
    assert_bits(y, y_ref, "y")
    # outside the sink (several padded rows write it; on a GPU which write lands is arbitrary)
    assert_bits(np.asarray(a)[lay.slot_units:], np.asarray(a_ref)[lay.slot_units:], "arena")


# ---------------------------------------------------------------------- GPU lowering


@pytest.mark.skipif(has_cuda_device(),
                    reason="abstract CUDA lowering is for machines without a GPU; the compiled tests cover a GPU")
def test_kernels_lower_for_gpu(verify_triton_modules):
    """The kernels pass the Triton lowering (power-of-two blocks, supported ops) for CUDA,
    at the bench config's layout; this runs on CPU (it compiles nothing)."""
    cfg = InklingConfig.bench()
    lay = ArenaLayout.build(cfg, 64)
    sds = jax.ShapeDtypeStruct
    arena = sds((lay.slot_units * 600, lay.unit_elems), jnp.bfloat16)  # ~7.6 GB: int64 offsets
    i32 = lambda *s: sds(s, jnp.int32)

    def lower(fn, *args):
        try:
            text = jax.jit(fn, donate_argnums=0).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        except (ImportError, NotImplementedError) as exc:  # a jaxlib without the Triton dialect
            pytest.skip(f"no Triton lowering here: {exc}")
        assert "xla.gpu.triton" in text

    f = lay.target[0].conv
    ch = lay.target[0].channels("attn")
    w = ch[1] - ch[0]
    for b, t, q in [(32, 32, 1), (4, 256, 64)]:
        rows = PackedRows(token_row=i32(t), token_offset=i32(t), row_tokens=i32(b, q), has_state=sds((b,), jnp.bool_),
                          commit_len=i32(b), track_len=i32(b, 2))
        meta = Meta(rows, i32(b), i32(b, 2))
        x = sds((t, w), jnp.bfloat16)
        lower(conv_call(pconv.conv_update, lay, f, ch), arena, x, sds((4, w), jnp.bfloat16), meta)
    lower(conv_call(pconv.conv_write, lay, f, ch), arena, x, sds((b, 3, w), jnp.bfloat16), meta)
    kw = dict(num_units=lay.slot_units, sink_rows=lay.sink_rows)
    lower(lambda a, s, d: pslot.copy_units(a, s, d, **kw), arena, i32(8), i32(8))
    lower(lambda a, d: pslot.clear_units(a, d, **kw), arena, i32(8))
    lower(lambda a, s, d: pslot.copy_units(a, s, d), arena, i32(64), i32(64))


def test_engine_with_pallas_kernels_matches_jnp(trunk_params, monkeypatch):
    """The engine wired to the Pallas ops (interpret mode on CPU, compiled on a GPU) generates
    what the jnp engine generates: one 40-token request, whose prefill takes the many-query
    kernels, the flash attention (`KernelOps.ring_attention / paged_attention` for rows of >= 32
    queries) and the grouped-GEMM experts (`KernelOps.experts` for many tokens; their threshold
    lowered to 8 choices per expert so the tiny model's 32-token step reaches it), and whose
    batch-1 decode steps take the few-token MoE kernel (`KernelOps.experts`: the routed and
    shared experts in one launch per product; `KernelOps.matmul` the mat-vec kernel without
    expert ids for the attention projections) and the decode attention kernels, which read the
    sliding rings and the pages in place (`KernelOps.ring_attention` / `paged_attention` for
    fewer queries; pages of 16 tokens so the paged kernel, not its fallback, runs), over
    checkpoint boundaries; both phases route through the router's epilogue kernel. Tokens equal;
    log-probs within 1e-5 (the kernels sum in other orders than XLA)."""
    prompt = list(np.random.RandomState(8).randint(3, TRUNK.unpadded_vocab_size, 40))
    kw = {**ENGINE_KW, "max_running": 1, "min_batch_bucket": 1, "chunk_size": 64, "max_step_tokens": 64,
          "page_size": 16, "track_interval": 16}
    out, traced = {}, {"experts": [], "attention": [], "in_place": [], "matvec": [], "router": [], "joined": []}

    def spy(name, kernel):
        def fn(x, *a, **k):  # runs when the step is traced
            traced[name].append(k.get("ring") if name == "in_place" else x.shape)
            return kernel(x, *a, **k)
        return fn

    monkeypatch.setattr(pk.moe.grouped, "moe_experts_grouped", spy("experts", pk.moe.grouped.moe_experts_grouped))
    monkeypatch.setattr(pk.attention.pallas, "attention", spy("attention", pk.attention.pallas.attention))
    monkeypatch.setattr(pk.attention.decode, "_decode_call", spy("in_place", pk.attention.decode._decode_call))
    monkeypatch.setattr(pk.moe.pallas, "matvec", spy("matvec", pk.moe.pallas.matvec))
    monkeypatch.setattr(pk.moe.router, "router_epilogue", spy("router", pk.moe.router.router_epilogue))
    monkeypatch.setattr(pk.moe.pallas, "moe_experts_with_shared", spy("joined", pk.moe.pallas.moe_experts_with_shared))
    monkeypatch.setattr(pk.ops, "GROUPED_MIN_CHOICES_PER_EXPERT", 8)
    pk._pallas_ops.cache_clear()  # the ops pick the spies up
    try:
        for pallas in (False, True):
            with jax.default_matmul_precision("highest"):
                engine = ik.Engine(TRUNK, trunk_params, ik.EngineConfig(**kw, use_pallas=pallas,
                                                                      pallas_interpret=pallas and INTERPRET))
                (req,) = engine.submit([prompt], ik.SamplingParams(max_new_tokens=12))
                while engine.running or engine.waiting:
                    engine.step()
            engine.check_invariants()
            out[pallas] = (list(req.out_tokens), np.asarray(req.out_logprobs))
    finally:
        monkeypatch.undo()
        pk._pallas_ops.cache_clear()
    assert traced["experts"] and min(s[0] for s in traced["experts"]) * TRUNK.num_experts_per_tok >= 8 * 8
    assert len(traced["attention"]) == 2 and traced["attention"][0][1] >= 32  # traced once per window kind
    assert None in traced["in_place"] and any(r is not None for r in traced["in_place"])  # paged and ring kernels
    # one token's routed and shared experts in one launch per product, and its attention projections
    assert (1, TRUNK.hidden_size) in traced["joined"] and (1, TRUNK.hidden_size) in traced["matvec"]
    width = TRUNK.n_routed_experts + TRUNK.n_shared_experts
    assert (1, width) in traced["router"] and any(n > 1 for n, _ in traced["router"])  # decode and prefill
    assert out[True][0] == out[False][0]
    np.testing.assert_allclose(out[True][1], out[False][1], atol=1e-5)


LOWER_AND_COUNT = """
import builtins, jax, jax.numpy as jnp
from pallas_kernels.moe import router
tried, real_import = [], builtins.__import__
def spy(name, *args, **kwargs):
    if name.endswith(".tt"):
        tried.append(name)
    return real_import(name, *args, **kwargs)
sds = jax.ShapeDtypeStruct
fn = lambda lg, b, sc: router.router_epilogue(lg, b, sc, k=4, route_scale=8.0, num_experts=32)
traced = jax.jit(fn).trace(sds((8, 34), jnp.float32), sds((32,), jnp.float32), sds((1,), jnp.float32))
builtins.__import__ = spy
try:
    traced.lower(lowering_platforms=("cuda",))
except (ImportError, NotImplementedError) as exc:
    print("SKIP", exc)
builtins.__import__ = real_import
print("TRIED", len(tried))
"""


@pytest.mark.skipif(has_cuda_device(), reason="abstract CUDA lowering is for machines without a GPU")
def test_triton_lowering_imports_nothing_per_op():
    """A fresh process lowering a kernel for CUDA looks for the Triton dialect's Python module
    once, not for every op it builds (`pallas_kernels._common`: MLIR's bindings retried three
    failing imports per Triton op, about half of a bench step's lowering time; this kernel
    alone tried 141 of them)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", LOWER_AND_COUNT], capture_output=True, text=True, timeout=300,
                          cwd=root, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    if "SKIP" in proc.stdout:
        pytest.skip(proc.stdout)
    assert int(proc.stdout.split("TRIED")[1]) <= 1, proc.stdout

"""Check 2, the conv receptive field: the conv windows a step writes (active and checkpoint)
depend, through jax.jvp and through jax.vjp, exactly on the last K-1 inputs of each row's
stream [old window ++ new tokens] and on nothing else.

The check runs one conv-state op (`conv_update`, the jnp reference by default) on one stream
of one layer's conv field over a hand-built batch of rows (`ConvCase`), with arena rows from
the layout's formulas and shuffled physical slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from pallas_kernels.conv_state import ref as conv_ref
from pallas_kernels.conv_state.ref import PackedRows
from pallas_kernels.slot_ops.ref import read_field, write_field

from ..cache.layout import ArenaLayout, Field
from ..config import InklingConfig
from .step_fns import jit_check

DEFAULT_ROWS = ((True, 1, 1), (True, 2, 0), (True, 6, 4), (False, 2, 1), (False, 5, 3), (True, 0, 0))


@dataclass
class ConvReport:
    ok: bool
    details: str
    kernel_size: int
    max_outside: float  # max |derivative| of any window w.r.t. any input outside its receptive field (0.0)
    min_inside: float  # min over expected dependences of |derivative| (> 0)
    jvp_matches_vjp: bool  # the dependence patterns found forward and reverse agree
    input_labels: list[str] = field(repr=False)
    # [inputs, outputs] bool (outputs: active windows, then checkpoint windows)
    expected: np.ndarray = field(repr=False)
    jvp_dependence: np.ndarray = field(repr=False)  # [inputs, outputs] max |d window / d input|
    vjp_dependence: np.ndarray = field(repr=False)
    output_labels: list[str] = field(repr=False)

    def __str__(self) -> str:
        return self.details


@dataclass
class ConvCase:
    """One conv-state op's inputs: B rows over T packed tokens (the last `padding` of them
    padding tokens on the last row), one stream [c0, c1) of a [K-1, C] conv field.

    Inputs of the check: the K-1 old window rows of every row's slot (input b * (K-1) + j),
    then the packed tokens (input B * (K-1) + t). Outputs: every row's active window, then the
    checkpoint window of every row in `tracked`."""

    field: Field
    channels: tuple[int, int]
    sink_rows: int
    has_state: np.ndarray  # [B] bool
    num_new: np.ndarray  # [B]
    track_len: np.ndarray  # [B]
    query_start: np.ndarray  # [B]
    token_row: np.ndarray  # [T]
    token_offset: np.ndarray  # [T]
    padding: int  # padding tokens at the end of the packed tokens
    packed: PackedRows
    active_rows: jax.Array  # [B] first arena row of each row's conv field
    track_rows: jax.Array  # [B, 1] first arena row of each row's checkpoint field (the sink's when none)
    tracked: np.ndarray  # rows with a checkpoint
    arena: jax.Array  # [U, E] random
    x: jax.Array  # [T, width] random
    weight: jax.Array  # [K, width] random

    @property
    def km1(self) -> int:
        return self.field.shape[0]

    @property
    def width(self) -> int:
        return self.channels[1] - self.channels[0]

    @property
    def rows(self) -> int:
        return len(self.num_new)

    @property
    def tokens(self) -> int:
        return len(self.token_row)

    @property
    def num_inputs(self) -> int:
        return self.rows * self.km1 + self.tokens

    @property
    def num_outputs(self) -> int:
        return self.rows + len(self.tracked)


def conv_case(layout: ArenaLayout, rows: Sequence[tuple[bool, int, int]], layer: int, stream: str,
              padding_tokens: int, seed: int) -> ConvCase:
    """rows: (has_state, num_new, track_len) per request row. Row b gets virtual slot b+1 and
    checkpoint virtual slot b+1+B, behind a shuffled virtual -> physical table."""
    fields = layout.target[layer]
    f = fields.conv
    km1 = f.shape[0]
    c0, c1 = fields.channels(stream)
    b = len(rows)
    has_state = np.array([r[0] for r in rows], bool)
    num_new = np.array([r[1] for r in rows], np.int32)
    track_len = np.array([r[2] for r in rows], np.int32)
    if np.any(track_len > num_new):
        raise ValueError("track_len must not exceed num_new")
    q = max(int(num_new.max()), 1)
    t = int(num_new.sum()) + padding_tokens
    rng = np.random.RandomState(seed)

    v2p = np.concatenate([[0], rng.permutation(np.arange(1, 2 * b + 1))]).astype(np.int32)
    active = v2p[np.arange(1, b + 1)]
    track_dest = np.where(track_len > 0, v2p[np.arange(b + 1, 2 * b + 1)], 0).astype(np.int32)
    arena = jnp.asarray(rng.standard_normal(((2 * b + 1) * layout.slot_units, layout.unit_elems)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((t, c1 - c0)), jnp.float32)
    weight = jnp.asarray(rng.standard_normal((km1 + 1, c1 - c0)), jnp.float32)

    query_start = np.concatenate([[0], np.cumsum(num_new)[:-1]]).astype(np.int32)
    token_row = np.concatenate([np.full(n, i) for i, n in enumerate(num_new)] + [np.full(padding_tokens, b - 1)])
    token_offset = np.concatenate([np.arange(n) for n in num_new]
                                  + [num_new[-1] + np.arange(padding_tokens)]).astype(np.int32)
    row_tokens = np.clip(query_start[:, None] + np.arange(q)[None, :], 0, t - 1).astype(np.int32)
    packed = PackedRows(token_row=jnp.asarray(token_row, jnp.int32), token_offset=jnp.asarray(token_offset),
                        row_tokens=jnp.asarray(row_tokens), has_state=jnp.asarray(has_state),
                        commit_len=jnp.asarray(num_new), track_len=jnp.asarray(track_len)[:, None])
    track_rows = jnp.asarray(layout.slot_row(track_dest, f), jnp.int32)[:, None]  # one checkpoint column
    return ConvCase(f, (c0, c1), layout.sink_rows, has_state, num_new, track_len, query_start, token_row,
                    token_offset, padding_tokens, packed, jnp.asarray(layout.slot_row(active, f), jnp.int32),
                    track_rows, np.nonzero(track_len > 0)[0], arena, x, weight)


def labels(case: ConvCase) -> tuple[list[str], list[str]]:
    """(input labels, output labels) in the check's input and output order."""
    b, km1 = case.rows, case.km1
    inputs = [f"row {i} old window[{j}]" for i in range(b) for j in range(km1)]
    t_real = case.tokens - case.padding
    for i in range(case.tokens):
        r = int(case.token_row[i])
        inputs.append(f"row {r} new[{case.token_offset[i]}]" if i < t_real else f"padding token {i}")
    outputs = [f"row {i} active window" for i in range(b)] + [f"row {i} checkpoint window" for i in case.tracked]
    return inputs, outputs


def expected_dependence(case: ConvCase) -> np.ndarray:
    """[inputs, outputs] bool: the active window of row b is the last K-1 of S_b = [old
    window ++ new tokens] (the old window when there are none), the checkpoint window the
    last K-1 of S_b[:K-1+track_len]; a stateless row's old window is zeros, not an input."""
    b, km1 = case.rows, case.km1
    n_old = b * km1
    expected = np.zeros((case.num_inputs, case.num_outputs), bool)

    def stream_inputs(i):  # input index of each element of S_i; None for a zeroed (stateless) old row
        old = [i * km1 + j if case.has_state[i] else None for j in range(km1)]
        return old + [n_old + case.query_start[i] + k for k in range(case.num_new[i])]

    for i in range(b):
        n = case.num_new[i]
        picked = [i * km1 + j for j in range(km1)] if n == 0 else stream_inputs(i)[n:n + km1]
        for idx in picked:
            if idx is not None:
                expected[idx, i] = True
    for o, i in enumerate(case.tracked):
        for idx in stream_inputs(i)[case.track_len[i]:case.track_len[i] + km1]:
            if idx is not None:
                expected[idx, b + o] = True
    return expected


def measure_dependence(case: ConvCase, conv_update: Callable, modes: Sequence[str], seed: int):
    """(jvp [inputs, outputs] or None, vjp [inputs, outputs] or None, max |arena gradient| off
    the old windows), from one jitted program: the jvp pushes one basis tangent per input (an
    old window row of a row's slot, or a packed token; all the stream's channels), the vjp
    pulls one random cotangent per output window."""
    f, (c0, c1), b, km1, t, width = case.field, case.channels, case.rows, case.km1, case.tokens, case.width
    n_old, n_out = b * km1, case.num_outputs
    act_rows, trk_rows, tracked = case.active_rows, case.track_rows, case.tracked

    def windows(x, arena):
        _, new = conv_update(arena, x, case.weight, case.packed, act_rows, trk_rows, window_shape=f.shape,
                             channels=(c0, c1), sink_rows=case.sink_rows)
        act = read_field(new, act_rows, f.shape)[..., c0:c1]
        trk = read_field(new, trk_rows[:, 0], f.shape)[..., c0:c1][tracked]
        return jnp.concatenate([act, trk], axis=0)  # [B + tracked, K-1, width]

    def owned(i, j):  # arena mask of old window row j of row i's slot, the stream's channels
        full = jnp.zeros((b,) + f.shape, jnp.float32).at[i, j, c0:c1].set(1.0)
        return write_field(jnp.zeros_like(case.arena), act_rows, full)

    def measure(x, arena):
        res = {}
        if "jvp" in modes:
            def push(xd, ad):
                return jnp.max(jnp.abs(jax.jvp(windows, (x, arena), (xd, ad))[1]), axis=(1, 2))

            a_tan = jax.vmap(lambda k: owned(k // km1, k % km1))(jnp.arange(n_old))
            x_tan = jnp.eye(t, dtype=jnp.float32)[:, :, None] * jnp.ones((1, 1, width), jnp.float32)
            xd = jnp.concatenate([jnp.zeros((n_old, t, width), jnp.float32), x_tan])
            ad = jnp.concatenate([a_tan, jnp.zeros((t,) + arena.shape, jnp.float32)])
            res["jvp"] = jax.vmap(push)(xd, ad)  # [inputs, outputs]
        if "vjp" in modes:
            out, pull = jax.vjp(windows, x, arena)
            cot = jax.random.normal(jax.random.key(seed), out.shape, out.dtype)
            window_mask = sum(owned(i, j) for i in range(b) for j in range(km1)) > 0

            def pull_one(o):
                xb, ab = pull(jnp.where((jnp.arange(n_out) == o)[:, None, None], cot, 0.0))
                old = read_field(ab, act_rows, f.shape)[..., c0:c1]  # [B, K-1, width]
                return (jnp.concatenate([jnp.max(jnp.abs(old), -1).reshape(-1), jnp.max(jnp.abs(xb), -1)]),
                        jnp.max(jnp.abs(jnp.where(window_mask, 0.0, ab))))

            dep, rest = jax.vmap(pull_one)(jnp.arange(n_out))
            res["vjp"], res["rest"] = dep.T, jnp.max(rest)
        return res

    res = jax.device_get(jit_check(measure)(case.x, case.arena))
    jvp_dep = np.asarray(res["jvp"]) if "jvp" in res else None
    vjp_dep = np.asarray(res["vjp"]) if "vjp" in res else None
    return jvp_dep, vjp_dep, float(res.get("rest", 0.0))


def _window_lines(case: ConvCase, expected: np.ndarray, measured: np.ndarray, input_labels: list[str]) -> list[str]:
    """One line per output window: the inputs it depends on, ok or MISMATCH against expected."""
    lines = []
    b = case.rows
    for o in range(case.num_outputs):
        want = [input_labels[i] for i in np.nonzero(expected[:, o])[0]]
        got = [input_labels[i] for i in np.nonzero(measured[:, o])[0]]
        row = o if o < b else int(case.tracked[o - b])
        hs, n = bool(case.has_state[row]), int(case.num_new[row])
        kind = "active" if o < b else f"checkpoint (after {case.track_len[row]} new)"
        mark = "ok" if sorted(want) == sorted(got) else "MISMATCH"
        lines.append(f"  row {row} ({'state' if hs else 'no state'}, {n} new) {kind} window <- "
                     f"{', '.join(got) or 'nothing'} [{mark}]")
        if mark != "ok":
            lines.append(f"    expected {', '.join(want) or 'nothing'}")
    return lines


def check_conv_receptive_field(
    cfg: InklingConfig, rows: Sequence[tuple[bool, int, int]] = DEFAULT_ROWS,
    *, page_size: int = 4, layer: int = 0, stream: str = "attn", padding_tokens: int = 2,
    conv_update: Callable | None = None, modes: Sequence[str] = ("jvp", "vjp"), seed: int = 0,
) -> ConvReport:
    """The conv state a step writes depends only on the last K-1 inputs of each stream.

    rows: (has_state, num_new, track_len) per request row; every row gets its own slot (and
    its own checkpoint slot when track_len > 0), virtual ids shuffled. For row b the stream is
    S_b = [old window (K-1 rows, read from the arena) ++ its num_new new tokens]; a row without
    state reads zeros instead of its (stale) old window. Expected: the new active window is the
    last K-1 rows of S_b (the old window unchanged when num_new == 0) and the checkpoint window
    the last K-1 rows of S_b[:K-1+track_len]; it depends on exactly those inputs (and, for a
    stateless row, not on its stale old window). Measured with jax.jvp (one tangent per
    input: each old-window row of each slot, each packed token including padding tokens) and
    with jax.vjp (one random cotangent per output window); ok iff both patterns are exactly the
    expected one (0.0 outside, nonzero inside) and the arena gradient is 0.0 everywhere else.
    `conv_update` defaults to the jnp reference (`pallas_kernels.conv_state.ref.conv_update`);
    a custom_vjp kernel (Pallas) cannot be pushed forward: pass modes=("vjp",)."""
    case = conv_case(ArenaLayout.build(cfg, page_size), rows, layer, stream, padding_tokens, seed)
    input_labels, output_labels = labels(case)
    expected = expected_dependence(case)
    jvp_dep, vjp_dep, max_elsewhere = measure_dependence(case, conv_update or conv_ref.conv_update, modes, seed)

    measured = [d for d in (jvp_dep, vjp_dep) if d is not None]
    max_outside = max(float(np.max(np.where(expected, 0.0, d))) for d in measured)
    min_inside = min(float(np.min(np.where(expected, d, np.inf))) for d in measured)
    agree = jvp_dep is None or vjp_dep is None or bool(np.array_equal(jvp_dep != 0, vjp_dep != 0))
    ok = max_outside == 0.0 and min_inside > 0.0 and agree and max_elsewhere == 0.0

    k = case.km1 + 1
    lines = [f"conv receptive field {'OK' if ok else 'FAILED'}: K = {k}, layer {layer} stream {stream!r} "
             f"({case.width} channels), {case.rows} rows, {case.tokens} packed tokens ({padding_tokens} padding); "
             f"modes {tuple(modes)}",
             f"max |d window / d input| outside the last K-1 inputs: {max_outside:.3g} (must be exactly 0); "
             f"min inside: {min_inside:.3g}; arena gradient elsewhere: {max_elsewhere:.3g}"]
    if not agree:
        lines.append("jvp and vjp dependence patterns differ")
    lines += _window_lines(case, expected, measured[0], input_labels)
    return ConvReport(ok, "\n".join(lines), k, max_outside, min_inside, agree, input_labels, expected,
                      jvp_dep, vjp_dep, output_labels)

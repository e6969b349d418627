"""Short-conv state on the arena: the jnp references (the Pallas kernels mirror these).

Per step, one conv stream of one layer reads each row's K-1-row window from the arena,
convolves the step's packed ragged tokens, and writes back

* the *active* window: the last K-1 inputs of [window ++ first commit_len new tokens]
  (all new tokens in extend / decode; the accepted ones in verify);
* the *checkpoint* windows, M per row: the last K-1 inputs of [window ++ first
  track_len[b, m] new tokens], into checkpoint field m (a sink field for the columns a row
  does not use: several boundaries may fall inside one chunk).

A window is [K-1, C_stream], oldest input first. A row without state (has_state False: a
fresh request) reads zeros instead of its field's stale contents, so recycled slots need no
clearing.

Arena addressing is the caller's: a conv *field* `[K-1, C]` (`window_shape`) holds the
windows of several streams side by side (channel ranges; one op touches only its
`channels = (c0, c1)`), stored from an arena row on over whole units (see `slot_ops.ref`).
`active_row[b]` / `track_row[b, m]` are the first rows of row b's active field and of its
m-th checkpoint field.

`conv_update_residual_norm` is `conv_update` followed by the decoder layer's residual add and
the next RMSNorm (`inkling_jax.model.layers.decoder_layer`: x + conv(a), then `_common.rms_norm`),
the composition its kernel fuses. `conv_from_taps` is the model's conv arithmetic too
(`layers.causal_conv` calls it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import no_type_check

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._common import rms_norm
from ..slot_ops.ref import read_field, write_field


# no_type_check (the tests' jaxtyping hook): a pytree node, rebuilt through __init__ by JAX with
# leaves of any kind (lowering's ArgInfo, specs, float0 cotangents; numpy on the host)
@no_type_check
@jax.tree_util.register_dataclass
@dataclass
class PackedRows:
    """How a step's packed tokens form request rows, and how much of each row enters state.

    Shapes: T packed tokens, B rows, Q the most new tokens of one row, M checkpoints per row."""

    token_row: Int[Array, " t"]  # request row of each packed token
    token_offset: Int[Array, " t"]  # index of the token among its row's new tokens
    row_tokens: Int[Array, "b q"]  # packed index of each row's i-th new token (clipped in range)
    has_state: Bool[Array, " b"]  # the row's state holds the window before its first new token
    commit_len: Int[Array, " b"]  # new tokens that enter the active window (0: leave it)
    track_len: Int[Array, "b m"]  # new tokens before each checkpoint position


def conv_from_taps(x: Float[Array, "... d"], taps: Float[Array, "... k d"], weight: Float[Array, "k d"]) -> Array:
    """y = x + sum_i weight[i] * taps[i], accumulated in fp32, returned in x's dtype
    (taps[..., K-1, :] is the token itself)."""
    acc = jnp.einsum("...kd,kd->...d", taps.astype(jnp.float32), weight.astype(jnp.float32))
    return (x.astype(jnp.float32) + acc).astype(x.dtype)


def padded_inputs(x: Float[Array, "t c"], window: Float[Array, "b km1 c"], rows: PackedRows) -> Array:
    """[B, K-1+Q, C]: each row's old window (zeros without state) followed by its new tokens."""
    window = jnp.where(rows.has_state[:, None, None], window, jnp.zeros((), window.dtype)).astype(x.dtype)
    return jnp.concatenate([window, x[rows.row_tokens]], axis=1)


def conv_tokens(x: Float[Array, "t c"], weight: Float[Array, "k c"], window: Float[Array, "b km1 c"],
                rows: PackedRows) -> Float[Array, "t c"]:
    """y[t] = x[t] + sum_i w[i] * input(t - (K-1) + i), inputs before the row's first new
    token taken from its window (zeros without state)."""
    k = weight.shape[0]
    q = rows.row_tokens.shape[1]
    xpad = padded_inputs(x, window, rows)
    taps = jnp.stack([xpad[:, i:i + q] for i in range(k)], axis=2)  # [B, Q, K, C]
    y = conv_from_taps(xpad[:, k - 1:], taps, weight)
    return y[rows.token_row, rows.token_offset]


def window_after(x: Float[Array, "t c"], window: Float[Array, "b km1 c"], rows: PackedRows,
                 n: Int[Array, " b"]) -> Float[Array, "b km1 c"]:
    """The last K-1 inputs of [window ++ first n new tokens] for every row."""
    km1 = window.shape[1]
    xpad = padded_inputs(x, window, rows)
    idx = jnp.clip(n, 0, xpad.shape[1] - km1)[:, None] + jnp.arange(km1)[None, :]  # rows n .. n+K-2 of xpad
    return jnp.take_along_axis(xpad, idx[:, :, None], axis=1).astype(window.dtype)


def read_window(arena: Array, first_rows: Int[Array, " b"], window_shape: tuple[int, int],
                channels: tuple[int, int]) -> Array:
    """[B, K-1, c1 - c0]: one stream's windows from the fields starting at first_rows."""
    return read_field(arena, first_rows, window_shape)[..., channels[0]:channels[1]]


def conv_write(arena: Array, x: Float[Array, "t c"], window: Float[Array, "b km1 c"], rows: PackedRows,
               active_row: Int[Array, " b"], track_row: Int[Array, "b m"], *, window_shape: tuple[int, int],
               channels: tuple[int, int], sink_rows: int = 0) -> Array:
    """Write the active and checkpoint windows of one stream into its channel range (the
    sink's fields too: `sink_rows` only tells the kernels what they may skip)."""
    del sink_rows
    c0, c1 = channels
    full = read_field(arena, active_row, window_shape)
    new = window_after(x, window, rows, rows.commit_len)
    keep = (rows.commit_len == 0)[:, None, None]
    full = full.at[..., c0:c1].set(jnp.where(keep, full[..., c0:c1], new.astype(full.dtype)))
    arena = write_field(arena, active_row, full)

    for m in range(track_row.shape[1]):
        tfull = read_field(arena, track_row[:, m], window_shape)
        tfull = tfull.at[..., c0:c1].set(window_after(x, window, rows, rows.track_len[:, m]).astype(tfull.dtype))
        arena = write_field(arena, track_row[:, m], tfull)
    return arena


def conv_update(arena: Array, x: Float[Array, "t c"], weight: Float[Array, "k c"], rows: PackedRows,
                active_row: Int[Array, " b"], track_row: Int[Array, "b m"], *, window_shape: tuple[int, int],
                channels: tuple[int, int], sink_rows: int = 0) -> tuple[Float[Array, "t c"], Array]:
    """Fused conv + state write for one stream (extend and decode): returns (y, arena)."""
    window = read_window(arena, active_row, window_shape, channels)
    y = conv_tokens(x, weight, window, rows)
    return y, conv_write(arena, x, window, rows, active_row, track_row, window_shape=window_shape,
                         channels=channels, sink_rows=sink_rows)


def residual_norm(y: Float[Array, "t c"], residual: Float[Array, "t c"], norm_weight: Float[Array, " c"],
                  eps: float) -> tuple[Float[Array, "t c"], Float[Array, "t c"]]:
    """(residual + y, rms_norm(residual + y)): y rounded to residual's dtype first, the add in
    that dtype (as `x + conv(a)` in the decoder layer, where both have the activation dtype)."""
    new = residual + y.astype(residual.dtype)
    return new, rms_norm(new, norm_weight, eps)


def conv_update_residual_norm(arena: Array, x: Float[Array, "t c"], weight: Float[Array, "k c"], rows: PackedRows,
                              active_row: Int[Array, " b"], track_row: Int[Array, "b m"],
                              residual: Float[Array, "t c"], norm_weight: Float[Array, " c"], *, eps: float,
                              window_shape: tuple[int, int], channels: tuple[int, int], sink_rows: int = 0
                              ) -> tuple[Float[Array, "t c"], Float[Array, "t c"], Array]:
    """`conv_update`, then the residual add and the RMSNorm of the sum: returns
    (new_residual = residual + y, normed = rms_norm(new_residual, norm_weight, eps), arena)."""
    y, arena = conv_update(arena, x, weight, rows, active_row, track_row, window_shape=window_shape,
                           channels=channels, sink_rows=sink_rows)
    new, normed = residual_norm(y, residual, norm_weight, eps)
    return new, normed, arena

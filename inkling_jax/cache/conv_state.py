"""Short-conv state on the arena: the jnp reference ops (Pallas kernels mirror these).

Per step, every conv stream of every layer reads its K-1-row window from the request's
slot, convolves the step's packed ragged tokens, and writes back

* the *active* window: the last K-1 inputs of [window ++ first commit_len new tokens]
  (all new tokens in extend/decode; the accepted ones in verify);
* the *checkpoint* window: the last K-1 inputs before the checkpoint position, i.e. of
  [window ++ first track_len new tokens], into the checkpoint slot (the sink when the
  row does not checkpoint this step).

A window is [K-1, C], oldest input first. A row without state (has_state False: a fresh
request) reads zeros instead of its slot's stale contents, so recycled slots need no
clearing. Streams of one layer share a field (channels k | v | attn | mlp); each op touches
only its channel range.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ..model.layers import conv_from_taps
from .layout import ArenaLayout, Field
from .state import read_field, slot_rows, write_field


@jax.tree_util.register_dataclass
@dataclass
class ConvMeta:
    """Per-step conv metadata shared by every layer (physical ids, translated once)."""

    token_row: Int[Array, "t"]  # request row of each packed token
    token_offset: Int[Array, "t"]  # index of the token among its row's new tokens
    row_tokens: Int[Array, "b q"]  # packed index of each row's i-th new token (clipped in range)
    has_state: Bool[Array, "b"]  # the slot holds the window before the first new token
    commit_len: Int[Array, "b"]  # new tokens that enter the active window (0: leave it)
    active: Int[Array, "b"]  # physical slot (the sink for padded rows)
    track_dest: Int[Array, "b"]  # physical checkpoint slot (the sink when not tracking)
    track_len: Int[Array, "b"]  # new tokens before the checkpoint position


def padded_inputs(x: Float[Array, "t c"], window: Float[Array, "b km1 c"], meta: ConvMeta) -> Array:
    """[B, K-1+Q, C]: each row's old window (zeros without state) followed by its new tokens."""
    window = jnp.where(meta.has_state[:, None, None], window, jnp.zeros((), window.dtype)).astype(x.dtype)
    return jnp.concatenate([window, x[meta.row_tokens]], axis=1)


def conv_tokens(x: Float[Array, "t c"], weight: Float[Array, "k c"], window: Float[Array, "b km1 c"],
                meta: ConvMeta) -> Float[Array, "t c"]:
    """y[t] = x[t] + sum_i w[i] * input(t - (K-1) + i), inputs before the row's first new
    token taken from its window (zeros without state)."""
    k = weight.shape[0]
    q = meta.row_tokens.shape[1]
    xpad = padded_inputs(x, window, meta)
    taps = jnp.stack([xpad[:, i:i + q] for i in range(k)], axis=2)  # [B, Q, K, C]
    y = conv_from_taps(xpad[:, k - 1:], taps, weight)
    return y[meta.token_row, meta.token_offset]


def window_after(x: Float[Array, "t c"], window: Float[Array, "b km1 c"], meta: ConvMeta,
                 n: Int[Array, "b"]) -> Float[Array, "b km1 c"]:
    """The last K-1 inputs of [window ++ first n new tokens] for every row."""
    km1 = window.shape[1]
    xpad = padded_inputs(x, window, meta)
    idx = jnp.clip(n, 0, xpad.shape[1] - km1)[:, None] + jnp.arange(km1)[None, :]  # rows n .. n+K-2 of xpad
    return jnp.take_along_axis(xpad, idx[:, :, None], axis=1).astype(window.dtype)


def conv_write(arena: Array, layout: ArenaLayout, f: Field, channels: tuple[int, int], x: Float[Array, "t c"],
               window: Float[Array, "b km1 c"], meta: ConvMeta) -> Array:
    """Write the active and checkpoint windows of one stream into its channel range of field f."""
    c0, c1 = channels
    rows = slot_rows(layout, meta.active, f)
    full = read_field(arena, layout, rows, f)
    new = window_after(x, window, meta, meta.commit_len)
    keep = (meta.commit_len == 0)[:, None, None]
    full = full.at[..., c0:c1].set(jnp.where(keep, full[..., c0:c1], new.astype(full.dtype)))
    arena = write_field(arena, layout, rows, f, full)

    trows = slot_rows(layout, meta.track_dest, f)
    tfull = read_field(arena, layout, trows, f)
    tfull = tfull.at[..., c0:c1].set(window_after(x, window, meta, meta.track_len).astype(tfull.dtype))
    return write_field(arena, layout, trows, f, tfull)


def conv_update(arena: Array, layout: ArenaLayout, f: Field, channels: tuple[int, int], x: Float[Array, "t c"],
                weight: Float[Array, "k c"], meta: ConvMeta) -> tuple[Float[Array, "t c"], Array]:
    """Fused conv + state write for one stream (extend and decode): returns (y, arena)."""
    c0, c1 = channels
    window = read_field(arena, layout, slot_rows(layout, meta.active, f), f)[..., c0:c1]
    y = conv_tokens(x, weight, window, meta)
    return y, conv_write(arena, layout, f, channels, x, window, meta)

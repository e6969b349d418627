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
    query_start: Int[Array, "b"]  # packed index of each row's first new token
    has_state: Bool[Array, "b"]  # the slot holds the window before the first new token
    commit_len: Int[Array, "b"]  # new tokens that enter the active window (0: leave it)
    active: Int[Array, "b"]  # physical slot (the sink for padded rows)
    track_dest: Int[Array, "b"]  # physical checkpoint slot (the sink when not tracking)
    track_len: Int[Array, "b"]  # new tokens before the checkpoint position


def conv_tokens(x: Float[Array, "t c"], weight: Float[Array, "k c"], window: Float[Array, "b km1 c"],
                meta: ConvMeta) -> Float[Array, "t c"]:
    """y[t] = x[t] + sum_i w[i] * input(t - (K-1) + i), inputs before the row's first new
    token taken from its window (zeros without state)."""
    k = weight.shape[0]
    t = x.shape[0]
    window = jnp.where(meta.has_state[:, None, None], window, jnp.zeros((), window.dtype)).astype(x.dtype)
    rows = jnp.arange(t)
    taps = []
    for i in range(k):
        rel = meta.token_offset - (k - 1) + i  # offset of the tap among the row's new tokens
        from_x = x[jnp.clip(rows - (k - 1) + i, 0, t - 1)]
        from_w = window[meta.token_row, jnp.clip(k - 1 + rel, 0, k - 2)]
        taps.append(jnp.where((rel >= 0)[:, None], from_x, from_w))
    return conv_from_taps(x, jnp.stack(taps, axis=1), weight)


def window_after(x: Float[Array, "t c"], window: Float[Array, "b km1 c"], meta: ConvMeta,
                 n: Int[Array, "b"]) -> Float[Array, "b km1 c"]:
    """The last K-1 inputs of [window ++ first n new tokens] for every row."""
    km1 = window.shape[1]
    t = x.shape[0]
    window = jnp.where(meta.has_state[:, None, None], window, jnp.zeros((), window.dtype))
    rows = []
    for j in range(km1):
        e = n - km1 + j  # offset among new tokens; negative: a row of the old window
        from_x = x[jnp.clip(meta.query_start + e, 0, t - 1)]
        from_w = window[jnp.arange(window.shape[0]), jnp.clip(km1 + e, 0, km1 - 1)]
        rows.append(jnp.where((e >= 0)[:, None], from_x.astype(window.dtype), from_w))
    return jnp.stack(rows, axis=1)


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

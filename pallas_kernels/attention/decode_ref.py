"""A serving step's attention against the arena in jnp: what the CPU serves for every step
(`pallas_kernels.REFERENCE_OPS.ring_attention / paged_attention`) and the oracle of `decode.py`'s
kernels (same signatures without `context` and the tuning arguments).

    ring_attention(q, r, rel_proj, tau, k_new, v_new, q_pos, q_valid, arena, ring_unit_row,
                   seq_start, has_state, *, ring, window, context=None) -> out [B, Q, H, hd] in q's dtype
    paged_attention(q, r, rel_proj, tau, k_new, v_new, q_pos, q_valid, arena, page_unit_row,
                    seq_start, *, page_size, window=None, context=None) -> out [B, Q, H, hd]
    tables(q, r, rel_proj, tau) -> (q * tau, rel [B, Q, H, E]) in q's dtype (`ref.tables`)

    q              [B, Q, H, hd]      queries (RMS-normed, not yet tau-scaled)
    r              [B, Q, H, dr]      the queries' relative-bias inputs
    rel_proj       [dr, E]            the layer's relative-bias projection (E = rel_extent)
    tau            [B, Q] fp32        log scaling of each query (`layers.log_scaling_tau`),
                                      1.0 on layers without log scaling
    k_new, v_new   [B, Q, nkv, hd]    the step's own keys / values (not yet in the arena)
    q_pos          [B, Q] int32       positions of the queries and of the new keys
                                      (the step builds seq_start[b] + i)
    q_valid        [B, Q] bool        new key i of row b present
    arena          [U, unit_elems]    the serving arena (`inkling_jax/cache/layout.py`)
    seq_start      [B] int32          positions < seq_start[b] are the row's cached context
    ring_unit_row  [B] int32          sliding layers: the arena row where the row's ring field
                                      starts; the ring is a row-major [ring, 2, nkv, hd] array
                                      over consecutive units (K at index 0, V at 1); ring row i
                                      holds position (s-1) - ((s-1-i) mod ring), valid iff
                                      has_state[b] and that position is >= 0
    has_state      [B] bool           sliding layers: the row has a ring to read
    page_unit_row  [B, P] int32       full layers: arena row of the row's p-th page (positions
                                      [p*ps, (p+1)*ps)), each a row-major [ps, 2, nkv, hd]
                                      array in one unit; context position j valid iff
                                      j < seq_start[b] (unused columns: any row, masked)
    context        None, or a function returning the row's context keys (k, v [B, C, nkv, hd],
                                      pos [B, C], valid [B, C]) as `ring_keys` / `page_keys` read
                                      them: the caller's reader (`StepContext._ring_keys`), used
                                      instead of reading the arena here

The bias and the log scaling are rounded as `layers.attention_tables` rounds them (`tables`):
rel = (r @ rel_proj) accumulated in fp32, rounded to q's dtype, times tau in fp32, rounded
again; q times tau in fp32, rounded (tau = 1.0 changes nothing). The scores are `ref.attention`'s
(`layers.attention_core`'s) over one key block: the context keys then the new ones, joined (as
the flash kernel's caller joins them). Two blocks (the scores joined instead of the keys, the
two value products added) computed the same up to the fp32 order of that sum, and made the
CPU step programs slower to compile: `make run`'s extend step 8.2-8.9 s against 5.2-6.6 s with
one block, its decode step 5.7-6.4 against 4.6-5.1 (BENCHMARKS.md, 2026-12-07, session 14).
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ..slot_ops.ref import read_field
from . import ref
from .ref import tables


def ring_keys(arena: Array, ring_unit_row: Int[Array, " B"], seq_start: Int[Array, " B"], has_state: Bool[Array, " B"],
              *, ring: int, nkv: int, hd: int) -> tuple[Array, Array, Array, Array]:
    """(k, v [B, R, nkv, hd], pos [B, R] int32, valid [B, R] bool): `context._ring_keys`."""
    kv = read_field(arena, ring_unit_row.astype(jnp.int32), (ring, 2, nkv, hd))  # [B, R, 2, nkv, hd]
    last = seq_start.astype(jnp.int32)[:, None] - 1
    idx = jnp.arange(ring, dtype=jnp.int32)[None, :]
    pos = last - jnp.mod(last - idx, ring)  # the position each ring row holds, in (s-1-R, s-1]
    valid = has_state.astype(bool)[:, None] & (pos >= 0)
    return kv[:, :, 0], kv[:, :, 1], pos, valid


def page_keys(arena: Array, page_unit_row: Int[Array, "B P"], seq_start: Int[Array, " B"], *, nkv: int,
              hd: int) -> tuple[Array, Array, Array, Array]:
    """(k, v [B, P*ps, nkv, hd], pos, valid [B, P*ps]): `context._page_keys` (ps = the tokens
    of one unit)."""
    b = page_unit_row.shape[0]
    kv = arena[page_unit_row.astype(jnp.int32)].reshape(b, -1, 2, nkv, hd)
    n = kv.shape[1]
    pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    valid = pos < seq_start.astype(jnp.int32)[:, None]
    return kv[:, :, 0], kv[:, :, 1], pos, valid


def attend(q: Float[Array, "B Q H D"], r: Float[Array, "B Q H R"], rel_proj: Float[Array, "R E"],
           tau: Float[Array, "B Q"], k_new: Array, v_new: Array, q_pos: Int[Array, "B Q"], q_valid: Bool[Array, "B Q"],
           keys: tuple[Array, Array, Array, Array], *, window: int | None) -> Float[Array, "B Q H D"]:
    """The queries against the context keys `keys` (k, v, pos, valid) and their own new keys,
    joined into one key block of `ref.attention` (module docstring); the tables from r,
    rel_proj and tau."""
    ctx_k, ctx_v, ctx_pos, ctx_valid = keys
    q_pos = q_pos.astype(jnp.int32)
    qs, rel = tables(q, r, rel_proj, tau)
    return ref.attention(qs, jnp.concatenate([ctx_k.astype(k_new.dtype), k_new], axis=1),
                         jnp.concatenate([ctx_v.astype(v_new.dtype), v_new], axis=1), rel, q_pos,
                         jnp.concatenate([ctx_pos.astype(jnp.int32), q_pos], axis=1),
                         jnp.concatenate([ctx_valid.astype(bool), q_valid.astype(bool)], axis=1), window=window)


def ring_attention(q: Float[Array, "B Q H D"], r: Float[Array, "B Q H R"], rel_proj: Float[Array, "R E"],
                   tau: Float[Array, "B Q"], k_new: Float[Array, "B Q Hkv D"],
                   v_new: Float[Array, "B Q Hkv D"], q_pos: Int[Array, "B Q"], q_valid: Bool[Array, "B Q"],
                   arena: Array, ring_unit_row: Int[Array, " B"], seq_start: Int[Array, " B"],
                   has_state: Bool[Array, " B"], *, ring: int, window: int | None,
                   context: Callable | None = None) -> Float[Array, "B Q H D"]:
    """Sliding layers: the row's ring (read from the arena, or by `context`) plus the new keys.
    See the module docstring."""
    nkv, hd = k_new.shape[2], k_new.shape[3]
    keys = context() if context is not None else ring_keys(arena, ring_unit_row, seq_start, has_state, ring=ring,
                                                           nkv=nkv, hd=hd)
    return attend(q, r, rel_proj, tau, k_new, v_new, q_pos, q_valid, keys, window=window)


def paged_attention(q: Float[Array, "B Q H D"], r: Float[Array, "B Q H R"], rel_proj: Float[Array, "R E"],
                    tau: Float[Array, "B Q"], k_new: Float[Array, "B Q Hkv D"],
                    v_new: Float[Array, "B Q Hkv D"], q_pos: Int[Array, "B Q"], q_valid: Bool[Array, "B Q"],
                    arena: Array, page_unit_row: Int[Array, "B P"], seq_start: Int[Array, " B"], *, page_size: int,
                    window: int | None = None, context: Callable | None = None) -> Float[Array, "B Q H D"]:
    """Full layers: the row's pages (read from the arena, or by `context`) plus the new keys.
    `page_size` must be the tokens of one unit (unit_elems == page_size * 2 * nkv * hd); see
    the module docstring."""
    nkv, hd = k_new.shape[2], k_new.shape[3]
    if arena.shape[1] != page_size * 2 * nkv * hd:
        raise ValueError(f"a unit of {arena.shape[1]} elements is not one page of {page_size} tokens "
                         f"x 2 x {nkv} x {hd}")
    keys = context() if context is not None else page_keys(arena, page_unit_row, seq_start, nkv=nkv, hd=hd)
    return attend(q, r, rel_proj, tau, k_new, v_new, q_pos, q_valid, keys, window=window)


__all__ = ["attend", "page_keys", "paged_attention", "ring_attention", "ring_keys", "tables"]

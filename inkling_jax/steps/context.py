"""The layer context of the serving steps: packed ragged tokens against the serving state.

`StepContext` implements `model.layers.LayerContext` (`conv`, `attend`, `conv_residual_norm`)
over one pass of rows (the target, or one MTP depth): each layer reads the *old* state (conv
windows, sliding K/V rings, full-attention pages) and writes the new one into the arena it
carries, through the kernel seam it is given (`ops`, a `pallas_kernels.KernelOps`: the jnp
references or the Pallas kernels; the layers read the same `ctx.ops`). Ids here are physical
(translated once by the step); arena rows come from `cache/layout.py`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, no_type_check

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int
from pallas_kernels import KernelOps
from pallas_kernels.conv_state import ref as conv_ref
from pallas_kernels.conv_state.ref import PackedRows

from ..cache.layout import ArenaLayout, LayerSlotFields
from ..cache.state import read_slot_field, write_slot_field
from ..config import AttentionGeometry, InklingConfig
from ..model import layers as L


# no_type_check (the tests' jaxtyping hook): a pytree node, rebuilt through __init__ by JAX with
# leaves of any kind (lowering's ArgInfo, specs, float0 cotangents; numpy on the host)
@no_type_check
@jax.tree_util.register_dataclass
@dataclass
class RowMeta:
    """The rows of one pass (the target, or one MTP depth) over packed tokens; physical ids.

    `rows` (token layout, commit and checkpoint lengths) is handed to the conv kernels as is."""

    rows: PackedRows
    seq_start: Int[Array, " b"]  # position of each row's new-token index 0
    num_new: Int[Array, " b"]  # valid tokens (queries, K/V writes)
    physical_slot: Int[Array, " b"]  # the row's slot (the sink for padded rows)
    physical_track_slot: Int[Array, "b m"]  # checkpoint slots (the sink for unused columns)


# Verify's deferred target pass on the Pallas ops: its convs by the conv kernels computing only
# (the fused conv + residual + norm where the other passes fuse them), the window writes queued as
# before, instead of the jnp conv, add and norm (XLA's fusions, their launch count unprofiled). Off
# until measured on a GPU beside the GPU check (`bash bench/gpu_session.sh OUT verify_convs`,
# issue 36: a batch-1 verify step took 615 launches on an H100 against 309 for a decode step)
FUSED_DEFERRED_CONVS = False


class StepContext(L.LayerContext):
    """LayerContext for packed ragged tokens against the serving state (see layers.py).

    Holds the arena being updated (functionally) while the layers are traced. With
    `deferred`, slot writes (conv windows, sliding rings) are queued and applied by
    `commit(meta)` once the commit and checkpoint lengths are known (speculative verify).

    `parallel` (a `ParallelAxes`, read by `layers.py` as `ctx.parallel`): the step runs as one
    shard of a mesh, inside `shard_map`; cfg and layout are then the plan's local ones and
    `arena` is this device's block `[num_units, unit_elems_local]` (see
    `inkling_jax/parallel/serving.py`). None: the single-device program.

    `one_token_per_row`: packed token i is row i's only new token (a decode step's target
    pass, `steps.batch.pack_batch`): the attention then takes its per-row [B, 1, ...] views
    by reshapes instead of gathers through `row_tokens` (one launch each on the GPU, five per
    layer). Padded rows read their own padding token instead of token 0: no valid query or
    key either way. Its sliding rings are checkpointed once per step, after the last layer
    (`write_ring_checkpoints`), not by a conditional in every sliding layer."""

    def __init__(self, cfg: InklingConfig, layout: ArenaLayout, ops: KernelOps, arena: Array, meta: RowMeta,
                 physical_pages: Array, deferred: bool = False, parallel: Any = None,
                 one_token_per_row: bool = False):
        self.cfg, self.layout, self.ops = cfg, layout, ops
        self.parallel = parallel
        self.one_token_per_row = one_token_per_row
        self.ring_checkpoint_fields: list = []  # one_token_per_row: rings to checkpoint at the end
        self.arena = arena
        self.meta = meta
        self.physical_pages = physical_pages  # [B, P]
        self.deferred = deferred
        self.pending: list[Callable[[Array, RowMeta], Array]] = []
        rows = meta.rows
        self.positions = meta.seq_start[rows.token_row] + rows.token_offset  # [T]
        self.fields: LayerSlotFields | None = None
        self.page_layer: int | None = None

    def bind(self, fields: LayerSlotFields, page_layer: int | None) -> "StepContext":
        self.fields, self.page_layer = fields, page_layer
        return self

    def commit(self, meta: RowMeta) -> None:
        """Apply the queued slot writes with the final commit / checkpoint lengths."""
        for write in self.pending:
            self.arena = write(self.arena, meta)
        self.pending.clear()

    # -- short convolutions

    def conv(self, stream: str, x: Array, weight: Array) -> Array:
        with jax.named_scope(f"conv_{stream}"):
            return self._conv(stream, x, weight)

    def _conv(self, stream: str, x: Array, weight: Array) -> Array:
        lay, f = self.layout, self.fields.conv
        kw = dict(window_shape=f.shape, channels=self.fields.channels(stream), sink_rows=lay.sink_rows)
        active_row, track_row = lay.slot_row(self.meta.physical_slot, f), lay.slot_row(self.meta.physical_track_slot, f)
        if not self.deferred:
            y, self.arena = self.ops.conv_update(self.arena, x, weight, self.meta.rows, active_row, track_row, **kw)
            return y
        if self.ops.pallas and FUSED_DEFERRED_CONVS:
            y, self.arena = self.ops.conv_update(self.arena, x, weight, *self._computing_only(active_row), **kw)
            self._queue_conv_write(stream, x)
            return y
        window = conv_ref.read_window(self.arena, active_row, f.shape, kw["channels"])
        self._queue_conv_write(stream, x, window)
        return conv_ref.conv_tokens(x, weight, window, self.meta.rows)

    def _computing_only(self, active_row: Array) -> tuple[PackedRows, Array, Array]:
        """(rows, active_row, track_row) for a conv kernel that computes and writes nothing:
        every commit length 0 (the active window kept) and every checkpoint aimed at the sink
        (never written by the kernels). The deferred pass's convs on the Pallas ops: the same
        kernels as the other passes (one launch per conv, with the residual add and norm where
        fused), the writes queued for `commit` (FUSED_DEFERRED_CONVS)."""
        rows = dataclasses.replace(self.meta.rows, commit_len=jnp.zeros_like(self.meta.rows.commit_len))
        sink = self.layout.slot_row(jnp.zeros_like(self.meta.physical_track_slot), self.fields.conv)
        return rows, active_row, sink

    def _queue_conv_write(self, stream: str, x: Array, window: Array | None = None) -> None:
        """Queue stream's window writes for `commit`, from the old window `window` (read before
        the pass), or read then where None: a kernel that computed the conv computing only left
        the field as it was, so no early read keeps the old arena alive."""
        lay, f = self.layout, self.fields.conv
        kw = dict(window_shape=f.shape, channels=self.fields.channels(stream), sink_rows=lay.sink_rows)

        def write(arena: Array, m: RowMeta) -> Array:
            active_row = lay.slot_row(m.physical_slot, f)
            old = conv_ref.read_window(arena, active_row, f.shape, kw["channels"]) if window is None else window
            return self.ops.conv_write(arena, x, old, m.rows, active_row, lay.slot_row(m.physical_track_slot, f), **kw)
        self.pending.append(write)

    def conv_residual_norm(self, stream: str, a: Array, weight: Array, residual: Array, norm_weight: Array,
                           eps: float) -> tuple[Array, Array]:
        """(x, h) with x = residual + conv(stream, a) and h = rms_norm(x, norm_weight) (read by
        `layers.decoder_layer`): `ops.conv_residual_norm` (on the Pallas ops one kernel on
        few-token steps). Deferred writes (verify's target pass): `conv` with its queued writes,
        the add and the norm; with FUSED_DEFERRED_CONVS on the Pallas ops the same op computing
        only, its writes queued."""
        if self.deferred and not (self.ops.pallas and FUSED_DEFERRED_CONVS):
            return super().conv_residual_norm(stream, a, weight, residual, norm_weight, eps)
        with jax.named_scope(f"conv_{stream}_norm"):
            lay, f = self.layout, self.fields.conv
            active_row = lay.slot_row(self.meta.physical_slot, f)
            rows, active_row, track_row = (self._computing_only(active_row) if self.deferred else
                                           (self.meta.rows, active_row, lay.slot_row(self.meta.physical_track_slot, f)))
            x, h, self.arena = self.ops.conv_residual_norm(
                self.arena, a, weight, rows, active_row, track_row, residual, norm_weight, eps=eps,
                window_shape=f.shape, channels=self.fields.channels(stream), sink_rows=lay.sink_rows)
            if self.deferred:
                self._queue_conv_write(stream, a)
            return x, h

    # -- attention

    @jax.named_scope("attend")
    def attend(self, q: Array, k: Array, v: Array, r: Array, rel_proj: Array, geom: AttentionGeometry) -> Array:
        meta = self.meta
        qn = meta.rows.row_tokens.shape[1]
        # packed [T, ...] -> per-row padded [B, Q, ...]
        q_valid = jnp.arange(qn)[None, :] < meta.num_new[:, None]
        q_pos = meta.seq_start[:, None] + jnp.arange(qn)[None, :]
        if self.one_token_per_row:
            qp, kp, vp, rp = q[:, None], k[:, None], v[:, None], r[:, None]
        else:
            q_idx = meta.rows.row_tokens
            qp, kp, vp, rp = q[q_idx], k[q_idx], v[q_idx], r[q_idx]

        lay = self.layout
        # the bias from r and rel_proj, the log scaling from tau (rounded as attention_tables
        # rounds them): the decode kernels compute just the visited keys' bias in the kernel
        if geom.log_scaling:
            tau = L.log_scaling_tau(q_pos, self.cfg)  # the same in every layer: XLA computes it once
        else:
            tau = jnp.ones(q_pos.shape, jnp.float32)
        # the ops read the context keys in place (the decode kernels) or call `context` for them
        # (the jnp ops, the flash kernel's gather); the sliding ring read here is also the old
        # ring the writes below start from
        read = {}
        if geom.is_sliding:
            def context():
                *keys, read["ring"] = self._ring_keys(geom)
                return tuple(keys)

            out = self.ops.ring_attention(qp, rp, rel_proj, tau, kp, vp, q_pos, q_valid, self.arena,
                                          lay.slot_row(meta.physical_slot, self.fields.ring), meta.seq_start,
                                          meta.rows.has_state, ring=lay.ring, window=geom.window, context=context)
        else:
            out = self.ops.paged_attention(qp, rp, rel_proj, tau, kp, vp, q_pos, q_valid, self.arena,
                                           lay.page_row(self.physical_pages, self.arena.shape[0], self.page_layer),
                                           meta.seq_start, page_size=lay.page_size, window=geom.window,
                                           context=lambda: self._page_keys(geom))
        old_ring = read.get("ring")  # the sliding ring before this step, where it was read

        if geom.is_sliding:
            f = self.fields.ring
            kv = jnp.stack([k, v], axis=1)
            # the writes take `out` (see set_rows): they wait for the reads of the old state
            checkpoints = not (self.one_token_per_row and not self.deferred)
            if not checkpoints:
                self.ring_checkpoint_fields.append(f)
            write = lambda arena, m: self._write_ring(arena, m, f, old_ring, kv, out, checkpoints)
            if self.deferred:
                self.pending.append(write)
            else:
                self.arena = write(self.arena, self.meta)
        else:
            self._write_pages(k, v, out)
        if self.one_token_per_row:
            return out[:, 0]
        return out[meta.rows.token_row, meta.rows.token_offset]

    @jax.named_scope("read_pages")
    def _page_keys(self, geom: AttentionGeometry):
        lay, b = self.layout, self.meta.seq_start.shape[0]
        rows = lay.page_row(self.physical_pages, self.arena.shape[0], self.page_layer)  # [B, P]
        kv = self.arena[rows].reshape(b, -1, 2, geom.num_kv_heads, geom.head_dim)  # [B, P*ps, 2, nkv, hd]
        pos = jnp.broadcast_to(jnp.arange(kv.shape[1], dtype=jnp.int32), (b, kv.shape[1]))
        valid = pos < self.meta.seq_start[:, None]
        return kv[:, :, 0], kv[:, :, 1], pos, valid

    @jax.named_scope("write_pages")
    def _write_pages(self, k: Array, v: Array, after: Array) -> None:
        """Store every valid new token's K/V at its position (drafts included: positions past
        the committed length are rewritten before any query can see them)."""
        lay, meta = self.layout, self.meta
        ps = lay.page_size
        pos = self.positions
        token_row, token_offset = meta.rows.token_row, meta.rows.token_offset
        valid = (meta.num_new[token_row] > token_offset) & (pos >= 0)
        page_col = jnp.clip(pos // ps, 0, self.physical_pages.shape[1] - 1)
        page = jnp.where(valid, self.physical_pages[token_row, page_col], 0)
        rows = lay.page_row(page, self.arena.shape[0], self.page_layer)
        offset = jnp.where(valid, pos % ps, 0)
        t = k.shape[0]
        kv = jnp.stack([k, v], axis=1).reshape(t, -1).astype(self.arena.dtype)
        arena3 = self.arena.reshape(self.arena.shape[0], ps, -1)
        self.arena = set_rows(arena3, rows, offset, kv, valid, after).reshape(self.arena.shape)

    @jax.named_scope("read_ring")
    def _ring_keys(self, geom: AttentionGeometry):
        lay, meta = self.layout, self.meta
        f = self.fields.ring
        ring = read_slot_field(self.arena, lay, meta.physical_slot, f)  # [B, R, 2, nkv, hd]
        r = lay.ring
        last = meta.seq_start[:, None] - 1
        idx = jnp.arange(r, dtype=jnp.int32)[None, :]
        pos = last - jnp.mod(last - idx, r)  # the position each ring row holds, in (s-1-R, s-1]
        valid = meta.rows.has_state[:, None] & (pos >= 0)
        return ring[:, :, 0], ring[:, :, 1], pos, valid, ring

    @jax.named_scope("write_ring_checkpoints")
    def write_ring_checkpoints(self) -> None:
        """One token per row: checkpoint ring m of a tracking row (track_len[:, m] = 1, the
        step's one token) is its active ring after this step's write, so every sliding
        layer's checkpoints are copies of active ring fields, made here once after the last
        layer: one conditional per step (most steps checkpoint no row) instead of one per
        sliding layer. Rows not tracking write the sink, as the per-layer writes do (the same
        XLA reads and writes as there: what a command buffer captures with its conditional)."""
        fields, self.ring_checkpoint_fields = self.ring_checkpoint_fields, []
        if not fields:
            return
        lay, meta = self.layout, self.meta

        def copy(arena):
            for f in fields:
                active = read_slot_field(arena, lay, meta.physical_slot, f)
                for m in range(meta.physical_track_slot.shape[1]):
                    arena = write_slot_field(arena, lay, meta.physical_track_slot[:, m], f, active)
            return arena

        self.arena = jax.lax.cond(jnp.any(meta.physical_track_slot > 0), copy, lambda a: a, self.arena)

    @jax.named_scope("write_ring")
    def _write_ring(self, arena: Array, meta: RowMeta, f, old_ring: Array | None, kv: Array, after: Array,
                    checkpoints: bool = True) -> Array:
        """Active ring: the first commit_len new tokens written into their rows (the last R
        of them); checkpoint ring m: the old ring with the first track_len[:, m] tokens written
        (`checkpoints=False`: left to `write_ring_checkpoints`).

        old_ring: the rings as the attention read them, or None (the attention read them in
        place): they are then read here, where needed, from `arena` before the active write.
        `after` (the attention output) orders every write after the attention's reads: see
        `set_rows`."""
        lay, rows = self.layout, meta.rows
        r = lay.ring
        b = meta.seq_start.shape[0]
        row, off = rows.token_row, rows.token_offset
        slot_idx = jnp.mod(self.positions, r)
        has_state = rows.has_state[:, None, None, None, None]
        read_old = lambda a: read_slot_field(a, lay, meta.physical_slot, f) if old_ring is None else old_ring

        def checkpoint(arena):
            old = jnp.where(has_state, read_old(arena), 0)
            for m in range(rows.track_len.shape[1]):  # each checkpoint: the old ring with its tokens written
                tl = rows.track_len[row, m]
                tkeep = (off < tl) & (off >= tl - r)
                ck = old.at[jnp.where(tkeep, row, b), slot_idx].set(kv.astype(old.dtype), mode="drop")
                arena = write_slot_field(arena, lay, meta.physical_track_slot[:, m], f, ck)
            return arena

        # most steps checkpoint no row: skip the whole-ring copy then. The checkpoints go first
        # (they read the old active ring); the predicate takes `after` so that the conditional,
        # which writes the arena in place, waits for the attention's reads (`never` is False)
        if checkpoints:
            x = after.reshape(-1)[0]
            never = jnp.isnan(x) & jnp.isinf(x)
            arena = jax.lax.cond(jnp.any(meta.physical_track_slot > 0) | never, checkpoint, lambda a: a, arena)

        n = rows.commit_len[row]
        keep = (off < n) & (off >= n - r)
        row_elems = math.prod(f.shape[1:])  # one ring row: [2, kv_heads, head_dim]
        if lay.unit_elems % row_elems == 0:
            # each ring row sits inside one unit: scatter just the new rows, in place
            per_unit = lay.unit_elems // row_elems
            # masked tokens write the sink slot (a dropped out-of-bounds write would make XLA
            # copy the whole arena around a one-token update)
            slot = jnp.where(keep, meta.physical_slot[row], 0)
            unit = lay.slot_row(slot, f) + slot_idx // per_unit
            view = arena.reshape(arena.shape[0], per_unit, row_elems)
            return set_rows(view, unit, slot_idx % per_unit, kv.reshape(kv.shape[0], -1).astype(arena.dtype),
                            keep, after).reshape(arena.shape)
        old = jnp.where(has_state, read_old(arena), 0)
        new = old.at[jnp.where(keep, row, b), slot_idx].set(kv.astype(old.dtype), mode="drop")
        return write_slot_field(arena, lay, meta.physical_slot, f, new)


def set_rows(view: Array, unit: Int[Array, " t"], sub: Int[Array, " t"], values: Array, keep: Bool[Array, " t"],
             after: Array) -> Array:
    """view[unit[i], sub[i]] = values[i] for a [units, rows, elems] view of the arena, every
    index in bounds (masked tokens, keep[i] False, aim at a sink). One token (batch-1 decode)
    is a dynamic-update-slice: XLA turns a one-index scatter into one that re-reads the target
    to emulate out-of-bounds skipping, and that read made it copy the whole arena.

    `after`: the result of the layer's reads of the old arena (its attention output). Masked
    tokens write an element of it into the sink instead of their K/V, which makes the write
    depend on it: without that nothing orders the in-place write (it depends on k, v only)
    after the reads, and XLA's copy insertion copies the whole donated arena ahead of it, once
    per layer. An optimization_barrier would not do on the CPU (XLA:CPU drops barriers before
    copy insertion). The sink is only ever read as masked keys; the element is replaced by 0
    where it is not finite (it is row 0's output: a row gone NaN must not write NaN where
    every padded row reads)."""
    first = after.reshape(-1)[0]
    fill = jnp.where(jnp.isfinite(first), first, jnp.zeros((), first.dtype)).astype(values.dtype)
    values = jnp.where(keep[:, None], values, fill)
    if unit.shape[0] == 1:
        zero = jnp.zeros((), unit.dtype)
        return jax.lax.dynamic_update_slice(view, values[:, None].astype(view.dtype), (unit[0], sub[0], zero))
    return view.at[unit, sub].set(values.astype(view.dtype), mode="promise_in_bounds")

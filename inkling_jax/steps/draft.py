"""The draft phase of a speculative step: the MTP depths after the target (see `program.py`'s
module docstring for which rows each depth commits)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array
from pallas_kernels.conv_state.ref import PackedRows

from ..cache.layout import ArenaLayout
from ..cache.state import read_slot_field, write_slot_field
from ..config import InklingConfig
from ..model import layers as L
from ..model.forward import mtp_depth_block, mtp_depth_input
from .batch import StepBatch
from .context import RowMeta, StepContext

Params = dict[str, Any]


@jax.named_scope("draft")
def draft_phase(params: Params, cfg: InklingConfig, layout: ArenaLayout, ops: Any, arena: Array, batch: StepBatch,
                target_meta: RowMeta, physical_pages: Array, h_target: Array, commit: Array, track: Array,
                bonus: Array, parallel: Any = None) -> tuple[Array, Array, Array]:
    """Run the MTP depths after the target committed `commit` tokens per row (module docstring).
    Returns (arena, drafts [B, S], depth 0's logits finite [B]: they read the committed tokens
    and the next one only, so a non-finite value there is the request's, not a proposal's).

    parallel: as for `run_step` (the depths' embed, input_proj and LM head use the mesh
    collectives; their drafts are argmaxes of the gathered logits, the same on every device).

    Each depth works on rows laid out with a uniform stride W = Q + S per request: index i of
    depth d is row start_d + i, start_d = max(0, s - d)."""
    spec = layout.spec_steps
    b, q = target_meta.rows.row_tokens.shape
    physical_slot = target_meta.physical_slot
    width = q + spec
    s = batch.layout.seq_start
    e = s + commit  # the target's committed length after this step
    idx = jnp.arange(width)[None, :]
    t_pack = batch.layout.tokens.shape[0]

    # lookahead stream la[i] = t_{s+1+i}: the row's own next tokens, then t_e, then t_{e+1}..
    own = batch.layout.tokens[jnp.clip(batch.layout.query_start[:, None] + 1 + idx, 0, t_pack - 1)]
    t_next = jnp.where(batch.spec.sample_next, bonus, batch.spec.lookahead[:, 0])
    la = jnp.where(idx < commit[:, None] - 1, own, t_next[:, None])
    known_after = jnp.concatenate([batch.spec.lookahead[:, 1:], jnp.zeros((b, width), jnp.int32)], axis=1)
    la = jnp.where(idx > commit[:, None] - 1, jnp.take_along_axis(known_after, jnp.maximum(idx - commit[:, None], 0),
                                                                  axis=1), la)
    tracking = (track > 0) & (batch.layout.num_new > 0)[:, None]  # [B, M]
    physical_track_slot = target_meta.physical_track_slot  # the sink where the target does not checkpoint

    packed_rows = (jnp.arange(b)[:, None] * width + idx).reshape(-1)
    token_row = jnp.repeat(jnp.arange(b, dtype=jnp.int32), width)
    token_offset = jnp.tile(jnp.arange(width, dtype=jnp.int32), b)
    row_tokens = packed_rows.reshape(b, width)

    h_prev = jnp.take(h_target, jnp.clip(batch.layout.query_start[:, None] + idx, 0, t_pack - 1), axis=0)  # [B, W, H]
    # every depth's carried hidden as it was before this step (depth d - 1 rewrites its own)
    carries = [read_slot_field(arena, layout, physical_slot, f.hidden) for f in layout.draft[:-1]]
    drafts = []
    for d in range(spec):
        start = jnp.maximum(s - d, 0)
        shift = start - (s - d)  # 0 when s >= d
        n_rows = jnp.where(batch.layout.num_new > 0, e - start, 0)
        n_commit = jnp.where(batch.layout.num_new > 0, jnp.maximum(e - d - start, 0), 0)
        n_track = jnp.where(tracking, jnp.maximum(track - shift[:, None], 0), 0)  # [B, M]
        fields = layout.draft[d]
        if d > 0:
            # depth d's row start_d + i reads depth d-1's row start_d + i: index i - 1 when
            # s >= d (the row before this step's first one is carried in the slot)
            carried = carries[d - 1]  # [B, H]
            back = jnp.where(s >= d, 1, 0)[:, None]
            src = idx - back
            h_in = jnp.take_along_axis(h_prev, jnp.maximum(src, 0)[:, :, None], axis=1)
            h_in = jnp.where((src < 0)[:, :, None], carried[:, None, :].astype(h_in.dtype), h_in)
        else:
            h_in = h_prev
        tok = jnp.take_along_axis(la, jnp.clip(idx + shift[:, None], 0, width - 1), axis=1)
        rows = PackedRows(token_row=token_row, token_offset=token_offset, row_tokens=row_tokens,
                          has_state=start > 0, commit_len=n_commit, track_len=n_track)
        track_slot = jnp.where(n_track > 0, physical_track_slot, 0)
        meta = RowMeta(rows=rows, seq_start=start, num_new=n_rows, physical_slot=physical_slot,
                       physical_track_slot=track_slot)
        ctx = StepContext(cfg, layout, ops, arena, meta, physical_pages, parallel=parallel)
        ctx.bind(fields, layout.draft_page_layer[d])
        z = mtp_depth_input(params, cfg, d, h_in.reshape(b * width, -1), tok.reshape(-1), parallel)
        h_out = mtp_depth_block(params, cfg, d, z, ctx).reshape(b, width, -1)
        arena = ctx.arena
        if fields.hidden is not None and d < spec - 1:
            # carry this depth's last committed row (and the checkpoint's) for depth d + 1
            def at(n):
                return h_out[jnp.arange(b), jnp.maximum(n - 1, 0)]
            old = read_slot_field(arena, layout, physical_slot, fields.hidden)
            keep = jnp.where((n_commit > 0)[:, None], at(n_commit), old)
            arena = write_slot_field(arena, layout, physical_slot, fields.hidden, keep)
            for m in range(n_track.shape[1]):
                arena = write_slot_field(arena, layout, track_slot[:, m], fields.hidden, at(n_track[:, m]))
        # the draft: depth d's greedy prediction at row e - 1 (index n_rows - 1) is t_{e+d+1}
        last = h_out[jnp.arange(b), jnp.maximum(n_rows - 1, 0)]
        draft_logits = L.lm_head(params, cfg, last, parallel)
        if d == 0:
            ok = jnp.all(jnp.isfinite(draft_logits), axis=-1)
        draft = jnp.argmax(draft_logits, axis=-1).astype(jnp.int32)
        drafts.append(draft)
        la = jnp.where(batch.spec.sample_next[:, None] & (idx == commit[:, None] + d), draft[:, None], la)
        h_prev = h_out
    return arena, jnp.stack(drafts, axis=1), ok

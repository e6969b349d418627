"""Jitted serving steps: (params, state, batch) -> (outputs, new_state).

One step function serves every mode; its static `StepShape` (mode and bucket sizes) picks
the compiled program. A batch holds packed ragged tokens plus per-row arrays padded to the
bucket; every field is present in every mode (a row that does not checkpoint points at the
sink with a false mask, never a missing field), so the jit cache compiles each bucket once.

Inside the step, and only there, virtual slot and page ids become physical through the
state's tables. The state is donated: the arena is updated in place.

Data flow of one step:
  1. copy-on-write restores (prefix hits): slot `cow_src` -> the row's slot, whole entries;
  2. the target layers on packed tokens [T, H]; each layer's context reads the *old* state
     (conv windows, sliding rings, pages) and writes the new one; in `verify` mode the slot
     writes wait until the accepted count is known (pages may take draft K/V: positions past
     the committed length are rewritten before any query reads them);
  3. the LM head and sampling (extend / decode: each row's last token; verify: every draft
     position, then acceptance with the rejection-sampling rule);
  4. with speculative decoding, the draft phase: the MTP depths, one after another (below).

MTP state is a pure function of the committed tokens. With n committed target positions
(t_n the next token, sampled or known), depth d has committed rows [0, n - d): row j reads
the previous depth's hidden at row j and token t_{j+d+1}, which is known only for
j + d + 1 <= n. A step that commits positions [s, e) of the target runs depth d over rows
[max(0, s - d), e): the first rows commit (the same count as the target, shifted by d), the
last d read draft tokens of this round and only propose (their K/V is rewritten next round,
their conv windows never enter the state). Depth d - 1's output at row s - d, computed in
an earlier step, is carried in the slot (`hidden` field). Depth d's greedy prediction at
row e - 1 is the draft for t_{e+d+1}.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from .cache.conv_state import ConvMeta, conv_tokens
from .cache.layout import ArenaLayout, LayerSlotFields
from .cache.state import (ServingState, page_rows, read_field, slot_rows, translate_pages, translate_slots,
                          write_field)
from .config import AttentionGeometry, InklingConfig
from .model import layers as L
from .model.forward import mtp_depth_input, mtp_depth_output

Params = dict[str, Any]

MODES = ("extend", "decode", "verify")
MAX_STOP_IDS = 4


@dataclass(frozen=True)
class StepShape:
    """Static shape of a compiled step: mode and bucket sizes."""

    mode: str
    batch: int  # B: request rows
    tokens: int  # T: packed tokens
    query: int  # Q: max new tokens of one row (verify: spec_steps + 1)
    pages: int  # P: page-table columns (context up to P * page_size tokens)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown step mode {self.mode!r}")
        if self.mode == "decode" and not (self.query == 1 and self.tokens == self.batch):
            raise ValueError("decode steps have one token per row")
        if self.mode == "verify" and self.tokens != self.batch * self.query:
            raise ValueError("verify steps have spec_steps + 1 tokens per row")


@jax.tree_util.register_dataclass
@dataclass
class StepBatch:
    """One step's inputs (numpy on the host, device arrays inside the step). Ids are virtual."""

    tokens: Int[Array, "t"]
    token_row: Int[Array, "t"]  # request row of each packed token (padding: a padded row)
    token_offset: Int[Array, "t"]  # index among the row's new tokens (padding: >= the row's num_new)
    slot: Int[Array, "b"]  # virtual slot (0: padded row -> sink)
    has_state: Bool[Array, "b"]  # the slot holds state for positions < seq_start
    seq_start: Int[Array, "b"]  # position of the row's first new token
    num_new: Int[Array, "b"]  # new tokens this step (0: padded row); verify: 1 + spec_steps
    query_start: Int[Array, "b"]  # packed index of the row's first new token
    pages: Int[Array, "b p"]  # virtual page ids covering positions [0, P * page_size)
    track_slot: Int[Array, "b"]  # virtual checkpoint slot (0 when none)
    track_len: Int[Array, "b"]  # new tokens before the checkpoint position (0: none); verify: the
    #                             candidate, written only if at least that many tokens commit
    cow_src: Int[Array, "b"]  # virtual slot to restore into `slot` first (0: none)
    temperature: Float[Array, "b"]
    top_k: Int[Array, "b"]  # 0: off
    top_p: Float[Array, "b"]  # 1: off
    seed: Int[Array, "b"]  # per-request sampling seed (keys fold in the position)
    lookahead: Int[Array, "b la"]  # known tokens after the row's new ones (t_e, t_e+1, ...), spec only
    sample_next: Bool[Array, "b"]  # t_e is this step's sample (else lookahead[0]); spec only
    max_accept: Int[Array, "b"]  # verify: accept at most this many drafts
    stop_ids: Int[Array, "b ns"]  # verify: tokens that end the row's generation (-1: none)

    @staticmethod
    def empty(shape: StepShape, spec_steps: int = 0) -> "StepBatch":
        """An all-padding batch of `shape` (numpy), to fill in with dataclasses.replace."""
        b, t, p = shape.batch, shape.tokens, shape.pages
        i32 = lambda *n: np.zeros(n, np.int32)
        return StepBatch(tokens=i32(t), token_row=np.full(t, b - 1, np.int32),
                         token_offset=np.full(t, shape.query + 8, np.int32), slot=i32(b),
                         has_state=np.zeros(b, bool), seq_start=i32(b), num_new=i32(b), query_start=i32(b),
                         pages=i32(b, p), track_slot=i32(b), track_len=i32(b), cow_src=i32(b),
                         temperature=np.zeros(b, np.float32), top_k=i32(b), top_p=np.ones(b, np.float32),
                         seed=i32(b), lookahead=i32(b, spec_steps + 1), sample_next=np.zeros(b, bool),
                         max_accept=i32(b), stop_ids=np.full((b, MAX_STOP_IDS), -1, np.int32))


def check_batch(batch: StepBatch, shape: StepShape, spec_steps: int = 0) -> None:
    """Raise ValueError naming the first field whose shape does not fit the compiled bucket
    (before anything is donated, so the state is untouched)."""
    want = {"tokens": (shape.tokens,), "token_row": (shape.tokens,), "token_offset": (shape.tokens,),
            "pages": (shape.batch, shape.pages), "lookahead": (shape.batch, spec_steps + 1),
            "stop_ids": (shape.batch, MAX_STOP_IDS)}
    for name in StepBatch.__dataclass_fields__:
        got = tuple(getattr(batch, name).shape)
        expected = want.get(name, (shape.batch,))
        if got != expected:
            raise ValueError(f"StepBatch.{name} has shape {got}; the compiled {shape.mode} bucket takes {expected} "
                             f"(batch {shape.batch}, tokens {shape.tokens}, pages {shape.pages})")


@jax.tree_util.register_dataclass
@dataclass
class StepOutput:
    tokens: Int[Array, "b"]  # sampled next token of each row (verify: the bonus after the accepted drafts)
    logprobs: Float[Array, "b"]  # log p(token) under the model (temperature 1, no truncation)
    num_accepted: Int[Array, "b"]  # verify: drafts accepted (they precede `tokens`); else 0
    accepted_logprobs: Float[Array, "b s"]  # verify: log p of each draft (valid for the accepted ones)
    drafts: Int[Array, "b s"]  # spec: the next round's draft tokens (valid when sample_next)


# ----------------------------------------------------------------------- context


@jax.tree_util.register_dataclass
@dataclass
class RowMeta:
    """The rows of one pass (the target, or one MTP depth) over packed tokens; physical ids."""

    token_row: Int[Array, "t"]
    token_offset: Int[Array, "t"]
    row_tokens: Int[Array, "b q"]  # packed index of each row's i-th token (clipped)
    seq_start: Int[Array, "b"]  # position of index 0
    num_new: Int[Array, "b"]  # valid tokens (queries, K/V writes)
    has_state: Bool[Array, "b"]
    commit_len: Int[Array, "b"]  # tokens entering the slot's state
    track_len: Int[Array, "b"]  # tokens before the checkpoint position
    active: Int[Array, "b"]  # physical slot
    track_dest: Int[Array, "b"]  # physical checkpoint slot (the sink when none)

    def conv_meta(self) -> ConvMeta:
        return ConvMeta(token_row=self.token_row, token_offset=self.token_offset, row_tokens=self.row_tokens,
                        has_state=self.has_state, commit_len=self.commit_len, active=self.active,
                        track_dest=self.track_dest, track_len=self.track_len)


class StepContext:
    """LayerContext for packed ragged tokens against the serving state (see layers.py).

    Holds the arena being updated (functionally) while the layers are traced. With
    `deferred`, slot writes (conv windows, sliding rings) are queued and applied by
    `commit(meta)` once the commit and checkpoint lengths are known (speculative verify)."""

    def __init__(self, cfg: InklingConfig, layout: ArenaLayout, ops: Any, arena: Array, meta: RowMeta,
                 phys_pages: Array, deferred: bool = False):
        self.cfg, self.layout, self.ops = cfg, layout, ops
        self.arena = arena
        self.meta = meta
        self.phys_pages = phys_pages
        self.deferred = deferred
        self.pending: list[Callable[[Array, RowMeta], Array]] = []
        self.positions = meta.seq_start[meta.token_row] + meta.token_offset  # [T]
        self.fields: LayerSlotFields | None = None
        self.page_layer: int | None = None
        self.few_token_experts = ops.moe_experts  # read by layers.decoder_layer

    def bind(self, fields: LayerSlotFields, page_layer: int | None) -> "StepContext":
        self.fields, self.page_layer = fields, page_layer
        return self

    def commit(self, meta: RowMeta) -> None:
        """Apply the queued slot writes with the final commit / checkpoint lengths."""
        for write in self.pending:
            self.arena = write(self.arena, meta)
        self.pending.clear()

    # -- short convolutions

    def _channels(self, stream: str, width: int) -> tuple[int, int]:
        c = self.fields.conv.shape[1]
        h = self.cfg.hidden_size
        kv = (c - 2 * h) // 2
        start = {"k": 0, "kv": 0, "v": kv, "attn": 2 * kv, "mlp": 2 * kv + h}[stream]
        return start, start + width

    def conv(self, stream: str, x: Array, weight: Array) -> Array:
        f, ch = self.fields.conv, self._channels(stream, x.shape[-1])
        if not self.deferred:
            y, self.arena = self.ops.conv_update(self.arena, self.layout, f, ch, x, weight, self.meta.conv_meta())
            return y
        window = read_field(self.arena, self.layout, slot_rows(self.layout, self.meta.active, f), f)[..., ch[0]:ch[1]]
        y = conv_tokens(x, weight, window, self.meta.conv_meta())
        self.pending.append(lambda arena, m: self.ops.conv_write(arena, self.layout, f, ch, x, window, m.conv_meta()))
        return y

    # -- attention

    def attend(self, q: Array, k: Array, v: Array, r: Array, rel_proj: Array, geom: AttentionGeometry) -> Array:
        meta = self.meta
        qn = meta.row_tokens.shape[1]
        # packed [T, ...] -> per-row padded [B, Q, ...]
        q_idx = meta.row_tokens
        q_valid = jnp.arange(qn)[None, :] < meta.num_new[:, None]
        q_pos = meta.seq_start[:, None] + jnp.arange(qn)[None, :]
        qp, kp, vp, rp = q[q_idx], k[q_idx], v[q_idx], r[q_idx]

        if geom.is_sliding:
            ctx_k, ctx_v, ctx_pos, ctx_valid, old_ring = self._ring_keys(geom)
        else:
            ctx_k, ctx_v, ctx_pos, ctx_valid = self._page_keys(geom)
        out = L.attention_core(qp, (ctx_k, kp), (ctx_v, vp), rp, rel_proj, q_pos, (ctx_pos, q_pos),
                               (ctx_valid, q_valid), geom, self.cfg)

        if geom.is_sliding:
            f = self.fields.ring
            kv = jnp.stack([k, v], axis=1)
            write = lambda arena, m: self._write_ring(arena, m, f, old_ring, kv)
            if self.deferred:
                self.pending.append(write)
            else:
                self.arena = write(self.arena, self.meta)
        else:
            self._write_pages(k, v)
        return out[meta.token_row, meta.token_offset]

    def _page_keys(self, geom: AttentionGeometry):
        lay, b = self.layout, self.meta.seq_start.shape[0]
        rows = page_rows(lay, self.arena.shape[0], self.phys_pages, self.page_layer)  # [B, P]
        kv = self.arena[rows].reshape(b, -1, 2, geom.num_kv_heads, geom.head_dim)  # [B, P*ps, 2, nkv, hd]
        pos = jnp.broadcast_to(jnp.arange(kv.shape[1], dtype=jnp.int32), (b, kv.shape[1]))
        valid = pos < self.meta.seq_start[:, None]
        return kv[:, :, 0], kv[:, :, 1], pos, valid

    def _write_pages(self, k: Array, v: Array) -> None:
        """Store every valid new token's K/V at its position (drafts included: positions past
        the committed length are rewritten before any query can see them)."""
        lay, meta = self.layout, self.meta
        ps = lay.page_size
        pos = self.positions
        valid = (meta.num_new[meta.token_row] > meta.token_offset) & (pos >= 0)
        page_col = jnp.clip(pos // ps, 0, self.phys_pages.shape[1] - 1)
        phys = jnp.where(valid, self.phys_pages[meta.token_row, page_col], 0)
        rows = page_rows(lay, self.arena.shape[0], phys, self.page_layer)
        offset = jnp.where(valid, pos % ps, 0)
        t = k.shape[0]
        kv = jnp.stack([k, v], axis=1).reshape(t, -1).astype(self.arena.dtype)
        arena3 = self.arena.reshape(self.arena.shape[0], ps, -1)
        self.arena = set_rows(arena3, rows, offset, kv).reshape(self.arena.shape)

    def _ring_keys(self, geom: AttentionGeometry):
        lay, meta = self.layout, self.meta
        f = self.fields.ring
        ring = read_field(self.arena, lay, slot_rows(lay, meta.active, f), f)  # [B, R, 2, nkv, hd]
        r = lay.ring
        last = meta.seq_start[:, None] - 1
        idx = jnp.arange(r, dtype=jnp.int32)[None, :]
        pos = last - jnp.mod(last - idx, r)  # the position each ring row holds, in (s-1-R, s-1]
        valid = meta.has_state[:, None] & (pos >= 0)
        return ring[:, :, 0], ring[:, :, 1], pos, valid, ring

    def _write_ring(self, arena: Array, meta: RowMeta, f, old_ring: Array, kv: Array) -> Array:
        """Active ring: the first commit_len new tokens written into their rows (the last R
        of them); checkpoint ring: the old ring with the first track_len tokens written."""
        lay = self.layout
        r = lay.ring
        b = meta.seq_start.shape[0]
        row, off = meta.token_row, meta.token_offset
        slot_idx = jnp.mod(self.positions, r)
        n = meta.commit_len[row]
        keep = (off < n) & (off >= n - r)
        row_elems = math.prod(f.shape[1:])  # one ring row: [2, kv_heads, head_dim]
        if lay.unit_elems % row_elems == 0:
            # each ring row sits inside one unit: scatter just the new rows, in place
            per_unit = lay.unit_elems // row_elems
            # masked tokens write the sink slot (a dropped out-of-bounds write would make XLA
            # copy the whole arena around a one-token update)
            slot = jnp.where(keep, meta.active[row], 0)
            unit = slot * lay.slot_units + f.unit_offset + slot_idx // per_unit
            view = arena.reshape(arena.shape[0], per_unit, row_elems)
            arena = set_rows(view, unit, slot_idx % per_unit,
                             kv.reshape(kv.shape[0], -1).astype(arena.dtype)).reshape(arena.shape)
        else:
            old = jnp.where(meta.has_state[:, None, None, None, None], old_ring, 0)
            new = old.at[jnp.where(keep, row, b), slot_idx].set(kv.astype(old.dtype), mode="drop")
            arena = write_field(arena, lay, slot_rows(lay, meta.active, f), f, new)

        def checkpoint(arena):
            old = jnp.where(meta.has_state[:, None, None, None, None], old_ring, 0)
            tl = meta.track_len[row]
            tkeep = (off < tl) & (off >= tl - r)
            ck = old.at[jnp.where(tkeep, row, b), slot_idx].set(kv.astype(old.dtype), mode="drop")
            return write_field(arena, lay, slot_rows(lay, meta.track_dest, f), f, ck)

        # most steps checkpoint no row: skip the whole-ring copy then
        return jax.lax.cond(jnp.any(meta.track_dest > 0), checkpoint, lambda a: a, arena)


def set_rows(view: Array, unit: Int[Array, "t"], sub: Int[Array, "t"], values: Array) -> Array:
    """view[unit[i], sub[i]] = values[i] for a [units, rows, elems] view of the arena, every
    index in bounds (masked tokens aim at a sink). One token (batch-1 decode) is a
    dynamic-update-slice: XLA turns a one-index scatter into one that re-reads the target
    to emulate out-of-bounds skipping, and that read made it copy the whole arena."""
    if unit.shape[0] == 1:
        zero = jnp.zeros((), unit.dtype)
        return jax.lax.dynamic_update_slice(view, values[:, None].astype(view.dtype), (unit[0], sub[0], zero))
    return view.at[unit, sub].set(values.astype(view.dtype), mode="promise_in_bounds")


# ------------------------------------------------------------------------ sampling


def sample_tokens(logits: Float[Array, "b v"], temperature: Array, top_k: Array, top_p: Array,
                  seed: Array, position: Array) -> tuple[Array, Array]:
    """Greedy where temperature == 0, else temperature / top-k / top-p sampling with the key
    fold_in(key(seed), position): reproducible for a request whatever it is batched with."""
    logits = logits.astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sample(_):
        filt = _filtered(logits, temperature, top_k, top_p)

        def draw(s, p, row):
            key = jax.random.fold_in(jax.random.key(s.astype(jnp.uint32)), p)
            return jax.random.categorical(key, row)

        sampled = jax.vmap(draw)(seed, position, filt).astype(jnp.int32)
        return jnp.where(temperature > 0, sampled, greedy)

    # an all-greedy batch (the common case) skips the sort and the draws
    tokens = jax.lax.cond(jnp.any(temperature > 0), sample, lambda _: greedy, None)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


# ---------------------------------------------------------------------------- step


def accept_drafts(logits: Float[Array, "b s1 v"], drafts: Int[Array, "b s"], batch: StepBatch,
                  position: Int[Array, "b"]) -> tuple[Array, Array, Array, Array]:
    """Speculative acceptance for one verify step.

    logits[:, i] is the target at the row holding t_{p+i} (it predicts t_{p+i+1}); drafts[:, i]
    proposes t_{p+i+1}. Greedy rows accept the longest prefix equal to the target's argmax
    and take the argmax after it (so the output is exactly greedy decoding). Sampled rows use
    the rejection rule with a greedy (point-mass) proposal: accept draft i with probability
    p_i(d_i); at the first rejection sample from p_i with d_i removed, renormalised; after S
    acceptances sample from p_S. The emitted tokens are distributed exactly as the target's
    samples. Acceptance stops at `max_accept` and after an accepted stop token (which then
    becomes the last token). Returns (num_accepted, bonus, bonus logprob, draft logprobs)."""
    b, s1, v = logits.shape
    s = s1 - 1
    logits = logits.astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    draft_logp = jnp.take_along_axis(logp[:, :s], drafts[:, :, None], axis=-1)[..., 0]  # [B, S]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, S+1]

    temp = batch.temperature
    filt = jax.vmap(lambda l, t, k, p: _filtered(l, t, k, p), in_axes=(1, None, None, None), out_axes=1)(
        logits, temp, batch.top_k, batch.top_p)  # [B, S+1, V] filtered, temperature-scaled logits
    probs = jax.nn.softmax(filt, axis=-1)
    p_draft = jnp.take_along_axis(probs[:, :s], drafts[:, :, None], axis=-1)[..., 0]  # [B, S]
    keys = jax.vmap(lambda sd, pos: jax.random.fold_in(jax.random.key(sd.astype(jnp.uint32)), pos))(batch.seed, position)
    u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1 << 20), (s,)))(keys)  # [B, S]
    ok = jnp.where((temp > 0)[:, None], u < p_draft, drafts == greedy[:, :s])
    n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    n_acc = jnp.minimum(n_acc, batch.max_accept)

    # the token after the accepted drafts
    rows = jnp.arange(b)
    row_filt = filt[rows, n_acc]  # [B, V]
    rejected = jnp.where(n_acc < s, drafts[rows, jnp.minimum(n_acc, s - 1)], -1)
    residual = jnp.where(jnp.arange(v)[None, :] == rejected[:, None], -jnp.inf, row_filt)
    # a rejected draft held all the mass (p = 1): nothing left; fall back to the filtered row
    residual = jnp.where(jnp.any(jnp.isfinite(residual), axis=-1, keepdims=True), residual, row_filt)
    sampled = jax.vmap(lambda k, a, l: jax.random.categorical(jax.random.fold_in(k, a), l))(keys, n_acc, residual)
    bonus = jnp.where(temp > 0, sampled.astype(jnp.int32), greedy[rows, n_acc])

    # an accepted stop token ends the row: it becomes the last token
    is_stop = jnp.any(drafts[:, :, None] == batch.stop_ids[:, None, :], axis=-1) & (batch.stop_ids >= 0).any(-1)[:, None]
    first_stop = jnp.argmax(is_stop, axis=1)
    stop_hit = jnp.any(is_stop, axis=1) & (first_stop < n_acc)
    bonus = jnp.where(stop_hit, drafts[rows, first_stop], bonus)
    n_acc = jnp.where(stop_hit, first_stop, n_acc)
    bonus_logp = logp[rows, n_acc, bonus]
    return n_acc.astype(jnp.int32), bonus, bonus_logp, draft_logp


def _filtered(logits: Array, temperature: Array, top_k: Array, top_p: Array) -> Array:
    """Temperature-scaled logits with top-k / top-p truncation (-inf outside), per row."""
    v = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    rank = jnp.arange(v)[None, :]
    keep_sorted = (rank < jnp.where(top_k > 0, top_k, v)[:, None]) & (cum_before < top_p[:, None])
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
    return jnp.where(keep, scaled, -jnp.inf)


def _target_meta(batch: StepBatch, query: int, phys_slot: Array, phys_track: Array, commit_len: Array,
                 track_len: Array) -> RowMeta:
    t = batch.tokens.shape[0]
    return RowMeta(
        token_row=batch.token_row, token_offset=batch.token_offset,
        row_tokens=jnp.clip(batch.query_start[:, None] + jnp.arange(query)[None, :], 0, t - 1),
        seq_start=batch.seq_start, num_new=batch.num_new, has_state=batch.has_state, commit_len=commit_len,
        track_len=track_len, active=phys_slot,
        track_dest=jnp.where((track_len > 0) & (batch.num_new > 0), phys_track, 0))


def _run_layers(params: Params, cfg: InklingConfig, layout: ArenaLayout, ctx: StepContext, x: Array) -> Array:
    for i, p in enumerate(params["layers"]):
        ctx.bind(layout.target[i], layout.target_page_layer[i])
        x = L.decoder_layer(p, cfg, cfg.layer_geometry(i), cfg.is_dense(i), x, ctx)
    return L.rms_norm(x, params["final_norm"], cfg.rms_norm_eps)


def _prepare(params, state, batch, layout, use_pallas, interpret):
    from pallas_kernels import conv_ops

    ops = conv_ops(use_pallas, interpret)
    phys_slot = translate_slots(state, batch.slot)
    phys_track = translate_slots(state, batch.track_slot)
    phys_pages = translate_pages(state, batch.pages)
    phys_cow = translate_slots(state, batch.cow_src)
    # rows that restore nothing copy sink -> sink: a no-op for the Pallas copy (no lax.cond
    # here: a conditional that may return the donated arena made XLA copy it whole at B = 1)
    arena = ops.copy_slot_units(state.arena, layout, phys_cow, jnp.where(phys_cow > 0, phys_slot, 0))
    return ops, phys_slot, phys_track, phys_pages, arena


def step_logits(params: Params, state: ServingState, batch: StepBatch, *, cfg: InklingConfig, layout: ArenaLayout,
                shape: StepShape, use_pallas: bool = False, interpret: bool = False
                ) -> tuple[Float[Array, "b v"], ServingState]:
    """The target's extend / decode step without sampling: logits (fp32) of each row's last
    new token, and the new state. Differentiable in params and state (the research / harness
    entry point). It runs the target only: a layout's draft block is left as it was."""
    ops, phys_slot, phys_track, phys_pages, arena = _prepare(params, state, batch, layout, use_pallas, interpret)
    meta = _target_meta(batch, shape.query, phys_slot, phys_track, batch.num_new, batch.track_len)
    ctx = StepContext(cfg, layout, ops, arena, meta, phys_pages)
    h = _run_layers(params, cfg, layout, ctx, L.embed(params, cfg, batch.tokens, params["unembed"].dtype))
    last = jnp.clip(batch.query_start + batch.num_new - 1, 0, h.shape[0] - 1)
    return L.lm_head(params, cfg, h[last]), state.replace(arena=ctx.arena)


def run_step(params: Params, state: ServingState, batch: StepBatch, *, cfg: InklingConfig, layout: ArenaLayout,
             shape: StepShape, use_pallas: bool = False, interpret: bool = False) -> tuple[StepOutput, ServingState]:
    """One serving step (not jitted; `compile_step` wraps it). use_pallas picks the Pallas
    conv-state kernels (interpret=True runs them in interpret mode, for CPU tests)."""
    ops, phys_slot, phys_track, phys_pages, arena = _prepare(params, state, batch, layout, use_pallas, interpret)
    spec = layout.spec_steps
    b = shape.batch
    verify = shape.mode == "verify"
    meta = _target_meta(batch, shape.query, phys_slot, phys_track, batch.num_new, batch.track_len)
    ctx = StepContext(cfg, layout, ops, arena, meta, phys_pages, deferred=verify)
    h = _run_layers(params, cfg, layout, ctx, L.embed(params, cfg, batch.tokens, params["unembed"].dtype))

    if verify:
        rows_h = h[meta.row_tokens]  # [B, S+1, H]
        logits = L.lm_head(params, cfg, rows_h)
        drafts = batch.tokens[meta.row_tokens[:, 1:]]  # [B, S]
        n_acc, bonus, bonus_logp, draft_logp = accept_drafts(logits, drafts, batch, batch.seq_start + 1)
        commit = jnp.where(batch.num_new > 0, n_acc + 1, 0)
        track = jnp.where(commit >= batch.track_len, batch.track_len, 0)
        meta = _target_meta(batch, shape.query, phys_slot, phys_track, commit, track)
        ctx.commit(meta)
    else:
        last = jnp.clip(batch.query_start + batch.num_new - 1, 0, h.shape[0] - 1)
        logits = L.lm_head(params, cfg, h[last])
        bonus, bonus_logp = sample_tokens(logits, batch.temperature, batch.top_k, batch.top_p, batch.seed,
                                          batch.seq_start + batch.num_new)
        n_acc = jnp.zeros(b, jnp.int32)
        draft_logp = jnp.zeros((b, spec), jnp.float32)
        commit, track = batch.num_new, batch.track_len
    arena = ctx.arena

    new_drafts = jnp.zeros((b, spec), jnp.int32)
    if spec:
        arena, new_drafts = _draft_phase(params, cfg, layout, ops, arena, batch, meta, phys_slot, phys_pages, h,
                                         commit, track, bonus)
    out = StepOutput(bonus, bonus_logp, n_acc, draft_logp, new_drafts)
    return out, state.replace(arena=arena)


def _draft_phase(params: Params, cfg: InklingConfig, layout: ArenaLayout, ops: Any, arena: Array, batch: StepBatch,
                 target_meta: RowMeta, phys_slot: Array, phys_pages: Array, h_target: Array, commit: Array,
                 track: Array, bonus: Array) -> tuple[Array, Array]:
    """Run the MTP depths after the target committed `commit` tokens per row (module docstring).

    Each depth works on rows laid out with a uniform stride W = Q + S per request: index i of
    depth d is row start_d + i, start_d = max(0, s - d)."""
    spec = layout.spec_steps
    b, q = target_meta.row_tokens.shape
    width = q + spec
    dtype = params["unembed"].dtype
    s = batch.seq_start
    e = s + commit  # the target's committed length after this step
    idx = jnp.arange(width)[None, :]
    t_pack = batch.tokens.shape[0]

    # lookahead stream la[i] = t_{s+1+i}: the row's own next tokens, then t_e, then t_{e+1}..
    own = batch.tokens[jnp.clip(batch.query_start[:, None] + 1 + idx, 0, t_pack - 1)]
    t_next = jnp.where(batch.sample_next, bonus, batch.lookahead[:, 0])
    la = jnp.where(idx < commit[:, None] - 1, own, t_next[:, None])
    known_after = jnp.concatenate([batch.lookahead[:, 1:], jnp.zeros((b, width), jnp.int32)], axis=1)
    la = jnp.where(idx > commit[:, None] - 1, jnp.take_along_axis(known_after, jnp.maximum(idx - commit[:, None], 0),
                                                                  axis=1), la)
    tracking = (track > 0) & (batch.num_new > 0)
    phys_track = target_meta.track_dest  # the sink where the target does not checkpoint

    packed_rows = (jnp.arange(b)[:, None] * width + idx).reshape(-1)
    token_row = jnp.repeat(jnp.arange(b, dtype=jnp.int32), width)
    token_offset = jnp.tile(jnp.arange(width, dtype=jnp.int32), b)
    row_tokens = packed_rows.reshape(b, width)

    h_prev = jnp.take(h_target, jnp.clip(batch.query_start[:, None] + idx, 0, t_pack - 1), axis=0)  # [B, W, H]
    # every depth's carried hidden as it was before this step (depth d - 1 rewrites its own)
    carries = [read_field(arena, layout, slot_rows(layout, phys_slot, f.hidden), f.hidden)
               for f in layout.draft[:-1]]
    drafts = []
    for d in range(spec):
        start = jnp.maximum(s - d, 0)
        shift = start - (s - d)  # 0 when s >= d
        n_rows = jnp.where(batch.num_new > 0, e - start, 0)
        n_commit = jnp.where(batch.num_new > 0, jnp.maximum(e - d - start, 0), 0)
        n_track = jnp.where(tracking, jnp.maximum(track - shift, 0), 0)
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
        meta = RowMeta(token_row=token_row, token_offset=token_offset, row_tokens=row_tokens, seq_start=start,
                       num_new=n_rows, has_state=start > 0, commit_len=n_commit, track_len=n_track,
                       active=phys_slot, track_dest=jnp.where(n_track > 0, phys_track, 0))
        ctx = StepContext(cfg, layout, ops, arena, meta, phys_pages).bind(fields, layout.draft_page_layer[d])
        z = mtp_depth_input(params, cfg, d, h_in.reshape(b * width, -1), tok.reshape(-1))
        y = L.decoder_layer(params["mtp"]["layers"][d]["block"], cfg, cfg.mtp_geometry(d), True, z, ctx)
        h_out = mtp_depth_output(params, cfg, y).reshape(b, width, -1)
        arena = ctx.arena
        if fields.hidden is not None and d < spec - 1:
            # carry this depth's last committed row (and the checkpoint's) for depth d + 1
            def at(n):
                return h_out[jnp.arange(b), jnp.maximum(n - 1, 0)]
            old = read_field(arena, layout, slot_rows(layout, phys_slot, fields.hidden), fields.hidden)
            keep = jnp.where((n_commit > 0)[:, None], at(n_commit), old)
            arena = write_field(arena, layout, slot_rows(layout, phys_slot, fields.hidden), fields.hidden, keep)
            tdest = jnp.where(n_track > 0, phys_track, 0)
            arena = write_field(arena, layout, slot_rows(layout, tdest, fields.hidden), fields.hidden, at(n_track))
        # the draft: depth d's greedy prediction at row e - 1 (index n_rows - 1) is t_{e+d+1}
        last = h_out[jnp.arange(b), jnp.maximum(n_rows - 1, 0)]
        draft = jnp.argmax(L.lm_head(params, cfg, last), axis=-1).astype(jnp.int32)
        drafts.append(draft)
        la = jnp.where(batch.sample_next[:, None] & (idx == commit[:, None] + d), draft[:, None], la)
        h_prev = h_out
    return arena, jnp.stack(drafts, axis=1)


def compile_step(cfg: InklingConfig, layout: ArenaLayout, shape: StepShape, use_pallas: bool = False,
                 interpret: bool = False):
    """The jitted step for one (mode, bucket); the state argument is donated."""
    return jax.jit(partial(run_step, cfg=cfg, layout=layout, shape=shape, use_pallas=use_pallas, interpret=interpret),
                   donate_argnums=(1,))


# XLA's GPU compiler sorts a single row (top-p sampling at batch 1) with CUB, which cannot be
# captured in a command buffer (CUDA graph); the sampling `lax.cond` around it then runs on
# the host, which copies its predicate back and waits for the whole step so far: a pipeline
# drain in the middle of every batch-1 decode. XLA's own sort kernel keeps the step one graph.
GPU_STEP_OPTIONS = {"xla_gpu_enable_cub_radix_sort": False}


def compile_lowered(lowered):
    """Compile a lowered step with the options above on a GPU (plain compile elsewhere, or
    where this XLA does not know an option)."""
    if jax.default_backend() == "gpu":
        try:
            return lowered.compile(compiler_options=GPU_STEP_OPTIONS)
        except Exception as exc:  # noqa: BLE001 - an XLA without the option: compile as is
            import warnings

            warnings.warn(f"compiling without {GPU_STEP_OPTIONS}: {type(exc).__name__}: {exc}")
    return lowered.compile()

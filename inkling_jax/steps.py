"""Jitted serving steps: (params, state, batch) -> (outputs, new_state).

One step function serves every mode; its static `StepShape` (mode and bucket sizes) picks
the compiled program. A batch holds packed ragged tokens plus per-row arrays padded to the
bucket; every field is present in every mode (a row that does not checkpoint points at the
sink with a false mask, never a missing field), so the jit cache compiles each bucket once.

Inside the step, and only there, virtual slot and page ids become physical through the
state's tables. The state is donated: the arena is updated in place.

Data flow of one step:
  1. copy-on-write restores (prefix hits): slot `cow_src` -> the row's slot, whole entries;
  2. the layers, on packed tokens [T, H]; each layer's context reads the *old* state
     (conv windows, sliding rings, pages) and writes the new one;
  3. the LM head on each row's last new token, sampling with per-request PRNG keys.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .cache.conv_state import ConvMeta
from .cache.layout import ArenaLayout, LayerSlotFields
from .cache.state import (ServingState, page_rows, read_field, slot_rows, translate_pages, translate_slots,
                          write_field)
from .config import AttentionGeometry, InklingConfig
from .model import layers as L

Params = dict[str, Any]

MODES = ("extend", "decode")


@dataclass(frozen=True)
class StepShape:
    """Static shape of a compiled step: mode and bucket sizes."""

    mode: str
    batch: int  # B: request rows
    tokens: int  # T: packed tokens
    query: int  # Q: max new tokens of one row
    pages: int  # P: page-table columns (context up to P * page_size tokens)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown step mode {self.mode!r}")
        if self.mode == "decode" and not (self.query == 1 and self.tokens == self.batch):
            raise ValueError("decode steps have one token per row")


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
    num_new: Int[Array, "b"]  # new tokens this step (0: padded row)
    query_start: Int[Array, "b"]  # packed index of the row's first new token
    pages: Int[Array, "b p"]  # virtual page ids covering positions [0, P * page_size)
    track_slot: Int[Array, "b"]  # virtual checkpoint slot (0 when none)
    track_len: Int[Array, "b"]  # new tokens before the checkpoint position (0: no checkpoint)
    cow_src: Int[Array, "b"]  # virtual slot to restore into `slot` first (0: none)
    temperature: Float[Array, "b"]
    top_k: Int[Array, "b"]  # 0: off
    top_p: Float[Array, "b"]  # 1: off
    seed: Int[Array, "b"]  # per-request sampling seed (keys fold in the position)


def check_batch(batch: StepBatch, shape: StepShape) -> None:
    """Raise ValueError naming the first field whose shape does not fit the compiled bucket
    (before anything is donated, so the state is untouched)."""
    want = {"tokens": (shape.tokens,), "token_row": (shape.tokens,), "token_offset": (shape.tokens,),
            "pages": (shape.batch, shape.pages)}
    for name in StepBatch.__dataclass_fields__:
        got = tuple(getattr(batch, name).shape)
        expected = want.get(name, (shape.batch,))
        if got != expected:
            raise ValueError(f"StepBatch.{name} has shape {got}; the compiled {shape.mode} bucket takes {expected} "
                             f"(batch {shape.batch}, tokens {shape.tokens}, pages {shape.pages})")


@jax.tree_util.register_dataclass
@dataclass
class StepOutput:
    tokens: Int[Array, "b"]  # sampled next token of each row
    logprobs: Float[Array, "b"]  # log p(token) under the model (temperature 1, no truncation)


# ----------------------------------------------------------------------- context


class StepContext:
    """LayerContext for packed ragged tokens against the serving state (see layers.py).

    Holds the arena being updated (functionally) while the layers are traced."""

    def __init__(self, cfg: InklingConfig, layout: ArenaLayout, shape: StepShape, ops: Any, arena: Array,
                 batch: StepBatch, phys_slot: Array, phys_track: Array, phys_pages: Array):
        self.cfg, self.layout, self.shape, self.ops = cfg, layout, shape, ops
        self.arena = arena
        self.batch = batch
        self.phys_pages = phys_pages
        self.positions = batch.seq_start[batch.token_row] + batch.token_offset  # [T]
        valid_rows = batch.num_new > 0
        t = batch.tokens.shape[0]
        self.row_tokens = jnp.clip(batch.query_start[:, None] + jnp.arange(shape.query)[None, :], 0, t - 1)
        self.conv_meta = ConvMeta(
            token_row=batch.token_row, token_offset=batch.token_offset, row_tokens=self.row_tokens,
            has_state=batch.has_state, commit_len=batch.num_new, active=phys_slot,
            track_dest=jnp.where((batch.track_len > 0) & valid_rows, phys_track, 0),
            track_len=batch.track_len)
        self.fields: LayerSlotFields | None = None
        self.page_layer: int | None = None

    def bind(self, fields: LayerSlotFields, page_layer: int | None) -> "StepContext":
        self.fields, self.page_layer = fields, page_layer
        return self

    # -- short convolutions

    def _channels(self, stream: str, width: int) -> tuple[int, int]:
        c = self.fields.conv.shape[1]
        h = self.cfg.hidden_size
        kv = (c - 2 * h) // 2
        start = {"k": 0, "v": kv, "attn": 2 * kv, "mlp": 2 * kv + h}[stream]
        return start, start + width

    def conv(self, stream: str, x: Array, weight: Array) -> Array:
        y, self.arena = self.ops.conv_update(self.arena, self.layout, self.fields.conv,
                                             self._channels(stream, x.shape[-1]), x, weight, self.conv_meta)
        return y

    # -- attention

    def attend(self, q: Array, k: Array, v: Array, r: Array, rel_proj: Array, geom: AttentionGeometry) -> Array:
        b, qn = self.shape.batch, self.shape.query
        batch = self.batch
        t = q.shape[0]
        # packed [T, ...] -> per-row padded [B, Q, ...]
        q_idx = self.row_tokens
        q_valid = jnp.arange(qn)[None, :] < batch.num_new[:, None]
        q_pos = batch.seq_start[:, None] + jnp.arange(qn)[None, :]
        qp, kp, vp, rp = q[q_idx], k[q_idx], v[q_idx], r[q_idx]

        if geom.is_sliding:
            ctx_k, ctx_v, ctx_pos, ctx_valid = self._ring_keys(geom)
        else:
            ctx_k, ctx_v, ctx_pos, ctx_valid = self._page_keys(geom)
        keys = jnp.concatenate([ctx_k, kp], axis=1)
        values = jnp.concatenate([ctx_v, vp], axis=1)
        k_pos = jnp.concatenate([ctx_pos, q_pos], axis=1)
        k_valid = jnp.concatenate([ctx_valid, q_valid], axis=1)
        out = L.attention_core(qp, keys, values, rp, rel_proj, q_pos, k_pos, k_valid, geom, self.cfg)

        if geom.is_sliding:
            self._write_ring(geom, k, v)
        else:
            self._write_pages(k, v)
        return out[batch.token_row, batch.token_offset]

    def _page_keys(self, geom: AttentionGeometry):
        lay, b = self.layout, self.shape.batch
        rows = page_rows(lay, self.arena.shape[0], self.phys_pages, self.page_layer)  # [B, P]
        kv = self.arena[rows].reshape(b, -1, 2, geom.num_kv_heads, geom.head_dim)  # [B, P*ps, 2, nkv, hd]
        pos = jnp.broadcast_to(jnp.arange(kv.shape[1], dtype=jnp.int32), (b, kv.shape[1]))
        valid = pos < self.batch.seq_start[:, None]
        return kv[:, :, 0], kv[:, :, 1], pos, valid

    def _write_pages(self, k: Array, v: Array) -> None:
        """Store every valid new token's K/V at its position (drafts included: positions past
        the committed length are rewritten before any query can see them)."""
        lay, batch = self.layout, self.batch
        ps = lay.page_size
        pos = self.positions
        valid = (batch.num_new[batch.token_row] > batch.token_offset)
        page_col = jnp.clip(pos // ps, 0, self.shape.pages - 1)
        phys = jnp.where(valid, self.phys_pages[batch.token_row, page_col], 0)
        rows = page_rows(lay, self.arena.shape[0], phys, self.page_layer)
        offset = jnp.where(valid, pos % ps, 0)
        t = k.shape[0]
        kv = jnp.stack([k, v], axis=1).reshape(t, -1).astype(self.arena.dtype)
        arena3 = self.arena.reshape(self.arena.shape[0], ps, -1)
        self.arena = arena3.at[rows, offset].set(kv).reshape(self.arena.shape)

    def _ring_keys(self, geom: AttentionGeometry):
        lay, b = self.layout, self.shape.batch
        f = self.fields.ring
        ring = read_field(self.arena, lay, slot_rows(lay, self.conv_meta.active, f), f)  # [B, R, 2, nkv, hd]
        self._old_ring = ring
        r = lay.ring
        last = self.batch.seq_start[:, None] - 1
        idx = jnp.arange(r, dtype=jnp.int32)[None, :]
        pos = last - jnp.mod(last - idx, r)  # the position each ring row holds, in (s-1-R, s-1]
        valid = self.batch.has_state[:, None] & (pos >= 0)
        return ring[:, :, 0], ring[:, :, 1], pos, valid

    def _write_ring(self, geom: AttentionGeometry, k: Array, v: Array) -> None:
        lay, batch, meta = self.layout, self.batch, self.conv_meta
        f, r = self.fields.ring, lay.ring
        old = jnp.where(batch.has_state[:, None, None, None, None], self._old_ring, 0)
        kv = jnp.stack([k, v], axis=1).astype(old.dtype)  # [T, 2, nkv, hd]
        row, off = batch.token_row, batch.token_offset
        n = batch.num_new[row]
        slot_idx = self.positions % r
        b = self.shape.batch
        # active ring: the last R new tokens of each row
        keep = (off < n) & (off >= n - r)
        new = old.at[jnp.where(keep, row, b), slot_idx].set(kv, mode="drop")
        self.arena = write_field(self.arena, lay, slot_rows(lay, meta.active, f), f, new)
        # checkpoint ring: the ring as it was before the checkpoint position
        tl = batch.track_len[row]
        tkeep = (off < tl) & (off >= tl - r)
        ck = old.at[jnp.where(tkeep, row, b), slot_idx].set(kv, mode="drop")
        self.arena = write_field(self.arena, lay, slot_rows(lay, meta.track_dest, f), f, ck)


# ------------------------------------------------------------------------ sampling


def sample_tokens(logits: Float[Array, "b v"], temperature: Array, top_k: Array, top_p: Array,
                  seed: Array, position: Array) -> tuple[Array, Array]:
    """Greedy where temperature == 0, else temperature / top-k / top-p sampling with the key
    fold_in(key(seed), position): reproducible for a request whatever it is batched with."""
    logits = logits.astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    v = logits.shape[-1]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(v)[None, :]
    k_eff = jnp.where(top_k > 0, top_k, v)[:, None]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (rank < k_eff) & (cum_before < top_p[:, None])
    sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)

    def draw(s, p, row):
        key = jax.random.fold_in(jax.random.key(s.astype(jnp.uint32)), p)
        return jax.random.categorical(key, row)

    picked = jax.vmap(draw)(seed, position, sorted_logits)
    sampled = jnp.take_along_axis(order, picked[:, None], axis=-1)[:, 0].astype(jnp.int32)
    tokens = jnp.where(temperature > 0, sampled, greedy)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


# ---------------------------------------------------------------------------- step


def step_logits(params: Params, state: ServingState, batch: StepBatch, *, cfg: InklingConfig, layout: ArenaLayout,
                shape: StepShape, use_pallas: bool = False, interpret: bool = False
                ) -> tuple[Float[Array, "b v"], ServingState]:
    """The step without sampling: logits (fp32) of each row's last new token, and the new
    state. Differentiable in params and state (the research / harness entry point)."""
    from pallas_kernels import conv_ops

    ops = conv_ops(use_pallas, interpret)
    dtype = params["unembed"].dtype
    phys_slot = translate_slots(state, batch.slot)
    phys_track = translate_slots(state, batch.track_slot)
    phys_pages = translate_pages(state, batch.pages)
    phys_cow = translate_slots(state, batch.cow_src)
    arena = ops.copy_slot_units(state.arena, layout, phys_cow, jnp.where(phys_cow > 0, phys_slot, 0))

    ctx = StepContext(cfg, layout, shape, ops, arena, batch, phys_slot, phys_track, phys_pages)
    x = L.embed(params, cfg, batch.tokens, dtype)
    for i, p in enumerate(params["layers"]):
        ctx.bind(layout.target[i], layout.target_page_layer[i])
        x = L.decoder_layer(p, cfg, cfg.layer_geometry(i), cfg.is_dense(i), x, ctx)
    last = jnp.clip(batch.query_start + batch.num_new - 1, 0, x.shape[0] - 1)
    h = L.rms_norm(x[last], params["final_norm"], cfg.rms_norm_eps)
    return L.lm_head(params, cfg, h), state.replace(arena=ctx.arena)


def run_step(params: Params, state: ServingState, batch: StepBatch, *, cfg: InklingConfig, layout: ArenaLayout,
             shape: StepShape, use_pallas: bool = False, interpret: bool = False) -> tuple[StepOutput, ServingState]:
    """One serving step (not jitted; `compile_step` wraps it): logits, then sampling. use_pallas
    picks the Pallas conv-state kernels (interpret=True runs them in interpret mode, for CPU tests)."""
    logits, state = step_logits(params, state, batch, cfg=cfg, layout=layout, shape=shape, use_pallas=use_pallas,
                                interpret=interpret)
    tokens, logprobs = sample_tokens(logits, batch.temperature, batch.top_k, batch.top_p, batch.seed,
                                     batch.seq_start + batch.num_new)
    return StepOutput(tokens, logprobs), state


def compile_step(cfg: InklingConfig, layout: ArenaLayout, shape: StepShape, use_pallas: bool = False,
                 interpret: bool = False):
    """The jitted step for one (mode, bucket); the state argument is donated."""
    return jax.jit(partial(run_step, cfg=cfg, layout=layout, shape=shape, use_pallas=use_pallas, interpret=interpret),
                   donate_argnums=(1,))

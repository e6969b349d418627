"""Check 3, cached path == reference path: d loss / d params through the chunked, cached
serving path (a chain of step calls threading the state from a zero arena, differentiated
backwards step by step through the state) equals d loss / d params through the reference
`forward`, within a stated float32 tolerance.

The chain runs forward with the step's VJP program (`step_fns.step_vjp`, zero cotangents),
then backward from the last step to the first, handing each step's arena cotangent to the
step before; check 1 uses the same program when the bucket is the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..config import InklingConfig
from ..model import forward
from ..steps import RowPlan, StepBatch, StepShape, pack_batch
from .scenario import Geometry, default_geometry
from .step_fns import Params, StepFn, extend_embeddings, jit_check, make_step_fn, step_vjp


@dataclass
class CachedPathReport:
    ok: bool
    details: str
    max_rel_diff: float  # max over param leaves of max|g_cached - g_ref| / max|g_ref|
    worst_leaf: str
    global_rel_diff: float  # ||g_cached - g_ref|| / ||g_ref|| over all leaves
    tolerance: float
    loss_cached: float
    loss_reference: float
    num_steps: int
    loss_positions: int  # (row, position) pairs in the loss
    schedule: list[list[int]]  # new tokens of each sequence at each step
    state_cotangent_norms: list[float]  # ||d loss / d arena|| handed back into each step's input state
    per_leaf: dict[str, float] = field(repr=False)

    def __str__(self) -> str:
        return self.details


def default_schedule(lens: Sequence[int], query: int, tokens: int) -> list[list[int]]:
    """Uneven chunks: at step k sequence i wants (5, 1, 7, 3, 8, 2, 6, 4)[(k + 3 i) % 8] tokens
    (at most `query`, at most what is left), rows served in order from a budget of `tokens`
    packed tokens, so later rows sometimes sit a step out."""
    pattern = (5, 1, 7, 3, 8, 2, 6, 4)
    done = [0] * len(lens)
    schedule = []
    while any(d < n for d, n in zip(done, lens)):
        budget, step = tokens, []
        for i, n in enumerate(lens):
            take = min(pattern[(len(schedule) + 3 * i) % len(pattern)], n - done[i], query, budget)
            budget -= take
            done[i] += take
            step.append(take)
        schedule.append(step)
    return schedule


def _check_fits(geometry: Geometry, lens: list[int], schedule: list[list[int]]) -> None:
    layout, shape = geometry.layout, geometry.shape
    n, p_cols = len(lens), shape.pages
    if not 0 < n <= min(shape.batch, geometry.num_slots) or n * p_cols > geometry.num_pages:
        raise ValueError(f"{n} sequences do not fit the bucket (B {shape.batch}, {geometry.num_slots} slots, "
                         f"{geometry.num_pages} pages of which {p_cols} per row)")
    if min(lens) < 1 or max(lens) > p_cols * layout.page_size:
        raise ValueError(f"sequence lengths must be in [1, {p_cols * layout.page_size}] (P * page_size)")
    for k, step in enumerate(schedule):
        if len(step) != n or max(step) > shape.query or sum(step) > shape.tokens or min(step) < 0:
            raise ValueError(f"schedule step {k} {step} does not fit (Q {shape.query}, T {shape.tokens})")
    if [sum(col) for col in zip(*schedule)] != lens:
        raise ValueError("the schedule must feed every sequence exactly once")


@dataclass
class LossPlan:
    """The chain's batches and the loss's positions: entry j of rows / positions / targets is
    the j-th (row, last fed position, next token) in step order."""

    batches: list[StepBatch]
    rows: list[int]
    positions: list[int]
    targets: list[int]


def plan_chain(sequences: Sequence[Sequence[int]], schedule: list[list[int]], shape: StepShape) -> LossPlan:
    """Sequence i in row i, virtual slot i + 1 and its own pages; at step k it feeds
    schedule[k][i] new tokens. Loss target: the next token (the token itself at the end)."""
    plan = LossPlan([], [], [], [])
    done = [0] * len(sequences)
    for step in schedule:
        rows = []
        for i, c in enumerate(step):
            s = done[i]
            rows.append(RowPlan(tokens=list(sequences[i][s:s + c]), seq_start=s, virtual_slot=i + 1,
                                virtual_pages=list(i * shape.pages + 1 + np.arange(shape.pages))))
            if c:
                plan.rows.append(i)
                plan.positions.append(s + c - 1)
                end = len(sequences[i])
                plan.targets.append(sequences[i][s + c] if s + c < end else sequences[i][s + c - 1])
                done[i] += c
        plan.batches.append(pack_batch(shape, rows))
    return plan


def _loss_and_cotangents(logits: list[np.ndarray], schedule: list[list[int]], targets: list[int]):
    """(mean cross-entropy, its cotangent on each step's logits [B, V]) in float64."""
    count = len(targets)
    cot_logits = [np.zeros_like(lg) for lg in logits]
    loss, j = 0.0, 0
    for k, step in enumerate(schedule):
        for i, c in enumerate(step):
            if c:
                lg = logits[k][i]
                m = lg.max()
                prob = np.exp(lg - m)
                z = prob.sum()
                loss += (m + np.log(z) - lg[targets[j]]) / count
                g = prob / z
                g[targets[j]] -= 1.0
                cot_logits[k][i] = g / count
                j += 1
    return loss, cot_logits


def _chain_gradients(vjp: Callable, params: Params, state, plan: LossPlan, schedule: list[list[int]], vocab: int):
    """Forward through the chain, then backward with each step's arena cotangent handed to the
    step before. Returns (loss, d loss / d params (float64), ||d loss / d input arena|| per step)."""
    b = len(np.asarray(plan.batches[0].layout.num_new))
    zero_arena = jnp.zeros_like(state.arena)
    zero_cot = np.zeros((b, vocab), np.float32)
    states, exts, logits = [], [], []
    for batch in plan.batches:
        ext_rows, batch_ext = extend_embeddings(params, batch)
        lg, new_arena, _, _, _ = vjp(params, ext_rows, state, batch_ext, zero_cot, zero_arena)
        states.append(state)
        exts.append((ext_rows, batch_ext, np.asarray(batch.layout.tokens)))
        logits.append(np.asarray(lg, np.float64))
        state = state.replace(arena=new_arena)
    loss, cot_logits = _loss_and_cotangents(logits, schedule, plan.targets)

    grads = jax.tree_util.tree_map(lambda x: np.zeros(x.shape, np.float64), params)
    cot_arena = zero_arena
    state_norms = []
    for k in reversed(range(len(plan.batches))):
        ext_rows, batch_ext, tokens = exts[k]
        _, _, d_params, d_ext, d_arena = vjp(params, ext_rows, states[k], batch_ext,
                                             cot_logits[k].astype(np.float32), cot_arena)
        grads = jax.tree_util.tree_map(lambda a, g: a + np.asarray(g, np.float64), grads, d_params)
        np.add.at(grads["embed"], tokens, np.asarray(d_ext, np.float64))
        cot_arena = d_arena
        state_norms.append(float(jnp.linalg.norm(d_arena.astype(jnp.float32))))
    state_norms.reverse()
    return loss, grads, state_norms


_REFERENCE_GRADS: dict[InklingConfig, Callable] = {}


def reference_value_and_grad(cfg: InklingConfig) -> Callable:
    """Jitted (loss, d loss / d params) of the same loss through `forward`:
    fn(params, tokens [N, L], rows [M], positions [M], targets [M], mask [M])."""
    fn = _REFERENCE_GRADS.get(cfg)
    if fn is None:
        def loss(p, tokens, rows, positions, targets, mask):
            logits = forward(p, cfg, tokens)[rows, positions]  # [M, V]
            logz = jax.nn.logsumexp(logits, axis=-1)
            picked = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
            return jnp.sum(jnp.where(mask, logz - picked, 0.0)) / jnp.maximum(jnp.sum(mask), 1)

        fn = _REFERENCE_GRADS[cfg] = jit_check(jax.value_and_grad(loss))
    return fn


def _compare(grads, g_ref) -> tuple[dict[str, float], float]:
    """(per-leaf max|g - g_ref| / max|g_ref|, global ||g - g_ref|| / ||g_ref||); a leaf whose
    reference gradient is exactly 0 scores 0 when equal, inf otherwise."""
    per_leaf: dict[str, float] = {}
    num = den = 0.0
    for (path, gc), gr in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree_util.tree_leaves(g_ref)):
        gr = np.asarray(gr, np.float64)
        diff = float(np.max(np.abs(gc - gr))) if gc.size else 0.0
        scale = float(np.max(np.abs(gr))) if gr.size else 0.0
        per_leaf[jax.tree_util.keystr(path)] = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
        num += float(np.sum((gc - gr) ** 2))
        den += float(np.sum(gr ** 2))
    return per_leaf, math.sqrt(num / den) if den > 0 else 0.0


def check_cached_matches_reference(
    params: Params, cfg: InklingConfig, sequences: Sequence[Sequence[int]],
    schedule: Sequence[Sequence[int]] | None = None, *, geometry: Geometry | None = None,
    step_fn: StepFn | None = None, tolerance: float = 1e-4, seed: int = 0,
) -> CachedPathReport:
    """Gradient of one loss through the cached, chunked serving path vs the reference forward.

    Cached path: extend steps of the geometry's bucket (default: B 4, T 16, Q 8, P 8, page
    size 4), sequence i in row i with its own slot and pages (shuffled physical ids), state
    threaded from a zero arena; at step k sequence i feeds schedule[k][i] new tokens
    (`default_schedule` when None: uneven chunks, rows idle some steps). Loss: mean
    cross-entropy of each step's last-token logits of every row that fed tokens, against the
    next token of its sequence (the token itself at the sequence end). Its gradient is
    taken backwards step by step with the step's VJP (`step_vjp`): each step gets the loss's
    cotangent on its logits and the arena cotangent handed back by the step after it, and
    returns its parameter share and the arena cotangent for the step before it.
    Reference: the same positions' logits from `forward` on the padded [N, L] token batch,
    differentiated by jax.value_and_grad.
    ok iff for every param leaf max|g_cached - g_ref| <= tolerance * max|g_ref| (float32; a
    leaf whose reference gradient is exactly 0 must be exactly 0 too)."""
    geometry = geometry or default_geometry(cfg)
    shape = geometry.shape
    lens = [len(s) for s in sequences]
    schedule = [list(s) for s in (schedule or default_schedule(lens, shape.query, shape.tokens))]
    _check_fits(geometry, lens, schedule)
    vjp = step_vjp(step_fn or make_step_fn(cfg, geometry.layout, shape))
    plan = plan_chain(sequences, schedule, shape)
    state = geometry.state(seed=seed, dtype=params["unembed"].dtype)
    loss, grads, state_norms = _chain_gradients(vjp, params, state, plan, schedule, cfg.unpadded_vocab_size)

    n, count = len(sequences), len(plan.rows)
    padded = np.zeros((n, max(lens)), np.int32)
    for i, s in enumerate(sequences):
        padded[i, :len(s)] = s
    loss_ref, g_ref = reference_value_and_grad(cfg)(
        params, jnp.asarray(padded), jnp.asarray(plan.rows, jnp.int32), jnp.asarray(plan.positions, jnp.int32),
        jnp.asarray(plan.targets, jnp.int32), jnp.ones(count, bool))

    per_leaf, global_rel = _compare(grads, g_ref)
    worst = max(per_leaf, key=per_leaf.get)
    max_rel = per_leaf[worst]
    ok = max_rel <= tolerance
    details = "\n".join([
        f"cached path == reference {'OK' if ok else 'FAILED'}: d loss / d params through {len(schedule)} chained "
        f"{shape.mode} steps ({n} sequences of lengths {tuple(lens)}, zero initial state) vs through forward()",
        f"schedule (new tokens per sequence per step): {' '.join('/'.join(map(str, s)) for s in schedule)}",
        f"loss over {count} last-token positions: cached {loss:.7g}, reference {float(loss_ref):.7g}",
        f"max relative gradient difference {max_rel:.3g} (leaf {worst}); tolerance {tolerance:.1g} of each "
        f"leaf's max |grad|; global ||g_cached - g_ref|| / ||g_ref|| {global_rel:.3g}",
        f"||d loss / d state|| handed back into steps 1..{len(schedule) - 1}: "
        + ", ".join(f"{x:.3g}" for x in state_norms[1:]),
    ])
    return CachedPathReport(ok, details, max_rel, worst, global_rel, tolerance, float(loss), float(loss_ref),
                            len(schedule), count, schedule, state_norms, per_leaf)

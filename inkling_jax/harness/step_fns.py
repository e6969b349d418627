"""The step under test, and its compiled VJP w.r.t. params, token embeddings and the arena.

A step function is any ``step_fn(params, state, batch) -> (logits [B, V], state)`` with the
signature of `steps.step_logits` once cfg / layout / shape are bound (`make_step_fn`).

Differentiating w.r.t. the token *embeddings* of an unmodified step: the embedding table is
extended by T rows holding the packed tokens' embedding vectors (``ext_rows [T, H]``) and the
batch's token ids are rewritten to V + t (`extend_embeddings`). The step computes bitwise the
same logits, and the gradient w.r.t. ``ext_rows[t]`` is the gradient w.r.t. the vector fed in
for packed token t (padding included), without aliasing between tokens that share an id;
scattering it back onto the token ids gives the gradient w.r.t. ``params["embed"]``.
"""

from __future__ import annotations

from dataclasses import replace as dc_replace
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from .. import steps
from ..cache.layout import ArenaLayout
from ..cache.state import ServingState
from ..config import InklingConfig
from ..steps import StepBatch, StepContext, StepShape

Params = dict[str, Any]
StepFn = Callable[[Params, ServingState, StepBatch], tuple[jax.Array, ServingState]]


def jit_check(fn: Callable) -> Callable:
    """jax.jit for the checks' programs: on CPU with XLA's backend optimisation off (about
    twice as fast to compile; each program runs a handful of times)."""
    if jax.default_backend() == "cpu":
        return jax.jit(fn, compiler_options={"xla_backend_optimization_level": 0})
    return jax.jit(fn)


_STEP_FNS: dict[tuple, StepFn] = {}


def make_step_fn(cfg: InklingConfig, layout: ArenaLayout, shape: StepShape, context_cls: type | None = None,
                 use_pallas: bool = False, interpret: bool = False) -> StepFn:
    """step_fn(params, state, batch) -> (logits, state): `steps.step_logits` with the layer
    context class `context_cls` (default `StepContext`; a subclass with a planted bug in the
    tests). The same object is returned for the same arguments, so the harness's compiled
    programs are reused."""
    key = (cfg, layout, shape, context_cls, use_pallas, interpret)
    fn = _STEP_FNS.get(key)
    if fn is None:
        fn = partial(steps.step_logits, cfg=cfg, layout=layout, shape=shape, use_pallas=use_pallas,
                     interpret=interpret, context_cls=context_cls or StepContext)
        _STEP_FNS[key] = fn
    return fn


_VJPS: dict[int, tuple[StepFn, Callable]] = {}


def step_vjp(step_fn: StepFn) -> Callable:
    """The compiled VJP of one step (cached per step function):

        vjp(params, ext_rows [T, H], state, batch_ext, cot_logits [B, V], cot_arena [U, E])
            -> (logits, new_arena, d_params, d_ext_rows, d_arena)

    where the step sees params["embed"] extended by ext_rows and batch_ext.tokens = V + t
    (`extend_embeddings`). d_params["embed"] covers the original table only (zero: no token
    points there); the tokens' share is d_ext_rows."""
    hit = _VJPS.get(id(step_fn))
    if hit is not None and hit[0] is step_fn:
        return hit[1]

    def run(params, ext_rows, state, batch_ext, cot_logits, cot_arena):
        def f(params, ext_rows, arena):
            p = dict(params)
            p["embed"] = jnp.concatenate([params["embed"], ext_rows.astype(params["embed"].dtype)])
            logits, new_state = step_fn(p, state.replace(arena=arena), batch_ext)
            return logits, new_state.arena

        (logits, new_arena), pull = jax.vjp(f, params, ext_rows, state.arena)
        d_params, d_ext, d_arena = pull((cot_logits.astype(logits.dtype), cot_arena.astype(new_arena.dtype)))
        return logits, new_arena, d_params, d_ext, d_arena

    fn = jit_check(run)
    _VJPS[id(step_fn)] = (step_fn, fn)
    return fn


def extend_embeddings(params: Params, batch: StepBatch) -> tuple[jax.Array, StepBatch]:
    """(ext_rows [T, H], batch_ext): the packed tokens' embedding vectors, and the batch with
    token t rewritten to id V + t (pointing at ext_rows[t])."""
    tokens = np.asarray(batch.layout.tokens)
    v = params["embed"].shape[0]
    ext_rows = jnp.asarray(params["embed"])[jnp.asarray(tokens)]
    layout = dc_replace(batch.layout, tokens=np.arange(v, v + len(tokens), dtype=np.int32))
    return ext_rows, dc_replace(batch, layout=layout)

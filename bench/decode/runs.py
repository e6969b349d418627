"""The runs of bench.decode.decode's compiled steps (prefill, greedy host loop, steady-state
decode), the bytes a decode step must move (the roofline), and comparisons of tokens and
state."""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import inkling_jax as ik
from inkling_jax.cache.state import read_slot_field
from inkling_jax.steps import StepShape, pack_batch

from bench.decode.setup import RowIds, Setup


def prefill(fn, params, shape: StepShape, state, prompts: list[np.ndarray], first_row: int, ids: RowIds):
    """Prefill prompts (rows first_row..) in chunks of shape.query through one extend shape.
    Returns (state, greedy next tokens [n], logprobs [n], seconds)."""
    n_chunks = math.ceil(max(len(p) for p in prompts) / shape.query)
    t0 = time.perf_counter()
    out = None
    for c in range(n_chunks):
        start = c * shape.query
        rows = [ids.row(first_row + i, start, p[start:start + shape.query], shape) for i, p in enumerate(prompts)]
        out, state = fn(params, state, pack_batch(shape, rows))
    tokens, logprobs = jax.device_get((out.tokens, out.logprobs))
    dt = time.perf_counter() - t0
    return state, tokens[:len(prompts)], logprobs[:len(prompts)], dt


def greedy_decode(fn, params, shape: StepShape, state, prompt_lens: list[int], first: np.ndarray, steps: int,
                  ids: RowIds):
    """Host loop (as the engine runs it): one numpy batch per step, tokens read back each step.
    Returns (state, tokens [n, steps + 1] incl. `first`, logprobs [n, steps], seconds per step)."""
    n = len(prompt_lens)
    toks = [np.asarray(first)]
    lps, times = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        rows = [ids.row(r, prompt_lens[r] + i, toks[-1][r:r + 1], shape) for r in range(n)]
        out, state = fn(params, state, pack_batch(shape, rows))
        t, lp = jax.device_get((out.tokens, out.logprobs))
        times.append(time.perf_counter() - t0)
        toks.append(t[:n])
        lps.append(lp[:n])
    return state, np.stack(toks, 1), np.stack(lps, 1) if lps else np.zeros((n, 0)), times


def _steps(fn, params, state, batch, n: int):
    """n steps back to back, each step's sampled tokens fed to the next on the device."""
    out = None
    for _ in range(n):
        out, state = fn(params, state, batch)
        batch = dataclasses.replace(batch, layout=dataclasses.replace(batch.layout, tokens=out.tokens))
    return out, state, batch


def time_decode(s: Setup, fn, params, shape: StepShape, state, ctx: int, ids: RowIds, rng, trace_dir: str = ""):
    """Steady-state decode at position ctx - 1 for every row. Returns (state, median synced
    seconds per step, pipelined seconds per step)."""
    b = shape.batch
    rows = [ids.row(r, ctx - 1, rng.randint(3, s.cfg.unpadded_vocab_size, 1), shape) for r in range(b)]
    batch = jax.device_put(pack_batch(shape, rows))
    out, state, batch = _steps(fn, params, state, batch, s.warmup)
    jax.block_until_ready((out, state))
    times = []
    for _ in range(s.iters):
        t0 = time.perf_counter()
        out, state, batch = _steps(fn, params, state, batch, 1)
        jax.block_until_ready((out, state))
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    out, state, batch = _steps(fn, params, state, batch, s.iters)
    jax.block_until_ready((out, state))
    pipelined = (time.perf_counter() - t0) / s.iters
    if trace_dir:
        with jax.profiler.trace(os.path.join(trace_dir, f"decode_B{b}_L{ctx}")):
            out, state, batch = _steps(fn, params, state, batch, 5)
            jax.block_until_ready((out, state))
    return state, statistics.median(times), pipelined


# ------------------------------------------------------------------------------ roofline


def expected_experts(cfg: ik.InklingConfig, b: int) -> float:
    """Distinct routed experts b tokens touch per MoE layer under uniform independent routing."""
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return e * (1.0 - (1.0 - k / e) ** b)


def decode_bytes(cfg: ik.InklingConfig, params, b: int, ctx: int) -> dict[str, float]:
    """Bytes one decode step must move: weights actually read (b embedding rows, every other
    non-expert weight, routed experts at the expected distinct count), K/V read (full layers
    ctx tokens, sliding min(ctx, window)) and the new token's K/V written, conv windows read
    and written."""
    item = jnp.dtype(params["unembed"].dtype).itemsize  # the arena's dtype
    h = cfg.hidden_size
    out = dict(weights=0.0, experts=0.0, kv=0.0, conv=0.0)
    frac = expected_experts(cfg, b) / cfg.n_routed_experts if cfg.has_moe else 0.0
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = [str(e.key) for e in path if isinstance(e, jax.tree_util.DictKey)]
        itemsize = jnp.dtype(x.dtype).itemsize
        nbytes = math.prod(x.shape) * itemsize
        if names[-1] == "embed":
            out["weights"] += min(b, x.shape[0]) * x.shape[1] * itemsize
        elif names[-2:] in (["mlp", "w13"], ["mlp", "w2"]) and x.ndim == 3:  # routed experts [E, ., .]
            out["experts"] += frac * nbytes
        else:
            out["weights"] += nbytes
    k1 = cfg.conv_kernel_size - 1
    for i in range(cfg.num_layers):
        g = cfg.layer_geometry(i)
        keys = ctx if g.window is None else min(ctx, g.window)
        out["kv"] += b * (keys + 1) * 2 * g.kv_dim * item  # read the context, write the new token
        out["conv"] += b * 2 * k1 * (2 * g.kv_dim + 2 * h) * item  # windows read + written
    out["total"] = sum(out.values())
    return out


# ---------------------------------------------------------------------------- comparisons


def state_diff(ids: RowIds, a, b, rows: int, n_pages: int) -> float:
    """Max |a - b| over the conv windows and sliding rings of rows 0..rows-1's slots and the
    full-attention K/V of their first n_pages pages (padding elements and sinks left out)."""
    lay = ids.layout
    slots = jnp.asarray([ids.slot(r) for r in range(rows)], jnp.int32)  # virtual == physical
    pages = jnp.asarray(np.concatenate([ids.pages(r, n_pages) for r in range(rows)]), jnp.int32)

    @jax.jit
    def diff(a, b):
        out = jnp.float32(0)
        d = lambda x, y: jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))
        for i, f in enumerate(lay.target):
            for fld in (f.conv, f.ring):
                if fld is not None:
                    out = jnp.maximum(out, d(read_slot_field(a, lay, slots, fld), read_slot_field(b, lay, slots, fld)))
            if lay.target_page_layer[i] is not None:
                pr = lay.page_row(pages, a.shape[0], lay.target_page_layer[i])
                out = jnp.maximum(out, d(a[pr], b[pr]))
        return out

    return float(diff(a, b))


def agreement(a: np.ndarray, b: np.ndarray) -> tuple[str, str, str]:
    """(first-token matches, position-wise matches, mean common prefix) of [n, t] token arrays."""
    n, t = a.shape
    first = int((a[:, 0] == b[:, 0]).sum())
    same = int((a == b).sum())
    prefix = [int(np.argmin(np.append(a[r] == b[r], False))) for r in range(n)]
    return f"{first}/{n}", f"{same}/{n * t} ({100 * same / (n * t):.0f}%)", f"{np.mean(prefix):.1f} / {t}"

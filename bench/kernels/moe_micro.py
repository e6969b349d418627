"""Routed-expert implementations on the bench config's shapes (bf16).

    python -m bench.kernels.moe_micro         a few tokens: dense (every expert), gather (w13[idx]
                                              copies), slices (dynamic slice per choice)
    python -m bench.kernels.moe_micro --many  many tokens: dense against jax.lax.ragged_dot
                                              (moe.ref.moe_experts_ragged) and the sorted-block grouped
                                              GEMM kernels (pallas_kernels/moe/grouped.py) per tiling
                                              (GPU); useful TFLOP/s count only the chosen experts
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from inkling_jax.config import InklingConfig
from pallas_kernels.moe import ref as L

from bench.common.helpers import median_seconds


TILINGS = ((64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (64, 128, 64, 4, 4), (128, 128, 32, 4, 3),
           (64, 64, 64, 4, 3), (128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 4, 4))
# bm, bn, bk, num_warps, num_stages


def expert_weights():
    """The bench config, a key, and random bf16 expert matrices w13 [E, h, 2f], w2 [E, f, h]."""
    cfg = InklingConfig.bench()
    e, h, f = cfg.n_routed_experts, cfg.hidden_size, cfg.expert_intermediate_size
    key = jax.random.key(0)
    w13 = (0.02 * jax.random.normal(key, (e, h, 2 * f), jnp.float32)).astype(jnp.bfloat16)
    w2 = (0.02 * jax.random.normal(jax.random.fold_in(key, 1), (e, f, h), jnp.float32)).astype(jnp.bfloat16)
    return cfg, key, w13, w2


def many(tokens=(64, 128, 512, 2048, 8192, 32768)) -> None:
    from pallas_kernels.moe import grouped

    cfg, key, w13, w2 = expert_weights()
    e, h, f, k = cfg.n_routed_experts, cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts_per_tok
    print(f"{jax.devices()[0].device_kind}: E={e} H={h} F={f} top-{k}")
    print("| n | impl (bm, bn, bk, warps, stages) | ms | useful TFLOP/s | vs dense | max |diff| vs dense |")
    print("|---:|---|---:|---:|---:|---:|")
    for n in tokens:
        x = jax.random.normal(jax.random.fold_in(key, 2), (n, h), jnp.float32).astype(jnp.bfloat16)
        logits = jax.random.normal(jax.random.fold_in(key, 3), (n, e))
        _, idx = jax.lax.top_k(logits, k)
        wt = jax.nn.softmax(jax.random.normal(jax.random.fold_in(key, 4), (n, k)), axis=-1)
        flops = 2 * n * k * 3 * h * f
        dense = jax.jit(L.moe_experts_dense)
        ref = np.asarray(dense(x, idx, wt, w13, w2), np.float32)
        t_dense = median_seconds(dense, x, idx, wt, w13, w2)
        print(f"| {n} | dense | {t_dense * 1e3:.3f} | {flops / t_dense / 1e12:.0f} | 1.00x | 0 |")
        ragged = jax.jit(L.moe_experts_ragged)  # XLA's grouped GEMM (jax.lax.ragged_dot)
        out = np.asarray(ragged(x, idx, wt, w13, w2), np.float32)
        t = median_seconds(ragged, x, idx, wt, w13, w2)
        print(f"| {n} | ragged_dot | {t * 1e3:.3f} | {flops / t / 1e12:.0f} | {t_dense / t:.2f}x | "
              f"{np.abs(out - ref).max():.2e} |")
        for bm, bn, bk, nw, ns in TILINGS:
            fn = jax.jit(lambda *a, t=(bm, bn, bk, nw, ns): grouped.moe_experts_grouped(
                *a, bm=t[0], bn=t[1], bk=t[2], num_warps=t[3], num_stages=t[4]))
            try:
                out = np.asarray(fn(x, idx, wt, w13, w2), np.float32)
                t = median_seconds(fn, x, idx, wt, w13, w2)
            except Exception as exc:  # a tiling Triton rejects: say so, keep going
                print(f"| {n} | grouped {(bm, bn, bk, nw, ns)} | failed: {type(exc).__name__}: {str(exc)[:80]} |")
                continue
            print(f"| {n} | grouped {(bm, bn, bk, nw, ns)} | {t * 1e3:.3f} | {flops / t / 1e12:.0f} | "
                  f"{t_dense / t:.2f}x | {np.abs(out - ref).max():.2e} |")


def main() -> None:
    if "--many" in sys.argv:
        return many()
    cfg, key, w13, w2 = expert_weights()
    e, h, f, k = cfg.n_routed_experts, cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts_per_tok
    print(f"{jax.devices()[0].device_kind}: E={e} H={h} F={f} top-{k}; expert bytes {2 * 3 * h * f / 1e6:.1f} MB")
    print("| n | impl | us | max |diff| vs dense |")
    print("|---:|---|---:|---:|")
    for n in (1, 2, 4, 8):
        x = jax.random.normal(jax.random.fold_in(key, 2), (n, h), jnp.float32).astype(jnp.bfloat16)
        idx = jnp.asarray(np.random.RandomState(n).permutation(e)[: n * k].reshape(n, k) % e, jnp.int32)
        wt = jnp.full((n, k), 0.25, jnp.float32)
        ref = None
        for name in ("dense", "gather", "slices"):
            fn = jax.jit(lambda x, i, w, a, b, name=name: L.MOE_IMPLS[name](x, i, w, a, b))
            out = jax.block_until_ready(fn(x, idx, wt, w13, w2))
            t = median_seconds(fn, x, idx, wt, w13, w2, reps=30)
            if ref is None:
                ref = np.asarray(out, np.float32)
            err = float(np.abs(np.asarray(out, np.float32) - ref).max())
            print(f"| {n} | {name} | {1e6 * t:.0f} | {err:.2e} |")


if __name__ == "__main__":
    main()

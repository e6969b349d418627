"""Routed-expert implementations for a few tokens on the bench config's shapes (bf16):
dense (every expert), gather (w13[idx] copies), slices (dynamic slice per choice).

    python bench/moe_micro.py
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from inkling_jax.config import InklingConfig  # noqa: E402
from inkling_jax.model import layers as L  # noqa: E402


def main() -> None:
    cfg = InklingConfig.bench()
    e, h, f, k = cfg.n_routed_experts, cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts_per_tok
    key = jax.random.key(0)
    w13 = (0.02 * jax.random.normal(key, (e, h, 2 * f), jnp.float32)).astype(jnp.bfloat16)
    w2 = (0.02 * jax.random.normal(jax.random.fold_in(key, 1), (e, f, h), jnp.float32)).astype(jnp.bfloat16)
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
            ts = []
            for _ in range(30):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(x, idx, wt, w13, w2))
                ts.append(time.perf_counter() - t0)
            if ref is None:
                ref = np.asarray(out, np.float32)
            err = float(np.abs(np.asarray(out, np.float32) - ref).max())
            print(f"| {n} | {name} | {1e6 * sorted(ts)[len(ts) // 2]:.0f} | {err:.2e} |")


if __name__ == "__main__":
    main()

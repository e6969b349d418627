"""The flash attention kernel (pallas_kernels/attention) per tiling on the bench model's
prefill shapes (bf16, H200): rows of fresh prompts, full layers (16 q heads over 2 kv heads,
every earlier token) and sliding layers (4 kv heads, window 512, an empty 512-key ring in
front of the new tokens, as the engine passes them).

    python -m bench.kernels.attention_micro [--cases 8x1024,1x8192]

Useful TFLOP/s count the allowed (causal / windowed) score and value products only."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention import pallas as attn

from bench.common.helpers import median_seconds

TILINGS = ((64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 4, 2), (64, 128, 4, 2), (128, 128, 8, 2), (64, 64, 4, 3),
           (128, 64, 8, 3))  # bq, bk, num_warps, num_stages


def inputs(b: int, q: int, hkv: int, ring: int, key):
    h, d, e = 16, 128, 1024
    ks = jax.random.split(key, 4)
    n_keys = ring + q
    qx = jax.random.normal(ks[0], (b, q, h, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, n_keys, hkv, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, n_keys, hkv, d), jnp.bfloat16)
    rel = (0.1 * jax.random.normal(ks[3], (b, q, h, e), jnp.float32)).astype(jnp.bfloat16)
    q_pos = jnp.broadcast_to(jnp.arange(q, dtype=jnp.int32), (b, q))
    k_pos = jnp.concatenate([jnp.full((b, ring), -1, jnp.int32), q_pos], axis=1)
    k_valid = k_pos >= 0
    return qx, k, v, rel, q_pos, k_pos, k_valid


def useful_flops(b: int, q: int, window: int | None) -> float:
    keys = np.arange(q) + 1 if window is None else np.minimum(np.arange(q) + 1, window)
    return 4.0 * b * 16 * 128 * float(keys.sum())


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="8x1024,1x8192")
    args = p.parse_args(argv)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    print("| case | layer | bq, bk, warps, stages | ms | useful TFLOP/s | vs default |")
    print("|---|---|---|---:|---:|---:|")
    key = jax.random.key(0)
    for case in args.cases.split(","):
        b, q = (int(x) for x in case.split("x"))
        for layer, hkv, ring, window in (("full", 2, 0, None), ("sliding", 4, 512, 512)):
            xs = inputs(b, q, hkv, ring, key)
            base = None
            for bq, bk, nw, ns in TILINGS:
                fn = jax.jit(lambda *a, t=(bq, bk, nw, ns), w=window: attn.attention(
                    *a, window=w, bq=t[0], bk=t[1], num_warps=t[2], num_stages=t[3]))
                try:
                    t = median_seconds(fn, *xs, reps=10)
                except Exception as exc:  # a tiling Triton rejects (registers, shared memory): say so
                    print(f"| {case} | {layer} | {bq}, {bk}, {nw}, {ns} | failed: {type(exc).__name__}: "
                          f"{str(exc)[:80]} | | |")
                    continue
                base = base or t
                print(f"| {case} | {layer} | {bq}, {bk}, {nw}, {ns} | {t * 1e3:.3f} | "
                      f"{useful_flops(b, q, window) / t / 1e12:.0f} | {base / t:.2f}x |")


if __name__ == "__main__":
    main()

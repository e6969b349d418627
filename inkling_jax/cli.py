"""inkling-generate: greedy continuations from the embedded default model (reference path).

The engine-backed generation loop replaces the body of `main` once the serving core lands;
the command line stays."""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from .config import InklingConfig
from .model import forward, init_params
from .tokenizer import ByteTokenizer

DEFAULT_PROMPTS = ["The short convolution remembers", "Attention with a sliding window"]


def load_model(spec: str, dtype=jnp.float32):
    if spec in ("tiny", "small", "bench"):
        cfg = getattr(InklingConfig, spec)()
        return cfg, init_params(cfg, jax.random.key(0), dtype=dtype)
    from .weights import load_pretrained
    return load_pretrained(spec, dtype=dtype)


def greedy_reference(params, cfg, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding by re-running the whole sequence, padded to one length (one compile)."""
    total = len(prompt) + max_new_tokens
    step = jax.jit(lambda p, t, n: forward(p, cfg, t)[0, n - 1])
    tokens = np.zeros((1, total), np.int32)
    tokens[0, :len(prompt)] = prompt
    for n in range(len(prompt), total):
        tokens[0, n] = int(jnp.argmax(step(params, jnp.asarray(tokens), n)))
    return tokens[0, len(prompt):].tolist()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="inkling-generate", description=__doc__)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prompt", action="append")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    cfg, params = load_model(args.model)
    tok = ByteTokenizer(cfg)
    prompts = args.prompt or DEFAULT_PROMPTS
    t0 = time.perf_counter()
    n = 0
    for text in prompts:
        ids = tok.encode(text)
        out = greedy_reference(params, cfg, ids, args.max_new_tokens)
        n += len(out)
        print(f"{text!r} -> {tok.decode(out)!r}  (ids {out})")
    dt = time.perf_counter() - t0
    print(f"{n} tokens in {dt:.2f}s ({n / dt:.1f} tok/s, reference forward, no cache)")


if __name__ == "__main__":
    main()

"""Decode step time with every logits processor on against off (issue 34's target: the
processors cost at most 5 % of a decode step), at batch 1 and 32, in the engine loop.

    python -m bench.serve.processors [--config small|bench|tiny] [--vocab N] [--batches 1,32]
                                     [--decode-steps K] [--prompt-len L] [--new N] [--rounds R] [--out F]
    python -m bench.serve.processors --smoke     # tiny model, few tokens: checks the script (~1 min on 2 cores)

Settings, each `--rounds` times in a rotating order, on one engine per batch (values are
arrays: all run the same compiled steps, which the warm-up compiles):

    greedy             temperature 0, nothing else
    greedy + proc      the same with every processor on: repetition 1.2, presence 0.5,
                       frequency 0.5, an 8-entry logit_bias, min_tokens = max_new_tokens (stop ids
                       suppressed throughout), min_p 0.05 (no effect on greedy rows) and logprobs 5
                       (top alternatives of every token)
    sampled            temperature 0.8, top-k 50, top-p 0.95 (what a request could ask before)
    sampled + proc     the same with every processor on

ms per token step = the decode phase's wall time / the tokens one row generated in it
(`bench.serve.loop.phases`); the table gives the median over the rounds (and the minimum) and
the processors' cost relative to the same setting without them. `--vocab N` replaces the model's
vocabulary size (the processors and the LM head scale with it; the real Inkling has 200,058).
Default model: `bench` on a GPU, `small` on the CPU (random weights).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import inkling_jax as ik

from bench.common.helpers import Report, device_params, log, table
from bench.serve.loop import decode_ms_per_token, phases

SETTINGS = ("greedy", "greedy + proc", "sampled", "sampled + proc")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", choices=("tiny", "small", "bench"), default=None)
    ap.add_argument("--vocab", type=int, default=None, help="replace the model's vocabulary size")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--decode-steps", type=int, default=None, help="K per dispatch (default: the engine's auto)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=64, help="tokens each request generates")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.config, args.prompt_len, args.new, args.rounds = args.config or "tiny", 16, 12, 1
        args.batches = "1,4"
    args.config = args.config or ("bench" if jax.default_backend() == "gpu" else "small")
    args.batches = [int(b) for b in args.batches.split(",")]
    return args


def model(args):
    cfg = getattr(ik.InklingConfig, args.config)(num_mtp_layers=0, mtp_local_layer_ids=())
    if args.vocab:
        cfg = cfg.replace(unpadded_vocab_size=args.vocab, vocab_size=-(-args.vocab // 256) * 256)
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" and not args.smoke else jnp.float32
    return cfg, device_params(cfg, 0, dtype)


def sampling(setting: str, args, vocab: int) -> ik.SamplingParams:
    base = dict(max_new_tokens=args.new, stop_at_eos=False)
    if setting.startswith("sampled"):
        base.update(temperature=0.8, top_k=50, top_p=0.95, seed=1)
    if not setting.endswith("proc"):
        return ik.SamplingParams(**base)
    bias = {int(t): float(b) for t, b in zip(np.linspace(3, vocab - 1, 8).astype(int), np.linspace(-2, 2, 8))}
    return ik.SamplingParams(**base, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5,
                             logit_bias=bias, min_tokens=args.new, logprobs=5, stop_token_ids=(3,))


def engine_config(args, batch: int) -> ik.EngineConfig:
    page = 16
    ctx = 1 << (args.prompt_len + args.new).bit_length()
    chunk = args.prompt_len
    step_tokens = 1 << max(batch * chunk, batch).bit_length()
    kw = {} if args.decode_steps is None else {"decode_steps": args.decode_steps}
    return ik.EngineConfig(max_running=batch, num_slots=batch + 8, num_pages=batch * (ctx // page) + 8, page_size=page,
                           track_interval=4 * page, chunk_size=chunk, max_step_tokens=step_tokens, max_context=ctx,
                           min_context_bucket=ctx, min_token_bucket=step_tokens, min_batch_bucket=batch,
                           prefix_cache=False, max_logprobs=5, warmup=True, **kw)


def measure(args, cfg, params, batch: int) -> dict[str, list[float]]:
    engine = ik.Engine(cfg, params, engine_config(args, batch))
    rng = np.random.RandomState(batch)
    prompts = [list(rng.randint(3, cfg.unpadded_vocab_size, args.prompt_len)) for _ in range(batch)]
    ms: dict[str, list[float]] = {s: [] for s in SETTINGS}
    compiles = engine.stats()["compiles"]
    for s in SETTINGS:  # untimed: the first dispatches of a program are slower
        sp = sampling(s, args, cfg.unpadded_vocab_size)
        phases(engine, prompts, dataclasses.replace(sp, max_new_tokens=4, min_tokens=min(sp.min_tokens, 4)))
    for r in range(args.rounds):
        for s in SETTINGS[r % len(SETTINGS):] + SETTINGS[:r % len(SETTINGS)]:
            ms[s].append(decode_ms_per_token(phases(engine, prompts, sampling(s, args, cfg.unpadded_vocab_size))))
    assert engine.stats()["compiles"] == compiles, "a setting compiled a program: the comparison would be unfair"
    log(f"batch {batch}: " + ", ".join(f"{s} {statistics.median(v):.3f} ms" for s, v in ms.items())
        + f" (K = {engine.runner.decode_steps})")
    return ms


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg, params = model(args)
    report = Report(args.out)
    log(f"{args.config} model, vocab {cfg.unpadded_vocab_size}, "
        f"{jax.default_backend()} ({jax.devices()[0].device_kind})")
    rows = []
    for b in args.batches:
        ms = measure(args, cfg, params, b)
        med = {s: statistics.median(v) for s, v in ms.items()}
        low = {s: min(v) for s, v in ms.items()}
        for base in ("greedy", "sampled"):
            on = f"{base} + proc"
            rows.append([b, base, f"{med[base]:.3f} ({low[base]:.3f})", f"{med[on]:.3f} ({low[on]:.3f})",
                         f"{100 * (med[on] / med[base] - 1):+.1f} %", f"{100 * (low[on] / low[base] - 1):+.1f} %"])
    report.add(f"## Logits processors: decode ms per token step ({args.config} model, vocab {cfg.unpadded_vocab_size}, "
               f"{jax.default_backend()}, prompt {args.prompt_len}, {args.new} new tokens, median (min) of "
               f"{args.rounds} rounds)\n\n"
               + table(["batch", "sampling", "processors off", "every processor on", "cost (medians)",
                        "cost (minima)"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The engine as a user sees it: `Engine.generate` (host loop included), timed end to end and
per phase, on a GPU. One run, sections chosen with --sections:

    python -m bench.serve.serve [--sections prefix,decode,prefill,verify,spec,fidelity,mesh,startup,flags] [--out FILE]
    python -m bench.serve.serve --smoke      # tiny sizes on CPU: checks the script, measures nothing

* prefix: the shared-system-prompt workload of issue 14 on the bench model (bf16, random
  weights): 32 requests of `--prompt-len` tokens sharing the first `--shared` ones, 128 new
  tokens each. The first request runs alone, then the other 31 together; the same with the
  prefix cache off. Cache-hit tokens (against the shared tokens that lie on checkpoint
  boundaries), time to first token (hit vs miss), end-to-end tokens/s.
* decode: batch 1, 8, 32 (`--decode-batches`) of `--prompt-len`-token prompts and 128 new
  tokens (cache off), for each K of `--decode-steps` (EngineConfig.decode_steps: K decode
  steps per dispatch; only K=1 on an engine without the field): prefill tokens/s and decode
  ms/step measured in the engine loop (submit -> every first token; then -> the last token).
  ms/step is per generated token step (decode wall time / the tokens a row generated after
  its first), so K=1 and K>1 compare; the dispatches are counted apart. Against the HBM
  roofline of a decode step at that context (bytes that must move / measured copy
  bandwidth: on a GPU the copy kernel's time from a profile; bench/decode/runs.py). Median
  of `--decode-reps` timed runs on one engine, with their range: B = 1 totals of one tree
  moved by up to 0.17 ms between device runs.
* prefill: issue 17's target, prefill >= 40 % of the bf16 peak (--peak-tflops) at 8 x 1k and
  1 x 8k (`--prefill-cases 8x1024,1x8192`; smoke: 2x32,1x128) in the engine loop: one engine
  per case with the whole case in one extend step where the config allows (chunk_size = L,
  max_step_tokens = N * L, context bucket L), max_new_tokens=1, prefix cache off, warmed up on a
  same-shape case; median over --prefill-reps of submit -> the last request's first token,
  extend steps, compiles (checked not to grow while timed), tok/s, and model TFLOP/s from the
  useful forward FLOPs per token (bench/serve/prefill.py, checked against param_shapes).
* verify: issue 17's lever 4, a speculative verify step's cost against a decode step's, on the
  bench model with its MTP depths (bf16, random weights: drafts are mostly rejected, so this
  times the steps, not speculation's gain): per batch size of --decode-batches, a plain engine
  and one with spec_steps = --spec-steps (both one model step per dispatch, no overlap, prefix
  cache off) on the same prompts; decode-phase ms per dispatch (a decode step, or a verify
  step with its drafting) and per generated token step, and whether the greedy outputs are
  equal (in exact arithmetic speculation changes nothing; in bf16 a verify step computes its
  positions together and may round a near-tie differently, so a "NO" there is a flag to look
  into, as bf16 is in gpu_check, not by itself a bug).
* spec: the shipped trained model (`inkling_jax/models/shakespeare`): mean accept length
  (bonus included) and acceptance per depth for spec_steps 1..3, tokens/s with and without
  speculation at batch 1 and 8, on Shakespeare-like prompts (greedy).
* fidelity: the trained model's bf16 greedy tokens (ours, batch 1 and 8; HF transformers'
  bf16 at batch 1 and 8) scored teacher-forced against HF's fp32 forward: the fraction of
  tokens that are the fp32 model's argmax, and the median |log p difference|.
* mesh: the bench model's decode ms/step through an engine on a one-device mesh against the
  decode section's K=1 figure without a mesh (issue 18: no slower).
* startup: fresh processes, nothing warm (bench/serve/fresh.py): `import inkling_jax`;
  `init_params` of the bench model (no MTP) in bf16 to `block_until_ready` (target <= 10 s);
  import -> params -> `Engine` (the batch-1 decode config, prefix cache off) -> the first
  `generate` of one `--prompt-len` prompt with 16 new tokens (target <= 20 s), once with the
  engine's persistent compile cache (`EngineConfig.compile_cache_dir`) in an empty temporary
  directory (cold) and once more in a new process on that filled directory (warm). --cache-dir
  does not reach these children.
* flags: the decode section at batch 1 and 32 again, a fresh process per XLA_FLAGS variant
  (`--flag-variants`, ";"-separated, each appended to the inherited XLA_FLAGS; default: none,
  and XLA's command buffers (CUDA graphs) for every command type at any graph size), every K
  of `--decode-steps`, against the first variant. A variant whose process fails (an unknown
  flag) shows its error line in the table.

Compile seconds are reported apart (the engine's own compile counter and seconds); a
persistent compilation cache (--cache-dir, default .jax_cache) makes repeated runs start fast.
The engine-loop helpers live in bench/serve/loop.py, the fresh-process sections in
bench/serve/fresh.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import inkling_jax as ik

from bench import REPO
from bench.common.helpers import Report, copy_bandwidth, device_params, log, table
from bench.decode.runs import decode_bytes
from bench.serve.fresh import section_flags, section_startup, startup_child
from bench.serve.loop import (bench_config, decode_ms_per_token, model_config, parse_decode_steps, phases, run,
                              tiny_config, warm)
from bench.serve.prefill import section_prefill

SECTIONS = ("prefix", "decode", "prefill", "verify", "spec", "fidelity", "mesh", "startup", "flags")
PROSE = ["To be, or not to be, that is the question:", "ROMEO. But soft, what light through yonder window",
         "Now is the winter of our discontent", "HAMLET. O, that this too too solid flesh would melt,",
         "All the world's a stage, and all the men and women", "KING LEAR. Blow, winds, and crack your cheeks!",
         "Friends, Romans, countrymen, lend me your ears;", "If music be the food of love, play on,"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--out", default="")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (checks the script)")
    p.add_argument("--prompt-len", type=int, default=1000)
    p.add_argument("--shared", type=int, default=960)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--cache-dir", default=os.path.join(REPO, ".jax_cache"))
    p.add_argument("--model", default="", help="trained model directory (default: the shipped one)")
    p.add_argument("--decode-batches", default=None, help="batch sizes of the decode section (default 1,8,32; "
                   "smoke: 1,2)")
    p.add_argument("--decode-steps", default="1", help="K decode steps per dispatch (EngineConfig.decode_steps) of "
                   "the decode and flags sections, a comma list")
    p.add_argument("--overlap", default="auto", help="decode section: EngineConfig.overlap values, comma-separated "
                   "from auto,on,off (on only with K > 1)")
    p.add_argument("--flag-variants", default=None, help="XLA_FLAGS variants of the flags section, ';'-separated "
                   "(default: none, and command buffers for everything; smoke: none, and a CPU flag)")
    p.add_argument("--flag-batches", default="1,32", help="batch sizes of the flags section (smoke: 1)")
    p.add_argument("--prefill-cases", default=None, help="prefill section: NxL cases, N prompts of L tokens "
                   "submitted together (default 8x1024,1x8192; smoke: 2x32,1x128)")
    p.add_argument("--prefill-kernels", default="pallas,jnp", help="prefill section, side by side: 'pallas' (the "
                   "engine's default on a GPU), 'ragged' (pallas with the many-token routed experts through "
                   "jax.lax.ragged_dot), 'jnp' (use_pallas=False); smoke: jnp")
    p.add_argument("--spec-steps", type=int, default=3, help="verify section: draft tokens per round")
    p.add_argument("--spec-rounds", default="auto", type=lambda v: v if v == "auto" else int(v),
                   help="spec section: verify rounds per dispatch of the multi-round rows (decode_steps)")
    p.add_argument("--few-token-bounds", default="0.5", help="verify section: values of "
                   "pallas_kernels.ops.FEW_TOKEN_KERNEL_CHOICES_PER_EXPERT to time the verify engine at, side by side "
                   "(e.g. 0.3333,0.5: the bound before and after 9f3d57e)")
    p.add_argument("--decode-reps", type=int, default=3, help="decode section: timed runs per case (median, range)")
    p.add_argument("--prefill-reps", type=int, default=3, help="prefill section: timed runs per case (median)")
    p.add_argument("--prefill-step-tokens", type=int, default=0, help="prefill section: cap on tokens per extend "
                   "step (0: the whole case, N x L)")
    p.add_argument("--peak-tflops", type=float, default=989.4, help="dense bf16 peak TFLOP/s of the device "
                   "(default: H200 SXM)")
    p.add_argument("--startup-warmup", action="store_true", help="startup: also cold / warm with "
                   "Engine.warmup(wait=False) before the first generate (what inkling-generate does)")
    p.add_argument("--startup-jnp", action="store_true", help="startup: also cold / warm with use_pallas=False "
                   "(in a child: this run's engine uses the jnp kernels)")
    p.add_argument("--startup-child", default="", metavar="DIR", help=argparse.SUPPRESS)  # serve_fresh's child
    p.add_argument("--child-out", default="", metavar="FILE", help=argparse.SUPPRESS)  # a child's JSON results
    return p.parse_args(argv)


# ------------------------------------------------------------------------------ sections


def section_prefix(args, cfg, params, report: Report) -> None:
    rng = np.random.RandomState(0)
    v = cfg.unpadded_vocab_size
    shared = list(rng.randint(3, v, args.shared))
    prompts = [shared + list(rng.randint(3, v, args.prompt_len - args.shared)) for _ in range(args.requests)]
    sp = ik.SamplingParams(max_new_tokens=args.new, stop_at_eos=False)
    rows, outs = [], []
    for prefix in (False, True):
        engine = ik.Engine(cfg, params, bench_config(args, args.requests, prefix))
        w = warm(engine, [list(rng.randint(3, v, args.prompt_len))], sp)
        first = run(engine, prompts[:1], sp)
        rest = run(engine, prompts[1:], sp)
        outs.append(first.outputs + rest.outputs)
        st = engine.stats()
        on_boundary = args.shared // engine.config.track_interval * engine.config.track_interval
        hit_frac = statistics.mean(c / on_boundary for c in rest.cached) if on_boundary else 0.0
        rows.append([f"cache {'on' if prefix else 'off'}", f"{first.ttft[0] * 1e3:.0f}",
                     f"{statistics.mean(rest.ttft) * 1e3:.0f}", f"{statistics.median(rest.ttft) * 1e3:.0f}",
                     f"{(first.tokens + rest.tokens) / (first.wall + rest.wall):.0f}",
                     f"{sum(rest.cached)} ({100 * hit_frac:.0f} % of {on_boundary} per request)",
                     f"{st['compiles']} / {st['compile_seconds']:.1f} s (warm-up run {w:.1f} s)"])
        log(f"prefix cache {'on' if prefix else 'off'}: {rows[-1]}")
    same = np.mean([a == b for x, y in zip(*outs) for a, b in zip(x, y)])
    report.add(f"### Prefix cache on a shared system prompt ({args.requests} requests x {args.prompt_len} tokens, "
               f"{args.shared} shared, {args.new} new; request 1 alone, then the others together)\n\n" + table(
                   ["run", "TTFT req 1 (ms)", "TTFT others mean (ms)", "median", "tokens/s end to end",
                    "cache-hit tokens (others)", "compiles"], rows)
               + f"\n\nGreedy tokens equal with the cache on and off: {100 * same:.1f} % (bf16, random weights:"
               f" a hit computes the prefix's state in other chunks than a miss, so near-ties may flip)", "prefix")


def outputs_digest(reqs) -> str:
    """Ten hex digits of a sha1 over every request's generated tokens, in submission order."""
    text = json.dumps([[int(t) for t in r.out_tokens] for r in reqs])
    return hashlib.sha1(text.encode()).hexdigest()[:10]


def section_decode(args, cfg, params, report: Report, bandwidth: float) -> dict:
    """Prefill and decode in the engine loop per batch size and K; {(B, K): decode ms/step}."""
    rng = np.random.RandomState(1)
    v = cfg.unpadded_vocab_size
    sp = ik.SamplingParams(max_new_tokens=args.new, stop_at_eos=False)
    rows, per_batch = [], {}
    for b in [int(x) for x in args.decode_batches.split(",")]:
        prompts = [list(rng.randint(3, v, args.prompt_len)) for _ in range(b)]
        ctx = args.prompt_len + args.new // 2
        roof_ms = 1e3 * decode_bytes(cfg, params, b, ctx)["total"] / bandwidth
        for k in args.decode_steps_list:
            for overlap in [o for o in args.overlap_list if k > 1 or o is not True]:
                config = bench_config(args, b, prefix=False, decode_steps=k)
                if overlap != "auto":
                    config = dataclasses.replace(config, overlap=overlap)
                engine = ik.Engine(cfg, params, config)
                # long enough for a dispatch of K steps
                warm(engine, prompts, ik.SamplingParams(max_new_tokens=max(4, 2 * k + 2), stop_at_eos=False))
                runs = []
                for _ in range(max(1, args.decode_reps)):
                    runs.append(phases(engine, prompts, sp))
                    engine.evict_all()
                times = sorted(decode_ms_per_token(r) for r in runs)
                digests = [outputs_digest(r["reqs"]) for r in runs]
                ms = statistics.median(times)
                ph = runs[0]
                on = engine.runner.overlap
                per_batch[(b, k) if overlap == "auto" else (b, k, on)] = ms
                spread = f" ({times[0]:.3f}-{times[-1]:.3f})" if len(times) > 1 else ""
                rows.append([b, k, "on" if on else "off", f"{b * args.prompt_len / ph['prefill_s']:.0f}",
                             ph["prefill_steps"], f"{ms:.3f}{spread}", f"{b * 1e3 / ms:.0f}",
                             f"{ph['decode_dispatches']} / {ph['decode_tokens']}", f"{roof_ms:.3f}",
                             f"{100 * roof_ms / ms:.0f} %", engine.stats()["compiles"],
                             digests[0] if len(set(digests)) == 1 else "differ: " + " ".join(digests)])
                log(f"decode B={b} K={k} overlap={on}: {rows[-1]}")
    report.add(f"### Engine loop: prefill and decode ({args.prompt_len}-token prompts, {args.new} new, bf16)\n\n"
               + table(["B", "K", "overlap", "prefill tok/s", "prefill steps", "decode ms/step", "decode tok/s",
                        "dispatches / token steps", "roofline ms", "% of roofline", "compiles", "outputs"], rows)
               + "\n\nK: decode steps per dispatch (EngineConfig.decode_steps). overlap: EngineConfig.overlap (the "
               "next decode dispatched before the last is read). ms/step: decode wall time / the "
               "tokens a row generated after its first token (per token step, whatever K), against the roofline of "
               "one decode step; median (range) of the timed runs. outputs: a digest of every request's "
               "greedy tokens, equal in every timed run (else each run's: a race would show here); trees or "
               "flags that must not change a result compare by it.", "decode")
    return per_batch


def section_verify(args, report: Report) -> None:
    """A verify step against a decode step in the engine loop (module docstring, verify)."""
    from inkling_jax.engine import runner as runner_mod
    from pallas_kernels import ops as kernel_bounds

    cfg = model_config(args.smoke)
    params = device_params(cfg, 0, jnp.float32 if args.smoke else jnp.bfloat16)
    spec = min(args.spec_steps, cfg.num_mtp_layers)
    bounds = [float(x) for x in args.few_token_bounds.split(",") if x.strip()]
    rng = np.random.RandomState(4)
    v = cfg.unpadded_vocab_size
    sp = ik.SamplingParams(max_new_tokens=args.new, stop_at_eos=False)
    default_bound = kernel_bounds.FEW_TOKEN_KERNEL_CHOICES_PER_EXPERT
    rows = []

    def timed(config) -> dict:
        engine = ik.Engine(cfg, params, config)
        warm(engine, prompts, ik.SamplingParams(max_new_tokens=8, stop_at_eos=False))
        runs = []
        for _ in range(max(1, args.decode_reps)):
            runs.append(phases(engine, prompts, sp))
            engine.evict_all()
        per_dispatch = sorted(1e3 * r["decode_s"] / max(r["decode_dispatches"], 1) for r in runs)
        return dict(ms=statistics.median(per_dispatch), lo=per_dispatch[0], hi=per_dispatch[-1],
                    token_ms=statistics.median(decode_ms_per_token(r) for r in runs),
                    digests={outputs_digest(r["reqs"]) for r in runs}, stats=engine.stats())

    try:
        for b in [int(x) for x in args.decode_batches.split(",")]:
            prompts = [list(rng.randint(3, v, args.prompt_len)) for _ in range(b)]
            base = dataclasses.replace(bench_config(args, b, prefix=False, decode_steps=1), spec_steps=0)
            kernel_bounds.FEW_TOKEN_KERNEL_CHOICES_PER_EXPERT = default_bound
            d = timed(base)
            for bound in bounds:
                # the few-token expert kernel's bound (pallas_kernels.ops, read at trace time): steps compiled afresh
                kernel_bounds.FEW_TOKEN_KERNEL_CHOICES_PER_EXPERT = bound
                runner_mod._COMPILED.clear()
                s_ = timed(dataclasses.replace(base, spec_steps=spec))
                runner_mod._COMPILED.clear()
                rows.append([b, spec, f"{bound:g}", f"{d['ms']:.3f} ({d['lo']:.3f}-{d['hi']:.3f})",
                             f"{s_['ms']:.3f} ({s_['lo']:.3f}-{s_['hi']:.3f})", f"{s_['ms'] / d['ms']:.2f}x",
                             f"{d['token_ms']:.3f}", f"{s_['token_ms']:.3f}",
                             f"{s_['stats']['mean_accept_length']:.2f}",
                             "yes" if d["digests"] == s_["digests"] and len(d["digests"]) == 1 else
                             f"NO: {sorted(d['digests'])} vs {sorted(s_['digests'])}"])
                log(f"verify B={b} bound={bound}: {rows[-1]}")
    finally:
        kernel_bounds.FEW_TOKEN_KERNEL_CHOICES_PER_EXPERT = default_bound
        runner_mod._COMPILED.clear()
    report.add(f"### Verify step against decode step (issue 17 lever 4; {args.prompt_len}-token prompts, "
               f"{args.new} new, {'fp32' if args.smoke else 'bf16'}, random weights)\n\n"
               + table(["B", "spec_steps", "few-token kernel bound", "decode ms / dispatch", "verify ms / dispatch",
                        "verify / decode", "decode ms / token step", "spec ms / token step", "mean accept length",
                        "greedy outputs equal"], rows)
               + "\n\nBoth engines: one model step per dispatch (decode_steps=1, no overlap), prefix cache off; "
               "median (range) of the timed runs' decode phase. A verify dispatch drafts with the MTP depths and "
               "checks spec_steps + 1 tokens per row. Few-token kernel bound: the verify engine's "
               "`pallas_kernels.ops.FEW_TOKEN_KERNEL_CHOICES_PER_EXPERT` (routed experts of n tokens by the grouped "
               "mat-vec "
               f"kernel up to n * k <= bound * E, else dense; {default_bound:g} is the library's, 1/3 the bound "
               "before it). Greedy outputs equal: the plain and the speculative engines' tokens; in bf16 a "
               "verify step may round a near-tie differently (a flag to look into, not by itself a bug). "
               "Random MTP heads: acceptance near zero, so the per-token figures show the cost of "
               "speculation, not its gain (the spec section measures that).", "verify")


def trained_model(args):
    from inkling_jax.models import model_dir

    path = args.model or model_dir("shakespeare")
    return path, *ik.load_pretrained(path, dtype=jnp.bfloat16)


def section_spec(args, report: Report) -> None:
    """Speculation's gain on the shipped model: for spec_steps 1..3, verify dispatches of one
    round (decode_steps=1) and of R rounds (--spec-rounds, default the engine's 'auto': 8 on a
    GPU), against the plain engine (decode_steps 'auto', overlapped) in the same run."""
    path, cfg, params = trained_model(args)
    from inkling_jax.tokenizer import ByteTokenizer

    tok = ByteTokenizer(cfg)
    new = 32 if args.smoke else 200
    sp = ik.SamplingParams(max_new_tokens=new, stop_at_eos=False)
    rows = []
    for b in (1, 8):
        prompts = [tok.encode(PROSE[i % len(PROSE)]) for i in range(b)]
        base = plain_tokens = None
        cases = [(0, "auto")] + [(spec, rounds) for spec in range(1, min(3, cfg.num_mtp_layers) + 1)
                                 for rounds in (1, args.spec_rounds)]
        for spec, rounds in cases:
            engine = ik.Engine(cfg, params, dataclasses.replace(tiny_config(b, spec), decode_steps=rounds))
            # 40 tokens: several dispatches, so the overlapped decode's feed program compiles here too
            warm(engine, prompts, ik.SamplingParams(max_new_tokens=40, stop_at_eos=False))
            before = engine.stats()
            t = run(engine, prompts, sp)
            st = engine.stats()
            tps = t.tokens / t.wall
            if (st["compiles"], st["compile_seconds"]) != (before["compiles"], before["compile_seconds"]):
                log(f"spec B={b} S={spec} R={rounds}: the timed run waited {st['compile_seconds']:.2f} s for "
                    f"{st['compiles'] - before['compiles']} new step program(s)")
            base = base or tps
            tokens = t.outputs
            plain_tokens = plain_tokens or tokens
            rows.append([b, spec, engine.runner.decode_steps if spec else "-",
                         st["verify_steps"] if spec else "-",
                         f"{st['mean_accept_length']:.2f}" if spec else "-",
                         " / ".join(f"{a:.2f}" for a in st["depth_acceptance"]) or "-",
                         f"{tps:.0f}", f"{tps / base:.2f}x",
                         "-" if not spec else ("yes" if tokens == plain_tokens else
                                               f"no ({sum(a == b_ for a, b_ in zip(tokens, plain_tokens))} / {b})")])
            log(f"spec B={b} S={spec} R={rounds}: {rows[-1]}")
    report.add(f"### Speculative decoding with the trained model ({os.path.basename(path)}, bf16, greedy, "
               f"{new} new tokens)\n\n" + table(["B", "spec_steps", "rounds / dispatch", "verify dispatches",
                                                  "mean accept length", "acceptance per depth", "tokens/s",
                                                  "vs no speculation", "plain's tokens"], rows)
               + "\n\nrounds / dispatch: the verify rounds a dispatch runs at most (decode_steps); the plain "
               "engine runs decode_steps 'auto' with overlap. plain's tokens: the speculative engine's greedy "
               "tokens equal the plain engine's (bf16: a near-tie may differ).", "spec")


def section_fidelity(args, report: Report) -> None:
    import torch
    from bench.decode.hf import hf_generate, oracle_scores

    from inkling_jax.hf_transformers import causal_lm
    from inkling_jax.tokenizer import ByteTokenizer

    path, cfg, params = trained_model(args)
    tok = ByteTokenizer(cfg)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    new = 16 if args.smoke else 64
    n_prompts = 8 if args.smoke else 32
    texts = [PROSE[i % len(PROSE)] + " " * (i // len(PROSE)) for i in range(n_prompts)]
    length = min(len(tok.encode(t)) for t in texts)
    prompts = np.asarray([tok.encode(t)[:length] for t in texts], np.int64)
    params32 = ik.cast_params(params, jnp.float32)
    oracle = causal_lm(cfg, params32, torch.float32, device)
    hf_bf16 = causal_lm(cfg, params, torch.bfloat16, device)
    for m in (oracle, hf_bf16):
        m.generation_config.eos_token_id, m.generation_config.pad_token_id = None, 0
    sp = ik.SamplingParams(max_new_tokens=new, stop_at_eos=False)
    rows = []
    for b in (1, 8):
        engine = ik.Engine(cfg, params, tiny_config(b, 0))
        done = engine.generate([list(map(int, p)) for p in prompts], sp)
        ours, ours_lp = np.asarray([c.tokens for c in done]), np.asarray([c.logprobs for c in done])
        hf = [hf_generate(hf_bf16, prompts[i:i + b], new, device, logits=True) for i in range(0, n_prompts, b)]
        hf_toks, hf_lp = np.concatenate([h[0] for h in hf]), np.concatenate([h[2] for h in hf])
        for who, toks, own_lp in (("inkling-jax bf16", ours, ours_lp), ("HF transformers bf16", hf_toks, hf_lp)):
            o = oracle_scores(oracle, prompts, toks, device)
            agree = float(np.mean(toks == o["argmax"]))
            dlp = float(np.median(np.abs(own_lp - o["lp"])))
            rows.append([who, b, f"{100 * agree:.1f} %", f"{dlp:.4f}"])
            log(f"fidelity {who} B={b}: {rows[-1]}")
    report.add(f"### bf16 fidelity of the trained model against HF fp32 ({n_prompts} prompts, {new} greedy tokens,"
               f" teacher-forced)\n\n" + table(["who", "B", "tokens = fp32 argmax",
                                                  "median |log p - fp32 log p| (nats)"], rows), "fidelity")


def section_mesh(args, cfg, params, report: Report, no_mesh: dict) -> None:
    import inspect

    if "mesh" not in inspect.signature(ik.Engine).parameters:
        report.add("### Mesh of one device\n\nskipped: this checkout's Engine takes no mesh", "mesh")
        return
    rng = np.random.RandomState(2)
    v = cfg.unpadded_vocab_size
    sp = ik.SamplingParams(max_new_tokens=args.new, stop_at_eos=False)
    rows = []
    for b in ((1,) if args.smoke else [int(x) for x in args.decode_batches.split(",")]):  # the decode section's
        prompts = [list(rng.randint(3, v, args.prompt_len)) for _ in range(b)]
        engine = ik.Engine(cfg, params, bench_config(args, b, prefix=False), mesh=ik.make_mesh(tp=1, ep=1))
        warm(engine, prompts, ik.SamplingParams(max_new_tokens=4, stop_at_eos=False))
        ph = phases(engine, prompts, sp)
        ms = decode_ms_per_token(ph)
        ref = no_mesh.get((b, 1))
        rows.append([b, f"{ms:.2f}", f"{ref:.2f}" if ref else "-", f"{ms / ref:.3f}" if ref else "-"])
        log(f"mesh B={b}: {rows[-1]}")
    report.add("### One-device mesh against no mesh (decode ms/step in the engine loop, K=1)\n\n"
               + table(["B", "mesh (1, 1)", "no mesh", "ratio"], rows), "mesh")


def main(argv=None) -> int:
    args = parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    bad = set(sections) - set(SECTIONS)
    if bad:
        raise SystemExit(f"unknown sections {sorted(bad)}; choose from {SECTIONS}")
    args.decode_steps_list = parse_decode_steps(args.decode_steps)
    args.overlap_list = [{"on": True, "off": False, "auto": "auto"}[o] for o in args.overlap.split(",")]
    args.decode_batches = args.decode_batches or ("1,2" if args.smoke else "1,8,32")
    args.prefill_cases = args.prefill_cases or ("2x32,1x128" if args.smoke else "8x1024,1x8192")
    if args.smoke:
        jax.config.update("jax_platforms", "cpu")
        args.prompt_len, args.shared, args.new, args.requests = 96, 80, 8, 4
    if args.startup_child:  # a fresh process of the startup section: no cache but the engine's own
        return startup_child(args)
    if args.cache_dir and not args.smoke:
        jax.config.update("jax_compilation_cache_dir", args.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    report = Report(args.out)
    dev = jax.devices()[0]
    report.add(f"## bench.serve.serve: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
               f"{getattr(dev, 'device_kind', dev.platform)}, jax {jax.__version__}", "head")
    need_bench = {"prefix", "decode", "prefill", "mesh"} & set(sections)
    cfg = params = None
    if need_bench:
        cfg = model_config(args.smoke, mtp=False)
        t0 = time.perf_counter()
        params = device_params(cfg, 0, jnp.float32 if args.smoke else jnp.bfloat16)
        jax.block_until_ready(params)
        log(f"params: {ik.model.layers.param_count(params) / 1e9:.2f} B in {time.perf_counter() - t0:.1f} s")
    decode_ms = {}
    if "prefix" in sections:
        section_prefix(args, cfg, params, report)
    if "decode" in sections or "mesh" in sections:
        # on a GPU the copy kernel's own time (profiler): the wall time of synced copies, median
        # or best of 20, moved from 2974 to 3699 GB/s between processes on 2026-12-04, and with
        # it every roofline figure; the kernel time read 4264 and 4265
        bandwidth = copy_bandwidth(1 << 20 if args.smoke else 1 << 30, jnp.bfloat16,
                                   device_time=jax.default_backend() == "gpu")
        log(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
        decode_ms = section_decode(args, cfg, params, report, bandwidth)
    if "prefill" in sections:
        section_prefill(args, cfg, params, report)
    if "verify" in sections:
        section_verify(args, report)
    if "spec" in sections:
        section_spec(args, report)
    if "fidelity" in sections:
        section_fidelity(args, report)
    if "mesh" in sections:
        section_mesh(args, cfg, params, report, decode_ms)
    if "startup" in sections:
        section_startup(args, report)
    if "flags" in sections:
        section_flags(args, report)
    if args.child_out:  # a child of the flags section
        with open(args.child_out, "w") as f:
            json.dump({"decode": {",".join(map(str, key)): ms for key, ms in decode_ms.items()}}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""GPU acceptance check: the engine's greedy outputs with use_pallas=True equal those with
use_pallas=False (same weights, same prompts), for the small preset in float32 and bfloat16,
and for speculative engines (the shipped trained model, float32, spec_steps 1 and 3) against
plain greedy.

    python -m bench.check.gpu_check [--outputs-out F.json]

`--outputs-out`: every engine's tokens and log-probs as JSON, to compare two processes bit for
bit (e.g. XLA flag variants that must not change a result: command-buffer scheduling modes,
`XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=SERIALIZE python -m bench.check.gpu_check ...`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import inkling_jax as ik


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--outputs-out", default="", help="write tokens and log-probs of every engine run (JSON)")
    args = ap.parse_args(argv)
    # float32 matmuls are TF32 on Hopper by default: ~1e-3 noise flips the near-ties of a random
    # model; the check wants true float32
    jax.config.update("jax_default_matmul_precision", "highest")
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}, matmul precision highest")
    ok = True
    dump = {}
    rng = np.random.RandomState(0)
    for name, dtype in (("small", jnp.float32), ("small", jnp.bfloat16)):
        cfg = getattr(ik.InklingConfig, name)().replace(num_mtp_layers=0, mtp_local_layer_ids=())
        params = ik.init_params(cfg, jax.random.key(0), dtype=dtype, std=0.05)
        prompts = [list(rng.randint(3, cfg.unpadded_vocab_size, n)) for n in (5, 40, 97, 13, 150, 61, 200)]
        sp = ik.SamplingParams(max_new_tokens=48, stop_at_eos=False)
        outs = {}
        for pallas in (False, True):
            eng = ik.Engine(cfg, params, ik.EngineConfig(
                max_running=4, num_slots=32, num_pages=128, page_size=16, track_interval=32, chunk_size=32,
                max_step_tokens=64, use_pallas=pallas, min_batch_bucket=4, min_token_bucket=64,
                min_context_bucket=512, max_context=512))
            t0 = time.perf_counter()
            first = eng.generate(prompts, sp)
            second = eng.generate(prompts, sp)  # prefix hits, compactions
            eng.check_invariants()
            dt = time.perf_counter() - t0
            outs[pallas] = (first, second)
            dump[f"{name}/{jnp.dtype(dtype).name}/pallas={pallas}"] = [
                [([int(t) for t in r.tokens], [float(x) for x in r.logprobs]) for r in run] for run in (first, second)]
            st = eng.stats()
            print(f"{name} {jnp.dtype(dtype).name} pallas={pallas}: {dt:.1f}s, compiles {st['compiles']}, "
                  f"cache_hit_tokens {st['cache_hit_tokens']}, moves {st['compaction_moves']}")
        same = all(a.tokens == b.tokens for run in (0, 1) for a, b in zip(outs[False][run], outs[True][run]))
        lp = max(float(np.max(np.abs(np.array(a.logprobs) - np.array(b.logprobs))))
                 for run in (0, 1) for a, b in zip(outs[False][run], outs[True][run]))
        hits = {p: all(a.tokens == b.tokens for a, b in zip(outs[p][0], outs[p][1])) for p in (False, True)}
        print(f"  greedy tokens pallas == jnp: {same}; max |logprob diff| {lp:.2e}; "
              f"second run (prefix hits) == first: jnp {hits[False]}, pallas {hits[True]}")
        ok &= same or dtype != jnp.float32  # bf16: reported, not required (rounding flips near-ties)
    ok &= check_speculative(rng, dump)
    if args.outputs_out:
        with open(args.outputs_out, "w") as f:
            json.dump(dump, f)
    print("GPU CHECK", "PASS" if ok else "FAIL")
    return 0 if ok else 1


def check_speculative(rng, dump: dict) -> bool:
    """Speculative engines on the shipped trained model (its MTP heads draft well: verify
    rounds accept 0 to spec_steps drafts, so the partial-accept paths run), float32, batch 1
    (the verify steps' 2 and 4 tokens take the few-token expert kernel and dense
    respectively): Pallas greedy tokens == jnp's == the plain (spec_steps=0) jnp engine's."""
    from inkling_jax.models import model_dir
    from inkling_jax.tokenizer import ByteTokenizer

    cfg, params = ik.load_pretrained(model_dir("shakespeare"), dtype=jnp.float32)
    tok = ByteTokenizer(cfg)
    prompts = [tok.encode(t) for t in ("HAMLET. To be, or not to be", "ROMEO. But soft, what light",
                                       "Now is the winter of our discontent")]
    sp = ik.SamplingParams(max_new_tokens=40, stop_at_eos=False)
    runs = {}
    for spec, pallas in [(0, False), (1, False), (1, True), (3, False), (3, True)]:
        eng = ik.Engine(cfg, params, ik.EngineConfig(
            max_running=1, num_slots=16, num_pages=64, page_size=16, track_interval=32, chunk_size=32,
            max_step_tokens=64, use_pallas=pallas, spec_steps=spec, min_batch_bucket=1, min_context_bucket=256,
            max_context=256))
        out = eng.generate(prompts, sp)
        eng.check_invariants()
        runs[spec, pallas] = out
        dump[f"shakespeare/float32/spec={spec}/pallas={pallas}"] = [([int(t) for t in r.tokens],
                                                                    [float(x) for x in r.logprobs]) for r in out]
        st = eng.stats()
        print(f"shakespeare float32 spec_steps={spec} pallas={pallas}: verify steps {st['verify_steps']}, "
              f"accepted drafts {st['accepted_draft_tokens']}")
    plain = [r.tokens for r in runs[0, False]]
    same = all([r.tokens for r in out] == plain for out in runs.values())
    lp = max(float(np.max(np.abs(np.array(a.logprobs) - np.array(b.logprobs))))
             for spec in (1, 3) for a, b in zip(runs[spec, False], runs[spec, True]))
    print(f"  speculative greedy tokens (pallas and jnp, spec_steps 1 and 3) == plain jnp: {same}; "
          f"max |logprob diff| pallas vs jnp {lp:.2e}")
    return same


if __name__ == "__main__":
    sys.exit(main())

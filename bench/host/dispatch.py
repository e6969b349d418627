"""The engine's cost per dispatch at batch 1, one model step per dispatch (CPU: the host's share).

    python -m bench.host.dispatch [--spec-steps 0,3] [--dispatches 800] [--repeats 3]

A tiny two-layer model (random weights) in small buckets, so that on a CPU a dispatch is mostly
the engine's host work: planning, packing and checking the batch, the call (its arguments'
transfer), reading the outputs back, committing them. Prints ms per dispatch for plain decode
(`decode_steps=1`) and for speculative verify dispatches (`spec_steps` S, one round each; random
MTP heads accept almost nothing, so a dispatch commits about one token), the median and range of
the repeats, each repeat generating 40 tokens per request until `--dispatches` dispatches ran.
On a GPU the same figures hold the device's step as well. To compare trees, run it from each
checkout (`python -m` takes the checkout's `inkling_jax`), alternating.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

import inkling_jax as ik

ENGINE = dict(max_running=2, num_slots=16, num_pages=64, page_size=4, track_interval=8, chunk_size=8,
              max_step_tokens=16, min_context_bucket=64, min_batch_bucket=1, decode_steps=1, prefix_cache=False)
PROMPT = [5, 6, 7, 8, 9]


def ms_per_dispatch(engine: ik.Engine, dispatches: int) -> float:
    """Generate 40-token completions of PROMPT until `dispatches` steps ran; wall ms per step."""
    sampling = ik.SamplingParams(max_new_tokens=40, stop_at_eos=False)
    start, t0 = engine.stats()["steps"], time.perf_counter()
    while engine.stats()["steps"] - start < dispatches:
        engine.generate([PROMPT], sampling)
    return 1e3 * (time.perf_counter() - t0) / (engine.stats()["steps"] - start)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec-steps", default="0,3", help="comma-separated spec_steps (0: plain decode)")
    ap.add_argument("--dispatches", type=int, default=800)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="40 dispatches, one repeat")
    args = ap.parse_args(argv)
    if args.smoke:
        args.dispatches, args.repeats = 40, 1
    cfg = ik.InklingConfig.tiny(num_layers=2, local_layer_ids=(0,))
    params = ik.init_params(cfg, jax.random.key(0))
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; {args.dispatches} dispatches x {args.repeats}\n")
    print("| spec_steps | ms per dispatch | runs |\n| ---: | ---: | --- |")
    for spec in (int(s) for s in args.spec_steps.split(",")):
        engine = ik.Engine(cfg, params, ik.EngineConfig(**ENGINE, spec_steps=spec))
        ms_per_dispatch(engine, 1)  # compile and warm
        runs = [ms_per_dispatch(engine, args.dispatches) for _ in range(args.repeats)]
        print(f"| {spec} | {statistics.median(runs):.3f} ({min(runs):.3f}-{max(runs):.3f}) | "
              f"{' / '.join(f'{r:.3f}' for r in runs)} |")


if __name__ == "__main__":
    main()

"""Where the engine loop's decode time goes on the GPU: the device's busy time against the
wall time of `Engine.step()` calls, and the idle gaps between dispatches (host work the
device waits for), from a jax profiler trace.

    python -m bench.profile.engine [--batch 1] [--decode-steps 8] [--new 64] [--smoke]
    python -m bench.profile.engine --spec-steps 3 [--batch 1]     verify steps instead

Bench model, bf16, 1000-token prompts, the engine config of bench.serve.serve's decode section
(with --spec-steps S: the bench model with its MTP depths, speculative decoding with S drafts,
one verify step per dispatch, and the figures per verify step rather than per token step).

After a warm-up generate, the same decode runs twice (each after its prefill, which is not
timed): once plainly, then under the profiler. Prints: the unprofiled ms per token step; the
profiled wall ms per token step, device busy ms per token step (sum of kernel times), the gaps
between kernels longer than --gap-us (count per dispatch, total, median, and grouped by the
kernels around them), and the device span of a dispatch (kernels between two such gaps).
Under the profiler XLA runs command buffers op by op (the host launches every kernel) unless
XLA_FLAGS has --xla_enable_command_buffers_during_profiling=true, so the profiled wall and
gaps overstate the host's share; the kernel times and launch counts are the point."""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import inkling_jax as ik

from bench.common.device_time import device_events, event_part, hlo_op_parts
from bench.common.helpers import device_params
from bench.serve.loop import bench_config, warm


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=1000)
    p.add_argument("--gap-us", type=float, default=100.0)
    p.add_argument("--top", type=int, default=30, help="kernels listed (by device time)")
    p.add_argument("--hlo-out", default="", help="write the optimized HLO of the engine's steps to this file")
    p.add_argument("--spec-steps", type=int, default=0, help="profile verify steps with this many drafts")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        jax.config.update("jax_platforms", "cpu")
        args.prompt_len, args.new = 96, 16
    no_mtp = {} if args.spec_steps else dict(num_mtp_layers=0, mtp_local_layer_ids=())
    cfg = ik.InklingConfig.tiny(**no_mtp) if args.smoke else ik.InklingConfig.bench(**no_mtp)
    params = device_params(cfg, 0, jnp.float32 if args.smoke else jnp.bfloat16)
    config = bench_config(args, args.batch, prefix=False, decode_steps=1 if args.spec_steps else args.decode_steps)
    engine = ik.Engine(cfg, params, dataclasses.replace(config, spec_steps=args.spec_steps))
    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(3, cfg.unpadded_vocab_size, args.prompt_len)) for _ in range(args.batch)]
    sp = ik.SamplingParams(max_new_tokens=args.new, stop_at_eos=False)
    warm(engine, prompts, sp)
    plain_ms, plain_steps, plain_tokens = decode_run(engine, prompts, sp, None)
    engine.evict_all()
    tdir = tempfile.mkdtemp(prefix="engine_trace_")
    traced_ms, step_ms, tokens = decode_run(engine, prompts, sp, tdir)
    wall = traced_ms * tokens / 1e3
    unit = "token step"
    if args.spec_steps:  # per verify step (one per dispatch) from here on
        # each run per its own verify steps: the two runs may accept different numbers of drafts
        plain_ms = plain_ms * plain_tokens / len(plain_steps)
        traced_ms, tokens = wall * 1e3 / len(step_ms), len(step_ms)
        unit = "verify step"
    print(f"unprofiled: {plain_ms:.3f} ms per {unit} (the same decode without the profiler, which runs XLA's "
          f"command buffers op by op: see bench/README.md)")
    events = sorted(device_events(tdir), key=lambda e: e.start_ns)
    print(f"{jax.devices()[0].device_kind}, B={args.batch}, K={engine.runner.decode_steps}, "
          f"spec_steps={args.spec_steps}, overlap={engine.runner.overlap}: "
          f"{len(step_ms)} dispatches, "
          f"{tokens} {unit}s, wall {wall * 1e3:.1f} ms = {wall * 1e3 / max(tokens, 1):.3f} ms per {unit}; "
          f"step() calls median {statistics.median(step_ms):.2f} ms")
    if not events:
        print("no device events (no GPU trace on this backend)")
        return
    busy = sum(e.duration_ns for e in events) / 1e6
    gaps, spans, start, end = [], [], events[0].start_ns, events[0].start_ns + events[0].duration_ns
    last = events[0]  # the kernel that ended last so far
    around = collections.defaultdict(list)  # (kernel before, kernel after) -> gap ms
    for e in events[1:]:
        gap = e.start_ns - end
        if gap > args.gap_us * 1e3:
            gaps.append(gap / 1e6)
            spans.append((end - start) / 1e6)
            around[(last.label, e.label)].append(gap / 1e6)
            start = e.start_ns
        if e.start_ns + e.duration_ns >= end:
            end, last = e.start_ns + e.duration_ns, e
    spans.append((end - start) / 1e6)
    print(f"device busy {busy:.1f} ms = {busy / max(tokens, 1):.3f} ms per {unit} ({100 * busy / (wall * 1e3):.0f} % "
          f"of the wall); {len(events)} kernels = {len(events) / max(tokens, 1):.0f} per {unit}")
    if gaps:
        print(f"gaps > {args.gap_us:.0f} us: {len(gaps)} ({len(gaps) / len(step_ms):.1f} per dispatch), total "
              f"{sum(gaps):.1f} ms = {sum(gaps) / max(tokens, 1):.3f} ms per {unit}, "
              f"median {statistics.median(gaps):.3f}"
              f" ms, max {max(gaps):.3f} ms")
    if around:  # what the device waited between: the host's work, a sync, a transfer
        print("gaps by the kernels around them (count, total ms, median ms: before -> after):")
        for (before, after), gs in sorted(around.items(), key=lambda kv: -sum(kv[1]))[:12]:
            print(f"  {len(gs):4d} {sum(gs):8.2f} {statistics.median(gs):7.3f}  {before[:70]} -> {after[:70]}")
    print(f"device spans between gaps: median {statistics.median(spans):.3f} ms, "
          f"{len(spans)} spans; per {unit} inside spans {sum(spans) / max(tokens, 1):.3f} ms")
    print_breakdown(events, max(tokens, 1), args.top, unit)
    if args.hlo_out:
        from inkling_jax.engine import runner

        with open(args.hlo_out, "w") as f:
            for fn in runner._COMPILED.values():
                f.write(fn.as_text() + "\n")


def decode_run(engine, prompts, sp, trace_dir: str | None) -> tuple[float, list[float], int]:
    """Submit the prompts, run their prefill (untimed), then time the decode steps, under the
    profiler when trace_dir is given: (ms per token step, each step() call's ms, token steps
    per row)."""
    reqs = engine.submit(prompts, sp)
    while any(not r.out_tokens for r in reqs):
        engine.step()
    first = sum(len(r.out_tokens) for r in reqs)
    step_ms = []
    with jax.profiler.trace(trace_dir) if trace_dir else contextlib.nullcontext():
        t0 = time.perf_counter()
        while engine.running:
            s = time.perf_counter()
            engine.step()
            step_ms.append(1e3 * (time.perf_counter() - s))
        wall = time.perf_counter() - t0
    tokens = (sum(len(r.out_tokens) for r in reqs) - first) // len(reqs)  # token steps per row
    return wall * 1e3 / max(tokens, 1), step_ms, tokens


def print_breakdown(events, tokens: int, top: int, unit: str = "token step") -> None:
    """Device time and launches per `unit` (tokens of them) by model part (the ops' named scopes, from the
    optimized HLO of every step the engine compiled) and by kernel."""
    from inkling_jax.engine import runner

    parts = {}
    for fn in runner._COMPILED.values():
        parts.update(hlo_op_parts(fn.as_text()))
    by_part, n_part = collections.Counter(), collections.Counter()
    by_kernel, n_kernel = collections.Counter(), collections.Counter()
    for e in events:
        part = event_part(e, parts)
        by_part[part] += e.duration_ns
        n_part[part] += 1
        by_kernel[f"{part}: {e.label}"] += e.duration_ns
        n_kernel[f"{part}: {e.label}"] += 1
    print(f"\nby part (us / {unit}, launches / {unit}):")
    for name, t in by_part.most_common():
        print(f"{t / tokens / 1e3:9.1f} {n_part[name] / tokens:7.1f}  {name}")
    print(f"\ntop {top} kernels (us / {unit}, launches / {unit}):")
    for name, t in by_kernel.most_common(top):
        print(f"{t / tokens / 1e3:9.1f} {n_kernel[name] / tokens:7.1f}  {name[:160]}")


if __name__ == "__main__":
    main()

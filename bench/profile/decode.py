"""Where a compiled decode step spends its time on the GPU: per-kernel device time from a
jax profiler trace, and the arena-sized copies in the optimized HLO.

    python -m bench.profile.decode --out DIR [--batches 1,8,32] [--context 1024]
    python -m bench.profile.decode --out DIR --prefill [--prefill-cases 8x1024,1x8192] [--chunk 4096]

Builds the bench model and state as bench.decode.decode does, compiles the Pallas decode step
for each batch size, writes its optimized HLO to DIR, runs a few warm steps, traces 10
steps and prints, per batch: device time per step, the ops that take it (summed per
kernel name over the traced steps / 10, the largest first) and every HLO `copy` whose
result is arena-sized (a whole-arena copy around an in-place update).

`--prefill` profiles extend steps instead: for a case BxL, B rows each prefilling the last
min(L, chunk) tokens of an L-token prompt (the step that attends to the longest context),
one extend shape per case."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import statistics
import time

import jax
import numpy as np

from inkling_jax import steps
from inkling_jax.steps import program as step_program
from inkling_jax.steps import pack_batch

from bench.common.device_time import device_events, event_part, hlo_op_parts
from bench.common.helpers import device_params
from bench.decode.runs import time_decode
from bench.decode.setup import compile_all, decode_shape, make_setup, make_state, parse_args


def parse_profile_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--jnp", action="store_true", help="profile the jnp steps instead of the Pallas ones")
    p.add_argument("--xla", default="", help="extra XLA compile options for the steps, key=value[;key=value]")
    p.add_argument("--prefill", action="store_true", help="profile extend steps (--prefill-cases) instead of decode")
    p.add_argument("--prefill-cases", default="8x1024,1x8192", help="BxL: B prompts of L tokens")
    p.add_argument("--smoke", action="store_true", help="the tiny config on the CPU (checks the script)")
    p.add_argument("--chunk", type=int, default=4096, help="--prefill: tokens per row per step (at most)")
    return p.parse_args(argv)


def arena_copies(hlo: str, num_units: int) -> list[str]:
    """HLO `copy` instructions whose result has the arena's leading dimension."""
    return [line.strip()[:220] for line in hlo.split("\n")
            if re.search(r"= [a-z0-9]+\[%d[,\]]" % num_units, line) and re.search(r"\bcopy\(", line)]


def traced_steps(fn, params, state, batch, trace_dir: str, n: int = 10):
    """n steps under the profiler, each step's tokens fed to the next. Returns the state."""
    with jax.profiler.trace(trace_dir):
        for _ in range(n):
            out, state = fn(params, state, batch)
            batch = dataclasses.replace(batch, layout=dataclasses.replace(batch.layout, tokens=out.tokens))
        jax.block_until_ready((out, state))
    return state


def print_profile(args, b: int | str, pallas: bool, med: float, pipe: float, comp, copies: list[str], tdir: str,
                  what: str = "decode") -> None:
    """Per-kernel device time per step (the largest first), kernels per step, the arena-sized
    copies; writes DIR/ops_B{b}.tsv."""
    tot = collections.Counter()
    cnt = collections.Counter()
    by_part, n_part = collections.Counter(), collections.Counter()
    parts = hlo_op_parts(comp.fn.as_text())
    lines = set()
    first, last = float("inf"), 0.0
    for ev in device_events(tdir):
        tot[ev.label] += ev.duration_ns
        cnt[ev.label] += 1
        part = event_part(ev, parts)
        by_part[part] += ev.duration_ns
        n_part[part] += 1
        lines.add(ev.line)
        first, last = min(first, ev.start_ns), max(last, ev.start_ns + ev.duration_ns)
    step_us = sum(tot.values()) / 10 / 1e3
    span_ms = (last - first) / 10 / 1e6 if cnt else 0.0
    where = f"B={b} L={args.context}" if what == "decode" else str(b)
    print(f"\n=== {what} {where} ({'Pallas' if pallas else 'jnp'}): synced {med * 1e3:.3f} ms, "
          f"pipelined {pipe * 1e3:.3f} ms, device busy {step_us / 1e3:.3f} ms/step (first kernel to last: "
          f"{span_ms:.3f} ms/step), "
          f"{sum(cnt.values()) / 10:.0f} kernels/step; XLA temp {comp.temp_bytes / 1e6:.0f} MB; lines {sorted(lines)}")
    print(f"arena-sized copies in the HLO ({len(copies)}):")
    for c in copies[:12]:
        print("   ", c)
    print(f"by part: {'us/step':>9} {'n/step':>6}")
    for name, t in by_part.most_common():
        print(f"{t / 10 / 1e3:9.1f} {n_part[name] / 10:6.1f}  {name}")
    print(f"{'us/step':>9} {'n/step':>6}  op")
    for name, t in tot.most_common(args.top):
        print(f"{t / 10 / 1e3:9.1f} {cnt[name] / 10:6.1f}  {name[:150]}")
    for name, t in tot.items():
        if "emcpy" in name or "emset" in name:
            print(f"    memcpy/memset: {name[:100]}: {cnt[name] / 10:.1f}/step, {t / 10 / 1e3:.1f} us/step")
    with open(os.path.join(args.out, f"ops_{what}_{str(b).split()[0]}.tsv"), "w") as f:
        for name, t in tot.most_common():
            f.write(f"{t / 10 / 1e3:.2f}\t{cnt[name] / 10:.1f}\t{name}\n")


def profile_prefill(args, pallas: bool) -> None:
    """Per case BxL: the extend step of B rows each feeding the last min(L, chunk) tokens."""
    cases = [tuple(int(v) for v in c.split("x")) for c in args.prefill_cases.split(",") if c]
    longest = max(n for _, n in cases)
    base_b, base_c = ("2", "16") if args.smoke else ("8", "1024")  # make_setup's HF batch and context
    s = make_setup(parse_args(["--batches", ",".join(sorted({str(b) for b, _ in cases} | {base_b}, key=int)),
                               "--contexts", ",".join(sorted({base_c, str(longest)}, key=int))]
                              + (["--smoke"] if args.smoke else [])))
    s = dataclasses.replace(s, prefill_long=max(s.prefill_long, longest))
    params = device_params(s.cfg, 0, s.dtype)
    ids, state = make_state(s)
    rng = np.random.RandomState(0)
    for b, n in cases:
        q = min(n, args.chunk)
        shape = steps.StepShape("extend", b, b * q, q, n // s.page_size)
        comp = compile_all(s, params, state, [(shape, pallas)], 1)[(shape, pallas)]
        hlo = comp.fn.as_text()
        tag = f"{b}x{n}"
        with open(os.path.join(args.out, f"extend_{tag}.hlo.txt"), "w") as f:
            f.write(hlo)
        rows = [ids.row(r, n - q, rng.randint(3, s.cfg.unpadded_vocab_size, q), shape) for r in range(b)]
        batch = jax.device_put(pack_batch(shape, rows))
        out, state = comp.fn(params, state, batch)
        jax.block_until_ready((out, state))
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            out, state = comp.fn(params, state, batch)
            jax.block_until_ready((out, state))
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(5):
            out, state = comp.fn(params, state, batch)
        jax.block_until_ready((out, state))
        pipe = (time.perf_counter() - t0) / 5
        tdir = os.path.join(args.out, f"trace_{tag}")
        with jax.profiler.trace(tdir):
            for _ in range(10):
                out, state = comp.fn(params, state, batch)
            jax.block_until_ready((out, state))
        med = statistics.median(times)
        print(f"\n{tag}: {b * q} tokens per step (rows at positions {n - q}..{n - 1}): "
              f"{b * q / med:.0f} tok/s synced, {b * q / pipe:.0f} pipelined")
        print_profile(args, f"{tag} (T={b * q}, Q={q}, P={shape.pages})", pallas, med, pipe, comp,
                      arena_copies(hlo, state.arena.shape[0]), tdir, what="extend")


def main(argv=None) -> None:
    args = parse_profile_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for kv in filter(None, args.xla.split(";")):
        key, _, value = kv.partition("=")
        step_program.GPU_STEP_OPTIONS[key] = value
    print(f"step compile options: {step_program.GPU_STEP_OPTIONS}")
    if args.prefill:
        return profile_prefill(args, not args.jnp and not args.smoke)
    s = make_setup(parse_args(["--batches", args.batches, "--contexts", str(args.context)]))
    params = device_params(s.cfg, 0, s.dtype)
    ids, state = make_state(s)
    n_units = state.arena.shape[0]
    pallas = not args.jnp
    for b in s.batches:
        shape = decode_shape(s, b, args.context)
        comp = compile_all(s, params, state, [(shape, pallas)], 1)[(shape, pallas)]
        hlo = comp.fn.as_text()
        with open(os.path.join(args.out, f"decode_B{b}.hlo.txt"), "w") as f:
            f.write(hlo)
        rng = np.random.RandomState(0)
        state, med, pipe = time_decode(s, comp.fn, params, shape, state, args.context, ids, rng)
        rows = [ids.row(r, args.context - 1, rng.randint(3, s.cfg.unpadded_vocab_size, 1), shape) for r in range(b)]
        tdir = os.path.join(args.out, f"trace_B{b}")
        state = traced_steps(comp.fn, params, state, jax.device_put(pack_batch(shape, rows)), tdir)
        print_profile(args, b, pallas, med, pipe, comp, arena_copies(hlo, n_units), tdir)


if __name__ == "__main__":
    main()

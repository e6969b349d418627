"""Where a compiled decode step spends its time on the GPU: per-kernel device time from a
jax profiler trace, and the arena-sized copies in the optimized HLO.

    python bench/profile_decode.py --out DIR [--batches 1,8,32] [--context 1024]

Builds the bench model and state as bench/decode.py does, compiles the Pallas decode step
for each batch size, writes its optimized HLO to DIR, runs a few warm steps, traces 10
steps and prints, per batch: device time per step, the ops that take it (summed per
kernel name over the traced steps / 10, the largest first) and every HLO `copy` whose
result is arena-sized (a whole-arena copy around an in-place update)."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from common import device_params  # noqa: E402
from decode_runs import time_decode  # noqa: E402
from decode_setup import compile_all, decode_shape, make_setup, make_state, parse_args  # noqa: E402
from device_time import device_events  # noqa: E402

from inkling_jax import steps  # noqa: E402
from inkling_jax.steps import pack_batch  # noqa: E402


def parse_profile_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--jnp", action="store_true", help="profile the jnp steps instead of the Pallas ones")
    p.add_argument("--xla", default="", help="extra XLA compile options for the steps, key=value[;key=value]")
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
            batch = dataclasses.replace(batch, tokens=out.tokens)
        jax.block_until_ready((out, state))
    return state


def print_profile(args, b: int, pallas: bool, med: float, pipe: float, comp, copies: list[str], tdir: str) -> None:
    """Per-kernel device time per step (the largest first), kernels per step, the arena-sized
    copies; writes DIR/ops_B{b}.tsv."""
    tot = collections.Counter()
    cnt = collections.Counter()
    lines = set()
    first, last = float("inf"), 0.0
    for ev in device_events(tdir):
        tot[ev.label] += ev.duration_ns
        cnt[ev.label] += 1
        lines.add(ev.line)
        first, last = min(first, ev.start_ns), max(last, ev.start_ns + ev.duration_ns)
    step_us = sum(tot.values()) / 10 / 1e3
    span_ms = (last - first) / 10 / 1e6 if cnt else 0.0
    print(f"\n=== decode B={b} L={args.context} ({'Pallas' if pallas else 'jnp'}): synced {med * 1e3:.3f} ms, "
          f"pipelined {pipe * 1e3:.3f} ms, device busy {step_us / 1e3:.3f} ms/step (first kernel to last: "
          f"{span_ms:.3f} ms/step), "
          f"{sum(cnt.values()) / 10:.0f} kernels/step; XLA temp {comp.temp_bytes / 1e6:.0f} MB; lines {sorted(lines)}")
    print(f"arena-sized copies in the HLO ({len(copies)}):")
    for c in copies[:12]:
        print("   ", c)
    print(f"{'us/step':>9} {'n/step':>6}  op")
    for name, t in tot.most_common(args.top):
        print(f"{t / 10 / 1e3:9.1f} {cnt[name] / 10:6.1f}  {name[:150]}")
    for name, t in tot.items():
        if "emcpy" in name or "emset" in name:
            print(f"    memcpy/memset: {name[:100]}: {cnt[name] / 10:.1f}/step, {t / 10 / 1e3:.1f} us/step")
    with open(os.path.join(args.out, f"ops_B{b}.tsv"), "w") as f:
        for name, t in tot.most_common():
            f.write(f"{t / 10 / 1e3:.2f}\t{cnt[name] / 10:.1f}\t{name}\n")


def main(argv=None) -> None:
    args = parse_profile_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for kv in filter(None, args.xla.split(";")):
        key, _, value = kv.partition("=")
        steps.GPU_STEP_OPTIONS[key] = value
    print(f"step compile options: {steps.GPU_STEP_OPTIONS}")
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

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

_p = argparse.ArgumentParser()
_p.add_argument("--out", required=True)
_p.add_argument("--batches", default="1,8,32")
_p.add_argument("--context", type=int, default=1024)
_p.add_argument("--top", type=int, default=25)
_p.add_argument("--jnp", action="store_true", help="profile the jnp steps instead of the Pallas ones")
_p.add_argument("--xla", default="", help="extra XLA compile options for the steps, key=value[;key=value]")
ARGS = _p.parse_args()
sys.argv = [sys.argv[0], "--batches", ARGS.batches, "--contexts", str(ARGS.context)]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import decode as D  # noqa: E402  (parses the sys.argv above)
import jax  # noqa: E402
import numpy as np  # noqa: E402
from device_time import device_events  # noqa: E402


def main() -> None:
    os.makedirs(ARGS.out, exist_ok=True)
    from inkling_jax import steps

    for kv in filter(None, ARGS.xla.split(";")):
        key, _, value = kv.partition("=")
        steps.GPU_STEP_OPTIONS[key] = value
    print(f"step compile options: {steps.GPU_STEP_OPTIONS}")
    s = D.make_setup(D.ARGS)
    cfg = s.cfg
    params = D.device_params(cfg, 0, s.dtype)
    D.params_ref[0] = params
    ar, state = D.make_state(s)
    n_units = state.arena.shape[0]
    pallas = not ARGS.jnp
    for b in s.batches:
        shape = D.decode_shape(s, b, ARGS.context)
        comp = D.compile_all(s, params, state, [(shape, pallas)], 1)[(shape, pallas)]
        hlo = comp.fn.as_text()
        open(os.path.join(ARGS.out, f"decode_B{b}.hlo.txt"), "w").write(hlo)
        copies = [l.strip()[:220] for l in hlo.split("\n")
                  if re.search(r"= [a-z0-9]+\[%d[,\]]" % n_units, l) and re.search(r"\bcopy\(", l)]
        rng = np.random.RandomState(0)
        state, med, pipe = D.time_decode(s, comp.fn, shape, state, ARGS.context, ar, rng)
        tdir = os.path.join(ARGS.out, f"trace_B{b}")
        rows = [(ar.slot(r), ARGS.context - 1, rng.randint(3, cfg.unpadded_vocab_size, 1), ar.pages(r, shape.pages))
                for r in range(b)]
        batch = jax.device_put(D.make_batch(s, shape, rows))
        with jax.profiler.trace(tdir):
            for _ in range(10):
                out, state = comp.fn(params, state, batch)
                batch = dataclasses.replace(batch, tokens=out.tokens)
            jax.block_until_ready((out, state))
        tot = collections.Counter()
        cnt = collections.Counter()
        lines = set()
        first, last = float("inf"), 0.0
        for ev in device_events(tdir):
            line, name, start, dur = ev.line, ev.label, ev.start_ns, ev.duration_ns
            tot[name] += dur
            cnt[name] += 1
            lines.add(line)
            first, last = min(first, start), max(last, start + dur)
        step_us = sum(tot.values()) / 10 / 1e3
        span_ms = (last - first) / 10 / 1e6 if cnt else 0.0
        print(f"\n=== decode B={b} L={ARGS.context} ({'Pallas' if pallas else 'jnp'}): synced {med * 1e3:.3f} ms, "
              f"pipelined {pipe * 1e3:.3f} ms, device busy {step_us / 1e3:.3f} ms/step (first kernel to last: "
              f"{span_ms:.3f} ms/step), "
              f"{sum(cnt.values()) / 10:.0f} kernels/step; XLA temp {comp.temp_bytes / 1e6:.0f} MB; lines {sorted(lines)}")
        print(f"arena-sized copies in the HLO ({len(copies)}):")
        for c in copies[:12]:
            print("   ", c)
        print(f"{'us/step':>9} {'n/step':>6}  op")
        for name, t in tot.most_common(ARGS.top):
            print(f"{t / 10 / 1e3:9.1f} {cnt[name] / 10:6.1f}  {name[:150]}")
        memcpy = [(n, t, cnt[n]) for n, t in tot.items() if "emcpy" in n or "emset" in n]
        for n, t, c in memcpy:
            print(f"    memcpy/memset: {n[:100]}: {c / 10:.1f}/step, {t / 10 / 1e3:.1f} us/step")
        with open(os.path.join(ARGS.out, f"ops_B{b}.tsv"), "w") as f:
            for name, t in tot.most_common():
                f.write(f"{t / 10 / 1e3:.2f}\t{cnt[name] / 10:.1f}\t{name}\n")


if __name__ == "__main__":
    main()

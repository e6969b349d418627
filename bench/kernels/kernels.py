"""Pallas conv-state / slot / MoE kernels against their jnp (XLA) references, on the GPU.

    python -m bench.kernels.kernels [--out kernels.md]  # InklingConfig.bench() streams, K=4, bf16 arena, batch 1/32/256
    python -m bench.kernels.kernels --sweep [grid|default] [--compare-module M] [--moe-sweep] [--proj-sweep]
    python -m bench.kernels.kernels --smoke    # tiny sizes, interpret mode: runs anywhere (CPU) in about a minute

For every (kernel, stream, batch) it first checks the kernel against the reference on random
batches (random slot permutations, padded rows, rows without state, commit_len 0, checkpoints)
and prints PASS / FAIL, then times both: jitted, state donated, `reps` ops unrolled in one jit
with an L2 flush kernel (`l2_flush`, 256 MB) between ops, `iters` calls under the jax
profiler. The time of an op is its device (kernel) time from the trace, the flush kernels
left out, median over the iters * reps ops; so launches and host dispatch are not in it, and
every op finds its data in HBM as a decode step does. Reported per op: the time, launches,
bytes that must move / time as a fraction of the device copy bandwidth (a 2 GB copy, device
time), and the time of a device copy of the same byte count (`same_size_copy`: what any
kernel of that size can reach). With --smoke (CPU, no trace) times are wall time / reps.

--sweep grid times the conv_update kernel over channel blocks and warps on the cases that
matter (--sweep default: the default plan only), and on the extend cases over tokens per
program (tile 1-8); --compare-module M also times M.conv_update (M a module name importable
from the repository root, e.g. pallas_kernels._prev_conv_state for an earlier
pallas_kernels/conv_state/pallas.py copied into pallas_kernels/). --moe-sweep times the MoE
grouped mat-vec kernel's tiles; --proj-sweep the batch-1 attention projections' mat-vec tiles
and split counts against XLA's padded GEMM.

check: `exact` = arena (outside the sink) and y bit for bit; `y~ e` = arena exact, y within
e (max |diff| / max |y|; the reference's fp32 accumulation order on GPU is XLA's choice);
`FAIL ...` otherwise.

Modules: bench.kernels.cases (sizes, inputs, one case per kernel), bench.kernels.timing (the
rep loop, L2 flushes, device time), bench.kernels.sweeps (--sweep, --moe-sweep); this module
runs them and prints the tables.
"""


from __future__ import annotations

import argparse
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pallas_kernels as pk

from bench.common.helpers import copy_bandwidth
from bench.kernels.cases import (EXTEND_L, Row, Setup, conv_update_case, conv_write_case, make_setup, moe_case,
                                 slot_cases)
from bench.kernels.sweeps import moe_sweep, projection_sweep, sweep
from bench.kernels.timing import FLUSH_BYTES


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, interpret mode (CPU)")
    p.add_argument("--batches", default="", help="comma-separated batch sizes (default 1,32,256)")
    p.add_argument("--iters", type=int, default=0)
    p.add_argument("--reps", type=int, default=0)
    p.add_argument("--sweep", nargs="?", const="grid", default="", choices=["grid", "default"],
                   help="also time the conv_update kernel on the sweep cases: every block / warp choice (grid), "
                        "or the default plan only (with --compare-module: side by side)")
    p.add_argument("--moe-sweep", action="store_true", help="also time the MoE kernel's tile choices")
    p.add_argument("--proj-sweep", action="store_true", help="also time the batch-1 attention projections' "
                   "mat-vec tiles and splits")
    p.add_argument("--compare-module", default="", help="with --sweep: also time this module's conv_update")
    p.add_argument("--out", default="", help="also write the table(s) to this markdown file")
    return p.parse_args(argv)


def run_cases(s: Setup, ops, rng) -> list[Row]:
    """Every kernel case of the setup, each checked, timed and printed as it finishes."""
    rows: list[Row] = []

    def run(label, fn):
        t0 = time.perf_counter()
        try:
            out = fn()
        except Exception as exc:  # noqa: BLE001 - report and carry on
            traceback.print_exc()
            out = [Row(label[0], label[1], "ERROR", error=f"{type(exc).__name__}: {exc}"[:120])]
        out = out if isinstance(out, list) else [out]
        for r in out:
            if r.t_pallas is not None and r.nbytes:
                r.t_copy = s.timer.same_size_copy(r.nbytes)
            us = f"Pallas {r.t_pallas.seconds * 1e6:.2f} us, XLA {r.t_ref.seconds * 1e6:.2f} us" if r.t_pallas else ""
            print(f"{'PASS' if r.passed else 'FAIL'} {r.kernel} [{r.shape}]: {r.check} {us} "
                  f"({time.perf_counter() - t0:.1f}s)", flush=True)
        rows.extend(out)

    for b in s.batches:
        for name, (f, ch) in s.streams.items():
            run(("conv_update decode", f"{name}, B={b}"), lambda: conv_update_case(s, ops, name, f, ch, b, 1, rng))
        for name, (f, ch) in s.streams.items():
            run(("conv_write verify", f"{name}, B={b}"), lambda: conv_write_case(s, ops, name, f, ch, b, rng))
        run(("slot ops", f"B={b}"), lambda: slot_cases(s, ops, b, rng))
    for b in s.extend_batches:
        for name, (f, ch) in s.streams.items():
            q = 4 if s.interpret else EXTEND_L
            run(("conv_update extend", f"{name}, B={b}"), lambda: conv_update_case(s, ops, name, f, ch, b, q, rng))
    for n in s.moe_tokens:
        run(("moe_experts", f"n={n}"), lambda: moe_case(s, ops, n, rng))
    return rows


def results_table(rows: list[Row], bw: float) -> list[str]:
    lines = ["| kernel | shape | check | Pallas µs | XLA µs | speedup | kernels (Pallas / XLA) | MB moved "
             "| Pallas % copy BW | XLA % copy BW | same-size copy µs | Pallas % of same-size copy |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.t_pallas is None:
            lines.append(f"| {r.kernel} | {r.shape} | {r.check} {r.error} | | | | | | | | | |")
            continue
        tp, tr = r.t_pallas.seconds, r.t_ref.seconds
        frac = lambda t: 100 * r.nbytes / t / bw
        kern = f"{r.t_pallas.kernels:g} / {r.t_ref.kernels:g}" if r.t_pallas.kernels is not None else ""
        tc = r.t_copy.seconds if r.t_copy else float("nan")
        lines.append(f"| {r.kernel} | {r.shape} | {r.check} | {tp * 1e6:.2f} | {tr * 1e6:.2f} | {tr / tp:.2f}x | "
                     f"{kern} | {r.nbytes / 1e6:.3f} | {frac(tp):.1f}% | {frac(tr):.1f}% | {tc * 1e6:.2f} | "
                     f"{100 * tc / tp:.0f}% |")
    return lines


def sweep_tables(swept: list, moe_swept: list, bw: float) -> list[str]:
    lines = []
    if swept:
        lines += ["", "conv_update kernel: channel block and warps (Pallas only)", "",
                  "| case | block | warps | check | Pallas µs | % copy BW |", "|---|---:|---:|---|---:|---:|"]
        for shape, block, warps, r in swept:
            t = r.t_pallas.seconds if r.t_pallas else float("nan")
            lines.append(f"| {shape} | {block} | {warps} | {r.check} | {t * 1e6:.2f} | "
                         f"{100 * r.nbytes / t / bw:.1f}% |")
    if moe_swept:
        lines += ["", "Grouped mat-vec kernel: tiles (MoE gate|up) and the batch-1 projections' tiles and splits "
                  "(vs XLA's padded GEMM)", "",
                  "| case | check | Pallas µs | % copy BW |", "|---|---|---:|---:|"]
        for label, r in moe_swept:
            t = r.t_pallas.seconds if r.t_pallas else float("nan")
            lines.append(f"| {label} | {r.check} | {t * 1e6:.2f} | {100 * r.nbytes / t / bw:.1f}% |")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.smoke and jax.default_backend() != "gpu":
        print(f"backend is {jax.default_backend()!r}: run on a GPU, or pass --smoke", file=sys.stderr)
        return 2
    s = make_setup(args)
    ops = pk.conv_ops(True, interpret=s.interpret)
    rng = np.random.RandomState(0)
    head = (f"jax {jax.__version__}, {jax.devices()[0].device_kind}, interpret={s.interpret}; "
            f"K={s.k}, {jnp.dtype(s.dtype).name} arena; {s.lay.describe()}")
    print(head, flush=True)
    if s.timer.flush:
        s.timer.start_flushes()
        print(f"L2 flush: {FLUSH_BYTES >> 20} MB pass between timed ops, kernels {sorted(s.timer.flush_kernels)}")
    bw = copy_bandwidth(s.copy_elems, s.dtype, iters=max(s.timer.iters, 5), device_time=s.timer.flush)
    print(f"device copy bandwidth: {bw / 1e9:.0f} GB/s (read + write)", flush=True)

    rows = run_cases(s, ops, rng)
    swept = sweep(s, rng, args.compare_module, grid=args.sweep == "grid") if args.sweep else []
    moe_swept = moe_sweep(s, rng) if args.moe_sweep else []
    moe_swept += projection_sweep(s, rng) if args.proj_sweep else []

    unit = "device µs (kernels only, L2 flushed between ops)" if s.timer.flush else "wall µs / op"
    lines = [head, "", f"Pallas vs XLA reference; copy bandwidth {bw / 1e9:.0f} GB/s; {jax.devices()[0].device_kind}; "
             f"{unit}, median of {s.timer.iters} x {s.timer.reps} ops", ""]
    lines += results_table(rows, bw) + sweep_tables(swept, moe_swept, bw)
    failed = [r for r in rows + [x[3] for x in swept] + [x[1] for x in moe_swept] if not r.passed]
    lines += ["", "ALL PASS" if not failed else f"{len(failed)} FAILED"]
    print()
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

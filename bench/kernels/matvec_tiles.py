"""The grouped mat-vec kernel's tiling at batch-1 decode, against the device's copy rate.

    python -m bench.kernels.matvec_tiles [--budget S] [--out FILE]   (GPU)
    python -m bench.kernels.matvec_tiles --smoke                     (CPU, interpret mode, tiny)

A batch-1 decode step of the bench preset runs one token through k = 4 routed + 2 shared
experts per MoE layer: two grouped mat-vec products of m = 6 rows, gate|up (h 2048 -> 2f 2048)
and down (f 1024 -> h 2048), 50.3 + 25.2 MB of bf16 weights a layer, the largest part of the
step's HBM bytes. This times `moe.pallas.grouped_matvec` on both shapes per tiling, device time
with L2 flushed between ops (`bench.kernels.timing.Timer`), as a fraction of the device's own
copy of the same bytes (read + write of the weight bytes: what a read-only kernel can at best
approach), each result checked against the fp32 reference. An op is the kernel and the fusion
after it that sums its splits (the engine pays both); its output's first h columns feed the next
op, F >= h here. Stages:

    A  every (tf, bh, num_warps) with the default split rule, on the gate|up shape
    B  the best of A on the down shape, and with each split count and with a fori_loop body
       pipelined over num_stages 2-3 (max_unroll 0), on both shapes
    C  `moe_experts_with_shared` (the engine's joined routed + shared call, both products, the
       act prologue, the combine) at the library's defaults and the best tilings of B

Stages A / B stop adding variants at 55 / 80 % of `--budget` seconds, C at all of it and prints what it has (on an
H100 a variant took ~15 s, most of it the profiler's trace: the untried wide tiles come first).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from inkling_jax.config import InklingConfig
from pallas_kernels.moe import pallas as moe_pallas
from pallas_kernels.moe import ref as moe_ref

from bench.common.helpers import table
from bench.kernels.cases import rel_err
from bench.kernels.timing import Timer

T0 = time.perf_counter()


def _shapes(cfg):
    """{name: (h, F)} of the two expert products (contracting h, F output columns)."""
    h, f = cfg.hidden_size, cfg.expert_intermediate_size
    return {"gate|up": (h, 2 * f), "down": (f, h)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--budget", type=float, default=420.0)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    cfg = InklingConfig.tiny() if args.smoke else InklingConfig.bench()
    interpret = args.smoke
    e, k, s_sh = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts
    m = k + s_sh
    timer = Timer(jnp.bfloat16, iters=2 if args.smoke else 5, reps=1 if args.smoke else 10, flush=not args.smoke)
    if not args.smoke:
        timer.start_flushes()
    key = jax.random.key(0)
    rng = np.random.RandomState(0)
    idx = jnp.asarray(rng.permutation(e)[:m], jnp.int32)
    data = {}
    for i, (name, (h, f)) in enumerate(_shapes(cfg).items()):
        w = (0.02 * jax.random.normal(jax.random.fold_in(key, i), (e, h, f), jnp.float32)).astype(jnp.bfloat16)
        x = jax.random.normal(jax.random.fold_in(key, 10 + i), (m, h), jnp.float32).astype(jnp.bfloat16)
        with jax.default_matmul_precision("highest"):
            want = moe_ref.grouped_matvec(x.astype(jnp.float32), idx, w.astype(jnp.float32))
        nbytes = m * h * f * 2
        copy = timer.same_size_copy(2 * nbytes)  # the copy reads nbytes and writes nbytes
        data[name] = (h, f, w, x, want, nbytes, copy.seconds)
    sizes = "; ".join(f"{n} {d[0]}x{d[1]} {d[5] / 1e6:.1f} MB, same-size copy {d[6] * 1e6:.2f} us"
                      for n, d in data.items())
    print(f"{jax.devices()[0].device_kind}: m={m} rows; {sizes}", flush=True)

    rows: list[list] = []
    results: dict[tuple, float] = {}

    def run(stage, name, tf, bh, warps, splits=None, stages=1, unroll=moe_pallas.MAX_UNROLL) -> float:
        h, f, w, x, want, nbytes, copy_s = data[name]
        kw = dict(tf=tf, bh=bh, num_warps=warps, splits=splits, num_stages=stages, max_unroll=unroll,
                  interpret=interpret)
        try:
            grid = moe_pallas.grid_for(m, h, f, tf=tf, bh=bh, splits=splits)
        except ValueError:
            return float("nan")
        label = [stage, name, tf, bh, warps, grid[2] if grid else "-", stages if unroll == 0 else "unrolled"]
        try:
            got = jax.jit(lambda x_: moe_pallas.grouped_matvec(x_, idx, w, **kw))(x)
            err = float(rel_err(got, want))
            # y's first h columns, rounded, are the next op's x: a data dependence, so the rep
            # loop's calls are not merged into one (they were, with x passed through unchanged)
            op = lambda x_: moe_pallas.grouped_matvec(x_, idx, w, **kw)[:, :h].astype(x_.dtype)
            t = timer.timed(op, x.copy(), ()).seconds
            ok = "ok" if err <= 1e-2 else "FAIL"
            rows.append(label + [f"{t * 1e6:.2f}", f"{nbytes / t / 1e9:.0f}", f"{copy_s / t:.2f}", f"{ok} {err:.1e}"])
        except Exception as exc:  # noqa: BLE001 - report and carry on
            t = float("nan")
            rows.append(label + ["ERROR", "", "", f"{type(exc).__name__}: {exc}"[:80]])
        results[(name, tf, bh, warps, splits, stages, unroll)] = t
        print(" | ".join(str(c) for c in rows[-1]), f"[{time.perf_counter() - T0:.0f}s]", flush=True)
        return t

    def out_of_time(share: float = 1.0) -> bool:  # stages A / B / C end at 55 / 80 / 100 % of the budget
        return time.perf_counter() - T0 > share * args.budget

    tfs, bhs, warps_ = ((32, 64), (16, 32), (2, 4)) if args.smoke else ((256, 512, 128, 64), (32, 64, 16),
                                                                      (2, 4, 8, 1))
    # A: tiles x warps on gate|up, the library's defaults first
    run("A", "gate|up", moe_pallas.TF, moe_pallas.BH, moe_pallas.NUM_WARPS)
    for tf in tfs:
        for bh in bhs:
            for wp in warps_:
                if out_of_time(0.55):
                    break
                if (tf, bh, wp) != (moe_pallas.TF, moe_pallas.BH, moe_pallas.NUM_WARPS):
                    run("A", "gate|up", tf, bh, wp)
    a = sorted((t, key_) for key_, t in results.items() if key_[0] == "gate|up" and np.isfinite(t))
    best = [key_[1:4] for _, key_ in a[:4]]
    # B: the best tiles on down, with other split counts, and as a pipelined fori_loop
    for tf, bh, wp in [(moe_pallas.TF, moe_pallas.BH, moe_pallas.NUM_WARPS)] + best:
        if not out_of_time(0.8):
            run("B", "down", tf, bh, wp)
    for tf, bh, wp in best[:2]:
        for name in data:
            h, f = data[name][:2]
            grid = moe_pallas.grid_for(m, h, f, tf=tf, bh=bh)
            if grid is None:  # the reference at this shape: no split count to vary
                continue
            auto = grid[2]
            for sp in (auto // 4, auto // 2, auto * 2, auto * 4):
                if sp >= 1 and not out_of_time(0.8):
                    run("B", name, tf, bh, wp, splits=sp)
            for st in (2, 3):
                if not out_of_time(0.8):
                    run("B", name, tf, bh, wp, stages=st, unroll=0)
    header = ["stage", "product", "tf", "bh", "warps", "splits", "stages", "device us", "GB/s", "vs copy", "check"]
    text = [f"# grouped mat-vec tiles at batch 1 ({jax.devices()[0].device_kind})", "",
            table(header, rows)]

    # C: the engine's joined call with one tiling for both products
    h, two_f = data["gate|up"][:2]
    w13, w2 = data["gate|up"][2], data["down"][2]
    sh13 = w13[:s_sh]
    sh2 = w2[:s_sh]
    x1 = data["gate|up"][3][:1]
    idx1 = idx[:k][None]
    wt = jnp.full((1, k), 1.0 / k, jnp.float32)
    gamma = jnp.full((1, s_sh), 0.5, jnp.float32)
    want = moe_ref.experts(x1, idx1, wt, w13, w2, sh13, sh2, gamma, gated=True)
    layer_bytes = m * (h * two_f + two_f // 2 * h) * 2
    crow = []
    for tf, bh, wp in [(moe_pallas.TF, moe_pallas.BH, moe_pallas.NUM_WARPS)] + best[:3]:
        if out_of_time():
            break
        kw = dict(tf=tf, bh=bh, num_warps=wp, interpret=interpret)
        fn = lambda x_: moe_pallas.moe_experts_with_shared(x_, idx1, wt, w13, w2, sh13, sh2, gamma, gated=True, **kw)
        try:
            got = jax.jit(fn)(x1)
            err = float(rel_err(got, want))
            t = timer.timed(fn, x1.copy(), ())
            crow.append([tf, bh, wp, f"{t.seconds * 1e6:.2f}", t.kernels, f"{layer_bytes / t.seconds / 1e9:.0f}",
                         f"{err:.1e}"])
        except Exception as exc:  # noqa: BLE001
            crow.append([tf, bh, wp, "ERROR", "", "", f"{type(exc).__name__}: {exc}"[:80]])
        print(" | ".join(str(c) for c in crow[-1]), flush=True)
    text += ["", f"## moe_experts_with_shared, one token ({layer_bytes / 1e6:.1f} MB of expert weights)", "",
             table(["tf", "bh", "warps", "device us", "kernels", "GB/s", "rel err vs ref"], crow)]
    report = "\n".join(text)
    print("\n" + report, flush=True)
    if args.out:
        with open(args.out, "w") as f_:
            f_.write(report + "\n")


if __name__ == "__main__":
    main()

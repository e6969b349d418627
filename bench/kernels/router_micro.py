"""The MoE router epilogue kernel (`pallas_kernels/moe/router.py`) over its tile choices, on the GPU.

    python -m bench.kernels.router_micro [--rows 1,8,32,256,4096] [--out router.md]
    python -m bench.kernels.router_micro --smoke     # interpret mode on the CPU: checks only, no times

Bench model shapes (E = 32 routed experts, S = 2 sinks, top-4, route_scale 8). For every
token count n and (block_rows, num_warps) it checks the kernel against `router_epilogue_ref`
(ids equal, weights within 1e-5 relative) and times it: the kernel's device time from a
profiler trace, median of `--iters` calls. The row "ref (XLA)" is the jnp reference's kernels
summed per call. The kernel's default tile is marked.
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.moe import router

from bench.common.device_time import traced_device_events
from bench.common.helpers import Report, table

E, S, K, ROUTE_SCALE = 32, 2, 4, 8.0


def inputs(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.normal(0, 2, (n, E + S)), jnp.float32)
    bias = jnp.asarray(rng.normal(0, 0.1, (E,)), jnp.float32)
    scale = jnp.asarray([1.5], jnp.float32)
    return logits, bias, scale


def per_call_us(fn, args, iters: int, name: str | None) -> float:
    """Median device time of one call (kernels whose name contains `name`, or all)."""
    jax.block_until_ready(fn(*args))
    events = traced_device_events(lambda: jax.block_until_ready([fn(*args) for _ in range(iters)]))
    events = [e for e in events if name is None or name in e.kernel]
    if name is not None:
        return statistics.median(e.duration_ns for e in events) / 1e3 if events else float("nan")
    return sum(e.duration_ns for e in events) / iters / 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=None)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        jax.config.update("jax_platforms", "cpu")
    rows_list = [int(x) for x in (args.rows or ("1,32" if args.smoke else "1,8,32,256,4096")).split(",")]
    gpu = jax.default_backend() == "gpu"
    report = Report(args.out)
    kw = dict(k=K, route_scale=ROUTE_SCALE)
    ref = jax.jit(lambda lg, b, s: router.router_epilogue_ref(lg, b, s, **kw))
    lines = []
    for n in rows_list:
        args_n = inputs(n)
        want = ref(*args_n)
        default = (router.default_block_rows(n, E + S), router.default_num_warps(router.default_block_rows(n, E + S),
                                                                                  E + S))
        if gpu:
            lines.append([n, "ref (XLA)", "-", "-", f"{per_call_us(ref, args_n, args.iters, None):.2f}", "-"])
        for br in (1, 2, 4, 8, 16):
            if br > max(1, n) * 2:
                continue
            for nw in (1, 2, 4):
                fn = jax.jit(lambda lg, b, s, br=br, nw=nw: router.router_epilogue(
                    lg, b, s, block_rows=br, num_warps=nw, interpret=not gpu, **kw))
                got = fn(*args_n)
                ok = bool(np.array_equal(np.asarray(got[0]), np.asarray(want[0]))) and all(
                    np.allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6) for g, w in zip(got[1:], want[1:]))
                us = per_call_us(fn, args_n, args.iters, "moe_router_epilogue") if gpu else float("nan")
                mark = " (default)" if (br, nw) == default else ""
                lines.append([n, f"kernel{mark}", br, nw, f"{us:.2f}", "ok" if ok else "FAIL"])
                print(lines[-1], flush=True)
    dev = jax.devices()[0]
    report.add(f"### Router epilogue kernel, {getattr(dev, 'device_kind', dev.platform)}, jax {jax.__version__}: "
               f"E = {E}, S = {S}, k = {K}; us per call (device time, median of {args.iters})\n\n"
               + table(["n", "what", "block_rows", "num_warps", "us", "check"], lines))
    return 0 if all(r[-1] != "FAIL" for r in lines) else 1


if __name__ == "__main__":
    raise SystemExit(main())

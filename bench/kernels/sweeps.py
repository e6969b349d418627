"""The sweeps of bench.kernels.kernels: the conv_update kernel's channel block / warps / token
tile on the cases that matter, the MoE grouped mat-vec kernel's tiles, and the lone-row
attention projections' mat-vec tiles and split counts against XLA's padded GEMM."""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
import inkling_jax as ik
import numpy as np
import pallas_kernels as pk
from pallas_kernels.conv_state import pallas as conv_pallas
from pallas_kernels.moe import pallas as moe_pallas
from pallas_kernels.moe import ref as moe_ref

from bench.kernels.cases import EXTEND_L, Row, Setup, conv_update_case, moe_weights, rel_err

SWEEP_CASES = [("attn", 256, 1), ("attn", 32, 1), ("k (full", 256, 1), ("k (full", 1, EXTEND_L),
               ("attn", 32, EXTEND_L), ("k (full", 32, EXTEND_L), ("k (sliding", 32, EXTEND_L)]


def _try_case(s: Setup, name, f, ch, b, q, rng, **tuning) -> Row:
    try:
        return conv_update_case(s, None, name, f, ch, b, q, rng, trials=1, time_ref=False, **tuning)
    except Exception as exc:  # noqa: BLE001 - report and carry on
        return Row("conv_update", f"{name}, B={b}", "ERROR", error=f"{type(exc).__name__}: {exc}"[:100])


def _us(row: Row) -> float:
    return row.t_pallas.seconds * 1e6 if row.t_pallas else float("nan")


def _compare_module(s: Setup, module: str, name, f, ch, b, q, rng) -> Row:
    """The default plan of `module.conv_update` (the kernel's signature) on one case."""
    other = importlib.import_module(module)
    ops = dataclasses.replace(pk.conv_ops(True, s.interpret),
                              conv_update=functools.partial(other.conv_update, interpret=s.interpret))
    return conv_update_case(s, ops, name, f, ch, b, q, rng, trials=1, time_ref=False)


def _block_warps(s: Setup, name, f, ch, b, q, rng, default, grid: bool) -> list[tuple[str, int, int, Row]]:
    """Every (block, num_warps) choice (grid), or the default plan only."""
    out = []
    width = ch[1] - ch[0]
    for block in (b_ for b_ in (16, 32, 64, 128, 256, 512, 1024, 2048) if width // 16 <= b_ <= width):
        for warps in (1, 2, 4, 8):
            if not 64 <= block // warps <= 512 and warps != 1:
                continue
            if not grid and (block, warps) != (default.block, default.num_warps):
                continue
            row = _try_case(s, name, f, ch, b, q, rng, block=block, num_warps=warps)
            mark = " (default)" if (default.block, default.num_warps) == (block, warps) else ""
            out.append((row.shape + mark, block, warps, row))
            print(f"sweep {row.shape}{mark} block={block} warps={warps}: {row.check} {_us(row):.2f} us", flush=True)
    return out


def _tiles(s: Setup, name, f, ch, b, q, rng, default) -> list[tuple[str, int, int, Row]]:
    """Extend: tokens per program, at the default block and warps."""
    out = []
    default_tile = conv_pallas.token_tile(b * q, b, default.nblocks, default.num_warps)
    for tile in (1, 2, 4, 8):
        row = _try_case(s, name, f, ch, b, q, rng, block=default.block, num_warps=default.num_warps, tile=tile)
        mark = " (default)" if tile == default_tile else ""
        out.append((f"{row.shape}, tile {tile}{mark}", default.block, default.num_warps, row))
        print(f"sweep {row.shape} tile={tile}{mark}: {row.check} {_us(row):.2f} us", flush=True)
    return out


def sweep(s: Setup, rng, compare_module: str = "", grid: bool = True) -> list[tuple[str, int, int, Row]]:
    """The conv_update kernel's (block, num_warps) choices and extend token tiles on
    SWEEP_CASES; with compare_module (a module with conv_update's signature importable from the
    repository root, e.g. an earlier pallas_kernels/conv_state/pallas.py copied into pallas_kernels/) also its
    default plan."""
    out = []
    for prefix, b, q in SWEEP_CASES:
        match = next(((nm, v) for nm, v in s.streams.items() if nm.startswith(prefix)), None)
        if match is None:  # a stream the setup leaves out (--smoke)
            continue
        name, (f, ch) = match
        width = ch[1] - ch[0]
        default = conv_pallas.conv_plan(s.arena_shape, f.shape, ch, width, s.k, max(b, b * q), s.lay.sink_rows)
        if compare_module:
            row = _compare_module(s, compare_module, name, f, ch, b, q, rng)
            out.append((f"{row.shape} [{compare_module}]", default.block, default.num_warps, row))
            print(f"sweep {row.shape} [{compare_module}]: {row.check} {_us(row):.2f} us", flush=True)
        out += _block_warps(s, name, f, ch, b, q, rng, default, grid)
        if q > 1:
            out += _tiles(s, name, f, ch, b, q, rng, default)
    return out


def moe_sweep(s: Setup, rng, n: int = 1) -> list[tuple[str, Row]]:
    """The grouped mat-vec kernel's tiles on the gate|up product of n tokens' routed experts
    (x [n*k, h] @ w13[idx], F = 2f): tf x bh x num_warps (splits: the default rule)."""
    cfg = s.cfg
    e, h, f, k = cfg.n_routed_experts, cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts_per_tok
    m, two_f = n * k, 2 * f
    w13, _, x = moe_weights(s, m, 7)
    idx = jnp.asarray(rng.permutation(e)[:m], jnp.int32)
    with jax.default_matmul_precision("highest"):
        want = moe_ref.grouped_matvec(x.astype(jnp.float32), idx, w13.astype(jnp.float32))
    out = []
    for tf in (64, 128, 256):
        for bh in (32, 64, 128):
            for warps in (2, 4, 8):
                kw = dict(tf=tf, bh=bh, num_warps=warps, interpret=s.interpret)
                grid = moe_pallas.grid_for(m, h, two_f, tf=tf, bh=bh)
                label = f"gate|up, m={m}, tf={tf} bh={bh} warps={warps} grid={grid}"
                try:
                    got = jax.jit(lambda x_: moe_pallas.grouped_matvec(x_, idx, w13, **kw))(x)
                    err = float(rel_err(got, want))
                    check = f"y~ {err:.1e}" if err <= 1e-2 else f"FAIL y {err:.1e}"
                    if two_f == h:  # y feeds the next call's x
                        op = lambda x_: moe_pallas.grouped_matvec(x_, idx, w13, **kw).astype(x_.dtype)
                        row = Row("grouped_matvec", label, check, s.timer.timed(op, x.copy(), ()), None,
                                  m * h * two_f * jnp.dtype(s.dtype).itemsize)
                    else:
                        row = Row("grouped_matvec", label, check)
                except Exception as exc:  # noqa: BLE001 - report and carry on
                    row = Row("grouped_matvec", label, "ERROR", error=f"{type(exc).__name__}: {exc}"[:100])
                out.append((label, row))
                print(f"moe sweep {label}: {row.check} {_us(row):.2f} us", flush=True)
    return out


def projection_sweep(s: Setup, rng) -> list[tuple[str, Row]]:
    """A batch-1 token's attention projections (`wqkvr` of a sliding and a full layer, `wo`)
    through the grouped mat-vec kernel (`StepContext.few_token_matvec`) per column tile tf,
    contracting splits (1: no split partials to sum, so no summing launch after it in the
    engine) and warps, and XLA's GEMM on the row padded to two (`layers.matmul` without the
    kernel). Each timed op is the product plus what the engine does next with it (the sum over
    the splits and the cast to the row's dtype; its first h columns feed the next op)."""
    cfg = s.cfg
    shapes = ik.param_shapes(cfg)["layers"]
    full = next(i for i in range(cfg.num_layers) if i not in cfg.local_layer_ids)
    cases = [("wqkvr sliding", shapes[0]["attn"]["wqkvr"]), ("wqkvr full", shapes[full]["attn"]["wqkvr"]),
             ("wo", shapes[0]["attn"]["wo"])]
    zero = jnp.zeros((1,), jnp.int32)
    out = []
    for name, (h, f) in cases:
        key = jax.random.key(len(name))
        w = (0.02 * jax.random.normal(key, (h, f), jnp.float32)).astype(s.dtype)
        x = jax.random.normal(jax.random.fold_in(key, 1), (1, h), jnp.float32).astype(s.dtype)
        want = np.asarray(jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest"))
        nbytes = h * f * jnp.dtype(s.dtype).itemsize
        products = [("XLA GEMM, row padded to two", lambda x_, w_: jnp.matmul(
            jnp.pad(x_, ((0, 1), (0, 0))), w_, preferred_element_type=jnp.float32)[:1])]
        smoke = s.interpret  # interpret mode (CPU): a few variants, to check the script
        for tf in (16,) if smoke else (16, 32, 64, 128):
            for splits in (1, None) if smoke else (1, 2, 4, 8, None):
                for warps in (4,) if smoke else (4, 8):
                    try:
                        grid = moe_pallas.grid_for(1, h, f, tf=tf, splits=splits)
                    except ValueError:  # splits that do not divide the row blocks
                        continue
                    if grid is None:
                        continue
                    kw = dict(tf=tf, splits=splits, num_warps=warps, interpret=s.interpret)
                    products.append((f"mat-vec tf={tf} splits={splits or 'auto'} warps={warps} grid={grid}",
                                     lambda x_, w_, kw=kw: moe_pallas.grouped_matvec(x_, zero, w_[None], **kw)))
        for label, prod in products:
            label = f"{name} [{h}, {f}], 1 row: {label}"

            def op(x_, w_, prod=prod):  # y's first h columns, in x's dtype, are the next op's input
                y = prod(x_, w_)
                return jnp.pad(y, ((0, 0), (0, max(0, h - f))))[:, :h].astype(x_.dtype)

            try:
                got = np.asarray(jax.jit(prod)(x, w))
                err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
                check = f"y~ {err:.1e}" if err <= 1e-2 else f"FAIL y {err:.1e}"
                row = Row("projection", label, check, s.timer.timed(op, x.copy(), (w,)), None, nbytes)
            except Exception as exc:  # noqa: BLE001 - report and carry on
                row = Row("projection", label, "ERROR", error=f"{type(exc).__name__}: {exc}"[:100])
            out.append((label, row))
            print(f"projection sweep {label}: {row.check} {_us(row):.2f} us", flush=True)
    return out

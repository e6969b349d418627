"""Helpers shared by the bench scripts: progress lines, markdown reports and tables, the
device copy bandwidth, random params drawn on the device.

The scripts run as modules from the repository root (`python -m bench.<subject>.<script>`), so
this checkout's `inkling_jax` and `pallas_kernels` come first on `sys.path`: a run measures
this checkout's code.
"""

from __future__ import annotations

import math
import statistics
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from inkling_jax.model.params import is_shape, leaf_dtype, param_shapes

from bench.common.device_time import traced_device_events

_T0 = time.perf_counter()


def elapsed() -> float:
    """Seconds since the bench modules were imported (the run's clock)."""
    return time.perf_counter() - _T0


def log(msg: str) -> None:
    """A progress line with the run's clock."""
    print(f"[{elapsed():7.1f}s] {msg}", flush=True)


class Report:
    """Markdown sections, printed as they come and rewritten to `path` each time (a section
    added again under the same key replaces the earlier version)."""

    def __init__(self, path: str):
        self.path = path
        self.sections: dict[str, str] = {}

    def add(self, text: str, key: str | None = None) -> None:
        self.sections[key or f"_{len(self.sections)}"] = text.rstrip() + "\n"
        print("\n" + text.rstrip() + "\n", flush=True)
        if self.path:
            with open(self.path, "w") as f:
                f.write("\n".join(self.sections.values()))


def median_seconds(fn, *args, reps: int = 20) -> float:
    """Median wall seconds of fn(*args) over `reps` synced calls, after one warm call."""
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def table(header: list[str], rows: list[list], align: str = "") -> str:
    """A markdown table; align: one of "l" / "r" per column (default: first left, rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    sep = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def copy_bandwidth(elems: int, dtype, iters: int = 10, device_time: bool = False) -> float:
    """Device copy bandwidth in bytes (read + write) per second: a jitted copy of `elems`
    elements, median wall time of `iters` synced copies, or (device_time) the summed kernel
    time of `iters` copies from a profiler trace."""
    x = jnp.ones((elems,), dtype)
    f = jax.jit(lambda a: a.copy())
    jax.block_until_ready(f(x))
    if device_time:
        events = traced_device_events(lambda: jax.block_until_ready([f(x) for _ in range(iters)]))
        return 2 * x.nbytes / (sum(e.duration_ns for e in events) * 1e-9 / iters)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        times.append(time.perf_counter() - t0)
    return 2 * x.nbytes / statistics.median(times)


def device_params(cfg, seed: int, dtype, std: float = 0.02, head_std: float = 0.2) -> dict:
    """Random params with init_params' distributions (norms and scales 1, router bias 0, conv
    taps N(0, 0.3), matrices N(0, std)) but the unembed at N(0, head_std). Leaves of 1M+
    elements are drawn on the device (one small jit per distinct shape: `init_params` draws
    every number with numpy on the host, about a minute for the bench model), the rest with
    numpy. Every value is bf16-exact (fp32 leaves too), so bf16 copies hold the same numbers."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(cfg), is_leaf=is_shape)
    keys = jax.random.split(jax.random.key(seed), len(paths))
    rng = np.random.default_rng(seed)
    makers: dict = {}

    def on_device(shape, dt, key, scale):
        k = (shape, jnp.dtype(dt).name)
        if k not in makers:
            makers[k] = jax.jit(lambda key, scale: (scale * jax.random.normal(key, shape, jnp.float32)).astype(
                jnp.bfloat16).astype(dt))
        return makers[k](key, jnp.float32(scale))

    leaves = []
    for (path, shape), key in zip(paths, keys):
        shape = tuple(shape)
        name = next((str(e.key) for e in reversed(path) if isinstance(e, jax.tree_util.DictKey)), "")
        dt = leaf_dtype(name, dtype)
        if name.endswith("norm") or name in ("global_scale", "router_scale"):
            leaves.append(jnp.ones(shape, dt))
        elif name == "router_bias":
            leaves.append(jnp.zeros(shape, dt))
        else:
            scale = 0.3 if name.endswith("conv") else head_std if name == "unembed" else std
            if math.prod(shape) >= 1 << 20:
                leaves.append(on_device(shape, dt, key, scale))
            else:
                x = (scale * rng.standard_normal(shape, np.float32)).astype(ml_dtypes.bfloat16).astype(np.float32)
                leaves.append(jnp.asarray(x, dt))
    return jax.tree_util.tree_unflatten(treedef, leaves)

"""Memory per device of a sharded Inkling server: weights, serving arena, workspace.

    plan = plan_memory(InklingConfig.inkling(), "bfloat16", {"tp": 8, "ep": 1},
                       PoolSizes(num_slots=256, num_pages=8192, page_size=16))
    print(plan); plan.check(int(0.95 * H200_BYTES))

Weights (exact): every leaf's per-device shape from the `ShardPlan` (sharded layout, so
repeated kv heads count on every shard holding them) times its itemsize: fp32 for the
leaves `model/params.py` keeps fp32 (conv taps, router, scales), `weight_bytes` for the
projection matrices (wqkvr, wo, w13, w2, shared experts, MTP input_proj; 1 = fp8), the model
dtype for the rest (embed / unembed, norms, rel_proj). fp8 matrices add one fp32 scale per
128 x 128 block (per expert), the DeepSeek-V3 block-scale layout.

Arena (exact): `ArenaLayout.build(local_cfg, page_size, spec_steps)` on the local config —
units of one full layer's K/V page (the local kv heads); num_units = (num_slots + 1) * slot
units + (num_pages + 1) * page units (`ArenaLayout.arena_units`, which `Engine` sizes its arena with;
slot 0 and page 0 are sinks). `Engine(..., mesh=)` refuses an arena that does not fit
the devices' free memory by this count.

Workspace (an estimate of the reference jnp step, documented term by term in
`_workspace`): the largest step's residual stream, one layer's projections, the larger of
its attention (gathered context K/V and fp32 scores / probabilities) and its MLP / MoE
temporaries, and the logits. XLA's real peak depends on its schedule; keep a margin.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Mapping

import jax.numpy as jnp
from jax.sharding import Mesh

from ..cache.layout import ArenaLayout
from ..config import InklingConfig
from ..model.params import FP32_LEAVES
from .plan import ShardPlan

GiB = 1 << 30
# the matrices a quantised (e.g. fp8) checkpoint stores at `weight_bytes`
QUANTIZED_LEAVES = frozenset({"wqkvr", "wo", "w13", "w2", "shared_w13", "shared_w2", "input_proj"})
SCALE_BLOCK = 128  # fp8 block-scale tile (per expert): one fp32 scale per 128 x 128 block
# One H200's memory as JAX sees it: jax 0.11.2 reported bytes_limit 112,583,507,968 under
# the default XLA_PYTHON_CLIENT_MEM_FRACTION of 0.75 (2026-12 run), i.e. 139.8 GiB in all.
H200_BYTES = 112_583_507_968 * 4 // 3
SERVING_MEM_FRACTION = 0.95  # XLA_PYTHON_CLIENT_MEM_FRACTION a server sets (JAX's default: 0.75)


@dataclass(frozen=True)
class PoolSizes:
    """The serving pool and step sizes (the EngineConfig fields that set memory)."""

    num_slots: int = 64
    num_pages: int = 256
    page_size: int = 16
    spec_steps: int = 0
    max_running: int = 8
    chunk_size: int = 64  # most new tokens of one request in one step
    max_step_tokens: int = 256  # most packed tokens in one step
    max_context: int | None = None  # longest sequence attended (default num_pages * page_size)
    arena_units: int | None = None  # the arena's unit rows (default: what num_slots and num_pages need)

    def validate(self) -> None:
        for name in ("num_slots", "num_pages", "page_size", "max_running", "chunk_size", "max_step_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"PoolSizes: {name} must be >= 1, got {getattr(self, name)}")
        if self.spec_steps < 0:
            raise ValueError(f"PoolSizes: spec_steps must be >= 0, got {self.spec_steps}")


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device, by part. `weights` and `workspace` are {item: bytes}."""

    cfg: InklingConfig
    tp: int
    ep: int
    dtype: str
    weight_bytes: int  # itemsize of the quantised matrices
    pool: PoolSizes
    weights: dict[str, int]
    arena: int
    arena_note: str
    workspace: dict[str, int]

    @property
    def devices(self) -> int:
        return self.tp * self.ep

    @property
    def weights_total(self) -> int:
        return sum(self.weights.values())

    @property
    def workspace_total(self) -> int:
        return sum(self.workspace.values())

    @property
    def total(self) -> int:
        return self.weights_total + self.arena + self.workspace_total

    def fits(self, device_bytes: int) -> bool:
        return self.total <= device_bytes

    def check(self, device_bytes: int) -> None:
        """Raise ValueError saying what does not fit in `device_bytes` per device, and by how much."""
        if self.fits(device_bytes):
            return
        over = self.total - device_bytes
        if self.weights_total > device_bytes:
            what = (f"the weights alone need {_gib(self.weights_total)} per device "
                    f"(largest part: {max(self.weights, key=self.weights.get)} {_gib(max(self.weights.values()))})")
        else:
            room = device_bytes - self.weights_total - self.workspace_total
            what = (f"weights {_gib(self.weights_total)} + workspace {_gib(self.workspace_total)} leave "
                    f"{_gib(max(room, 0))} for the arena, which needs {_gib(self.arena)} ({self.arena_note}); "
                    f"fewer slots / pages, or more devices")
        raise ValueError(f"the model does not fit on tp={self.tp} x ep={self.ep} devices of {_gib(device_bytes)}: "
                         f"{_gib(self.total)} per device, {_gib(over)} over; {what}")

    def __str__(self) -> str:
        head = (f"{self.devices} devices (tp={self.tp}, ep={self.ep}), {self.dtype} activations, "
                f"{self.weight_bytes}-byte matrices")
        rows = [("weights", "", self.weights_total)] + [("", k, v) for k, v in self.weights.items()]
        rows += [("arena", self.arena_note, self.arena)]
        rows += [("workspace", "(estimate)", self.workspace_total)] + [("", k, v) for k, v in self.workspace.items()]
        rows += [("total", "per device", self.total)]
        w = max(len(a) + len(b) for a, b, _ in rows) + 3
        lines = [head, "-" * (w + 14)]
        for a, b, v in rows:
            label = f"{a:<10}{b}" if a else f"  {b}"
            lines.append(f"{label:<{w}}{v / GiB:>10.2f} GiB")
        return "\n".join(lines)


def plan_memory(cfg: InklingConfig, dtype: Any = "bfloat16", mesh: Mesh | Mapping[str, int] | ShardPlan | None = None,
                pool: PoolSizes | None = None, weight_bytes: int | None = None) -> MemoryPlan:
    """Bytes per device of weights, arena and workspace (see the module docstring).

    dtype: the model / activation / arena dtype. mesh: a Mesh, {"tp": .., "ep": ..}, or a
    ShardPlan (None: one device). weight_bytes: itemsize of the projection matrices
    (default: dtype's; 1 for fp8). Raises ValueError if the mesh cannot split the model."""
    pool = pool or PoolSizes()
    pool.validate()
    if isinstance(mesh, ShardPlan):
        plan = mesh
    elif isinstance(mesh, Mesh):
        plan = ShardPlan(cfg, mesh)
    else:
        sizes = dict(mesh or {})
        unknown = set(sizes) - {"tp", "ep"}
        if unknown:
            raise ValueError(f"plan_memory: unknown mesh axes {sorted(unknown)} (expected tp and ep)")
        plan = ShardPlan(cfg, tp=sizes.get("tp", 1), ep=sizes.get("ep", 1))
    act = jnp.dtype(dtype).itemsize
    wb = act if weight_bytes is None else int(weight_bytes)
    if wb < 1:
        raise ValueError(f"plan_memory: weight_bytes must be >= 1, got {weight_bytes}")

    weights: dict[str, int] = {}
    for path, layout in plan.flat_layouts().items():
        name = path[-1]
        local = layout.local_shape
        if name in FP32_LEAVES:
            nbytes = math.prod(local) * 4
        elif name in QUANTIZED_LEAVES:
            nbytes = math.prod(local) * wb
            if wb < 2:  # block scales of the quantised matrix (per expert / shared expert)
                *lead, rows, cols = local
                scales = math.prod(lead) * math.ceil(rows / SCALE_BLOCK) * math.ceil(cols / SCALE_BLOCK) * 4
                weights["fp8 block scales"] = weights.get("fp8 block scales", 0) + scales
        else:
            nbytes = math.prod(local) * act
        part = _weight_part(cfg, path)
        weights[part] = weights.get(part, 0) + nbytes
    order = ["embed + unembed", "attention", "dense MLP", "routed experts", "shared experts", "router",
             "norms, convs, rel_proj", "MTP depths", "fp8 block scales"]
    weights = {k: weights[k] for k in order if k in weights}

    lay = ArenaLayout.build(plan.local_cfg, pool.page_size, pool.spec_steps)
    budget = lay.arena_units(pool.num_slots, pool.num_pages)
    num_units = max(budget, pool.arena_units or 0)
    arena = num_units * lay.unit_elems * act
    note = (f"{pool.num_slots} slots x {lay.slot_units} + {pool.num_pages} pages x {lay.page_units} units "
            f"of {lay.unit_elems * act / 1024:.0f} KiB" + (f" in an arena of {num_units} units" if num_units > budget
                                                          else ""))
    return MemoryPlan(cfg, plan.tp, plan.ep, str(jnp.dtype(dtype)), wb, pool, weights, arena, note,
                      _workspace(plan, pool, act))


def pool_sizes(config: Any) -> PoolSizes:
    """The PoolSizes of an `EngineConfig` (the fields that set memory)."""
    return PoolSizes(config.num_slots, config.num_pages, config.page_size, config.spec_steps, config.max_running,
                     config.chunk_size, config.max_step_tokens, config.max_context, config.arena_units)


def _weight_part(cfg: InklingConfig, path: tuple) -> str:
    name = path[-1]
    if path[0] in ("embed", "unembed"):
        return "embed + unembed"
    if path[0] == "mtp":
        return "MTP depths"
    if "attn" in path and name in QUANTIZED_LEAVES:
        return "attention"
    if "mlp" in path:
        if name.startswith("router"):
            return "router"
        if name.startswith("shared_"):
            return "shared experts"
        if name in ("w13", "w2"):
            return "dense MLP" if cfg.is_dense(path[1]) else "routed experts"
    return "norms, convs, rel_proj"


def _workspace(plan: ShardPlan, pool: PoolSizes, act: int) -> dict[str, int]:
    """Per-device temporaries of the largest step of the reference jnp serving path.

    T tokens (max_step_tokens, or max_running * (spec_steps + 1) if larger) in B rows of up
    to Q new tokens (chunk_size, or spec_steps + 1) over C context tokens (max_context):
      residual  4 [T, H] activations (stream, normed input, branch output, psum buffer)
      qkvr      the widest layer's fused projection [T, q|k|v|r local], fp32 + activation copy
      attention gathered context K/V [B, C, 2, kv, hd] + fp32 scores and probabilities
                [B, heads, Q, C + Q] (the widest local geometry)
      MLP       the larger of the dense MLP ([T, 2I/tp] fp32 + [T, I/tp]) and the all-experts
                MoE path ([E/ep, T, 2F/tp] fp32 + [E/ep, T, F/tp] + [E/ep, T, H] fp32)
      logits    [B * (spec_steps + 1), V] fp32, local and gathered
    Only one layer's temporaries are counted, and of attention and MLP only the larger (they
    do not overlap); the table names which."""
    g, local = plan.cfg, plan.local_cfg
    h = g.hidden_size
    tokens = max(pool.max_step_tokens, pool.max_running * (pool.spec_steps + 1))
    rows, query = pool.max_running, max(pool.chunk_size, pool.spec_steps + 1)
    context = pool.max_context or pool.num_pages * pool.page_size
    geoms = [local.layer_geometry(i) for i in range(local.num_layers)]
    geoms += [local.mtp_geometry(d) for d in range(pool.spec_steps)]
    qkvr = max(x.q_dim + 2 * x.kv_dim + x.num_heads * local.d_rel for x in geoms)
    attention = max(rows * min(context, x.window or context) * 2 * x.kv_dim * act
                    + 2 * rows * x.num_heads * query * (min(context, x.window or context) + query) * 4 for x in geoms)
    dense_i = local.dense_intermediate_size
    mlp = tokens * 2 * dense_i * 4 + tokens * dense_i * act
    if g.has_moe:
        e, f = local.n_routed_experts, local.expert_intermediate_size
        mlp = max(mlp, e * tokens * (2 * f * 4 + f * act + h * 4))
    logit_rows = rows * (pool.spec_steps + 1)
    peak = ("peak layer: attention", attention) if attention >= mlp else \
        ("peak layer: MoE experts" if g.has_moe else "peak layer: dense MLP", mlp)
    return {
        "residual stream": 4 * tokens * h * act,
        "qkvr projection": tokens * qkvr * (4 + act),
        peak[0]: peak[1],
        "logits": logit_rows * (local.vocab_size + g.vocab_size) * 4,
    }


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m inkling_jax.parallel.planner",
                                description="Memory per device of a sharded Inkling server.")
    p.add_argument("--config", default="inkling", help="inkling (the real model), tiny, small, bench, or a config.json")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", help="activations / arena / non-quantised weights")
    p.add_argument("--weight-bytes", type=int, default=None, help="itemsize of the projection matrices (1 = fp8)")
    p.add_argument("--device-gib", type=float, default=H200_BYTES / GiB, help="memory per device (default: an H200)")
    p.add_argument("--mem-fraction", type=float, default=SERVING_MEM_FRACTION,
                   help="share of it JAX may use (XLA_PYTHON_CLIENT_MEM_FRACTION)")
    for name, default in (("num-slots", 64), ("num-pages", 256), ("page-size", 16), ("spec-steps", 0),
                          ("max-running", 8), ("chunk-size", 64), ("max-step-tokens", 256)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--max-context", type=int, default=None)
    a = p.parse_args(argv)
    presets = {"inkling": InklingConfig.inkling, "real": InklingConfig.inkling, "tiny": InklingConfig.tiny,
               "small": InklingConfig.small, "bench": InklingConfig.bench}
    cfg = presets[a.config]() if a.config in presets else InklingConfig.from_hf(a.config)
    pool = PoolSizes(a.num_slots, a.num_pages, a.page_size, a.spec_steps, a.max_running, a.chunk_size,
                     a.max_step_tokens, a.max_context)
    count = sum(math.prod(layout.shape) for layout in ShardPlan(cfg, tp=1, ep=1).flat_layouts().values())
    print(f"{count:,} parameters")
    plan = plan_memory(cfg, a.dtype, {"tp": a.tp, "ep": a.ep}, pool, a.weight_bytes)
    print(plan)
    device = int(a.device_gib * GiB * a.mem_fraction)
    try:
        plan.check(device)
    except ValueError as exc:
        print(f"does not fit: {exc}")
        return 1
    print(f"fits in {_gib(device)} per device ({a.mem_fraction:g} of {a.device_gib:.1f} GiB; "
          f"{_gib(device - plan.total)} to spare)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

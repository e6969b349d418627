"""The MoE block of a decoder layer: the router, then the routed and shared experts.

    route(p, cfg, x, ops) -> (topk_idx [n, k], topk_weight [n, k], shared_gamma [n, S])
    moe_mlp(p, cfg, x, ops, parallel) -> [.., H]

The model's part is the config and the mesh: which router (gate, norm_after_topk, the sink
columns), whether the shared experts are gated by their sink weights, and on a mesh which
choices this ep shard holds and where the partial outputs meet. The arithmetic after the
router's matmul is the kernel seam's (`pallas_kernels.KernelOps`, `ops` below):
`ops.router_epilogue` (jnp: `pallas_kernels.moe.router.router_epilogue_ref`) and `ops.experts`
(jnp: `pallas_kernels.moe.ref.experts`, whose module holds the routed experts' jnp
strategies, dense / slices / gather / ragged; the Pallas op picks its kernels by the number of
choices, `pallas_kernels.ops`).

Numerics follow `reference/inkling-model.md` §7: the router in fp32; each expert's SwiGLU in
fp32 on fp32-accumulated products, rounded to the activation dtype; the routed and shared
outputs summed in fp32 and rounded once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int
from pallas_kernels import REFERENCE_OPS, KernelOps

from ..config import InklingConfig

if TYPE_CHECKING:  # the parallel package imports the model; only the type is needed here
    from ..parallel.axes import ParallelAxes

Params = dict[str, Any]


def local_expert_choices(idx: Int[Array, "n k"], weight: Float[Array, "n k"], num_local: int,
                         parallel: "ParallelAxes") -> tuple[Int[Array, "n k"], Float[Array, "n k"]]:
    """Global expert choices -> this ep shard's local expert indices, with the weight of every
    choice held by another shard set to 0 (and its index to local expert 0, a valid row).

    Shard i of the ep axis holds experts [i * num_local, (i + 1) * num_local)."""
    local = idx - jax.lax.axis_index(parallel.ep_axis) * num_local
    held = (local >= 0) & (local < num_local)
    return jnp.where(held, local, 0), jnp.where(held, weight, jnp.zeros((), weight.dtype))


@jax.named_scope("router")
def route(p: Params, cfg: InklingConfig, x: Float[Array, "n h"], ops: KernelOps = REFERENCE_OPS
          ) -> tuple[Array, Array, Array]:
    """Inkling's router (fp32): returns (topk_idx [n,k], topk_weight [n,k], shared_gamma [n,S]).

    Selection uses sigmoid (or softmax) scores of the routed experts plus the selection bias;
    with norm_after_topk the weights renormalise over the selected routed experts *and* the
    shared "sink" experts; everything is scaled by route_scale * global_scale. The matmul here,
    the rest `ops.router_epilogue` (one kernel on the Pallas ops)."""
    e, s = cfg.n_routed_experts, cfg.n_shared_experts
    logits = jnp.matmul(x.astype(jnp.float32), p["router"].astype(jnp.float32))  # [n, e(+s)]
    if not (cfg.shared_expert_sink and s > 0):
        logits = logits[:, :e]
    return ops.router_epilogue(logits, p.get("router_bias"), p.get("router_scale"), k=cfg.num_experts_per_tok,
                               route_scale=cfg.route_scale, num_experts=e, gate=cfg.gate_activation,
                               norm_after_topk=cfg.norm_after_topk)


@jax.named_scope("moe")
def moe_mlp(p: Params, cfg: InklingConfig, x: Array, ops: KernelOps = REFERENCE_OPS,
            parallel: "ParallelAxes | None" = None) -> Array:
    """MoE: routed top-k experts plus shared experts (sink-weighted or plain), `ops.experts`.

    With `parallel`, cfg is the local config (E / ep experts of width F / tp here) and the
    router runs on `parallel.global_cfg`: choices of experts another ep shard holds get weight
    0, the shared experts are counted on ep rank 0 only (every shard holds them), and the routed
    and shared partial outputs meet in one psum over (ep, tp) (see `layers.py`)."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    routing_cfg = cfg if parallel is None else parallel.global_cfg
    idx, w, gamma = route(p, routing_cfg, flat, ops)
    shared_mask = None
    if parallel is not None:
        idx, w = local_expert_choices(idx, w, p["w13"].shape[0], parallel)
        # a mesh: the shared experts' sum passes through a mask, and the routed and shared
        # experts run as separate calls (the joined kernel applies no mask)
        shared_mask = lambda shared: shared  # noqa: E731
        if parallel.ep > 1:
            shared_mask = lambda shared: jnp.where(jax.lax.axis_index(parallel.ep_axis) == 0, shared, 0.0)  # noqa: E731
    shared = (p["shared_w13"], p["shared_w2"]) if cfg.n_shared_experts > 0 else (None, None)
    out = ops.experts(flat, idx, w, p["w13"], p["w2"], *shared, gamma,
                      gated=bool(cfg.shared_expert_sink and cfg.norm_after_topk),
                      num_experts=routing_cfg.n_routed_experts, shared_mask=shared_mask)
    if parallel is not None:
        out = jax.lax.psum(out, (parallel.ep_axis, parallel.tp_axis))
    return out.reshape(*lead, x.shape[-1])


__all__ = ["local_expert_choices", "moe_mlp", "route"]

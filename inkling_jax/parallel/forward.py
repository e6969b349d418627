"""The reference forward on a mesh: every device runs `model.forward` on the plan's local
config and its own param shards, inside `shard_map`, with the layer collectives switched on
(`parallel=plan.axes`). Same logits as `ik.forward` on one device; the proof of the sharded
math before the serving steps use it."""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int

from ..model.forward import forward, mtp_forward
from ..model.params import Params
from .compat import shard_map
from .plan import ShardPlan

REPLICATED = PartitionSpec()


def forward_sharded(params: Params, plan: ShardPlan, tokens: Int[Array, "b t"]) -> Float[Array, "b t v"]:
    """Logits [B, T, unpadded vocab] (fp32, replicated on every device) for tokens [B, T].

    params: `plan.shard_params(...)` output (or `load_pretrained(path, mesh=...)`)."""
    return _compiled(plan, "forward")(params, jnp.asarray(tokens, jnp.int32))


def mtp_forward_sharded(params: Params, plan: ShardPlan, hidden: Float[Array, "b t h"], tokens: Int[Array, "b t"]
                        ) -> tuple[Float[Array, "d b t v"], Float[Array, "d b t h"]]:
    """`mtp_forward` (the whole MTP chain) on the mesh; hidden [B, T, H] is replicated."""
    return _compiled(plan, "mtp")(params, jnp.asarray(hidden), jnp.asarray(tokens, jnp.int32))


@lru_cache(maxsize=None)
def _compiled(plan: ShardPlan, which: str) -> Callable:
    if plan.mesh is None:
        raise ValueError("forward_sharded needs a plan built with a mesh (make_mesh)")
    cfg, axes, specs = plan.local_cfg, plan.axes, plan.param_specs()
    if which == "forward":
        body = lambda p, t: forward(p, cfg, t, parallel=axes)
        in_specs, out_specs = (specs, REPLICATED), REPLICATED
    else:
        body = lambda p, h, t: mtp_forward(p, cfg, h, t, parallel=axes)
        in_specs, out_specs = (specs, REPLICATED, REPLICATED), (REPLICATED, REPLICATED)
    # check=False: the logits' all_gather output is typed "varying" over tp (the keyword that
    # declares it invariant differs between jax versions); the replication is real and tested.
    return jax.jit(shard_map(body, plan.mesh, in_specs=in_specs, out_specs=out_specs, check=False))

"""The mesh facts the layer math reads when it runs as one shard of a sharded model.

An instance is what `ctx.parallel` holds (and what `forward(..., parallel=)` takes); the
collectives it enables are listed in `inkling_jax/model/layers.py`. Frozen and hashable, so
it can sit in a jit's static arguments and in a context object.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import InklingConfig

TP_AXIS = "tp"  # tensor parallel: attention heads, MLP / expert widths, vocab
EP_AXIS = "ep"  # expert parallel: routed experts


@dataclass(frozen=True)
class ParallelAxes:
    """Axis names and sizes of the mesh, and the unsharded model's config.

    global_cfg: the routing and the vocab slice need the whole model (all experts' router
    columns, the unpadded vocab), while the layer math runs on the plan's local config."""

    global_cfg: InklingConfig
    tp: int = 1
    ep: int = 1
    tp_axis: str = TP_AXIS
    ep_axis: str = EP_AXIS

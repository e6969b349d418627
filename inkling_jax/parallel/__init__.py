"""Serving on a JAX device mesh: tensor parallel over heads, MLP widths and vocab, expert
parallel over routed experts (see `plan.py` for the split, `model/layers.py` for the
collectives, `serving.py` for the engine's state and steps on the mesh, `planner.py` for
memory per device)."""

from .axes import EP_AXIS, TP_AXIS, ParallelAxes
from .compat import shard_map
from .forward import forward_sharded, mtp_forward_sharded
from .layout import DimLayout, LeafLayout, Part
from .mesh import MESH_AXES, make_mesh
from .plan import ShardPlan

__all__ = ["make_mesh", "MESH_AXES", "TP_AXIS", "EP_AXIS", "ParallelAxes", "ShardPlan", "shard_map",
           "forward_sharded", "mtp_forward_sharded", "DimLayout", "LeafLayout", "Part"]

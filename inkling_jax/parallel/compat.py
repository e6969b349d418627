"""`shard_map` across jax versions: `jax.shard_map` (new, keyword `check_vma`) where it
exists, else `jax.experimental.shard_map.shard_map` (keyword `check_rep`)."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import jax
from jax.sharding import Mesh


def shard_map(f: Callable, mesh: Mesh, in_specs: Any, out_specs: Any, check: bool = True) -> Callable:
    """`f` mapped over the mesh: each device runs f on its shards (in_specs) and the results
    are assembled by out_specs. check: verify the replication that out_specs claims."""
    fn = getattr(jax, "shard_map", None)
    if fn is None:
        from jax.experimental.shard_map import shard_map as fn  # jax < 0.7
    params = inspect.signature(fn).parameters
    kw = {"check_vma": check} if "check_vma" in params else {"check_rep": check}
    return fn(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kw)

"""orbax checkpoints of the params in their original layout (restored per device with a mesh)."""

from __future__ import annotations

import json
import os
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from ..config import InklingConfig
from ..model.params import (
    cast_params,
    check_params,
    flat_params,
    leaf_dtype,
    nest_params,
    param_shapes,
)
from ..parallel.plan import ShardPlan
from .names import Params
from .safetensors_io import CONFIG_FILE, _check_directory, _read_config

# ----------------------------------------------------------------------------- orbax


def save_checkpoint(path: str | os.PathLike, cfg: InklingConfig, params: Params, mesh: Mesh | None = None) -> None:
    """Orbax checkpoint of the params in the original layout, with the config beside it
    (config.json).

    mesh: params are in the sharded layout of ShardPlan(cfg, mesh) (as `load_pretrained(...,
    mesh=)` or `ShardPlan.shard_params` give them); they are put back in the original layout on
    the devices and each device writes its part (nothing is gathered to one host)."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    if mesh is not None:
        params = ShardPlan(cfg, mesh).from_sharded_on_devices(params)
    check_params(cfg, params)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(cfg.to_hf(), f, indent=2)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.join(path, "params"), params, force=True)
    ckptr.wait_until_finished()


def load_checkpoint(path: str | os.PathLike, dtype: Any = None, mesh: Mesh | None = None
                    ) -> tuple[InklingConfig, Params]:
    """Inverse of save_checkpoint. dtype=None keeps the saved dtypes (fp32 leaves stay fp32).

    mesh: restore onto the mesh. Orbax reads each leaf with a target sharding (every device
    reads only its slice of the original layout), then one jitted relayout per reordered leaf
    (fused q|k|v|r and gate|up columns, repeated kv heads) moves columns between devices into
    the sharded layout of ShardPlan(cfg, mesh). Same result as shard_params(load_checkpoint(path))."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    _check_directory(path, "load_checkpoint")
    _, cfg = _read_config(path, "load_checkpoint")
    ckpt = os.path.join(path, "params")
    if not os.path.isdir(ckpt):
        raise ValueError(f"load_checkpoint: {path} has no orbax 'params' directory")
    ckptr = ocp.StandardCheckpointer()
    if mesh is None:
        params = _relist(ckptr.restore(ckpt), param_shapes(cfg))
        if dtype is not None:
            params = cast_params(params, dtype)
        check_params(cfg, params)
        return cfg, params

    plan = ShardPlan(cfg, mesh)
    saved = flat_params(_relist(_tree_metadata(ckptr.metadata(ckpt)), param_shapes(cfg)))
    layouts = plan.flat_layouts()
    if set(saved) != set(layouts):
        raise ValueError(f"load_checkpoint: {ckpt} does not hold this config's parameters "
                         f"(differences: {sorted(map(str, set(saved) ^ set(layouts)))[:5]})")
    targets = {}
    for key, layout in layouts.items():
        if tuple(saved[key].shape) != layout.shape:
            raise ValueError(f"load_checkpoint: {ckpt}: {key} has shape {tuple(saved[key].shape)}, "
                             f"expected {layout.shape}")
        leaf = saved[key].dtype if dtype is None else leaf_dtype(key[-1], dtype)
        targets[key] = jax.ShapeDtypeStruct(layout.shape, leaf, sharding=NamedSharding(mesh, layout.original_spec()))
    restored = ckptr.restore(ckpt, nest_params(targets))
    return cfg, plan.to_sharded_on_devices(restored)


def _tree_metadata(meta: Any) -> Any:
    """The per-leaf metadata tree (shape, dtype) of an orbax checkpoint, across orbax versions."""
    tree = getattr(meta, "item_metadata", meta)
    return getattr(tree, "tree", tree)


def _relist(tree: Any, like: Any) -> Any:
    """Orbax may restore lists as dicts keyed '0', '1', ...; put the lists back."""
    if isinstance(like, list):
        items = tree if isinstance(tree, list) else [tree[str(i)] if str(i) in tree else tree[i]
                                                     for i in range(len(like))]
        return [_relist(t, l) for t, l in zip(items, like)]
    if isinstance(like, dict):
        return {k: _relist(tree[k], v) for k, v in like.items()}
    return tree


"""Nested parameter names through `flax.traverse_util`: {("layers", 3, "attn", "wqkvr"): leaf}."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import traverse_util

from .names import Array, Params

# ------------------------------------------------------------- nested parameter names


def flat_params(params: Params) -> dict[tuple, Any]:
    """{path: leaf} with paths like ("layers", 3, "attn", "wqkvr") (list positions as ints):
    the keys `Entry.path` and `ShardPlan.flat_layouts` use."""
    return traverse_util.flatten_dict(_lists_to_dicts(params))


def nest_params(flat: dict[tuple, Any]) -> Params:
    """Inverse of flat_params: nested dicts, with int-keyed levels turned back into lists."""
    return _int_dicts_to_lists(traverse_util.unflatten_dict(flat))


def _lists_to_dicts(tree: Any) -> Any:
    if isinstance(tree, list):
        return {i: _lists_to_dicts(v) for i, v in enumerate(tree)}
    if isinstance(tree, dict):
        return {k: _lists_to_dicts(v) for k, v in tree.items()}
    return tree


def _int_dicts_to_lists(tree: Any) -> Any:
    if isinstance(tree, dict):
        if tree and all(isinstance(k, int) for k in tree):
            if sorted(tree) != list(range(len(tree))):
                raise ValueError(f"parameter list positions {sorted(tree)} are not 0..{len(tree) - 1}")
            return [_int_dicts_to_lists(tree[i]) for i in range(len(tree))]
        return {k: _int_dicts_to_lists(v) for k, v in tree.items()}
    return tree


def _to_numpy(x: Any, dtype: Any) -> Array:
    x = jax.device_get(x)
    x = np.asarray(x)
    return x.astype(dtype) if dtype is not None else x



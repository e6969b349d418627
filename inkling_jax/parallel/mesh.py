"""`make_mesh`: the device mesh the serving core shards over.

Axes, in order: ("ep", "tp"). Devices are laid out row-major, so the tp devices of one ep
group are adjacent in `devices` (on one host: NVLink neighbours share the tensor-parallel
all-reduces, which run twice per layer; the expert-parallel psum runs once per MoE layer).
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from .axes import EP_AXIS, TP_AXIS

MESH_AXES = (EP_AXIS, TP_AXIS)


def make_mesh(tp: int = 1, ep: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `Mesh` of shape (ep, tp) over axes ("ep", "tp").

    devices: exactly tp * ep devices (default: the first tp * ep of `jax.devices()`)."""
    for name, value in (("tp", tp), ("ep", ep)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"make_mesh: {name} must be a positive int, got {value!r}")
    need = int(tp) * int(ep)
    if devices is None:
        available = jax.devices()
        if len(available) < need:
            raise ValueError(f"make_mesh: tp={tp} x ep={ep} needs {need} devices, but only {len(available)} "
                             f"{available[0].platform} device(s) exist (on CPU set "
                             f"XLA_FLAGS=--xla_force_host_platform_device_count={need} before jax starts)")
        devices = available[:need]
    devices = list(devices)
    if len(devices) != need:
        raise ValueError(f"make_mesh: tp={tp} x ep={ep} needs exactly {need} devices, got {len(devices)}")
    if len(set(devices)) != len(devices):
        raise ValueError("make_mesh: the same device is listed twice")
    return Mesh(np.array(devices, dtype=object).reshape(int(ep), int(tp)), MESH_AXES)

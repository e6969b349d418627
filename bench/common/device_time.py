"""Device (kernel) time from a jax profiler trace, for the GPU benchmarks.

    events = traced_device_events(fn)     # runs fn() under jax.profiler.trace
    device_events(trace_dir)              # the events of a trace already written

A `DeviceEvent` is every kernel, memcpy or memset on a GPU stream line, with the HLO op it
runs for where the trace names one. On a backend without a GPU plane (CPU) there are none.
"""

from __future__ import annotations

import glob
import os
import re
import tempfile
import warnings
from typing import NamedTuple

import jax
from jax.profiler import ProfileData


class DeviceEvent(NamedTuple):
    line: str  # the stream
    op: str | None  # the HLO op (its `hlo_op` stat), where the trace says
    kernel: str  # the kernel (or memcpy / memset) name
    start_ns: int
    duration_ns: int

    @property
    def label(self) -> str:
        return f"{self.op} [{self.kernel[:80]}]" if self.op else self.kernel


def _stats(ev) -> dict:
    with warnings.catch_warnings():  # jax 0.11 warns that iterating the stats is deprecated
        warnings.simplefilter("ignore")
        return dict(ev.stats)


def device_events(trace_dir: str) -> list[DeviceEvent]:
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        return []
    pd = ProfileData.from_file(paths[-1])
    out = []
    for plane in pd.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue  # derived lines (XLA Modules / Ops, Steps) would count kernels twice
            for ev in line.events:
                out.append(DeviceEvent(line.name, _stats(ev).get("hlo_op"), ev.name, ev.start_ns, ev.duration_ns))
    out.sort(key=lambda e: e.start_ns)
    return out


def traced_device_events(fn) -> list[DeviceEvent]:
    """Run fn() (which must block until its device work is done) under the profiler."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            fn()
        return device_events(d)


# The named scopes the model and step code put on their ops (`jax.named_scope`), in the
# order a profile lists them; an op's part is the path of these scopes in its op_name.
PARTS = ("prepare", "embed", "norm", "attention", "conv_kv", "attention_tables", "attend", "read_ring", "read_pages",
         "attention_core", "write_ring", "write_pages", "conv_attn", "dense_mlp", "moe", "router", "routed_experts",
         "shared_experts", "swiglu", "conv_mlp", "lm_head", "sample", "accept", "draft")


def hlo_op_parts(hlo_text: str) -> dict[str, str]:
    """instruction name -> its part (the known scopes of its op_name, outermost first, joined
    by '/'), for every instruction of an optimized HLO text that has metadata; and for the
    Pallas (Triton) kernels, "kernel:<name>" -> the parts of every custom call of that kernel
    name, joined by '|' (one kernel may serve several parts, e.g. the three convs)."""
    out, kernels = {}, {}
    for m in re.finditer(r'^\s*(?:ROOT\s+)?%?([\w.\-]+) = ([^\n]*?)op_name="([^"]*)"([^\n]*)', hlo_text, re.M):
        scopes = [s for s in m.group(3).split("/") if s in PARTS]
        part = "/".join(dict.fromkeys(scopes)) or "(other)"
        out[m.group(1)] = part
        kernel = re.search(r'custom-call\(.*\bname = \\?"([\w]+)', m.group(2) + m.group(4))
        if kernel:
            kernels.setdefault(kernel.group(1), {})[part] = None
    out.update({f"kernel:{k}": "|".join(v) for k, v in kernels.items()})
    return out


def event_part(ev: DeviceEvent, parts: dict[str, str]) -> str:
    """The part of the model a kernel ran for (see hlo_op_parts); '(unknown)' without one.
    Kernels inside a command buffer carry the buffer's op, not their own: fusions are found
    by their kernel name, Pallas kernels by the name their custom calls give them."""
    for name in (ev.op, re.sub(r"_(\d+)$", r".\1", ev.kernel), ev.kernel,
                 "kernel:" + re.sub(r"__\d+$", "", ev.kernel)):
        if name and name in parts:
            return parts[name]
    return "(unknown)"

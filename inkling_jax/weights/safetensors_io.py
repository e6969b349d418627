"""safetensors files: `load_pretrained` (whole leaves, or each device's slices with a mesh) and
`save_pretrained` (temporary names renamed into place; only files it wrote are ever removed)."""

from __future__ import annotations

import itertools
import json
import os
import uuid
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from safetensors import safe_open
from safetensors.numpy import save_file

from ..config import InklingConfig
from ..model.params import (
    cast_params,
    check_params,
    flat_params,
    leaf_dtype,
    nest_params,
)
from ..parallel.plan import ShardPlan
from .names import _ALIASES, _IGNORED, Array, Params, detect_naming, entries

# ------------------------------------------------------------------------ safetensors


INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
# Marks an index written by save_pretrained: only the shards such an index lists are ever
# deleted by a later save_pretrained into the same directory.
WRITER_TAG = "inkling_jax.save_pretrained"


class _TensorFiles:
    """Lazy reader over a directory of (possibly sharded) safetensors files.

    Every failure to read is a ValueError naming the file (and the tensor)."""

    def __init__(self, path: str):
        self.path = path
        self._handles: dict[str, Any] = {}
        index = os.path.join(path, INDEX_FILE)
        if os.path.exists(index):
            weight_map = _read_json(index, "load_pretrained").get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"load_pretrained: {index} has no 'weight_map' object")
            for fname in sorted(set(weight_map.values())):
                if not os.path.isfile(os.path.join(path, fname)):
                    raise ValueError(f"load_pretrained: {index} lists {fname}, which does not exist in {path}")
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise ValueError(f"load_pretrained: no *.safetensors files in {path}")
            weight_map = {}
            for fname in files:
                for k in self._open(fname).keys():
                    weight_map[k] = fname
        self.indexed = os.path.exists(index)
        self.location = {}
        for name, fname in weight_map.items():
            canonical = name
            for pattern, repl in _ALIASES:
                if pattern.match(name):
                    canonical = repl
            self.location[canonical] = (fname, name)

    def names(self) -> set[str]:
        return set(self.location)

    def file_of(self, name: str) -> str:
        return self.location[name][0]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def fetch(self, name: str, index: tuple[np.ndarray, ...]) -> Array:
        """tensor[np.ix_(*index)], reading one slice per block of contiguous indices (never the
        whole tensor unless every index is asked for)."""
        sl = self._slice(name)
        fname = self.location[name][0]
        wanted = [np.unique(i) for i in index]
        runs = [_contiguous_runs(u) for u in wanted]
        try:
            if all(len(r) == 1 for r in runs):  # one block: the common case
                block = np.asarray(sl[tuple(slice(lo, hi) for lo, hi in (r[0] for r in runs))])
            else:
                block = None
                for combo in itertools.product(*runs):
                    part = np.asarray(sl[tuple(slice(lo, hi) for lo, hi in combo)])
                    if block is None:
                        block = np.empty(tuple(len(u) for u in wanted), part.dtype)
                    where = tuple(slice(np.searchsorted(u, lo), np.searchsorted(u, lo) + (hi - lo))
                                  for u, (lo, hi) in zip(wanted, combo))
                    block[where] = part
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type
            raise ValueError(f"load_pretrained: cannot read tensor {name} from {os.path.join(self.path, fname)}: "
                             f"{exc}") from exc
        positions = [np.searchsorted(u, i) for u, i in zip(wanted, index)]
        if all(len(p) == n and (p == np.arange(n)).all() for p, n in zip(positions, block.shape)):
            return block
        return block[np.ix_(*positions)]

    def _slice(self, name: str):
        fname, stored = self.location[name]
        handle = self._open(fname)
        if stored not in handle.keys():
            raise _NotInFile(f"tensor {name}: {INDEX_FILE} maps it to {fname}, which does not contain it")
        return handle.get_slice(stored)

    def _open(self, fname: str):
        if fname not in self._handles:
            full = os.path.join(self.path, fname)
            try:
                self._handles[fname] = safe_open(full, "np")
            except Exception as exc:  # noqa: BLE001 - truncated / corrupt files raise SafetensorError
                raise ValueError(f"load_pretrained: {full} is not a readable safetensors file ({exc})") from exc
        return self._handles[fname]


class _NotInFile(ValueError):
    """The index names a file for a tensor that the file does not hold."""


def _contiguous_runs(sorted_unique: np.ndarray) -> list[tuple[int, int]]:
    """[lo, hi) runs of consecutive integers covering a sorted unique index array."""
    if not len(sorted_unique):
        return [(0, 0)]
    breaks = np.nonzero(np.diff(sorted_unique) != 1)[0] + 1
    return [(int(r[0]), int(r[-1]) + 1) for r in np.split(sorted_unique, breaks)]


def _read_json(path: str, who: str) -> dict:
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"{who}: cannot read {path}: {exc.strerror or exc}") from exc
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{who}: {path} is not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{who}: {path} does not hold a JSON object")
    return value


def _read_config(path: str, who: str) -> tuple[dict, InklingConfig]:
    """The raw config.json of a checkpoint directory and the InklingConfig it describes."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.exists(file):
        raise ValueError(f"{who}: {path} has no {CONFIG_FILE}")
    raw = _read_json(file, who)
    try:
        return raw, InklingConfig.from_hf(raw)
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{who}: {file} does not describe an Inkling model: {exc}") from exc


def _check_directory(path: str, who: str) -> None:
    if not os.path.exists(path):
        raise ValueError(f"{who}: {path} does not exist")
    if not os.path.isdir(path):
        raise ValueError(f"{who}: {path} is not a directory")


def load_pretrained(path: str | os.PathLike, dtype: Any = jnp.bfloat16, cfg: InklingConfig | None = None,
                    mesh: Mesh | None = None) -> tuple[InklingConfig, Params]:
    """Read config.json and the safetensors of `path` (hub or transformers naming, sharded or
    not). Returns (cfg, params) with params in `dtype` (fp32 leaves stay fp32).

    mesh: a `make_mesh` mesh. Then params are global arrays in the sharded layout of
    `ShardPlan(cfg, mesh)`, and each device's block is read straight from the files (only the
    slices it needs, `jax.make_array_from_callback`): the host holds one device's block of
    one leaf at a time, never a whole leaf of a sharded tensor, let alone the whole model.

    Raises ValueError naming the path, file and tensor: a missing path or config.json, a
    config.json that is not JSON or not an Inkling config, a file that is not safetensors
    (truncated, say), and every missing, unexpected (text-model) or mis-shaped tensor."""
    path = os.fspath(path)
    _check_directory(path, "load_pretrained")
    raw: dict = {}
    if cfg is None or os.path.exists(os.path.join(path, CONFIG_FILE)):
        raw, file_cfg = _read_config(path, "load_pretrained")
        cfg = cfg or file_cfg
    text_raw = raw.get("text_config", raw)
    interleaved = bool(text_raw.get("inference_moe_w13_interleaved", raw.get("inference_moe_w13_interleaved", True)))
    files = _TensorFiles(path)
    naming, prefix = detect_naming(files.names())
    if cfg.num_mtp_layers and not any(n.startswith("model.mtp.") for n in files.names()):
        # HF transformers saves no MTP tensors: the trunk loads, speculative decoding is off.
        warnings.warn(f"load_pretrained({path}): config declares {cfg.num_mtp_layers} MTP depths but the "
                      "checkpoint has no model.mtp.* tensors; loading the trunk only (num_mtp_layers=0)")
        cfg = cfg.replace(num_mtp_layers=0, mtp_local_layer_ids=())
    table = entries(cfg, naming, interleaved=interleaved, prefix=prefix)

    problems = []
    for e in table:
        for name, shape in zip(e.names, e.shapes):
            if name not in files.location:
                problems.append(f"missing tensor {name} (expected shape {shape})")
                continue
            try:
                got = files.shape(name)
            except _NotInFile as exc:
                problems.append(str(exc))
                continue
            if got != shape:
                problems.append(f"tensor {name} has shape {got}, expected {shape} (in {files.file_of(name)})")
    known = {n for e in table for n in e.names}
    for name in sorted(files.names() - known):
        if _IGNORED.search(name):
            continue  # multimodal towers: not part of the text model
        problems.append(f"unexpected tensor {name} (in {files.file_of(name)})")
    if problems:
        raise ValueError(f"load_pretrained({path}): checkpoint does not match the config:\n  " + "\n  ".join(problems))

    if mesh is None:
        params = cast_params(nest_params({e.path: e.to_param(files.fetch) for e in table}), dtype)
        check_params(cfg, params)
        return cfg, params

    plan = ShardPlan(cfg, mesh)
    layouts = plan.flat_layouts()
    flat = {}
    for e in table:
        layout = layouts[e.path]
        leaf_np_dtype = np.dtype(leaf_dtype(e.path[-1], dtype))

        def read_block(index, e=e, layout=layout, leaf_np_dtype=leaf_np_dtype):
            return e.read(layout.original_indices(index), files.fetch).astype(leaf_np_dtype)

        flat[e.path] = jax.make_array_from_callback(layout.sharded_shape, NamedSharding(mesh, layout.spec), read_block)
    return cfg, nest_params(flat)


# ------------------------------------------------------------------------- saving

# fp32 leaves that stay fp32 when a checkpoint is written in a lower precision
KEEP_FP32 = frozenset({"k_conv", "v_conv", "attn_conv", "mlp_conv", "router", "router_bias", "router_scale"})


def checkpoint_tensors(cfg: InklingConfig, params: Params, naming: str = "hub", dtype: Any = None) -> dict[str, Array]:
    """The checkpoint tensors of `params` (numpy, torch layout) under `naming` ("hub" or
    "transformers"): what `save_pretrained` writes, and what HF's modules hold (see
    `hf_transformers.causal_lm`). dtype: the tensors' dtype (default: as the params are;
    fp32 conv and router leaves stay fp32)."""
    check_params(cfg, params)
    np_dtype = None if dtype is None else np.dtype(jnp.dtype(dtype))
    flat = flat_params(params)
    tensors: dict[str, Array] = {}
    for e in entries(cfg, naming):
        value = flat[e.path]
        keep32 = str(value.dtype) == "float32" and e.path[-1] in KEEP_FP32
        arr = _to_numpy(value, None if (np_dtype is None or keep32) else np_dtype)
        for name, t in zip(e.names, e.to_tensors(arr)):
            tensors[name] = np.ascontiguousarray(t)
    return tensors


def save_pretrained(path: str | os.PathLike, cfg: InklingConfig, params: Params, naming: str = "hub",
                    dtype: Any = None, max_shard_bytes: int = 4 << 30) -> None:
    """Write config.json and the weights: `model.safetensors` when one shard holds everything,
    else `model-0000i-of-0000n.safetensors` (split above `max_shard_bytes`) and
    model.safetensors.index.json listing them.

    naming "hub" writes what HF's InklingForConditionalGeneration reads (with the
    `inkling_mm_model` config); "transformers" writes InklingForCausalLM's layout and config.
    dtype: the tensor dtype on disk (default: as the params are; fp32 leaves stay fp32).

    Files in `path`: every file is first written under a temporary name in `path` and then
    renamed into place, so no reader sees a half-written file and a failed save leaves the
    old files as they were. The only files ever deleted are the ones a previous save_pretrained
    into `path` wrote and this one does not rewrite: the shards its index lists, and that
    index, recognised by the writer tag in its metadata (a single-file save leaves no index,
    so it is simply overwritten). Other files stay; when other *.safetensors files or an index
    we did not write are present, an index is written even for one shard, so that loaders
    read exactly this checkpoint's files."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"save_pretrained: {path} exists and is not a directory")
    os.makedirs(path, exist_ok=True)
    tensors = checkpoint_tensors(cfg, params, naming, dtype)
    np_dtype = None if dtype is None else np.dtype(jnp.dtype(dtype))
    config = cfg.to_hf()
    if naming == "transformers":
        config = dict(config["text_config"], architectures=["InklingForCausalLM"])
    torch_dtype = str(np.dtype(np_dtype or np.float32)) if np_dtype is not None else _dominant_dtype(tensors)
    config["dtype"] = torch_dtype
    _write_checkpoint_files(path, config, tensors, max_shard_bytes)


def _dominant_dtype(tensors: dict[str, Array]) -> str:
    sizes: dict[str, int] = {}
    for t in tensors.values():
        sizes[str(t.dtype)] = sizes.get(str(t.dtype), 0) + t.nbytes
    return max(sizes, key=sizes.get) if sizes else "float32"


def _our_previous_index(path: str) -> set[str] | None:
    """The shard files listed by the index in `path` if save_pretrained wrote that index;
    None when there is no index or another tool wrote it."""
    try:
        with open(os.path.join(path, INDEX_FILE)) as f:
            index = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(index, dict) or not isinstance(index.get("metadata"), dict) \
            or index["metadata"].get("writer") != WRITER_TAG:
        return None
    names = set((index.get("weight_map") or {}).values())
    # only plain file names of shards in this directory
    return {n for n in names if isinstance(n, str) and n.endswith(".safetensors") and os.path.basename(n) == n}


def _write_checkpoint_files(path: str, config: dict, tensors: dict[str, Array], max_shard_bytes: int) -> None:
    shards: list[dict[str, Array]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name]
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    n = len(shards)
    shard_names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    ours = _our_previous_index(path)
    index_exists = os.path.exists(os.path.join(path, INDEX_FILE))
    others = {f for f in os.listdir(path) if f.endswith(".safetensors")} - (ours or set()) - set(shard_names)
    write_index = n > 1 or bool(others) or (index_exists and ours is None)
    stale = (ours or set()) - set(shard_names)
    if ours is not None and not write_index:
        stale.add(INDEX_FILE)
    outputs: list[tuple[str, Any]] = list(zip(shard_names, shards))
    if write_index:
        outputs.append((INDEX_FILE, {
            "metadata": {"total_size": sum(t.nbytes for t in tensors.values()), "writer": WRITER_TAG},
            "weight_map": {name: fname for fname, shard in zip(shard_names, shards) for name in shard}}))
    outputs.append((CONFIG_FILE, config))

    token = uuid.uuid4().hex[:12]
    temp = lambda final: os.path.join(path, f".{final}.{token}.tmp")
    written: list[tuple[str, str]] = []  # (temporary, final)
    try:
        for fname, payload in outputs:
            written.append((temp(fname), fname))
            if fname.endswith(".safetensors"):
                save_file(payload, temp(fname), metadata={"format": "pt"})
            else:
                with open(temp(fname), "w") as f:
                    json.dump(payload, f, indent=2)
        # shards first, then the index naming them, then the config
        for tmp, final in written:
            os.replace(tmp, os.path.join(path, final))
    finally:
        for tmp, _ in written:
            if os.path.exists(tmp):
                os.remove(tmp)
    for fname in sorted(stale):
        full = os.path.join(path, fname)
        if os.path.isfile(full):
            os.remove(full)


def _to_numpy(x: Any, dtype: Any) -> Array:
    x = jax.device_get(x)
    x = np.asarray(x)
    return x.astype(dtype) if dtype is not None else x

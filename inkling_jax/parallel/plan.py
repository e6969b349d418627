"""`ShardPlan`: how an Inkling model is split over an ("ep", "tp") mesh.

Each device runs the single-device program on a *local config* (`ShardPlan.local_cfg`):

    attention      num_heads / tp and swa_num_heads / tp q heads; kv heads max(1, nkv / tp)
                   (when nkv < tp, shard j holds the one kv head its q heads use: tp must
                   be a multiple of nkv); rel heads (r) follow the q heads
    dense MLP      dense_intermediate_size / tp (dense layers and MTP blocks)
    routed experts n_routed_experts / ep experts, each expert_intermediate_size / tp wide
    shared experts their width / tp (replicated over ep)
    vocab          vocab_size / tp rows of embed, columns of unembed
    MTP input_proj rows (the 2H input features) / tp

Replicated: the residual stream and everything acting on its H channels (norms, the attn /
mlp short-conv weights and windows, rel_proj, q_norm / k_norm (per head_dim), the router and
its bias and scale). The k / v conv weights and windows, and the K/V cache, follow the kv
heads. The collectives are in `inkling_jax/model/layers.py`.

`param_shapes(local_cfg)` is each device's param tree except for two kinds of leaf:
- the router (weight [H, E (+S)], bias [E], scale): routing runs replicated on the *global*
  router (`ParallelAxes.global_cfg`), so these keep their global shape on every device;
- MTP input_proj: [2H / tp, H] (a row-parallel linear; H itself is never split).
`local_params_shape()` gives the true per-device shapes. The local config's
num_experts_per_tok is min(top-k, local experts) only so that it validates; the router reads
top-k from the global config.

Sharded layout: a leaf sharded along a dimension is stored so that device j's contiguous
shard is its local tensor (see `layout.py`): fused q|k|v|r and gate|up columns are
reordered per shard, and kv heads fewer than tp are repeated. `shard_params` /
`unshard_params` convert between that layout and the original (`model/params.py`) one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from ..config import AttentionGeometry, InklingConfig
from ..model.params import Params, check_params, flat_params, param_shapes
from .axes import EP_AXIS, TP_AXIS, ParallelAxes
from .layout import DimLayout, LeafLayout, Part


@dataclass(frozen=True)
class ShardPlan:
    """The split of `cfg` over `mesh` (axes "ep" and "tp"; see `make_mesh`).

    For planning without devices, pass mesh=None and the sizes: ShardPlan(cfg, tp=8, ep=1);
    then everything but the device placement (`shardings`, `shard_params`, ...) works."""

    cfg: InklingConfig
    mesh: Mesh | None = None
    tp: int | None = None  # None: from the mesh (1 without one)
    ep: int | None = None
    local_cfg: InklingConfig = field(init=False, compare=False, repr=False)
    axes: ParallelAxes = field(init=False, compare=False, repr=False)
    layouts: Params = field(init=False, compare=False, repr=False)  # LeafLayout per leaf, params' structure

    def __post_init__(self):
        tp, ep = self.tp, self.ep
        if self.mesh is not None:
            shape = dict(self.mesh.shape)
            missing = {TP_AXIS, EP_AXIS} - set(shape)
            if missing or len(shape) != 2:
                raise ValueError(f"ShardPlan: the mesh must have exactly the axes ('ep', 'tp') (make_mesh builds "
                                 f"one), got {tuple(self.mesh.axis_names)}")
            for name, given in ((TP_AXIS, tp), (EP_AXIS, ep)):
                if given is not None and given != shape[name]:
                    raise ValueError(f"ShardPlan: {name}={given} disagrees with the mesh's {name} axis "
                                     f"of {shape[name]}")
            tp, ep = shape[TP_AXIS], shape[EP_AXIS]
        tp, ep = (1 if tp is None else tp), (1 if ep is None else ep)
        for name, value in (("tp", tp), ("ep", ep)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"ShardPlan: {name} must be a positive int (or come from a mesh), got {value!r}")
        object.__setattr__(self, "tp", int(tp))
        object.__setattr__(self, "ep", int(ep))
        _check_divisible(self.cfg, self.tp, self.ep)
        object.__setattr__(self, "local_cfg", _local_config(self.cfg, self.tp, self.ep))
        object.__setattr__(self, "axes", ParallelAxes(self.cfg, self.tp, self.ep))
        object.__setattr__(self, "layouts", _leaf_layouts(self.cfg, self.tp, self.ep))

    # ------------------------------------------------------------- specs and shapes

    def param_specs(self) -> Params:
        """A PartitionSpec per leaf (params' structure) of the sharded-layout arrays."""
        return jax.tree_util.tree_map(lambda l: l.spec, self.layouts, is_leaf=_is_layout)

    def shardings(self) -> Params:
        mesh = self._need_mesh("shardings")
        return jax.tree_util.tree_map(lambda l: NamedSharding(mesh, l.spec), self.layouts, is_leaf=_is_layout)

    def sharded_params_shape(self) -> Params:
        """Global shape of every leaf in the sharded layout (longer than the original where
        kv heads are repeated)."""
        return jax.tree_util.tree_map(lambda l: l.sharded_shape, self.layouts, is_leaf=_is_layout)

    def local_params_shape(self) -> Params:
        """Every leaf's shape on one device: param_shapes(local_cfg), except the router leaves
        (global) and MTP input_proj (rows / tp); see the module docstring."""
        return jax.tree_util.tree_map(lambda l: l.local_shape, self.layouts, is_leaf=_is_layout)

    def flat_layouts(self) -> dict[tuple, LeafLayout]:
        """{params path: LeafLayout} (paths as `flat_params` makes them, list
        positions as ints)."""
        return flat_params(self.layouts)

    # ------------------------------------------------------------ moving params

    def shard_params(self, params: Params) -> Params:
        """Unsharded params (original layout; numpy, or jax arrays on one device) -> global
        jax arrays in the sharded layout, each device holding exactly its local tensors.

        Each device's block is gathered from host memory through the layout's index map
        (`jax.make_array_from_callback`); the reordered whole is never built."""
        mesh = self._need_mesh("shard_params")
        check_params(self.cfg, params)

        def place(layout: LeafLayout, x: Any) -> jax.Array:
            host = np.asarray(x)
            return jax.make_array_from_callback(layout.sharded_shape, NamedSharding(mesh, layout.spec),
                                                lambda index: host[np.ix_(*layout.original_indices(index))])

        return jax.tree_util.tree_map(place, self.layouts, params, is_leaf=_is_layout)

    def unshard_params(self, params: Params) -> Params:
        """Sharded-layout params -> numpy arrays in the original layout (gathered to this host).

        Raises ValueError if the repeated copies of a kv head disagree (they are one tensor)."""
        def gather(path, layout: LeafLayout, x: Any) -> np.ndarray:
            host = np.asarray(jax.device_get(x))
            if host.shape != layout.sharded_shape:
                raise ValueError(f"unshard_params: {jax.tree_util.keystr(path)} has shape {host.shape}, "
                                 f"expected the sharded layout's {layout.sharded_shape}")
            original = layout.from_sharded(np, host)
            if layout.sharded_shape != layout.shape and not _same_bits(layout.to_sharded(np, original), host):
                raise ValueError(f"unshard_params: the repeated copies of {jax.tree_util.keystr(path)} disagree")
            return original

        return jax.tree_util.tree_map_with_path(gather, self.layouts, params, is_leaf=_is_layout)

    def to_sharded_on_devices(self, params: Params) -> Params:
        """Original-layout global arrays already on the mesh (any sharding) -> the sharded
        layout, by one jitted reshape per reordered leaf (XLA moves columns between devices;
        nothing goes through the host). Leaves whose layout is the original one are only
        re-placed."""
        shardings = self.shardings()

        def move(layout: LeafLayout, sharding: NamedSharding, x: jax.Array) -> jax.Array:
            if layout.is_identity:
                return jax.device_put(x, sharding)
            return _relayout(layout, "to", sharding)(x)

        return jax.tree_util.tree_map(move, self.layouts, shardings, params, is_leaf=_is_layout)

    def from_sharded_on_devices(self, params: Params) -> Params:
        """Inverse of `to_sharded_on_devices`: original-layout global arrays, sharded by
        `original_spec` (for writing a checkpoint from the devices)."""
        mesh = self._need_mesh("from_sharded_on_devices")

        def move(layout: LeafLayout, x: jax.Array) -> jax.Array:
            sharding = NamedSharding(mesh, layout.original_spec())
            if layout.is_identity:
                return jax.device_put(x, sharding)
            return _relayout(layout, "from", sharding)(x)

        return jax.tree_util.tree_map(move, self.layouts, params, is_leaf=_is_layout)

    def original_shardings(self) -> Params:
        """NamedShardings for original-layout arrays (each sharded dim cut evenly where it divides)."""
        mesh = self._need_mesh("original_shardings")
        return jax.tree_util.tree_map(lambda l: NamedSharding(mesh, l.original_spec()), self.layouts,
                                      is_leaf=_is_layout)

    def _need_mesh(self, what: str) -> Mesh:
        if self.mesh is None:
            raise ValueError(f"ShardPlan.{what} needs devices: build the plan with a mesh (make_mesh)")
        return self.mesh

    def describe(self) -> str:
        c, l = self.cfg, self.local_cfg
        return (f"ShardPlan(tp={self.tp}, ep={self.ep}): heads {c.num_heads}->{l.num_heads} "
                f"(kv {c.num_kv_heads}->{l.num_kv_heads}), swa heads {c.swa_num_heads}->{l.swa_num_heads} "
                f"(kv {c.swa_num_kv_heads}->{l.swa_num_kv_heads}), dense width {c.dense_intermediate_size}->"
                f"{l.dense_intermediate_size}, experts {c.n_routed_experts}->{l.n_routed_experts} of width "
                f"{c.expert_intermediate_size}->{l.expert_intermediate_size}, vocab {c.vocab_size}->{l.vocab_size}")


# ---------------------------------------------------------------------- checks


def _geometries(cfg: InklingConfig) -> dict[str, AttentionGeometry]:
    """The attention geometries in use, keyed by the config fields that set their heads."""
    out = {}
    for i in range(cfg.num_layers):
        g = cfg.layer_geometry(i)
        out["swa_num_heads / swa_num_kv_heads" if g.is_sliding else "num_heads / num_kv_heads"] = g
    for d in range(cfg.num_mtp_layers):
        g = cfg.mtp_geometry(d)
        if g.is_sliding:
            out["mtp_swa_num_heads / mtp_swa_num_kv_heads (MTP banded depths)"] = g
        else:
            out["num_heads / num_kv_heads"] = g
    return out


def _check_divisible(cfg: InklingConfig, tp: int, ep: int) -> None:
    problems = []
    if cfg.vocab_size % tp:
        problems.append(f"vocab_size={cfg.vocab_size} is not divisible by tp={tp}")
    for fields, g in _geometries(cfg).items():
        heads_field, kv_field = (f.strip() for f in fields.split("(")[0].split("/"))
        if g.num_heads % tp:
            problems.append(f"{heads_field}={g.num_heads} is not divisible by tp={tp}")
        if g.num_kv_heads >= tp and g.num_kv_heads % tp:
            problems.append(f"{kv_field}={g.num_kv_heads} is not divisible by tp={tp}")
        if g.num_kv_heads < tp and tp % g.num_kv_heads:
            problems.append(f"{kv_field}={g.num_kv_heads} is fewer than tp={tp} but does not divide it (each "
                            f"shard's q heads must share one kv head, which is then repeated)")
    uses_dense = bool(cfg.dense_layer_ids) or cfg.num_mtp_layers > 0
    if uses_dense and cfg.dense_intermediate_size % tp:
        problems.append(f"dense_intermediate_size={cfg.dense_intermediate_size} is not divisible by tp={tp}")
    if cfg.has_moe:
        if cfg.n_routed_experts % ep:
            problems.append(f"n_routed_experts={cfg.n_routed_experts} is not divisible by ep={ep}")
        if cfg.expert_intermediate_size % tp:
            problems.append(f"expert_intermediate_size={cfg.expert_intermediate_size} (routed and shared expert "
                            f"width) is not divisible by tp={tp}")
    if cfg.num_mtp_layers and (2 * cfg.hidden_size) % tp:
        problems.append(f"2 * hidden_size={2 * cfg.hidden_size} (MTP input_proj rows) is not divisible by tp={tp}")
    if problems:
        raise ValueError(f"ShardPlan(tp={tp}, ep={ep}) cannot split this model:\n  " + "\n  ".join(problems))


def _local_config(cfg: InklingConfig, tp: int, ep: int) -> InklingConfig:
    kv = lambda n: max(1, n // tp)
    changes: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size // tp,
        unpadded_vocab_size=cfg.vocab_size // tp,  # the unpadded slice happens after the gather
        num_heads=cfg.num_heads // tp, num_kv_heads=kv(cfg.num_kv_heads),
        swa_num_heads=cfg.swa_num_heads // tp, swa_num_kv_heads=kv(cfg.swa_num_kv_heads),
    )
    if cfg.mtp_swa_num_heads is not None:
        changes["mtp_swa_num_heads"] = cfg.mtp_swa_num_heads // tp
    if cfg.mtp_swa_num_kv_heads is not None:
        changes["mtp_swa_num_kv_heads"] = kv(cfg.mtp_swa_num_kv_heads)
    if bool(cfg.dense_layer_ids) or cfg.num_mtp_layers:
        changes["dense_intermediate_size"] = cfg.dense_intermediate_size // tp
    if cfg.has_moe:
        local_experts = cfg.n_routed_experts // ep
        changes.update(n_routed_experts=local_experts, num_experts_per_tok=min(cfg.num_experts_per_tok, local_experts),
                       expert_intermediate_size=cfg.expert_intermediate_size // tp)
    return cfg.replace(**changes)


# --------------------------------------------------------------- leaf layouts


def _leaf_layouts(cfg: InklingConfig, tp: int, ep: int) -> Params:
    """A LeafLayout per parameter, mirroring `model/params.py` leaf by leaf."""
    h = cfg.hidden_size
    expected = param_shapes(cfg)
    even = lambda axis, shards, n: DimLayout.even(axis, shards, n)
    rep = LeafLayout.replicated

    def gate_up(width: int) -> DimLayout:  # [gate | up] -> (gate_j | up_j) per shard
        return DimLayout(TP_AXIS, tp, (Part(0, width, tp), Part(width, width, tp)))

    def attn(g: AttentionGeometry) -> dict[str, LeafLayout]:
        qd, kvd, rd = g.q_dim, g.kv_dim, g.num_heads * cfg.d_rel
        kv_pieces = min(g.num_kv_heads, tp)  # fewer kv heads than shards: each head is one repeated piece
        qkvr = DimLayout(TP_AXIS, tp, (Part(0, qd, tp), Part(qd, kvd, kv_pieces), Part(qd + kvd, kvd, kv_pieces),
                                       Part(qd + 2 * kvd, rd, tp)))
        kv_cols = DimLayout(TP_AXIS, tp, (Part(0, kvd, kv_pieces),))
        k = cfg.conv_kernel_size
        return {
            "wqkvr": LeafLayout((h, qd + 2 * kvd + rd), (None, qkvr)),
            "wo": LeafLayout((qd, h), (even(TP_AXIS, tp, qd), None)),
            "q_norm": rep((g.head_dim,)), "k_norm": rep((g.head_dim,)),
            "k_conv": LeafLayout((k, kvd), (None, kv_cols)), "v_conv": LeafLayout((k, kvd), (None, kv_cols)),
            "rel_proj": rep((cfg.d_rel, g.rel_extent)),
        }

    def mlp(dense: bool, shapes: dict[str, tuple[int, ...]]) -> dict[str, LeafLayout]:
        if dense:
            i = cfg.dense_intermediate_size
            out = {"w13": LeafLayout((h, 2 * i), (None, gate_up(i))),
                   "w2": LeafLayout((i, h), (even(TP_AXIS, tp, i), None))}
            if cfg.use_global_scale:
                out["global_scale"] = rep((1,))
            return out
        e, f = cfg.n_routed_experts, cfg.expert_intermediate_size
        out = {"router": rep(shapes["router"]),
               "w13": LeafLayout((e, h, 2 * f), (even(EP_AXIS, ep, e), None, gate_up(f))),
               "w2": LeafLayout((e, f, h), (even(EP_AXIS, ep, e), even(TP_AXIS, tp, f), None))}
        for name in ("router_bias", "router_scale"):
            if name in shapes:
                out[name] = rep(shapes[name])
        if "shared_w13" in shapes:
            ns, _, two_fs = shapes["shared_w13"]
            fs = two_fs // 2
            out["shared_w13"] = LeafLayout((ns, h, 2 * fs), (None, None, gate_up(fs)))
            out["shared_w2"] = LeafLayout((ns, fs, h), (None, even(TP_AXIS, tp, fs), None))
        return out

    def layer(g: AttentionGeometry, dense: bool, shapes: dict[str, Any]) -> dict[str, Any]:
        k = cfg.conv_kernel_size
        return {"attn_norm": rep((h,)), "mlp_norm": rep((h,)), "attn_conv": rep((k, h)), "mlp_conv": rep((k, h)),
                "attn": attn(g), "mlp": mlp(dense, shapes["mlp"])}

    v = cfg.vocab_size
    out: Params = {
        "embed": LeafLayout((v, h), (even(TP_AXIS, tp, v), None)),
        "layers": [layer(cfg.layer_geometry(i), cfg.is_dense(i), expected["layers"][i]) for i in range(cfg.num_layers)],
        "final_norm": rep((h,)),
        "unembed": LeafLayout((h, v), (None, even(TP_AXIS, tp, v))),
    }
    if cfg.use_embed_norm:
        out["embed_norm"] = rep((h,))
    if cfg.num_mtp_layers:
        mtp: Params = {"layers": [
            {"hidden_norm": rep((h,)), "embed_norm": rep((h,)),
             "input_proj": LeafLayout((2 * h, h), (even(TP_AXIS, tp, 2 * h), None)),
             "block": layer(cfg.mtp_geometry(d), True, expected["mtp"]["layers"][d]["block"])}
            for d in range(cfg.num_mtp_layers)]}
        if cfg.chain_hidden_post_norm:
            mtp["chain_norm"] = rep((h,))
        out["mtp"] = mtp
    # one source of truth for shapes: the layouts must mirror model/params.py exactly
    if jax.tree_util.tree_map(lambda l: l.shape, out, is_leaf=_is_layout) != expected:
        raise AssertionError("parallel/plan.py leaf layouts are out of step with model/params.py")
    return out


# ---------------------------------------------------------------------- helpers


def _is_layout(x: Any) -> bool:
    return isinstance(x, LeafLayout)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8)))


_RELAYOUTS: dict[tuple, Any] = {}


def _relayout(layout: LeafLayout, direction: str, sharding: NamedSharding):
    """A cached jitted relayout of one leaf (to / from the sharded layout) onto `sharding`."""
    key = (layout, direction, sharding)
    if key not in _RELAYOUTS:
        fn = (lambda x: layout.to_sharded(jnp, x)) if direction == "to" else (lambda x: layout.from_sharded(jnp, x))
        _RELAYOUTS[key] = jax.jit(fn, out_shardings=sharding)
    return _RELAYOUTS[key]

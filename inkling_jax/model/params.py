"""The parameter pytree: its layout (one source of truth for shapes) and random init.

Layout (nested dicts of arrays; matrices are stored [in, out] so activations do x @ W):

    embed        [V_pad, H]            embed_norm [H]           final_norm [H]
    unembed      [H, V_pad]
    layers[l]:   attn_norm [H]  mlp_norm [H]  attn_conv [K, H]  mlp_conv [K, H]
      attn:      wqkvr [H, nh*hd + 2*nkv*hd + nh*d_rel]   (q | k | v | r, sglang's fused order)
                 wo [nh*hd, H]  q_norm [hd]  k_norm [hd]  k_conv [K, nkv*hd]  v_conv [K, nkv*hd]
                 rel_proj [d_rel, rel_extent_l]
      mlp dense: w13 [H, 2*I] (gate | up)   w2 [I, H]   global_scale [1]
      mlp MoE:   router [H, E(+S)]  router_bias [E]  router_scale [1]
                 w13 [E, H, 2*F]  w2 [E, F, H]  shared_w13 [S, H, 2*F'] shared_w2 [S, F', H]
    mtp:         layers[d]: hidden_norm [H] embed_norm [H] input_proj [2H, H] block (a dense layer)
                 chain_norm [H] (when chain_hidden_post_norm)

Conv weights [K, D] hold tap K-1 on the current token. Conv weights, the router and its
bias and scales stay fp32 whatever the model dtype (as sglang and HF keep them).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import programs
from ..compile_cache import enable_compile_cache
from ..config import AttentionGeometry, InklingConfig

Params = dict[str, Any]

# Leaves kept in fp32 regardless of the model dtype (matched on the leaf's key).
FP32_LEAVES = frozenset({"k_conv", "v_conv", "attn_conv", "mlp_conv", "router", "router_bias", "router_scale",
                         "global_scale"})


def _attn_shapes(cfg: InklingConfig, g: AttentionGeometry) -> dict[str, tuple[int, ...]]:
    h, k = cfg.hidden_size, cfg.conv_kernel_size
    return {
        "wqkvr": (h, g.q_dim + 2 * g.kv_dim + g.num_heads * cfg.d_rel),
        "wo": (g.q_dim, h),
        "q_norm": (g.head_dim,),
        "k_norm": (g.head_dim,),
        "k_conv": (k, g.kv_dim),
        "v_conv": (k, g.kv_dim),
        "rel_proj": (cfg.d_rel, g.rel_extent),
    }


def _mlp_shapes(cfg: InklingConfig, dense: bool) -> dict[str, tuple[int, ...]]:
    h = cfg.hidden_size
    if dense:
        out = {"w13": (h, 2 * cfg.dense_intermediate_size), "w2": (cfg.dense_intermediate_size, h)}
        if cfg.use_global_scale:
            out["global_scale"] = (1,)
        return out
    e, s, f = cfg.n_routed_experts, cfg.n_shared_experts, cfg.expert_intermediate_size
    sink = cfg.shared_expert_sink and cfg.norm_after_topk
    out = {"router": (h, e + s if sink else e), "w13": (e, h, 2 * f), "w2": (e, f, h)}
    if cfg.use_gate_bias:
        out["router_bias"] = (e,)
    if cfg.use_global_scale:
        out["router_scale"] = (1,)
    if s > 0:
        if sink:
            out["shared_w13"], out["shared_w2"] = (s, h, 2 * f), (s, f, h)
        else:  # plain shared MLP of width S * size * F, unweighted: one "expert"
            fs = s * cfg.shared_experts_size * f
            out["shared_w13"], out["shared_w2"] = (1, h, 2 * fs), (1, fs, h)
    return out


def _layer_shapes(cfg: InklingConfig, g: AttentionGeometry, dense: bool) -> dict[str, Any]:
    h, k = cfg.hidden_size, cfg.conv_kernel_size
    return {
        "attn_norm": (h,), "mlp_norm": (h,), "attn_conv": (k, h), "mlp_conv": (k, h),
        "attn": _attn_shapes(cfg, g), "mlp": _mlp_shapes(cfg, dense),
    }


def param_shapes(cfg: InklingConfig) -> Params:
    """The expected shape of every parameter, as a pytree mirroring the params."""
    h, v = cfg.hidden_size, cfg.vocab_size
    shapes: Params = {
        "embed": (v, h),
        "layers": [_layer_shapes(cfg, cfg.layer_geometry(i), cfg.is_dense(i)) for i in range(cfg.num_layers)],
        "final_norm": (h,),
        "unembed": (h, v),
    }
    if cfg.use_embed_norm:
        shapes["embed_norm"] = (h,)
    if cfg.num_mtp_layers:
        mtp: Params = {"layers": [
            {"hidden_norm": (h,), "embed_norm": (h,), "input_proj": (2 * h, h),
             "block": _layer_shapes(cfg, cfg.mtp_geometry(d), dense=True)}
            for d in range(cfg.num_mtp_layers)]}
        if cfg.chain_hidden_post_norm:
            mtp["chain_norm"] = (h,)
        shapes["mtp"] = mtp
    return shapes


def is_shape(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def leaf_dtype(name: str, dtype: Any) -> Any:
    return jnp.float32 if name in FP32_LEAVES else dtype


DEVICE_INIT_ELEMS = 1 << 20  # leaves at least this large are drawn on the device


def init_params(cfg: InklingConfig, key: jax.Array, dtype: Any = jnp.float32, std: float = 0.02,
                compile_cache: str | None = "auto", executable_cache: str | None = "auto") -> Params:
    """Random parameters: normal(std) matrices, unit norms and scales, normal(0.3) conv taps,
    zero router bias. Deterministic for a given key.

    compile_cache: the persistent compilation cache for the sampling programs, as
    `EngineConfig.compile_cache_dir` ("auto": on a GPU; see `inkling_jax.compile_cache`).
    executable_cache: where their executables are kept, as `EngineConfig.executable_cache`
    (`inkling_jax.programs`).

    Leaves below DEVICE_INIT_ELEMS elements are sampled with numpy's generator seeded from
    the key's bits and cast on the host (a jitted init of a few hundred small leaves takes
    longer to compile than the model does); larger ones on the device, one small program per
    distinct shape (host sampling and the transfer of a few GB took about a minute for the
    bench preset). Their programs are asked for in the compile pool first and compile
    concurrently while the small leaves are drawn (a cold start on a GPU compiled them one
    after another)."""
    enable_compile_cache(compile_cache)
    seed = np.asarray(jax.random.key_data(key)).astype(np.uint64).ravel().tolist()
    rng = np.random.default_rng(seed)
    shapes = param_shapes(cfg)
    paths, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=is_shape)
    leaves: list[Any] = []
    on_device = []  # (position in leaves, the sampler's future, its arguments)
    for i, (path, shape) in enumerate(paths):
        name = _leaf_name(path)
        dt = np.dtype(leaf_dtype(name, dtype))
        # on the host, then placed: an eager jnp op here would compile a program per shape
        if name.endswith("norm") or name in ("global_scale", "router_scale"):
            leaves.append(jax.device_put(np.ones(shape, dt)))
            continue
        if name == "router_bias":
            leaves.append(jax.device_put(np.zeros(shape, dt)))
            continue
        scale = 0.3 if name.endswith("conv") else std
        if math.prod(shape) >= DEVICE_INIT_ELEMS:
            on_device.append((len(leaves), *_device_normal(key, i, tuple(shape), dt, scale, executable_cache)))
            leaves.append(None)
        else:
            leaves.append(jax.device_put((scale * rng.standard_normal(shape, np.float32)).astype(dt)))
    for position, sampler, args in on_device:
        leaves[position] = sampler.result()(*args)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _device_normal(key: jax.Array, i: int, shape: tuple[int, ...], dtype: Any, scale: float,
                   cache: str | None = "auto") -> tuple[Any, tuple]:
    """The program drawing scale * N(0, 1) of `shape` from fold_in(key, i) in fp32 on the default
    device, cast to dtype (one per shape and dtype, a future from the compile pool:
    `inkling_jax.programs`), and the arguments to call it with."""
    def make():
        return jax.jit(lambda k, j, s: (s * jax.random.normal(jax.random.fold_in(k, j), shape, jnp.float32)
                                        ).astype(dtype))

    args = (key, np.int32(i), np.float32(scale))
    sampler = programs.request("normal_sampler", dict(shape=shape, dtype=np.dtype(dtype),
                                                      device=getattr(jax.config, "jax_default_device", None)),
                               make, args, cache=cache, background=True)
    return sampler, args


def _leaf_name(path: tuple[Any, ...]) -> str:
    for entry in reversed(path):
        if isinstance(entry, jax.tree_util.DictKey):
            return str(entry.key)
    return ""


def cast_params(params: Params, dtype: Any) -> Params:
    """Cast to `dtype`, keeping the fp32 leaves fp32."""
    def cast(path, x):
        dt = leaf_dtype(_leaf_name(path), dtype)
        if isinstance(x, np.ndarray):  # cast on the host: on the device it compiles a program per shape
            return jax.device_put(x.astype(np.dtype(dt), copy=False))
        return jnp.asarray(x, dt)
    return jax.tree_util.tree_map_with_path(cast, params)


def check_params(cfg: InklingConfig, params: Params) -> None:
    """Raise ValueError naming every missing, unexpected or mis-shaped parameter."""
    expected = {jax.tree_util.keystr(p): s for p, s in
                jax.tree_util.tree_flatten_with_path(param_shapes(cfg), is_leaf=is_shape)[0]}
    got = {jax.tree_util.keystr(p): tuple(np.shape(x)) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    problems = [f"missing {k} (expected shape {expected[k]})" for k in expected if k not in got]
    problems += [f"unexpected {k}" for k in got if k not in expected]
    problems += [f"{k}: shape {got[k]}, expected {expected[k]}" for k in expected if k in got and got[k] != expected[k]]
    if problems:
        raise ValueError("parameters do not match the config:\n  " + "\n  ".join(problems))


# ------------------------------------------------------------- nested parameter names


def flat_params(params: Params) -> dict[tuple, Any]:
    """{path: leaf} with paths like ("layers", 3, "attn", "wqkvr") (list positions as ints):
    the keys `Entry.path` and `ShardPlan.flat_layouts` use. Dicts and lists are the nodes;
    an empty one leaves no entry. (Written here rather than taken from flax.traverse_util:
    importing flax cost every process ~0.25 s of start-up, BENCHMARKS.md 2026-12-06.)"""
    flat: dict[tuple, Any] = {}

    def walk(path: tuple, tree: Any) -> None:
        if isinstance(tree, (dict, list)):
            for key, sub in (tree.items() if isinstance(tree, dict) else enumerate(tree)):
                walk(path + (key,), sub)
        else:
            flat[path] = tree

    walk((), params)
    return flat


def nest_params(flat: dict[tuple, Any]) -> Params:
    """Inverse of flat_params: nested dicts, with int-keyed levels turned back into lists."""
    tree: dict = {}
    for path, leaf in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf
    return _int_dicts_to_lists(tree)


def _int_dicts_to_lists(tree: Any) -> Any:
    if isinstance(tree, dict):
        if tree and all(isinstance(k, int) for k in tree):
            if sorted(tree) != list(range(len(tree))):
                raise ValueError(f"parameter list positions {sorted(tree)} are not 0..{len(tree) - 1}")
            return [_int_dicts_to_lists(tree[i]) for i in range(len(tree))]
        return {k: _int_dicts_to_lists(v) for k, v in tree.items()}
    return tree

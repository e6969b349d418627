"""The epilogue of the MoE router (`inkling_jax.model.moe.route` after its matmul): the scores,
the biased top-k selection and the (sink-)normalised weights. `router_epilogue_ref` in jnp,
every config (what the CPU serves, `pallas_kernels.REFERENCE_OPS.router_epilogue`), and
`router_epilogue`, the sigmoid + norm_after_topk case in one Pallas launch.

    router_epilogue(logits, bias, scale, *, k, route_scale) -> (idx, w, gamma)
        logits [n, E+S] f32: x @ router (computed by XLA), the E routed experts' columns then
            the S shared "sink" experts' columns
        bias [E] f32 or None (the selection bias), scale [1] f32 or None (the global router scale)
        idx [n, k] int32: the top-k routed experts by sigmoid(logit) + bias, descending, ties to
            the lower index (lax.top_k's order)
        w [n, k] f32, gamma [n, S] f32: exp(ls - logsumexp(ls)) * route_scale * scale over
            ls = log_sigmoid([selected logits, sink logits]) (route's sigmoid + norm_after_topk +
            shared_expert_sink case)

E is bias.shape[0], or the keyword `num_experts` (required when bias is None); S = width - E
(S = 0 gives gamma [n, 0] and weights normalised over the k selected experts alone).
`router_epilogue_ref(..., gate="sigmoid", norm_after_topk=True)` is the same computation in
jnp (with gate="softmax" or norm_after_topk=False also the model's other routers); the kernel
is tested against it and against `route` itself, and falls back to it for n == 0 or
malformed shapes.

Why. After the router matmul, XLA's GPU code runs route's epilogue as ~5 small kernels per
layer (sigmoid + bias, the top-k, the gather of the selected logits, the concatenate /
log-sigmoid / logsumexp / scale): launch latency, not work, at a few decoding tokens. This
kernel is one launch reading logits once and writing the three outputs.

Work split. One program per block of `block_rows` rows (grid ceil(n / block_rows)); a row never
spans programs and every row lives in registers. The program loads its [block_rows, P] tile
of logits, P = the next power of two >= E + S (Triton block shapes are powers of two), with a
masked load: columns >= E + S and rows >= n read as 0 and are never selected or stored, so
no padded copy of the logits exists (a jnp.pad in the wrapper would be a second XLA fusion).
Then, on the tile:

    choice = sigmoid(logits) + bias              (bias loaded as a masked [P] row)
    k times: m = max over the still available routed columns (col < E, not yet taken)
             j = the lowest column with choice == m   (max + where(iota) + min; no argmax)
             idx[:, t] = j; the selected logit = max(where(col == j, logits, -inf)); j taken
    a = [selected logits (k), sink logits (S)]   per row, as k + S [block_rows] vectors
    ls = log_sigmoid(a); w = exp(ls - logsumexp(ls)) * route_scale * scale

The log-sigmoid / logsumexp part is jax's own formula op for op (log_sigmoid = -softplus(-a),
softplus(x) = max(x, 0) + log1p(exp(-|x|)); logsumexp with the max shifted to 0 when not
finite), over k + S columns accumulated in column order. The three outputs are written as
[block_rows, next_pow2(k)] and [block_rows, next_pow2(S)] tiles with masked stores.

Defaults. One row per program with one warp (num_warps 2 from P = 1024, 4 from P = 2048), a
grid of n programs. Measured on the H200 (`bench/kernels/router_micro.py`, bench shapes E + S = 34,
k = 4, device time per call): 1.8 / 2.0 / 4.7 us at n = 32 / 256 / 4096, where the earlier
default of 16-row tiles with 2 warps took 10.3 / 10.3 / 11.0 us (a [16, 64] tile's row
reductions and per-row [16, 1] vectors cost far more than spreading the rows over programs)
and XLA's own epilogue 7.7 / 8.8 / 14.3 us. At n = 4096, 2 rows per program read 4.5 us.

Exactness. idx equals the reference's when the kernel's sigmoid matches XLA's bit for bit:
true in interpret mode (both are XLA's logistic on the same values). On the GPU both sides
compute 1 / (1 + exp(-x)) (XLA's LogisticExpander; Pallas' Triton rule for logistic) with
libdevice's __nv_expf and a div.full.f32 division (Triton's f32 divf; XLA sets
-nvptx-prec-divf32=1, which selects div.full, or the rcp.approx that equals it for 1 / d), so
they should agree too; only a GPU run settles it. The weights equal the reference's within a
few fp32 ulp (transcendental implementations and the summation order of logsumexp differ).
NaN logits give unspecified (but in-range) expert ids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from .._common import pallas_call, pow2_ceil


def _num_experts(width: int, bias, num_experts: int | None) -> int:
    if num_experts is not None:
        return int(num_experts)
    if bias is None:
        raise ValueError("router_epilogue: pass num_experts (E) when bias is None")
    return int(bias.shape[0])


def default_block_rows(n: int, width: int) -> int:
    """Rows per program by default: one (see the module docstring's measurements)."""
    return 1


def default_num_warps(block_rows: int, width: int) -> int:
    """Warps per program: 1 up to 512 tile values, 2 below 2048, then 4."""
    elems = block_rows * pow2_ceil(width)
    return 1 if elems <= 512 else 2 if elems < 2048 else 4


def router_epilogue_ref(logits: Float[Array, "n w"], bias: Float[Array, " e"] | None, scale: Float[Array, "1"] | None,
                        *, k: int, route_scale: float, num_experts: int | None = None, gate: str = "sigmoid",
                        norm_after_topk: bool = True
                        ) -> tuple[Int[Array, "n k"], Float[Array, "n k"], Float[Array, "n s"]]:
    """The router after its matmul, fp32: (topk_idx [n, k], topk_weight [n, k], gamma [n, S]).

    Selection by the sigmoid (gate "sigmoid") or softmax ("softmax") scores of the E routed
    experts plus the selection bias; with norm_after_topk the weights renormalise over the
    selected routed experts *and* the S sink columns after them (gamma: the sinks' weights),
    else they are the selected scores (gamma [n, 0]); everything times route_scale * scale."""
    e = _num_experts(logits.shape[-1], bias, num_experts)
    s = logits.shape[-1] - e
    logits = logits.astype(jnp.float32)
    routed = logits[:, :e]
    scores = jax.nn.sigmoid(routed) if gate == "sigmoid" else jax.nn.softmax(routed, axis=-1)
    choice = scores + bias.astype(jnp.float32) if bias is not None else scores
    _, idx = lax.top_k(choice, k)
    if norm_after_topk:
        sel = jnp.take_along_axis(routed, idx, axis=-1)
        a = jnp.concatenate([sel, logits[:, e:]], axis=-1) if s else sel
        if gate == "sigmoid":
            ls = jax.nn.log_sigmoid(a)
            w = jnp.exp(ls - jax.nn.logsumexp(ls, axis=-1, keepdims=True))
        else:
            w = jax.nn.softmax(a, axis=-1)
    else:
        w = jnp.take_along_axis(scores, idx, axis=-1)
        s = 0
    w = w * route_scale * scale.astype(jnp.float32) if scale is not None else w * route_scale
    gamma = w[:, k:] if s else jnp.zeros((logits.shape[0], 0), jnp.float32)
    return idx, w[:, :k], gamma


def _log_sigmoid(a):
    """jax.nn.log_sigmoid(a) = -logaddexp(-a, 0), jax's formula op for op."""
    x = -a
    return -(jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x))))


def _kernel(*refs, n: int, e: int, s: int, k: int, route_scale: float, br: int, p: int, kp: int, sp: int,
            has_bias: bool, has_scale: bool):
    refs = list(refs)
    logits_ref = refs.pop(0)
    bias_ref = refs.pop(0) if has_bias else None
    scale_ref = refs.pop(0) if has_scale else None
    idx_ref, w_ref = refs.pop(0), refs.pop(0)
    gamma_ref = refs.pop(0) if s else None

    r0 = pl.multiple_of(pl.program_id(0) * br, br)
    rows = pl.ds(r0, br)
    row_ok = (r0 + lax.broadcasted_iota(jnp.int32, (br, 1), 0)) < n  # [br, 1]
    col = lax.broadcasted_iota(jnp.int32, (br, p), 1)
    x = plt.load(logits_ref.at[rows, pl.ds(0, p)], mask=row_ok & (col < e + s), other=0.0)

    choice = jax.nn.sigmoid(x)  # 1 / (1 + exp(-x)) on the GPU, as XLA expands it
    if has_bias:
        lane = lax.broadcasted_iota(jnp.int32, (p,), 0)
        b = plt.load(bias_ref.at[pl.ds(0, p)], mask=lane < e, other=0.0)
        choice = choice + b[None, :]

    # top-k: k rounds of (max over the available routed columns, lowest column attaining it)
    avail = col < e
    neg_inf = jnp.float32(-jnp.inf)
    sel_idx, a = [], []
    for _ in range(k):
        m = jnp.max(jnp.where(avail, choice, neg_inf), axis=1, keepdims=True)
        j = jnp.min(jnp.where(avail & (choice == m), col, p), axis=1, keepdims=True)
        j = jnp.minimum(j, e - 1)  # only NaN rows find no column equal to their max
        pick = col == j
        avail = avail & jnp.logical_not(pick)
        sel_idx.append(j)
        a.append(jnp.max(jnp.where(pick, x, neg_inf), axis=1, keepdims=True))
    for t in range(s):
        a.append(jnp.max(jnp.where(col == e + t, x, neg_inf), axis=1, keepdims=True))

    # weights: jax.nn.log_sigmoid, then exp(ls - logsumexp(ls)) over the k + S columns [br, 1]
    ls = [_log_sigmoid(v) for v in a]
    mx = ls[0]
    for v in ls[1:]:
        mx = jnp.maximum(mx, v)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    se = jnp.exp(ls[0] - mx)
    for v in ls[1:]:
        se = se + jnp.exp(v - mx)
    lse = jnp.log(se) + mx
    w = [jnp.exp(v - lse) * route_scale for v in ls]
    if has_scale:
        sc = scale_ref[0]
        w = [v * sc for v in w]

    def tile(vals, width, dtype):
        c = lax.broadcasted_iota(jnp.int32, (br, width), 1)
        out = jnp.zeros((br, width), dtype)
        for t, v in enumerate(vals):
            out = jnp.where(c == t, v, out)
        return out, row_ok & (c < len(vals))

    idx_tile, mask = tile(sel_idx, kp, jnp.int32)
    plt.store(idx_ref.at[rows, pl.ds(0, kp)], idx_tile, mask=mask)
    w_tile, mask = tile(w[:k], kp, jnp.float32)
    plt.store(w_ref.at[rows, pl.ds(0, kp)], w_tile, mask=mask)
    if s:
        g_tile, mask = tile(w[k:], sp, jnp.float32)
        plt.store(gamma_ref.at[rows, pl.ds(0, sp)], g_tile, mask=mask)


def router_epilogue(logits: Float[Array, "n w"], bias: Float[Array, " e"] | None, scale: Float[Array, "1"] | None,
                    *, k: int, route_scale: float, num_experts: int | None = None, interpret: bool = False,
                    block_rows: int | None = None, num_warps: int | None = None
                    ) -> tuple[Int[Array, "n k"], Float[Array, "n k"], Float[Array, "n s"]]:
    """(idx [n, k] int32, w [n, k] f32, gamma [n, S] f32): `router_epilogue_ref` in one Pallas
    launch. k, route_scale, num_experts (E; default bias.shape[0]), block_rows (a power of two)
    and num_warps are static. See the module docstring."""
    k = int(k)
    route_scale = float(route_scale)
    kw = dict(k=k, route_scale=route_scale, num_experts=num_experts)
    if logits.ndim != 2:
        return router_epilogue_ref(logits, bias, scale, **kw)
    n, width = logits.shape
    e = _num_experts(width, bias, num_experts)
    s = width - e
    ok = (n > 0 and 1 <= k <= e and s >= 0 and (bias is None or bias.shape == (e,))
          and (scale is None or scale.shape == (1,)))
    if not ok:
        return router_epilogue_ref(logits, bias, scale, **kw)
    if block_rows is None:
        block_rows = default_block_rows(n, width)
    elif block_rows < 1 or block_rows & (block_rows - 1):
        raise ValueError(f"block_rows must be a power of two, not {block_rows}")
    if num_warps is None:
        num_warps = default_num_warps(block_rows, width)

    kernel = lambda *refs: _kernel(*refs, n=n, e=e, s=s, k=k, route_scale=route_scale, br=block_rows,
                                   p=pow2_ceil(width), kp=pow2_ceil(k), sp=pow2_ceil(max(s, 1)),
                                   has_bias=bias is not None, has_scale=scale is not None)
    out_shape = [jax.ShapeDtypeStruct((n, k), jnp.int32), jax.ShapeDtypeStruct((n, k), jnp.float32)]
    if s:
        out_shape.append(jax.ShapeDtypeStruct((n, s), jnp.float32))
    args = [logits.astype(jnp.float32)]
    args += [bias.astype(jnp.float32)] if bias is not None else []
    args += [scale.astype(jnp.float32)] if scale is not None else []
    outs = pallas_call(kernel, out_shape=tuple(out_shape), grid=(pl.cdiv(n, block_rows),), aliases={},
                       interpret=interpret, num_warps=num_warps, name="moe_router_epilogue")(*args)
    if s:
        return tuple(outs)
    return outs[0], outs[1], jnp.zeros((n, 0), jnp.float32)


__all__ = ["default_block_rows", "router_epilogue", "router_epilogue_ref"]

"""What the decode loop body traces (the Pallas ops in interpret mode): every op there runs K
times per dispatch, and on the GPU each small one is a launch (BENCHMARKS.md, "Fewer launches
per decode step"). These tests pin the launches that were taken out, so that a rewrite does not
quietly bring them back:

* the attention of a decode step (one token per row) takes its per-row views by reshapes: no
  gather (and no concatenate) under the `attention` / `attend` scopes outside the K/V writes;
* the k / v conv taps are joined once per dispatch, before the loop (`layers.with_kv_conv`);
* the router's epilogue is one kernel per MoE layer (no `top_k` left);
* the sliding rings are checkpointed by one conditional per step, not one per layer;
* batch 1: the attention projections of the lone token go through the grouped mat-vec kernel;
* batch 1 and 2 (at most E / 3 expert choices): a MoE layer's routed and shared experts are
  one grouped mat-vec launch per product (`moe_experts_with_shared`: 2 per layer, where there
  were 4), the kernel reading the token's row in place for every expert and clamping the ids
  itself (no repeat or clip of them outside), the down product computing the SwiGLU of the
  gate|up partials in its loads (no activation launch between the two);
* decode attention: one kernel per layer reading the arena in place (pages of 16 tokens here,
  so the full layer takes the paged kernel too), its split-K partials merged by one combine
  kernel (not XLA's reductions and cast), the relative bias and the log scaling computed in
  the kernel (no `attention_tables` product or its fusions);
* each residual conv ("attn", "mlp") adds the residual and computes the norm after it in its
  kernel (`conv_update_residual_norm`): the only RMSNorm of the residual stream left outside a
  kernel is the first layer's attn_norm (the per-head q / k norms and embed_norm aside);
* the per-head q / k norms are one `qk_norm` kernel per layer reading q and k in place: no
  op of `rms_norm` left under the attention's `norm` scope.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.extend  # jax.extend.core below: a submodule `import jax` does not load
import jax.numpy as jnp
import pytest

import inkling_jax as ik
from inkling_jax.cache.layout import ArenaLayout
from inkling_jax.cache.state import ServingState
from inkling_jax.steps import StepBatch, StepShape
from inkling_jax.steps.program import run_step

SLOTS, PAGES = 8, 32


def loop_ops(jaxpr, in_loop: bool = False, in_kernel: bool = False):
    """(primitive name, pallas kernel name or None, name stack, inside the decode loop, inside a
    Pallas kernel) of every equation, sub-jaxprs included. The loop is a `fori_loop` over
    constants, which jax traces as a `scan` (the interpret-mode kernels' grids are `while` loops)."""
    for eqn in jaxpr.eqns:
        kernel = eqn.params.get("name") if eqn.primitive.name == "pallas_call" else None
        yield eqn.primitive.name, kernel, str(eqn.source_info.name_stack), in_loop, in_kernel
        for key, value in eqn.params.items():
            inside = in_loop or (eqn.primitive.name == "scan" and key == "jaxpr")
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from loop_ops(sub.jaxpr, inside, in_kernel or kernel is not None)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from loop_ops(sub, inside, in_kernel or kernel is not None)


def joined_expert_ops(jaxpr, under: bool = False, in_kernel: bool = False):
    """(primitive, kernel name, operand ranks > 0) of the equations outside kernels under a
    `routed_and_shared_experts` scope (jit sub-jaxprs restart their name stacks: followed)."""
    for eqn in jaxpr.eqns:
        here = under or str(eqn.source_info.name_stack).endswith("routed_and_shared_experts")
        kernel = eqn.primitive.name == "pallas_call"
        if here and not in_kernel:
            ranked = any(getattr(getattr(v, "aval", None), "ndim", 0) > 0 for v in eqn.invars)
            yield eqn.primitive.name, eqn.params.get("name") if kernel else None, ranked
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                sub = sub.jaxpr if isinstance(sub, jax.extend.core.ClosedJaxpr) else sub
                if isinstance(sub, jax.extend.core.Jaxpr):
                    yield from joined_expert_ops(sub, here, in_kernel or kernel)


@pytest.mark.parametrize("batch", [1, 2])
def test_decode_loop_body(batch):
    cfg = ik.InklingConfig.tiny(n_routed_experts=16)  # batch 2: 2 x top-2 = 4 <= 16 / 3 choices
    layout = ArenaLayout.build(cfg, 16)  # pages of 16: the paged kernel's smallest
    shape = StepShape("decode", batch, batch, 1, 4, steps=2)
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), ik.param_shapes(cfg),
                          is_leaf=lambda x: isinstance(x, tuple))
    state = ServingState(arena=jax.ShapeDtypeStruct((layout.arena_units(SLOTS, PAGES), layout.unit_elems),
                                                    jnp.float32),
                         slot_v2p=jax.ShapeDtypeStruct((SLOTS + 1,), jnp.int32),
                         page_v2p=jax.ShapeDtypeStruct((PAGES + 1,), jnp.int32))
    step = partial(run_step, cfg=cfg, layout=layout, shape=shape, use_pallas=True, interpret=True)
    jaxpr = jax.make_jaxpr(step)(params, state, StepBatch.empty(shape)).jaxpr
    ops = list(loop_ops(jaxpr))
    body = [op for op in ops if op[3]]
    assert body, "the K-step decode is a loop"

    def attention_scope(stack: str) -> bool:  # the layer's attention, but not its K/V writes
        return "layer/attention" in stack and "write_ring" not in stack and "write_pages" not in stack

    regathered = [op for op in body if op[0] in ("gather", "concatenate") and attention_scope(op[2])]
    assert regathered == []
    assert not [op for op in body if op[0] == "top_k"]
    # the ring checkpoints: one conditional per step, none per sliding layer
    conds = [op[2].rsplit("/", 1)[-1] for op in body if op[0] == "cond" and op[2]]
    assert conds.count("write_ring_checkpoints") == 1 and "write_ring" not in conds, conds
    moe_layers = cfg.num_layers - len(cfg.dense_layer_ids)
    kernels = [op[1] for op in body if op[1] is not None]
    assert kernels.count("moe_router_epilogue") == moe_layers
    sliding = len(cfg.local_layer_ids)
    assert kernels.count("inkling_ring_decode_attention") == sliding
    assert kernels.count("inkling_paged_decode_attention") == cfg.num_layers - sliding
    # the tiny ring is one key block (one split); the 4 pages are 2 splits, merged by the kernel
    assert kernels.count("inkling_decode_combine_splits") == cfg.num_layers - sliding
    # the kernels compute the bias from r and rel_proj: no bias-table product in any layer
    assert not [op for op in body if "attention_tables" in op[2]]
    assert not [op for op in body if op[0] == "dot_general" and "layer/attention/attend" in op[2]]
    # per MoE layer w13 and w2 of the routed and shared experts (B x top-2 of 16 experts: at most
    # E / 3 choices, the few-token kernel's bound); at batch 1 also per layer wqkvr and wo
    matvecs = kernels.count("moe_grouped_matvec")
    assert matvecs == 2 * moe_layers + (2 * cfg.num_layers if batch == 1 else 0)
    joined = list(joined_expert_ops(jaxpr))
    assert sum(1 for op in joined if op[0] == "pallas_call") == 2 * moe_layers
    assert {op[1] for op in joined if op[0] == "pallas_call"} == {"moe_grouped_matvec"}
    # no clip of the ids (clamp / max / min), no gather, no repeat of x (a broadcast of an array)
    assert not [op for op in joined if op[0] in ("clamp", "max", "min", "gather", "iota")], joined
    assert not [op for op in joined if op[0] == "broadcast_in_dim" and op[2]], joined
    # the SwiGLU between the products runs in the down product's loads: no activation outside
    assert not [op for op in joined if op[0] == "logistic"], joined
    assert not [op for op in body if op[2].endswith(("/routed_experts", "/shared_experts"))]
    # the residual convs carry the add and the next norm: one kernel each, two per layer; the
    # k|v conv stays conv_update. RMSNorms of the residual stream outside kernels (one rsqrt
    # each; not the per-head q / k norms under attention/, nor embed_norm): only the first
    # layer's attn_norm, where there were two per layer and the final norm
    assert kernels.count("conv_update_residual_norm") == 2 * cfg.num_layers
    assert kernels.count("conv_update") == cfg.num_layers
    stream_norms = [op[2] for op in body if op[0] == "rsqrt" and not op[4]
                    and not op[2].endswith(("attention/norm", "embed/norm"))]
    assert stream_norms == ["norm"], stream_norms
    # the per-head q / k norms: one qk_norm kernel per layer (q read in place from the fused
    # projection, k from the conv output), no reduction or rsqrt of rms_norm under the
    # attention's `norm` scope, and no slice of q or k left for them
    assert kernels.count("qk_norm") == cfg.num_layers
    head_norms = [op for op in body if not op[4] and "layer/attention" in op[2] and "norm" in op[2].split("/")]
    assert head_norms == [], head_norms

"""The `prefill` section of bench.serve.serve (issue 17: prefill >= 40 % of bf16 peak FLOP/s at
8 x 1k and at 1 x 8k, in the engine loop on one H200), and the model FLOPs it is measured against.

Each case `N x L` (--prefill-cases) runs on its own engine, configured so the whole case is one
extend step if the config allows it: chunk_size = L (a row's query width; larger would only pad
every row), max_step_tokens = N * L (--prefill-step-tokens caps it), the context bucket exactly
L (min_context_bucket = L, max_context = L + one page), N rows in one batch bucket, prefix cache
off, max_new_tokens = 1 (the first token ends the request: the time to it is the prefill). The
engine is warmed up on a same-shape case first (every compile happens there), then the case
runs --prefill-reps times; time: submit -> the first token of the last request (the engine's
own per-request record), median. The engine's compile counter is checked not to grow while
timed; extend steps are the engine's counter.

Model FLOPs (`prefill_flops`) count the useful forward work of the trunk, nothing the engine
adds (padding, masked keys, experts not chosen):

    per token, per layer: 2 x (attention projections wqkvr + wo
                               + dense MLP w13 + w2, or MoE router + k routed experts + shared experts)
                          + 2 x heads x d_rel x rel_extent     (relative bias r @ rel_proj)
                          + 2 x 2 x heads x head_dim x keys    (q.k scores and probs.v)
    keys: full layers pos + 1 (causal: (L + 1) / 2 on average), sliding min(pos + 1, window)
    per prompt: 2 x hidden x vocab_size (lm_head on the last token only)

Norms, short convolutions, softmax, SwiGLU and the embedding gather are not counted (element-
wise or gathers). `check_prefill_flops` recounts it from `param_shapes(cfg)` and a loop over
positions, so a wrong formula fails loudly (run in the section, smoke included).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics

import numpy as np

import inkling_jax as ik
import pallas_kernels as pk
from inkling_jax.engine import runner as runner_mod
from inkling_jax.model.params import param_shapes

from bench.common.helpers import Report, log, table
from bench.serve.loop import run, warm

TARGET = 0.40  # issue 17: fraction of bf16 peak


# ------------------------------------------------------------------------ model FLOPs


def prefill_flops_parts(cfg: ik.InklingConfig, context_len: int) -> dict[str, int]:
    """FLOPs of prefilling one prompt of context_len tokens, by part (ints, whole prompt)."""
    n, h = context_len, cfg.hidden_size
    matmul = rel = attn = 0
    for i in range(cfg.num_layers):
        g = cfg.layer_geometry(i)
        params = h * (g.q_dim + 2 * g.kv_dim + g.num_heads * cfg.d_rel) + g.q_dim * h  # wqkvr, wo
        if cfg.is_dense(i):
            params += 3 * h * cfg.dense_intermediate_size  # w13 [H, 2I], w2 [I, H]
        else:
            e, s, f = cfg.n_routed_experts, cfg.n_shared_experts, cfg.expert_intermediate_size
            sink = cfg.shared_expert_sink and cfg.norm_after_topk
            params += h * (e + s if sink else e)  # router
            params += cfg.num_experts_per_tok * 3 * h * f  # the routed experts a token uses
            params += 3 * h * s * (1 if sink else cfg.shared_experts_size) * f if s else 0  # shared experts
        matmul += 2 * params * n
        rel += 2 * g.num_heads * cfg.d_rel * g.rel_extent * n
        if g.window is None or g.window >= n:
            keys = n * (n + 1) // 2  # sum over positions of pos + 1
        else:
            keys = g.window * (g.window + 1) // 2 + (n - g.window) * g.window
        attn += 2 * 2 * g.num_heads * g.head_dim * keys
    return dict(matmul=matmul, rel=rel, attn=attn, lm_head=2 * h * cfg.vocab_size)


def prefill_flops(cfg: ik.InklingConfig, context_len: int) -> float:
    """Useful forward FLOPs per prompt token of prefilling a context_len-token prompt (module
    docstring: trunk matmuls with the active experts only, relative bias, causal attention
    averaged over the prompt, the lm_head once per prompt)."""
    return sum(prefill_flops_parts(cfg, context_len).values()) / context_len


def hand_count_flops(cfg: ik.InklingConfig, context_len: int) -> int:
    """The same count from the parameter shapes and a loop over positions (the check)."""
    shapes = param_shapes(cfg)
    k, e = cfg.num_experts_per_tok, cfg.n_routed_experts
    total = 2 * math.prod(shapes["unembed"])  # lm_head, last token only
    for i, layer in enumerate(shapes["layers"]):
        attn, mlp = layer["attn"], layer["mlp"]
        per_token = math.prod(attn["wqkvr"]) + math.prod(attn["wo"])
        if "router" in mlp:
            per_token += math.prod(mlp["router"]) + math.prod(mlp["w13"]) // e * k + math.prod(mlp["w2"]) // e * k
            if "shared_w13" in mlp:
                per_token += math.prod(mlp["shared_w13"]) + math.prod(mlp["shared_w2"])
        else:
            per_token += math.prod(mlp["w13"]) + math.prod(mlp["w2"])
        head_dim = attn["q_norm"][0]
        heads = attn["wo"][0] // head_dim
        total += 2 * per_token * context_len
        total += 2 * heads * math.prod(attn["rel_proj"]) * context_len  # r [heads, d_rel] @ rel_proj [d_rel, extent]
        window = cfg.layer_geometry(i).window
        for pos in range(context_len):
            keys = pos + 1 if window is None else min(pos + 1, window)
            total += 2 * 2 * heads * head_dim * keys  # scores and the value product
    return total


def check_prefill_flops(cfg: ik.InklingConfig, lengths) -> None:
    """AssertionError when prefill_flops disagrees with the count from param shapes."""
    for n in sorted(set(lengths)):
        want = hand_count_flops(cfg, n)
        got = sum(prefill_flops_parts(cfg, n).values())
        assert got == want, f"prefill_flops at {n} tokens: {got} != {want} counted from param_shapes"
        assert math.isclose(prefill_flops(cfg, n) * n, want, rel_tol=1e-12)


# -------------------------------------------------------------------------- the section


def parse_cases(text: str) -> list[tuple[int, int]]:
    """"8x1024,1x8192" -> [(8, 1024), (1, 8192)]."""
    cases = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            n, length = (int(x) for x in part.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--prefill-cases: {part!r} is not NxL (prompts x tokens)") from None
        if n < 1 or length < 2:
            raise SystemExit(f"--prefill-cases: {part!r} needs N >= 1 and L >= 2")
        cases.append((n, length))
    if not cases:
        raise SystemExit("--prefill-cases is empty")
    return cases


def prefill_config(args, n: int, length: int) -> ik.EngineConfig:
    """One case in as few extend steps as the config allows: every row's whole prompt per step
    (chunk_size = L), all N rows together (max_step_tokens = N * L, capped by
    --prefill-step-tokens), one context bucket of exactly L tokens."""
    page = 16 if args.smoke else 64
    step_tokens = n * length
    if args.prefill_step_tokens:
        step_tokens = max(n, min(step_tokens, args.prefill_step_tokens))
    chunk = min(length, step_tokens)
    ctx = -(-(length + 1) // page) * page  # the prompt and its one new token
    return ik.EngineConfig(
        max_running=n, num_slots=3 * n + 16, num_pages=n * (ctx // page + 1) + 16, page_size=page,
        track_interval=4 * page, chunk_size=chunk, max_step_tokens=step_tokens, max_context=ctx,
        min_context_bucket=length, min_token_bucket=step_tokens, min_batch_bucket=n, prefix_cache=False)


def _num(x: float) -> str:
    """One decimal, or 2 significant digits below 0.1 (the smoke's tiny model)."""
    return f"{x:.1f}" if x >= 0.1 else f"{x:.2g}"


KERNELS = ("pallas", "ragged", "jnp")  # --prefill-kernels


@contextlib.contextmanager
def prefill_kernels(kernel: str):
    """The engine's step ops for one --prefill-kernels name: "pallas" / "jnp" as use_pallas
    says; "ragged": the Pallas ops with the many-token routed experts through
    `pallas_kernels.moe.ref.moe_experts_ragged` (jax.lax.ragged_dot) instead of the sorted-block Pallas GEMMs
    (steps compiled inside the block, the process-wide step cache emptied on both sides)."""
    if kernel != "ragged":
        yield
        return
    pallas_ops = pk._pallas_ops
    pk._pallas_ops = lambda interpret: pk.ops.pallas_ops(interpret, many_token_experts=pk.moe.ref.moe_experts_ragged)
    runner_mod._COMPILED.clear()
    try:
        yield
    finally:
        pk._pallas_ops = pallas_ops
        runner_mod._COMPILED.clear()


def section_prefill(args, cfg, params, report: Report) -> None:
    cases = parse_cases(args.prefill_cases)
    check_prefill_flops(cfg, [length for _, length in cases])
    log(f"prefill FLOPs: formula == count from param_shapes at {sorted({c[1] for c in cases})} tokens")
    rng = np.random.RandomState(3)
    v = cfg.unpadded_vocab_size
    sp = ik.SamplingParams(max_new_tokens=1, stop_at_eos=False)
    peak = args.peak_tflops * 1e12
    rows = []
    kernels = ["jnp"] if args.smoke else [k for k in args.prefill_kernels.split(",") if k]
    if set(kernels) - set(KERNELS):
        raise SystemExit(f"--prefill-kernels takes {', '.join(KERNELS)}, not {args.prefill_kernels!r}")
    for (n, length), kernel in [(c, k) for c in cases for k in kernels]:
        prompts = lambda: [list(rng.randint(3, v, length)) for _ in range(n)]  # noqa: E731
        config = dataclasses.replace(prefill_config(args, n, length), use_pallas=kernel != "jnp")
        with prefill_kernels(kernel):
            engine = ik.Engine(cfg, params, config)
            w = warm(engine, prompts(), sp)
            compiles0 = engine.stats()["compiles"]
            times, steps = [], []
            for _ in range(args.prefill_reps):
                before = engine.stats()["extend_steps"]
                t = run(engine, prompts(), sp)
                times.append(max(t.ttft))  # submit -> the last request's first token
                steps.append(engine.stats()["extend_steps"] - before)
        grew = engine.stats()["compiles"] - compiles0
        if grew:
            log(f"WARNING prefill {n}x{length}: {grew} compiles during the timed runs")
        med = statistics.median(times)
        flops_tok = prefill_flops(cfg, length)
        achieved = n * length * flops_tok / med
        st = "/".join(str(s) for s in sorted(set(steps)))
        rows.append([f"{n} x {length}", kernel, config.max_step_tokens, config.chunk_size, st,
                     f"{med * 1e3:.1f} ({min(times) * 1e3:.1f}-{max(times) * 1e3:.1f})",
                     f"{n * length / med:.0f}", f"{flops_tok / 1e6:.5g}", _num(achieved / 1e12),
                     f"{_num(100 * achieved / peak)} %", f"{100 * TARGET:.0f} %",
                     "yes" if achieved >= TARGET * peak else "no",
                     f"{compiles0} (+{grew} timed{'!' if grew else ''}; warm-up {w:.1f} s)"])
        log(f"prefill {n}x{length} {kernel}: {rows[-1]}; step shapes {sorted(map(str, engine.runner.compiled))}")
        del engine
    report.add(f"### Prefill in the engine loop (issue 17: >= {100 * TARGET:.0f} % of {args.peak_tflops:g} TFLOP/s "
               f"bf16 peak; max_new_tokens=1, prefix cache off, median of {args.prefill_reps})\n\n"
               + table(["case", "kernels", "tokens / extend step", "chunk size", "extend steps",
                        "ms submit -> last first token",
                        "tok/s", "model MFLOP/token", "TFLOP/s", "% of peak", "target", "met", "compiles"], rows)
               + "\n\nModel FLOPs: useful trunk forward work per prompt token (2 x active matmul params with "
               "top-k routed experts only, the relative-bias product, causal attention averaged over the prompt, "
               "sliding layers within their window; the lm_head once per prompt), bench/serve/prefill.py. One "
               "engine per case: chunk size L, context bucket L, all N rows in one step where the token budget "
               "allows; warmed up on a same-shape case first.", "prefill")

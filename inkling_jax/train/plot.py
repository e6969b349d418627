"""The loss-curve figure of a run, drawn from its JSON-lines log."""

from __future__ import annotations

import math
from typing import Any


def plot_loss_curves(records: list[dict[str, Any]], path: str) -> None:
    """PNG with two panels: trunk train and validation loss (nats, bits per byte on the right
    axis), and each MTP depth's train and validation loss. matplotlib is imported here, with
    the Agg backend, so training without the `train` extra only loses the picture."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r["event"] == "train"]
    evals = [r for r in records if r["event"] == "eval"]
    fig, (ax, ax_mtp) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax.plot([r["step"] for r in train], [r["trunk"] for r in train], lw=1, label="train (trunk)")
    ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", ms=3, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    ax.set_title("next-byte loss")
    ax.grid(alpha=0.3)
    ax.legend()
    bpb = ax.secondary_yaxis("right", functions=(lambda x: x / math.log(2), lambda b: b * math.log(2)))
    bpb.set_ylabel("bits per byte")
    depths = len(train[0]["mtp"]) if train else 0
    for d in range(depths):
        line, = ax_mtp.plot([r["step"] for r in train], [r["mtp"][d] for r in train], lw=1,
                            label=f"depth {d} train (predicts t+{d + 2})")
        ax_mtp.plot([r["step"] for r in evals], [r["val_mtp"][d] for r in evals], "o", ms=3,
                    color=line.get_color(), label=f"depth {d} validation")
    ax_mtp.set_xlabel("step")
    ax_mtp.set_ylabel("loss (nats / byte)")
    ax_mtp.set_title("MTP draft depths")
    ax_mtp.grid(alpha=0.3)
    if depths:
        ax_mtp.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

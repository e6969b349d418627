"""Figures of the harness's reports (matplotlib, imported when a figure is drawn)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .isolation import IsolationReport


def plot_isolation(report: IsolationReport, rows: Sequence[int] | None = None, fig=None):
    """|d logits_r / d arena row| per arena row for each real row r (log scale): r's own
    slot and pages shaded green, the other requests' slots and pages grey; gradient on r's own
    rows drawn green, on any other row (a leak) red; exact zeros are not drawn. Returns the
    matplotlib figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = list(report.real_rows if rows is None else rows)
    if fig is None:
        fig = plt.figure(figsize=(10, 1.6 * len(rows) + 0.9))
    axes = fig.subplots(len(rows), 1, sharex=True, squeeze=False)[:, 0]
    u = report.arena_grad.shape[1]
    x = np.arange(u)
    positive = report.arena_grad[rows][report.arena_grad[rows] > 0]
    lo, hi = (positive.min() / 3, positive.max() * 3) if positive.size else (1e-3, 1.0)
    requests = np.array([lab.startswith("row ") for lab in report.unit_labels])
    for ax, r in zip(axes, rows):
        g, own = report.arena_grad[r], report.own_units[r]
        for start, stop in _runs(requests & ~own):
            ax.axvspan(start - 0.5, stop - 0.5, color="0.6", alpha=0.25, lw=0)
        for start, stop in _runs(own):
            ax.axvspan(start - 0.5, stop - 0.5, color="tab:green", alpha=0.2, lw=0)
        ax.scatter(x[(g > 0) & own], g[(g > 0) & own], s=7, color="tab:green", zorder=3)
        ax.scatter(x[(g > 0) & ~own], g[(g > 0) & ~own], s=14, color="tab:red", zorder=3)
        if not (g > 0).any():
            ax.text(0.5, 0.5, "no arena row moves this row's logits", transform=ax.transAxes, ha="center",
                    va="center", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylim(lo, hi)
        ax.set_xlim(-0.5, u - 0.5)
        ax.set_ylabel(f"row {r}")
    fig.suptitle("|d logits_r / d arena row| (max over the row's elements; exact zeros not drawn)", fontsize=10)
    fig.legend(handles=[Patch(color="tab:green", alpha=0.4, label="its own slot / pages"),
                        Patch(color="0.6", alpha=0.5, label="other requests' slots / pages, checkpoint slots"),
                        Patch(color="tab:red", label="gradient outside its own rows: a leak")],
               loc="upper center", bbox_to_anchor=(0.5, 0.955), ncol=3, fontsize=8, frameon=False)
    axes[-1].set_xlabel("arena row (unit): slots from 0 upwards (slot 0: the sink), pages from the top down "
                        "(the top row: the sink page)")
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return fig


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, stop) of each run of True in a 1-d mask."""
    idx = np.nonzero(mask)[0]
    if not len(idx):
        return []
    splits = np.nonzero(np.diff(idx) > 1)[0]
    starts = np.concatenate([[idx[0]], idx[splits + 1]])
    stops = np.concatenate([idx[splits] + 1, [idx[-1] + 1]])
    return list(zip(starts.tolist(), stops.tolist()))


"""Training batches (random windows, resumable) and the fixed validation windows.

A window is `seq_len + 1 + num_mtp_layers` consecutive tokens t_0 .. t_{T+D}: the trunk reads
t_0..t_{T-1} and predicts t_1..t_T; MTP depth d reads t_{d+1}..t_{d+T} and predicts
t_{d+2}..t_{d+T+1} (see `loss.py`), so every input and target of every depth is a real token.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def window_length(seq_len: int, num_mtp_layers: int) -> int:
    """Tokens per training window: T inputs, one trunk target past them, one more per MTP depth."""
    return seq_len + 1 + num_mtp_layers


class WindowSampler:
    """Uniformly random windows of a token stream, from a seeded numpy Generator (PCG64).

    `state_dict()` / `load_state_dict()` save and restore the generator, so a resumed run
    draws exactly the batches the uninterrupted run would have drawn."""

    def __init__(self, stream: np.ndarray, window: int, batch_size: int, seed: int):
        if stream.ndim != 1 or stream.size < window:
            raise ValueError(f"WindowSampler: a stream of {stream.size} tokens is shorter than one window ({window})")
        self.stream = stream
        self.window = window
        self.batch_size = batch_size
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self._offsets = np.arange(window)

    def next_batch(self) -> np.ndarray:
        """int32 [batch_size, window]: windows at starts drawn uniformly from [0, n - window]."""
        starts = self.rng.integers(0, self.stream.size - self.window + 1, size=self.batch_size)
        return self.stream[starts[:, None] + self._offsets].astype(np.int32)

    def state_dict(self) -> dict[str, Any]:
        # PCG64's state holds 128-bit Python ints; strings keep every JSON reader exact
        st = self.rng.bit_generator.state
        return {"bit_generator": st["bit_generator"], "has_uint32": int(st["has_uint32"]),
                "uinteger": int(st["uinteger"]),
                "state": {k: str(v) for k, v in st["state"].items()}}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.rng.bit_generator.state = {
            "bit_generator": d["bit_generator"], "has_uint32": int(d["has_uint32"]),
            "uinteger": int(d["uinteger"]), "state": {k: int(v) for k, v in d["state"].items()}}


def validation_windows(stream: np.ndarray, window: int, max_windows: int) -> np.ndarray:
    """int32 [N, window]: non-overlapping windows spread evenly over the stream, at most
    `max_windows` of them (the same windows on every call: validation losses are comparable
    across steps and runs)."""
    available = stream.size // window
    if available < 1:
        raise ValueError(f"validation_windows: {stream.size} tokens are fewer than one window ({window})")
    n = min(available, max_windows)
    slots = np.linspace(0, available - 1, n).round().astype(np.int64)  # distinct since n <= available
    starts = slots * window
    return stream[starts[:, None] + np.arange(window)].astype(np.int32)

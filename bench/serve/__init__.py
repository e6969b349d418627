"""`Engine.generate` as a user sees it: `serve` (the sections), with its engine-loop helpers
(`loop`), fresh-process sections (`fresh`) and prefill section (`prefill`)."""

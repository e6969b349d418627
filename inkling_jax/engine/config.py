"""The engine's settings (`EngineConfig`) and a request's sampling settings (`SamplingParams`),
each validated where it is made."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..steps import DEFAULT_MAX_STOP_IDS


@dataclass(frozen=True)
class EngineConfig:
    max_running: int = 8  # requests decoded together (rows of a step)
    num_slots: int = 64  # conv-state slots (virtual ids 1..; 0 is the sink)
    num_pages: int = 256  # full-attention K/V pages
    page_size: int = 16
    pool: str = "unified"  # "unified" or "static"
    prefix_cache: bool = True
    track_interval: int = 64  # checkpoint cadence in tokens (a multiple of page_size)
    max_step_checkpoints: int = 4  # checkpoints one request writes in one extend step (more: the chunk is cut)
    ping_pong: str = "eager"  # or "lazy"
    spec_steps: int = 0  # MTP draft tokens per round (0 = off)
    use_pallas: Any = "auto"  # True / False / "auto" (Pallas on GPU, jnp elsewhere)
    pallas_interpret: bool = False  # run the Pallas kernels in interpret mode (CPU tests)
    chunk_size: int = 64  # most new tokens one request adds in one step
    max_step_tokens: int = 256  # most packed tokens in one step
    max_context: int | None = None  # longest sequence served (default: all pages of one request)
    min_context_bucket: int = 128  # smallest context (tokens) a compiled step attends over
    min_token_bucket: int = 16  # smallest packed-token count of an extend step
    min_batch_bucket: int = 1  # smallest row count of a step (fewer buckets, more padding)
    warmup: bool = False  # compile every bucket at construction
    max_stop_ids: int = DEFAULT_MAX_STOP_IDS  # stop tokens a request may have (its eos included)

    def validate(self) -> None:
        def need(cond, msg):
            if not cond:
                raise ValueError(f"EngineConfig: {msg}")
        need(self.max_running >= 1, "max_running must be >= 1")
        need(self.num_slots >= 1 and self.num_pages >= 1, "num_slots and num_pages must be >= 1")
        need(self.page_size >= 1, "page_size must be >= 1")
        need(self.pool in ("unified", "static"), f"pool must be 'unified' or 'static', got {self.pool!r}")
        need(self.ping_pong in ("eager", "lazy"), f"ping_pong must be 'eager' or 'lazy', got {self.ping_pong!r}")
        need(self.track_interval >= self.page_size and self.track_interval % self.page_size == 0,
             "track_interval must be a positive multiple of page_size")
        need(self.spec_steps >= 0, "spec_steps must be >= 0")
        need(1 <= self.chunk_size <= self.max_step_tokens, "need 1 <= chunk_size <= max_step_tokens")
        need(self.max_step_tokens >= self.max_running, "max_step_tokens must be >= max_running")


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int = 0
    stop_at_eos: bool = True  # stop after the model's eos token
    stop_token_ids: tuple[int, ...] = ()  # further tokens that end a generation (kept in the output)

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0 or self.top_k < 0 or not (0 < self.top_p <= 1):
            raise ValueError("SamplingParams: need temperature >= 0, top_k >= 0, 0 < top_p <= 1")

"""The engine's settings (`EngineConfig`), validated where it is made. A request's sampling
settings, `SamplingParams`, live with the sampling they drive (`steps/sampling.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, no_type_check

from ..cache.prefix_tree import EVICT_POLICIES
from ..steps import DEFAULT_MAX_LOGIT_BIAS, DEFAULT_MAX_STOP_IDS
from ..steps.sampling import SamplingParams
from ..validate import is_int, is_real

__all__ = ["EngineConfig", "SamplingParams", "is_int", "is_real"]


# no_type_check (the tests' jaxtyping hook): __post_init__ normalises what the API accepts beyond
# the annotations and raises the ValueErrors it promises for the rest
@no_type_check
@dataclass(frozen=True)
class EngineConfig:
    max_running: int = 8  # requests decoded together (rows of a step)
    num_slots: int = 64  # conv-state slots (virtual ids 1..; 0 is the sink)
    num_pages: int = 256  # full-attention K/V pages
    arena_units: int | None = None  # the device arena's unit rows: None = what num_slots and num_pages need;
    #                                 larger: the pool still uses only that much, and engines of one arena
    #                                 size share compiled steps whatever their slot / page budgets
    page_size: int = 16
    pool: str = "unified"  # "unified" or "static"
    prefix_cache: bool = True
    track_interval: int = 64  # checkpoint cadence in tokens (a multiple of page_size)
    max_step_checkpoints: int = 4  # checkpoints one request writes in one extend step (more: the chunk is cut)
    ping_pong: str = "eager"  # or "lazy"
    evict_policy: str = "lru"  # prefix-cache eviction order: "lru", "lfu" (fewest hits) or "deepest"
    spec_steps: int = 0  # MTP draft tokens per round (0 = off)
    decode_steps: Any = "auto"  # model steps per dispatch, a device loop ("auto": 8 on GPU/TPU, 1 on CPU): decode
    #                             steps, or verify rounds with the MTP heads' own drafts
    overlap: Any = "auto"  # dispatch the next decode before reading the last (True / False / "auto": on GPU/TPU
    #                        with multi-step decode and no speculation)
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
    max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS  # logit_bias entries a request may have
    max_logprobs: int = 8  # top alternatives a request may ask for (SamplingParams.logprobs, prompt_logprobs)
    compile_cache_dir: str | None = "auto"  # persistent XLA cache: "auto" (GPU: ~/.cache/inkling-jax/xla), a path, None
    executable_cache: str | None = "auto"  # compiled programs on disk: "auto" ($INKLING_JAX_EXECUTABLE_CACHE, else
    #                                        ~/.cache/inkling-jax/executables), a directory, None (off)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field that is not a value the engine can use."""
        def need(cond, msg):
            if not cond:
                raise ValueError(f"EngineConfig: {msg}")

        for name in ("max_running", "num_slots", "num_pages", "page_size", "track_interval", "max_step_checkpoints",
                     "chunk_size", "max_step_tokens", "min_context_bucket", "min_token_bucket", "min_batch_bucket",
                     "max_stop_ids"):
            value = getattr(self, name)
            need(is_int(value) and value >= 1, f"{name} must be an int >= 1, got {value!r}")
        need(is_int(self.spec_steps) and self.spec_steps >= 0,
             f"spec_steps must be an int >= 0, got {self.spec_steps!r}")
        for name in ("max_logit_bias", "max_logprobs"):
            value = getattr(self, name)
            need(is_int(value) and value >= 0, f"{name} must be an int >= 0, got {value!r}")
        need(self.decode_steps == "auto" or (is_int(self.decode_steps) and self.decode_steps >= 1),
             f"decode_steps must be 'auto' or an int >= 1, got {self.decode_steps!r}")
        need(self.arena_units is None or (is_int(self.arena_units) and self.arena_units >= 1),
             f"arena_units must be None or an int >= 1, got {self.arena_units!r}")
        need(self.max_context is None or (is_int(self.max_context) and self.max_context >= 1),
             f"max_context must be None or an int >= 1, got {self.max_context!r}")
        for name in ("prefix_cache", "pallas_interpret", "warmup"):
            need(isinstance(getattr(self, name), bool), f"{name} must be True or False, got {getattr(self, name)!r}")
        need(self.pool in ("unified", "static"), f"pool must be 'unified' or 'static', got {self.pool!r}")
        need(self.ping_pong in ("eager", "lazy"), f"ping_pong must be 'eager' or 'lazy', got {self.ping_pong!r}")
        need(self.evict_policy in EVICT_POLICIES,
             f"evict_policy must be one of {sorted(EVICT_POLICIES)}, got {self.evict_policy!r}")
        need(isinstance(self.overlap, bool) or self.overlap == "auto",
             f"overlap must be True, False or 'auto', got {self.overlap!r}")
        need(not (self.overlap is True and self.spec_steps),
             "overlap needs spec_steps=0 (verify steps are not overlapped)")
        need(not (self.overlap is True and self.decode_steps == 1),
             "overlap needs multi-step decode (decode_steps > 1, or 'auto' on a GPU)")
        need(isinstance(self.use_pallas, bool) or self.use_pallas == "auto",
             f"use_pallas must be True, False or 'auto', got {self.use_pallas!r}")
        need(self.compile_cache_dir is None or isinstance(self.compile_cache_dir, str),
             f"compile_cache_dir must be 'auto', a directory or None, got {self.compile_cache_dir!r}")
        need(self.executable_cache is None or isinstance(self.executable_cache, str),
             f"executable_cache must be 'auto', a directory or None, got {self.executable_cache!r}")
        need(self.track_interval % self.page_size == 0, "track_interval must be a multiple of page_size")
        need(self.chunk_size <= self.max_step_tokens, "need chunk_size <= max_step_tokens")
        need(self.max_step_tokens >= self.max_running, "max_step_tokens must be >= max_running")

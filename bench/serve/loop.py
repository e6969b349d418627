"""The engine-loop helpers of bench.serve.serve: running `Engine` requests with their timeline,
the prefill / decode split of a run, the bench engine configurations, and the decode-steps (K)
setting, which only engines with `EngineConfig.decode_steps` accept.
"""

from __future__ import annotations

import dataclasses
import time

import inkling_jax as ik


class Timeline:
    """Per-request wall times, read off the engine's records after the run."""

    def __init__(self, requests, t0: float, t_end: float):
        self.ttft = [r.first_token_at - r.submitted for r in requests]
        self.wall = t_end - t0
        self.tokens = sum(len(r.out_tokens) for r in requests)
        self.cached = [r.cached for r in requests]
        self.outputs = [list(r.out_tokens) for r in requests]


def run(engine: ik.Engine, prompts: list[list[int]], sp: ik.SamplingParams) -> Timeline:
    """generate() with the timeline kept (submit + step until done is what generate does)."""
    t0 = time.perf_counter()
    reqs = engine.submit(prompts, sp)
    while any(r.finish_reason is None for r in reqs):
        engine.step()
    return Timeline(reqs, t0, time.perf_counter())


def phases(engine: ik.Engine, prompts: list[list[int]], sp: ik.SamplingParams) -> dict:
    """Prefill (submit -> every request has its first token) and decode (-> the end) times in
    the engine loop.

    decode_tokens: the most tokens one row generated in the decode phase (after the first
    token it had when the phase began): decode_s / decode_tokens is the time per generated
    token step whatever a dispatch holds (with decode_steps=K one dispatch makes K tokens per
    row; the dispatches are counted apart, from the engine's step counter)."""
    steps0 = engine.stats()["steps"]
    t0 = time.perf_counter()
    reqs = engine.submit(prompts, sp)
    while not all(r.out_tokens for r in reqs):
        engine.step()
    t1, steps1 = time.perf_counter(), engine.stats()["steps"]
    at_start = [len(r.out_tokens) for r in reqs]
    while any(r.finish_reason is None for r in reqs):
        engine.step()
    t2, steps2 = time.perf_counter(), engine.stats()["steps"]
    return dict(prefill_s=t1 - t0, prefill_steps=steps1 - steps0, decode_s=t2 - t1,
                decode_dispatches=steps2 - steps1,
                decode_tokens=max(len(r.out_tokens) - n for r, n in zip(reqs, at_start)),
                tokens=sum(len(r.out_tokens) for r in reqs), reqs=reqs)


def decode_ms_per_token(ph: dict) -> float:
    """Milliseconds per generated token step of a `phases` run's decode phase."""
    return 1e3 * ph["decode_s"] / max(ph["decode_tokens"], 1)


def warm(engine: ik.Engine, prompts: list[list[int]], sp: ik.SamplingParams) -> float:
    """One untimed run over the same shapes (compiles); its seconds."""
    t0 = time.perf_counter()
    engine.generate(prompts, sp)
    engine.evict_all()
    return time.perf_counter() - t0


# ------------------------------------------------------------------ configurations


def has_decode_steps() -> bool:
    """This checkout's EngineConfig has `decode_steps` (K decode steps per dispatch)."""
    return "decode_steps" in ik.EngineConfig.__dataclass_fields__


def parse_decode_steps(text: str) -> list[int]:
    """--decode-steps "1,4,8" -> [1, 4, 8]; SystemExit when a K is not a positive int, or is
    above 1 on an engine without `EngineConfig.decode_steps`."""
    try:
        ks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--decode-steps must be a comma-separated list of ints, got {text!r}") from None
    if not ks or any(k < 1 for k in ks):
        raise SystemExit(f"--decode-steps must list ints >= 1, got {text!r}")
    if any(k != 1 for k in ks) and not has_decode_steps():
        raise SystemExit(f"--decode-steps {text}: this checkout's EngineConfig has no decode_steps field (one "
                         f"decode step per dispatch), so K must be 1")
    return ks


def with_decode_steps(config: ik.EngineConfig, decode_steps: int) -> ik.EngineConfig:
    """config with decode_steps=K (K=1 on an engine without the field: unchanged)."""
    if not has_decode_steps():
        if decode_steps != 1:
            raise SystemExit(f"decode_steps={decode_steps} needs EngineConfig.decode_steps, absent in this checkout")
        return config
    return dataclasses.replace(config, decode_steps=decode_steps)


def model_config(smoke: bool, mtp: bool = True) -> ik.InklingConfig:
    """The model the sections serve: the bench preset, or with --smoke (CPU: checks the
    scripts, measures nothing) the tiny preset on two layers (sliding dense, full MoE: every
    kind of state at half the compile of its four). mtp False: without the MTP depths."""
    no_mtp = {} if mtp else dict(num_mtp_layers=0, mtp_local_layer_ids=())
    if smoke:
        return ik.InklingConfig.tiny(num_layers=2, local_layer_ids=(0,), **no_mtp)
    return ik.InklingConfig.bench(**no_mtp)


def bench_config(args, running: int, prefix: bool, decode_steps: int = 1) -> ik.EngineConfig:
    """One bucket per dimension for the bench model: few compiles."""
    page = 16 if args.smoke else 64
    interval = 4 * page
    ctx = 1 << (args.prompt_len + args.new + 8).bit_length()
    chunk = 1024 if not args.smoke else 64
    step_tokens = max(chunk, min(4096, running * chunk)) if not args.smoke else 128
    config = ik.EngineConfig(
        max_running=running, num_slots=3 * running + 64, num_pages=(running + 8) * (ctx // page), page_size=page,
        track_interval=interval, chunk_size=chunk, max_step_tokens=step_tokens, max_context=ctx,
        min_context_bucket=ctx, min_token_bucket=step_tokens, min_batch_bucket=running, prefix_cache=prefix)
    return with_decode_steps(config, decode_steps)


def tiny_config(running: int, spec: int, prefix: bool = False) -> ik.EngineConfig:
    return ik.EngineConfig(max_running=running, num_slots=3 * running + 16, num_pages=running * 32 + 64,
                           page_size=16, track_interval=64, chunk_size=64, max_step_tokens=max(64, running * 8),
                           max_context=512, min_context_bucket=512, min_batch_bucket=running, spec_steps=spec,
                           prefix_cache=prefix)

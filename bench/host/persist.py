"""Save and restore of the engine's durable state (issue 35): time and size for the shipped
model with a few sessions and a warm prefix cache.

    python -m bench.host.persist [--sessions 4] [--turns 3] [--repeats 3] [--out FILE]
    python -m bench.host.persist --smoke          # the tiny preset, one repeat

Serves the shipped trained model (`inkling_jax/models/shakespeare`, float32 on the CPU) with
the engine geometry `inkling-generate` picks for its built-in prompts (the prefix cache warmed
by those prompts), opens `--sessions` sessions of `--turns` turns each, then times
`Engine.save` (the sessions' state and the whole cache; and, separately, the sessions alone),
`Engine.restore` into a new engine (its construction included, no compile: nothing runs) and
the first turn after it (compiles aside: the engine's programs are warm), and reports the
bytes on disk. Medians of `--repeats`; each save goes to a fresh directory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import jax.numpy as jnp
import numpy as np

import inkling_jax as ik
from inkling_jax.cli import DEFAULT_PROMPTS, engine_config
from inkling_jax.tokenizer import tokenizer_for

from bench.common.helpers import Report

TURNS = ["ROMEO. What say you?", "JULIET. Good night, good night!", "HAMLET. Words, words, words.",
         "KING. How fares our cousin Hamlet?"]


def build(smoke: bool):
    if smoke:
        cfg = ik.InklingConfig.tiny()
        return cfg, ik.init_params(cfg, __import__("jax").random.key(0)), None, "tiny"
    from inkling_jax.models import model_dir

    path = model_dir("shakespeare")
    cfg, params = ik.load_pretrained(path, dtype=jnp.float32)
    return cfg, params, tokenizer_for(path, cfg), "shakespeare"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.sessions, args.turns, args.repeats, args.max_new_tokens = 2, 2, 1, 4
    cfg, params, tok, name = build(args.smoke)
    encode = (lambda t: list(t.encode())[:40]) if tok is None else tok.encode
    prompts = [encode(p) for p in DEFAULT_PROMPTS]
    turns = [encode(t) for t in TURNS]
    history = max(len(p) for p in prompts) + args.turns * (max(len(t) for t in turns) + args.max_new_tokens)
    cli_args = argparse.Namespace(page_size=16, track_interval=0, max_running=4, chunk_size=0,
                                  max_new_tokens=args.max_new_tokens, spec_steps=0, pool="unified",
                                  no_prefix_cache=False, lazy=False, decode_steps=None)
    config = engine_config(cli_args, [history] * max(len(prompts), args.sessions))
    sp = ik.SamplingParams(max_new_tokens=args.max_new_tokens, stop_at_eos=False)
    engine = ik.Engine(cfg, params, config)
    engine.generate(prompts, sp)  # the warm cache
    sids = [engine.open_session() for _ in range(args.sessions)]
    for k in range(args.turns):
        for i, sid in enumerate(sids):
            engine.generate([turns[(i + k) % len(turns)]], sp, session=sid)
    root = tempfile.mkdtemp(prefix="inkling-persist-")
    rows = []
    try:
        for label, cache in (("sessions + prefix cache", True), ("sessions only", False)):
            save_s, restore_s, turn_s, info = [], [], [], None
            for r in range(args.repeats):
                path = os.path.join(root, f"{cache}-{r}")
                t0 = time.perf_counter()
                info = engine.save(path, prefix_cache=cache)
                save_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                again = ik.Engine.restore(path, cfg, params)
                restore_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                again.generate([turns[0]], sp, session=sids[0])
                turn_s.append(time.perf_counter() - t0)
            arena_bytes = (info["slots"] * engine.layout.slot_units + info["pages"] * engine.layout.page_units) \
                * engine.layout.unit_elems * np.dtype(engine.runner.dtype).itemsize
            rows.append((label, info, statistics.median(save_s), statistics.median(restore_s),
                         statistics.median(turn_s), arena_bytes))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    s = engine.stats()
    lines = [f"model {name} (float32, CPU {os.cpu_count()} cores), {args.sessions} sessions x {args.turns} turns "
             f"of up to {args.max_new_tokens} new tokens, prefix cache warmed by the {len(prompts)} built-in prompts "
             f"({s['cache_hit_tokens']} hit tokens); layout: {engine.layout.describe()}; medians of {args.repeats}",
             "",
             "| saved | slots | pages | bytes on disk | arena bytes | save (s) | restore (s) | first turn after (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for label, info, save_s, restore_s, turn_s, arena_bytes in rows:
        lines.append(f"| {label} | {info['slots']} | {info['pages']} | {info['bytes'] / 2**20:.2f} MiB | "
                     f"{arena_bytes / 2**20:.2f} MiB | {save_s:.3f} | {restore_s:.3f} | {turn_s:.3f} |")
    text = "\n".join(lines)
    Report(args.out).add(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

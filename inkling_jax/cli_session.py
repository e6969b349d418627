"""`inkling-generate --session-dir DIR`: a chat that lives across runs.

The prompts of one run (`--prompt TEXT ...` or `--prompts-file`) are successive turns of one
engine session. When DIR holds a save (`Engine.save`), the engine is restored from it (its
session, the one with the lowest id, and its prefix cache) and the turns continue that
conversation exactly as if the process had never stopped; otherwise a new session starts.
After the turns the session and the prefix cache are saved to DIR (atomically: a run killed
meanwhile leaves the previous save). The model, the layout flags (--page-size,
--spec-steps, --track-interval, --no-prefix-cache, --lazy) and the dtype must stay the same
across runs; a save of another model or layout is a one-line error. The sampling flags apply
to every turn (stop strings included: the engine has the model's tokenizer), except --n (a
session has one history: refused) and --stream / --logprobs (each turn prints when it is done).
"""

from __future__ import annotations

import argparse
import os
from typing import Callable

from .engine import persist


def chat(args: argparse.Namespace, cfg, params, tok, texts: list[str], prompts: list[list[int]], sampling,
         mesh, say: Callable, error: type[Exception]) -> int:
    """Run the turns of `--session-dir` (module docstring); `error` is the CLI's one-line
    error type, `say` its printer."""
    from .cli import engine_config, shown
    from .engine import Engine

    directory = args.session_dir
    if mesh is not None:
        raise error("--session-dir serves on one device (no --tp / --ep)")
    if sampling.n > 1:
        raise error(f"--session-dir takes one sample per turn (--n {sampling.n}: a session has one history)")
    if not (args.prompt or args.prompts_file):
        raise error("--session-dir needs the turn(s): --prompt TEXT ... or --prompts-file F")
    restoring = os.path.isfile(os.path.join(directory, persist.LATEST))
    history, sid = [], None
    try:
        if restoring:
            _, state = persist.read_state(directory)
            if not state["sessions"]:
                raise error(f"--session-dir {directory}: the save there holds no session")
            first = min(state["sessions"], key=lambda s: s["sid"])
            history, sid = first["tokens"], first["sid"]
        # one context bucket for the whole chat so far and this run's turns
        total = len(history) + sum(len(p) + sampling.max_new_tokens for p in prompts)
        config = engine_config(args, [total])
        if restoring:
            engine = Engine.restore(directory, cfg, params, config, tokenizer=tok)
        else:
            engine = Engine(cfg, params, config, tokenizer=tok)
            sid = engine.open_session()
    except ValueError as e:
        raise error(str(e)) from None
    say(f"session {sid}: " + (f"restored from {directory} ({len(history)} tokens of history)" if restoring
                              else f"new (it is saved to {directory})"))
    if not args.no_warmup:
        engine.warmup()
    for i, (text, prompt) in enumerate(zip(texts, prompts)):
        c = engine.generate([prompt], sampling, session=sid)[0]
        out, why = shown(c, tok, cfg.eos_token_id)
        say(f"[turn {i}] {text!r}")
        say(f"    -> {out!r}")
        say(f"       ({len(c.tokens)} tokens, {why}, {c.cached_tokens} prompt tokens cached)")
    info = engine.save(directory)
    say(f"saved session {sid} ({len(engine.sessions[sid].tokens)} tokens of history) and the prefix cache to "
        f"{directory}: {info['bytes'] / 2**10:.0f} KiB in {info['seconds']:.2f} s")
    return 0

"""Chaos for the engine: real Ctrl-C. A timer thread sends SIGINT to the main thread at a random
moment inside `Engine.step()` while a random schedule runs (shared prefixes, session turns and
closes, aborts, prefix-cache evictions and compactions) on an engine with the prefix cache and
speculative decoding or multi-step decode with overlap. After every operation the invariants
must hold (`check_invariants`); at the end every greedy output must be the model's
teacher-forced argmax on its history (an aborted one a prefix of it).

    python tests/chaos.py --ops 2000 --mode spec --seed 1      # a long run

`tests/test_failures.py::test_chaos_interrupts` runs it at a size that fits the suite's time
budget (`INKLING_CHAOS_OPS` sets the length there).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections import deque

import numpy as np

import cpu_flags  # noqa: F401 - beside this script; sets XLA_FLAGS before jax is imported

import inkling_jax as ik  # noqa: E402

TIE = 1e-4  # a generated token whose logit is this close to the best one counts as the argmax


class Interrupter:
    """SIGINT to the main thread from a timer thread, `delay` seconds after `arm` unless
    `disarm` comes first. A signal sent just before `disarm` may still be on its way: `disarm`
    waits for it inside the caller's try (a short sleep, which a signal interrupts)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.armed = False
        self.timer: threading.Timer | None = None
        self.sent = 0

    def arm(self, delay: float) -> None:
        self.armed = True
        self.timer = threading.Timer(delay, self._fire)
        self.timer.daemon = True
        self.timer.start()

    def _fire(self) -> None:
        with self.lock:
            if self.armed:
                self.armed = False
                self.sent += 1
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    def disarm(self) -> None:
        with self.lock:
            self.armed = False
        if self.timer is not None:
            self.timer.cancel()
            self.timer.join()
        time.sleep(0.002)  # a signal already sent lands here, inside the caller's try


def greedy_ok(params, cfg, history: list[int], generated: list[int]) -> bool:
    """Each generated token is the model's argmax (within TIE) given the history and the
    tokens before it (the reference forward, teacher-forced)."""
    from conftest import reference_forward

    if not generated:
        return True
    logits = reference_forward(params, cfg, list(history) + list(generated))[len(history) - 1:-1]
    picked = logits[np.arange(len(generated)), generated]
    return bool((picked >= logits.max(-1) - TIE).all())


def run_chaos(cfg, params, engine_kw: dict, num_ops: int, seed: int = 0, max_new_tokens: int = 12,
              interrupt_rate: float = 0.5, max_history: int = 40) -> dict:
    """The chaos run (module docstring) over `faults.Schedule` (at most two sessions open, each
    closed once its history passes max_history tokens); returns its figures. Raises
    AssertionError on a violation. interrupt_rate: the share of steps a SIGINT is aimed at, a
    moment drawn inside a typical step (the median of the last ones)."""
    from faults import Schedule

    rng = np.random.RandomState(seed)
    engine = ik.Engine(cfg, params, ik.EngineConfig(**engine_kw))
    schedule = Schedule(engine, rng, max_new_tokens, max_sessions=2, max_history=max_history)
    tracked, figures = schedule.tracked, schedule.figures
    interrupter = Interrupter()
    step_times = deque([0.01], maxlen=25)  # the last steps' durations

    def step():
        if rng.rand() < interrupt_rate:
            interrupter.arm(float(rng.uniform(0, 0.8 * np.median(step_times))))
        t = time.perf_counter()
        try:
            engine.step()
            step_times.append(time.perf_counter() - t)
        finally:
            interrupter.disarm()

    t0 = time.perf_counter()
    prev = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for _ in range(num_ops):
            op = schedule.draw()
            try:
                schedule.run(op, step)
            except KeyboardInterrupt:
                figures["interrupted steps"] += 1
            except ValueError as exc:
                schedule.refused(exc)
            schedule.settle()
        while engine.running or engine.waiting:
            engine.step()
        engine.check_invariants()
    finally:
        signal.signal(signal.SIGINT, prev)
    for r, history in tracked:
        assert r.error is None, (r.rid, r.error)
        if r.finish_reason is None:
            continue
        assert greedy_ok(params, cfg, history, r.out_tokens), (r.rid, r.finish_reason, history, r.out_tokens)
        assert r.finish_reason == "abort" or len(r.out_tokens) == r.sampling.max_new_tokens
        figures["aborted" if r.finish_reason == "abort" else "completed"] += 1
        figures["tokens checked"] += len(r.out_tokens)
    s = engine.stats()
    figures.update({"signals sent": interrupter.sent, "resets": s["resets"], "cache hit tokens": s["cache_hit_tokens"],
                    "verify steps": s["verify_steps"], "overlapped dispatches": s["overlapped_dispatches"],
                    "seconds": round(time.perf_counter() - t0, 1)})
    return dict(figures)


CHAOS_MODES = {
    # speculative decoding (two MTP drafts per verify round) on a model with MTP depths
    "spec": dict(spec_steps=2),
    # multi-step decode (4 steps per dispatch), each dispatched before the previous one is read
    "overlap": dict(decode_steps=4, overlap=True),
}


def main(argv=None) -> int:
    import jax

    sys.path.insert(0, os.path.dirname(__file__))
    from conftest import ENGINE_KW

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", choices=sorted(CHAOS_MODES), default="spec")
    args = ap.parse_args(argv)
    cfg = ik.InklingConfig.tiny(num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,), num_mtp_layers=3,
                                mtp_local_layer_ids=(1,))
    params = ik.init_params(cfg, jax.random.key(1), std=0.1)
    figures = run_chaos(cfg, params, {**ENGINE_KW, **CHAOS_MODES[args.mode]}, args.ops, args.seed)
    for k, v in sorted(figures.items()):
        print(f"{k:24} {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Fault injection for the engine (a test double: it wraps an engine's own methods), and the
soak driver: random schedules of submit / step / abort / sessions / eviction / compaction with
exceptions injected where the engine meets the device or the pool.

    python tests/faults.py --ops 10000 --seed 0     # the long soak (README, Reliability)

Every completed greedy output must equal a cache-off engine's for the same history, every
aborted one must be a prefix of it, and `check_invariants()` must hold after every operation.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter

import numpy as np

import cpu_flags  # noqa: F401 - beside this script; sets XLA_FLAGS before jax is imported

import inkling_jax as ik  # noqa: E402


class InjectedFault(Exception):
    """An exception planted by `Faults` (stands for any failure at that point)."""


class Faults:
    """Wraps an engine so that, with probability `rate` per call, these raise:

    * "read": reading a step's outputs (`Engine._fetch`), as InjectedFault or KeyboardInterrupt
      (the outputs stay on the device);
    * "copy": a compaction copy (`StepRunner.move_units`), either before it starts (the arena
      intact) or after the arena was donated to it (the device state lost: the engine resets);
    * "alloc": allocating a slot or page during admission or planning (`UnitPool.alloc_*`).
    """

    def __init__(self, engine: ik.Engine, rng: np.random.RandomState, rate: float = 0.05):
        self.rng, self.rate, self.count = rng, rate, Counter()
        self.enabled = True
        fetch, move = engine._fetch, engine.runner.move_units
        alloc_slot, alloc_page = engine.pool.alloc_slot, engine.pool.alloc_page

        def faulty_fetch(out):
            if self._hit("read"):
                raise KeyboardInterrupt if self.rng.rand() < 0.5 else InjectedFault("output read")
            return fetch(out)

        def faulty_move(arena, src, dst):
            if self._hit("copy"):
                if self.rng.rand() < 0.5:
                    raise InjectedFault("compaction copy, before it starts")
                move(arena, src, dst)  # the arena is donated; its result is lost
                self.count["copy-lost"] += 1
                raise InjectedFault("compaction copy, after the arena was donated")
            return move(arena, src, dst)

        def faulty(alloc):
            def call():
                if self._hit("alloc"):
                    raise InjectedFault("allocation")
                return alloc()
            return call

        engine._fetch = faulty_fetch
        engine.runner.move_units = faulty_move
        engine.pool.alloc_slot, engine.pool.alloc_page = faulty(alloc_slot), faulty(alloc_page)

    def _hit(self, kind: str) -> bool:
        if self.enabled and self.rng.rand() < self.rate:
            self.count[kind] += 1
            return True
        return False


OPS = ["submit", "step", "abort", "turn", "close", "evict", "compact"]
OP_WEIGHTS = [0.2, 0.5, 0.05, 0.1, 0.04, 0.06, 0.05]


def housekeeping(engine: ik.Engine, op: str, sessions: dict, rng: np.random.RandomState) -> bool:
    """The random schedules' "close" (a random session of `sessions`, sid -> its turn, closed
    with its turn in flight aborted), "evict" and "compact" operations; False for another op."""
    if op == "close":
        if sessions:
            sid = list(sessions)[rng.randint(len(sessions))]
            engine.close_session(sid, abort=True)
            del sessions[sid]
    elif op == "evict":
        engine.evict_all()
    elif op == "compact":
        engine.compact()
    else:
        return False
    return True


class Schedule:
    """A random schedule of engine operations, shared by the soak and the chaos run
    (`chaos.py`): OPS drawn by OP_WEIGHTS, submits over shared prefixes (a system prompt and
    its branches), steps, aborts, session turns and closes, evictions, compactions. `draw()`
    the next operation, `run(op)` it (a step through `step`, default `engine.step`),
    `settle()` after it, whatever it raised (closed sessions forgotten, invariants checked).
    Requests ask for 1 to max_new_tokens new tokens (session turns for at most 5).
    max_sessions: open at most that many (None: a new one whenever all are busy, or 40 % of
    the time while fewer than two); max_history: a session whose history passed it is closed
    instead of given a turn (None: never)."""

    def __init__(self, engine: ik.Engine, rng: np.random.RandomState, max_new_tokens: int,
                 max_sessions: int | None = None, max_history: int | None = None):
        self.engine, self.rng, self.max_new_tokens = engine, rng, max_new_tokens
        self.max_sessions, self.max_history = max_sessions, max_history
        self.vocab = vocab = engine.cfg.unpadded_vocab_size
        system = list(rng.randint(3, vocab, 21))
        self.bases = [system + list(rng.randint(3, vocab, n)) for n in (6, 11, 3)] + [list(rng.randint(3, vocab, 17))]
        self.tracked = []  # (request, the full history it answers)
        self.sessions: dict[int, object] = {}  # sid -> its turn in flight (a Request) or None
        self.figures = Counter()

    @staticmethod
    def greedy(n: int) -> ik.SamplingParams:
        return ik.SamplingParams(max_new_tokens=n, stop_at_eos=False)

    def draw(self) -> str:
        op = str(self.rng.choice(OPS, p=OP_WEIGHTS))
        self.figures[op] += 1
        return op

    def run(self, op: str, step=None) -> None:
        engine, rng, vocab, sessions = self.engine, self.rng, self.vocab, self.sessions
        if op == "submit":
            base = self.bases[rng.randint(len(self.bases))]
            prompt = base[:rng.randint(1, len(base) + 1)] + [int(rng.randint(3, vocab))]
            r = engine.submit([prompt], self.greedy(int(rng.randint(1, self.max_new_tokens + 1))))[0]
            self.tracked.append((r, list(r.tokens)))
        elif op == "step":
            (step or engine.step)()
        elif op == "abort":
            live = [r for r, _ in self.tracked if r.finish_reason is None and r.error is None]
            if live:
                engine.abort(live[rng.randint(len(live))])
        elif op == "turn":
            idle = [sid for sid, turn in sessions.items() if turn is None or turn.finish_reason is not None]
            long = [sid for sid in idle if self.max_history and len(engine.sessions[sid].tokens) > self.max_history]
            if long:  # a history near the pool's limit: the conversation ends
                engine.close_session(long[0])
                del sessions[long[0]]
                return
            if self.max_sessions is None:
                new = not idle or (len(sessions) < 2 and rng.rand() < 0.4)
            else:
                new = len(sessions) < self.max_sessions and (not idle or rng.rand() < 0.4)
            sid = engine.open_session() if new else idle[rng.randint(len(idle))] if idle else None
            turn = list(rng.randint(3, vocab, int(rng.randint(1, 7))))
            r = engine.submit([turn], self.greedy(int(rng.randint(1, 6))), session=sid)[0]
            if sid is not None:
                sessions[sid] = r
            self.tracked.append((r, list(r.tokens)))
        else:
            housekeeping(engine, op, sessions, rng)

    def refused(self, exc: ValueError) -> None:
        """A request refused at submit (a session turn whose history outgrew the pool): nothing changed."""
        assert "exceed" in str(exc) or "never be admitted" in str(exc), exc
        self.figures["refused"] += 1

    def settle(self) -> None:
        for sid in [sid for sid in self.sessions if sid not in self.engine.sessions]:
            del self.sessions[sid]  # closed, though the call raised afterwards
        self.engine.check_invariants()


def run_soak(cfg, params, engine_kw: dict, num_ops: int, seed: int = 0, rate: float = 0.05,
             max_new_tokens: int = 7) -> dict:
    """The soak (module docstring); returns its figures. Raises AssertionError on a violation.
    Requests ask for 1 to max_new_tokens new tokens (session turns for at most 5)."""
    rng = np.random.RandomState(seed)
    engine = ik.Engine(cfg, params, ik.EngineConfig(**engine_kw))
    schedule = Schedule(engine, rng, max_new_tokens)
    faults = Faults(engine, rng, rate)
    greedy, tracked, figures = schedule.greedy, schedule.tracked, schedule.figures
    t0 = time.perf_counter()
    for _ in range(num_ops):
        op = schedule.draw()
        try:
            schedule.run(op)
        except (InjectedFault, KeyboardInterrupt):
            figures["raised"] += 1
        except ValueError as exc:
            schedule.refused(exc)
        schedule.settle()
    faults.enabled = False
    while engine.running or engine.waiting:
        engine.step()
    engine.check_invariants()

    clean = ik.Engine(cfg, params, ik.EngineConfig(**{**engine_kw, "prefix_cache": False}))
    for r, full in tracked:
        if r.error is not None:
            continue
        expected = clean.generate([full], greedy(r.sampling.max_new_tokens))[0].tokens
        if r.finish_reason == "abort":
            assert r.out_tokens == expected[:len(r.out_tokens)], (r.rid, r.out_tokens, expected)
            figures["aborted"] += 1
        else:
            assert r.out_tokens == expected, (r.rid, r.out_tokens, expected)
            figures["completed"] += 1
        figures["tokens checked"] += len(r.out_tokens)
    figures.update({f"faults: {k}": v for k, v in faults.count.items()})
    figures["resets"] = engine.stats()["resets"]
    figures["cache hit tokens"] = engine.stats()["cache_hit_tokens"]
    figures["overlapped dispatches"] = engine.stats()["overlapped_dispatches"]
    figures["seconds"] = round(time.perf_counter() - t0, 1)
    return dict(figures)


def main(argv=None) -> int:
    import jax

    sys.path.insert(0, os.path.dirname(__file__))
    from conftest import ENGINE_KW, TRUNK

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rate", type=float, default=0.05)
    args = ap.parse_args(argv)
    params = ik.init_params(TRUNK, jax.random.key(0), std=0.1)
    figures = run_soak(TRUNK, params, {**ENGINE_KW, "num_slots": 10, "num_pages": 40}, args.ops, args.seed, args.rate)
    for k, v in sorted(figures.items()):
        print(f"{k:24} {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

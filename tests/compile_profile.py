"""Where the suite's time goes: a pytest plugin that records, per test file, the wall time and
JAX's trace / lower / XLA-compile seconds, and one row per XLA compile (test, program name,
digest of the lowered module, seconds); and the report over a run's rows.

    PYTHONPATH=tests COMPILE_PROFILE_DIR=/tmp/prof JAX_PLATFORMS=cpu \
        .venv/bin/python -m pytest -n 2 --dist loadfile -p compile_profile    # make test's run, recorded
    python tests/compile_profile.py /tmp/prof                                # the report (markdown)

Each process (an xdist worker, or the main one) writes COMPILE_PROFILE_DIR/<worker>.json at the
end. Subprocesses a test starts (the 8-device mesh run, notebooks, the CLI's processes) are not
seen: their time is their test's wall time. A digest compiled twice in a run is a program the
run could have shared (the executable cache shares the engine's; 2026-12-06: 5 s of 660 s).
Off unless named with `-p compile_profile`: it patches `jax._src.compiler.backend_compile_and_load`.
"""

from __future__ import annotations

import collections
import glob
import hashlib
import json
import os
import sys
import time

import pytest

_ENV = "COMPILE_PROFILE_DIR"
_EVENTS = {"backend_compile_duration": "compile", "jaxpr_trace_duration": "trace",
           "jaxpr_to_mlir_module_duration": "lower"}


class _Recorder:
    def __init__(self):
        self.where = ("<collection>", "")
        self.files: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.compiles: list[tuple[str, str, str, str, float]] = []

    def event(self, event: str, duration: float, **_) -> None:
        name = _EVENTS.get(event.rsplit("/", 1)[-1])
        if name:
            self.files[self.where[0]][name] += duration

    def wrap(self, real):
        from jax._src.interpreters import mlir

        def backend_compile_and_load(backend, module, *args, **kwargs):
            t0 = time.perf_counter()
            out = real(backend, module, *args, **kwargs)
            seconds = time.perf_counter() - t0
            name = str(module.operation.attributes["sym_name"]).strip('"')
            digest = hashlib.sha1(mlir.module_to_bytecode(module)).hexdigest()[:12]
            self.compiles.append((*self.where, name, digest, seconds))
            return out

        return backend_compile_and_load


_REC: _Recorder | None = None


def pytest_configure(config):
    global _REC
    import jax.monitoring
    from jax._src import compiler

    _REC = _Recorder()
    jax.monitoring.register_event_duration_secs_listener(_REC.event)
    compiler.backend_compile_and_load = _REC.wrap(compiler.backend_compile_and_load)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """(Runs where the test runs: an xdist worker, not the controller.)"""
    _REC.where = (item.path.name, item.name)
    t0 = time.perf_counter()
    yield
    _REC.files[item.path.name]["wall"] += time.perf_counter() - t0
    _REC.files[item.path.name]["tests"] += 1


def pytest_sessionfinish(session):
    if not _REC.compiles and not any(c["tests"] for c in _REC.files.values()):
        return  # xdist's controller: the workers ran the tests
    out = os.environ.get(_ENV, "compile_profile")
    os.makedirs(out, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.path.join(out, f"{worker}.json"), "w") as f:
        json.dump({"files": {k: dict(v) for k, v in _REC.files.items()}, "compiles": _REC.compiles}, f)


def report(directory: str) -> str:
    """Per file: tests, wall, compile / trace / lower seconds, XLA compiles and the seconds of
    repeats (a digest already compiled in the run); then the programs by compile seconds."""
    files: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    compiles = []
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        data = json.load(open(path))
        for name, counts in data["files"].items():
            files[name].update(counts)
        compiles += data["compiles"]
    seen, by_name = set(), collections.defaultdict(lambda: [0, 0.0, set()])
    for file, _test, name, digest, seconds in compiles:
        files[file]["xla compiles"] += 1
        if digest in seen:
            files[file]["repeat"] += seconds
        seen.add(digest)
        entry = by_name[name]
        entry[0] += 1
        entry[1] += seconds
        entry[2].add(digest)
    cols = ["tests", "wall", "compile", "trace", "lower", "xla compiles", "repeat"]
    lines = ["| file | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    total = collections.Counter()
    for name, counts in sorted(files.items(), key=lambda kv: -kv[1]["wall"]):
        total.update(counts)
        lines.append(f"| {name} | " + " | ".join(f"{counts[c]:.0f}" if c in ("tests", "xla compiles")
                                                  else f"{counts[c]:.1f}" for c in cols) + " |")
    lines.append("| total | " + " | ".join(f"{total[c]:.1f}" for c in cols) + " |")
    lines += ["", "| program | compiles | distinct | seconds |", "|---|---|---|---|"]
    for name, (n, seconds, digests) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:20]:
        lines.append(f"| {name} | {n} | {len(digests)} | {seconds:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(sys.argv[1] if len(sys.argv) > 1 else "compile_profile"))

"""Start-up as a new user meets it: fresh processes running `make run`'s job
(`inkling-generate` with no arguments: the shipped model on the built-in prompts), timed from
process start to the first token and to the end of the job, cold (empty caches) and warm
(the executable cache the cold run filled), with where the time went.

    python -m bench.serve.startup [--warm-runs 3] [--cold-runs 1] [-- extra inkling-generate flags]

Each run is a child process (this file with --child) in an environment whose
$XDG_CACHE_HOME is a fresh temporary directory, so the library's caches (the executable
cache, and on a GPU JAX's persistent XLA cache) start empty for the cold run and hold exactly
what it stored for the warm runs. Columns:

  first token  process start -> the first generated token
  end          process start -> inkling-generate's work done (completions and stats printed)
  exit         process start -> the process has exited (background compiles still running
               at the end finish first)
  import       process start -> `import inkling_jax.cli` done (Python, jax, the library)
  load         the model loaded and the engine built (`load_model` and `Engine(...)`)
  trace, lower, compile   JAX's monitoring events summed over every thread
               (jaxpr_trace_duration, jaxpr_to_mlir_module_duration, backend_compile_duration):
               concurrent compiles make their sum larger than the wall time they took
  cache read   executable cache loads (`inkling_jax.programs`) plus JAX persistent cache reads
  run          the engine's run: submit -> last token
  compiles     XLA compiles in the process; loaded: programs read from the executable cache

Standalone: imports only the standard library and inkling_jax.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

MARK = "STARTUP-RESULT "


# ---------------------------------------------------------------------------- child


def child(spawned: float, cli_args: list[str]) -> None:
    """Run inkling-generate's default job in this process and print the timings (one line)."""
    import inkling_jax.cli as cli
    from inkling_jax import programs

    imported = time.time()
    marks: dict[str, float] = {}
    with programs.compile_events() as events:
        load_model, engine_cls, run = cli.load_model, None, cli.run

        def timed_load(*a, **kw):
            t0 = time.perf_counter()
            out = load_model(*a, **kw)
            marks["load"] = marks.get("load", 0.0) + time.perf_counter() - t0
            return out

        def timed_run(engine, prompts, sampling, progress=True, **kw):
            submitted = time.time()
            res = run(engine, prompts, sampling, progress, **kw)
            marks["first_token"] = submitted + min(res.ttft_s)
            marks["run"] = res.wall_s
            return res

        from inkling_jax import engine as engine_pkg

        engine_cls = engine_pkg.Engine

        class TimedEngine(engine_cls):
            def __init__(self, *a, **kw):
                t0 = time.perf_counter()
                super().__init__(*a, **kw)
                marks["load"] = marks.get("load", 0.0) + time.perf_counter() - t0

        cli.load_model, cli.run, engine_pkg.Engine = timed_load, timed_run, TimedEngine
        rc = cli.main(cli_args)
        sys.stdout.flush()
        ended = time.time()
    if rc:
        raise SystemExit(rc)
    cache_read = programs.program_stats()["load_seconds"] + sum(
        s for e, s in events.seconds.items() if e.startswith("/jax/compilation_cache/") and "retrieval" in e)
    result = dict(
        first_token=marks["first_token"] - spawned, end=ended - spawned, import_s=imported - spawned,
        load=marks.get("load", 0.0), trace=events.seconds[programs.TRACE_EVENT],
        lower=events.seconds[programs.LOWER_EVENT], compile=events.seconds[programs.COMPILE_EVENT],
        cache_read=cache_read, run=marks["run"], compiles=events.count[programs.COMPILE_EVENT],
        loaded=programs.program_stats()["loaded"])
    print(MARK + json.dumps(result), flush=True)


# --------------------------------------------------------------------------- parent


def run_child(cache_home: str, cli_args: list[str]) -> tuple[dict, list[str]]:
    """One fresh process; its timings (exit included) and its completions."""
    env = dict(os.environ, XDG_CACHE_HOME=cache_home)
    # the child runs this file as a script: put the repository root on its path, so that an
    # uninstalled checkout (e.g. the GPU machine's copy) imports inkling_jax
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    for name in ("INKLING_JAX_EXECUTABLE_CACHE", "JAX_COMPILATION_CACHE_DIR"):
        env.pop(name, None)
    spawned = time.time()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", repr(spawned), "--", *cli_args],
                          env=env, capture_output=True, text=True)
    exited = time.time() - spawned
    if proc.returncode != 0:
        raise SystemExit(f"child failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    lines = proc.stdout.splitlines()
    result = json.loads(next(line for line in lines if line.startswith(MARK))[len(MARK):])
    result["exit"] = exited
    return result, [line for line in lines if line.startswith("    -> ")]


def commit() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


COLUMNS = [("first token", "first_token"), ("end", "end"), ("exit", "exit"), ("import", "import_s"),
           ("load", "load"), ("trace", "trace"), ("lower", "lower"), ("compile", "compile"),
           ("cache read", "cache_read"), ("run", "run")]


def row(name: str, results: list[dict]) -> str:
    """A table row: medians over the runs (min-max when several)."""
    cells = [name, str(len(results))]
    for _, key in COLUMNS:
        values = [r[key] for r in results]
        med = statistics.median(values)
        cells.append(f"{med:.2f}" + (f" ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else ""))
    cells.append("/".join(str(v) for v in sorted({r["compiles"] for r in results})))
    cells.append("/".join(str(v) for v in sorted({r["loaded"] for r in results})))
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cold-runs", type=int, default=1, help="runs with empty caches (each its own)")
    ap.add_argument("--warm-runs", type=int, default=3, help="runs after the first cold run filled the caches")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("cli_args", nargs="*", help="extra inkling-generate flags (after --)")
    args = ap.parse_args(argv)
    cli_args = ["--no-progress", *args.cli_args]
    if args.child is not None:
        child(float(args.child), args.cli_args)
        return 0

    import inkling_jax

    cold, warm, outputs = [], [], []
    homes = [tempfile.mkdtemp(prefix="inkling-startup-") for _ in range(max(1, args.cold_runs))]
    try:
        for i, home in enumerate(homes):
            result, out = run_child(home, cli_args)
            cold.append(result)
            outputs.append(out)
            print(f"cold run {i + 1}: {json.dumps(result)}", file=sys.stderr)
        for i in range(args.warm_runs):
            result, out = run_child(homes[0], cli_args)
            warm.append(result)
            outputs.append(out)
            print(f"warm run {i + 1}: {json.dumps(result)}", file=sys.stderr)
    finally:
        for home in homes:
            shutil.rmtree(home, ignore_errors=True)
    same = all(o == outputs[0] for o in outputs)
    print(f"Start-up of `make run`'s job (inkling-generate {' '.join(cli_args)}), fresh processes; "
          f"{time.strftime('%Y-%m-%d')}, {platform.machine()} {os.cpu_count()} cores, inkling-jax "
          f"{inkling_jax.__version__} commit {commit()}, Python {platform.python_version()}. Seconds; medians "
          f"(min-max). Completions {'identical in every run' if same else 'DIFFER between runs'}.\n")
    print("| caches | runs | " + " | ".join(name for name, _ in COLUMNS) + " | compiles | loaded |")
    print("|---" * (len(COLUMNS) + 4) + "|")
    print(row("cold (empty)", cold))
    if warm:
        print(row("warm", warm))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

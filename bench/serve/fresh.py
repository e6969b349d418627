"""The sections of bench.serve.serve that measure in fresh processes (nothing compiled, cached
or allocated before them): `startup` (params, engine and first generate, with an empty and
then a filled persistent compilation cache) and `flags` (the decode section again under
each XLA_FLAGS variant). Each child is `python -m bench.serve.serve` itself, run in the
repository root, in a helper mode (`--startup-child DIR`, or `--sections decode --child-out
FILE`), with the results as JSON in a file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import inkling_jax as ik

from bench import REPO
from bench.common.helpers import Report, log, table
from bench.serve.loop import bench_config, model_config

SERVE = [sys.executable, "-m", "bench.serve.serve"]  # a child, run in REPO
STARTUP_NEW = 16  # tokens the first generate makes
INIT_TARGET_S, START_TARGET_S = 10.0, 20.0
# the command-buffer (CUDA graph) variant: every command type, graphs of any size
GPU_FLAG_VARIANTS = ";--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL " \
                    "--xla_gpu_graph_min_graph_size=1"
CPU_FLAG_VARIANTS = ";--xla_cpu_multi_thread_eigen=false"  # --smoke: a harmless CPU flag exercises the path
# settings a child must not inherit: the startup children get their compile cache through
# EngineConfig.compile_cache_dir only
CACHE_ENV = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
             "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")


# ---------------------------------------------------------------------- children


def child_env(args, xla_flags: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CACHE_ENV}
    if args.smoke:
        env["JAX_PLATFORMS"] = "cpu"
    if xla_flags is not None:
        env["XLA_FLAGS"] = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), xla_flags) if f.strip())
    return env


def size_args(args) -> list[str]:
    return ["--smoke"] if args.smoke else ["--prompt-len", str(args.prompt_len), "--new", str(args.new)]


def error_line(text: str, rc: int) -> str:
    """The line of a failed child's output that says why: the last glog fatal / error line or
    Python exception, else the last line (markdown-safe, at most 160 characters)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    why = next((line for line in reversed(lines)
                if re.match(r"[FE]\d{4} ", line) or re.match(r"[\w.]*(Error|Exception|SystemExit)\b", line)),
               lines[-1] if lines else "")
    why = re.sub(r"^[FE]\d{4} [\d:.]+\s+\d+ \S+\] ", "", why)  # glog prefix
    return (why or f"exit status {rc}").replace("|", "/")[:160]


def run_child(cmd: list[str], env: dict, out_path: str, timeout: float) -> tuple[dict | None, str, float]:
    """(the child's JSON results or None, why it failed, its wall seconds)."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s", time.perf_counter() - t0
    wall = time.perf_counter() - t0
    if proc.returncode == 0 and os.path.exists(out_path):
        with open(out_path) as f:
            return json.load(f), "", wall
    log(f"child failed (exit {proc.returncode}): {' '.join(cmd[1:])}\n{(proc.stderr or proc.stdout)[-2000:]}")
    return None, error_line(proc.stderr if proc.stderr.strip() else proc.stdout, proc.returncode), wall


def startup_child(args) -> int:
    """--startup-child DIR: params, engine and one generate in this fresh process, the
    engine's persistent compile cache in DIR (EngineConfig.compile_cache_dir); timings to
    --child-out."""
    events: dict[str, float] = {}  # jax's compile-time events: seconds summed per name

    def listen(name, secs, **kw):
        events[name] = events.get(name, 0.0) + secs

    jax.monitoring.register_event_duration_secs_listener(listen)
    t0 = time.perf_counter()  # just after `import inkling_jax` (serve.py's imports)
    cfg = model_config(args.smoke, mtp=False)
    params = ik.init_params(cfg, jax.random.key(0), dtype=jnp.float32 if args.smoke else jnp.bfloat16,
                            compile_cache=args.startup_child)
    jax.block_until_ready(params)
    t1 = time.perf_counter()
    config = dataclasses.replace(bench_config(args, 1, prefix=False), compile_cache_dir=args.startup_child,
                                 use_pallas=False if args.startup_jnp else "auto")
    engine = ik.Engine(cfg, params, config)
    if args.startup_warmup:  # as inkling-generate does: every program compiles in the background, and
        engine.warmup(wait=False)  # the first steps wait only for their own (compiled concurrently)
    t2 = time.perf_counter()
    prompt = [int(t) for t in np.random.RandomState(3).randint(3, cfg.unpadded_vocab_size, args.prompt_len)]
    done = engine.generate([prompt], ik.SamplingParams(max_new_tokens=STARTUP_NEW, stop_at_eos=False))
    t3 = time.perf_counter()
    st = engine.stats()
    result = dict(params_s=t1 - t0, engine_s=t2 - t1, generate_s=t3 - t2, total_s=t3 - t0,
                  tokens=len(done[0].tokens), compiles=st["compiles"], compile_seconds=st["compile_seconds"],
                  cache_dir=engine.runner.compile_cache_dir, backend=jax.default_backend(),
                  phases={k.rsplit("/", 1)[-1]: v for k, v in events.items() if k in PHASE_EVENTS})
    with open(args.child_out, "w") as f:
        json.dump(result, f)
    return 0


# where start-up compile time goes (jax.monitoring duration events)
PHASE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                "/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_retrieval_time_sec")


def cache_entries(path: str) -> int:
    return sum(len(files) for _, _, files in os.walk(path))


# ---------------------------------------------------------------------- sections


def import_seconds(args) -> float | None:
    """`import inkling_jax` in a fresh interpreter (jax's import included)."""
    code = "import time; t = time.perf_counter(); import inkling_jax; print(time.perf_counter() - t)"
    proc = subprocess.run([sys.executable, "-c", code], env=child_env(args), capture_output=True, text=True,
                          cwd=REPO, timeout=600)
    return float(proc.stdout.split()[-1]) if proc.returncode == 0 and proc.stdout.split() else None


def section_startup(args, report: Report) -> None:
    """Start-up seconds in fresh processes: `import inkling_jax`; init_params of the bench
    model; import -> init_params -> Engine -> first generate with the engine's persistent
    compile cache empty (cold), then filled by the cold run (warm)."""
    rows, notes = [], []
    imported = import_seconds(args)
    rows.append(["import inkling_jax (jax included)", "failed" if imported is None else f"{imported:.1f}", "-",
                 "-"])
    met = lambda s, target: "yes" if s <= target else "no"  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="inkling-startup-cache-") as cache, \
            tempfile.TemporaryDirectory(prefix="inkling-startup-out-") as outdir:
        runs = [("cold", cache, []), ("warm", cache, [])]
        if args.startup_jnp:  # the same with the jnp kernels, in a cache of their own
            jnp_cache = os.path.join(outdir, "jnp-cache")
            runs += [("cold, jnp kernels", jnp_cache, ["--startup-jnp"]),
                     ("warm, jnp kernels", jnp_cache, ["--startup-jnp"])]
        if args.startup_warmup:  # the same with Engine.warmup(wait=False) first, in a cache of its own
            bg_cache = os.path.join(outdir, "warmup-cache")
            runs += [("cold, background warm-up", bg_cache, ["--startup-warmup"]),
                     ("warm, background warm-up", bg_cache, ["--startup-warmup"])]
        for run_name, cache, extra in runs:
            out = os.path.join(outdir, f"{run_name}.json")
            entries = cache_entries(cache)
            cmd = SERVE + ["--startup-child", cache, "--child-out", out] + size_args(args) + extra
            # the executable cache (under $XDG_CACHE_HOME) lives beside the XLA cache, so a cold
            # run meets both empty and its warm run both filled
            env = dict(child_env(args), XDG_CACHE_HOME=os.path.join(cache, "xdg"))
            res, why, wall = run_child(cmd, env, out, timeout=1800)
            what = f"import -> init_params -> Engine -> first generate, {run_name} compile cache ({entries} entries)"
            if res is None:
                rows.append([what, f"failed: {why}", f"<= {START_TARGET_S:.0f}", "no"])
                continue
            log(f"startup {run_name}: {res} (process {wall:.1f} s)")
            if run_name == "cold":  # (the jnp runs' init_params is the same)
                model = "tiny model (2 layers, no MTP), fp32" if args.smoke else "bench model (no MTP), bf16"
                rows.insert(1, [f"init_params, {model}, block_until_ready", f"{res['params_s']:.1f}",
                                f"<= {INIT_TARGET_S:.0f}", met(res["params_s"], INIT_TARGET_S)])
            rows.append([what, f"{res['total_s']:.1f}", f"<= {START_TARGET_S:.0f}",
                         met(res["total_s"], START_TARGET_S)])
            rows.append([f"  of which init_params / Engine() / generate ({res['compiles']} compiles, "
                         f"{res['compile_seconds']:.1f} s)",
                         f"{res['params_s']:.1f} / {res['engine_s']:.1f} / {res['generate_s']:.1f}", "-", "-"])
            ph = res.get("phases", {})
            rows.append(["  compile phases: trace / to MLIR / XLA compile / cache reads",
                         " / ".join(f"{ph.get(k.rsplit('/', 1)[-1], 0.0):.1f}" for k in PHASE_EVENTS), "-", "-"])
            if res["cache_dir"] != cache:
                notes.append(f"the {run_name} engine's compile cache was {res['cache_dir']!r}, not the fresh directory")
    notes.append("entries: files in the cache directory before the run (the XLA cache keeps compiles of 1 s or more; "
                 "the executable cache every program)")
    smoke = " (smoke: 2-layer tiny model, CPU)" if args.smoke else ""
    report.add(f"### Start-up in fresh processes{smoke}: {args.prompt_len}-token prompt, {STARTUP_NEW} new tokens, "
               f"the batch-1 decode engine config, prefix cache off\n\n"
               + table(["what", "seconds", "target", "met"], rows) + "\n\n" + "; ".join(notes), "startup")


def flag_variants(args) -> list[str]:
    text = args.flag_variants if args.flag_variants is not None else \
        (CPU_FLAG_VARIANTS if args.smoke else GPU_FLAG_VARIANTS)
    return [v.strip() for v in text.split(";")]


def section_flags(args, report: Report) -> None:
    """The decode section (--flag-batches; smoke: 1) again in a fresh process per XLA_FLAGS
    variant (appended to the inherited XLA_FLAGS), against the first variant."""
    batches = "1" if args.smoke else args.flag_batches
    ks = args.decode_steps_list
    results: list[tuple[str, dict | None, str]] = []
    with tempfile.TemporaryDirectory(prefix="inkling-flags-") as outdir:
        for i, flags in enumerate(flag_variants(args)):
            out = os.path.join(outdir, f"{i}.json")
            cache = os.path.abspath(args.cache_dir) if args.cache_dir else ""  # the child runs in REPO
            cmd = SERVE + ["--sections", "decode", "--decode-batches", batches, "--decode-steps", args.decode_steps,
                           "--cache-dir", cache, "--child-out", out] + size_args(args)
            res, why, wall = run_child(cmd, child_env(args, flags), out, timeout=3600)
            log(f"flags {flags or '(none)'!r}: {res['decode'] if res else why} ({wall:.0f} s)")
            results.append((flags, res["decode"] if res else None, why))
    base = results[0][1] or {}
    rows = []
    for flags, decode, why in results:
        for b in (int(x) for x in batches.split(",")):
            for k in ks:
                ms = decode.get(f"{b},{k}") if decode else None
                ref = base.get(f"{b},{k}")
                rows.append([f"`{flags}`" if flags else "(inherited only)", b, k,
                             f"{ms:.3f}" if ms is not None else f"failed: {why}",
                             f"{ms / ref:.3f}" if ms is not None and ref else "-"])
    inherited = os.environ.get("XLA_FLAGS", "")
    smoke = " (smoke)" if args.smoke else ""
    report.add(f"### XLA flag variants{smoke}: decode ms/step in the engine loop, a fresh process each "
               f"(appended to XLA_FLAGS={inherited!r})\n\n"
               + table(["flags", "B", "K", "decode ms/step", "vs baseline"], rows, "lrrrr"), "flags")

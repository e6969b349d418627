"""inkling-generate: continuous-batching generation with the serving engine, and its statistics.

    inkling-generate [--model shakespeare|tiny|small|bench|PATH] [--prompt TEXT ... | --prompts-file F]
                     [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--min-p P] [--seed S]
                     [--n N] [--repetition-penalty R] [--presence-penalty P] [--frequency-penalty F]
                     [--logit-bias ID=BIAS ...] [--min-tokens N] [--stop TEXT ...] [--include-stop-str]
                     [--logprobs K] [--stream | --no-stream]
                     [--spec-steps K] [--decode-steps K]
                     [--no-prefix-cache] [--lazy] [--pool unified|static] [--max-running N] [--dtype D]
                     [--tp N] [--ep N] [--session-dir DIR]
                     [--coordinator HOST:PORT --num-processes N --process-id I]

With no arguments it runs the embedded default model, the trained byte-level `shakespeare`
model shipped in `inkling_jax/models/` (its card: `inkling_jax/models/shakespeare/README.md`),
on built-in prompts, several of which share a prefix so the prefix cache has something to
serve. The presets (tiny, small, bench) have deterministic random weights (jax.random.key(0)).
Streams each completion's text as it is generated (`Engine.stream`; the first unfinished
completion prints live, the others as soon as their turn comes), or with --no-stream prints
them when all are done; then a stats table (with the accept lengths under --spec-steps).
--n N prints N samples of each prompt; --logprobs K the top K alternatives of each token.

The engine geometry is sized from the prompts so that one run compiles few step shapes: one
batch bucket (max_running rows), one token bucket (max_step_tokens) and one context bucket
(the longest prompt plus max_new_tokens, rounded up to a power of two): an extend step and a
decode step, warmed up in the background from the start (they compile concurrently, and the
first step waits only for its own program; `--no-warmup` compiles each when first used).
Compiled programs are kept in the executable cache (`inkling_jax/programs.py`; default
~/.cache/inkling-jax/executables, $INKLING_JAX_EXECUTABLE_CACHE=off turns it off), so a later
run loads them instead of compiling; `--clear-compile-cache` empties it and exits.

A chat across runs: `--session-dir DIR` makes the prompts turns of one session, restored from
DIR's save (`Engine.save`) when there is one and saved there afterwards (`cli_session.py`).

Serving on a mesh: `--tp N --ep M` builds `make_mesh(tp=N, ep=M)` over the first N * M
devices and runs `Engine(..., mesh=)` (tensor parallel over heads, MLP widths and vocab;
expert parallel over routed experts; a model directory is read slice by slice onto the
devices). Either flag alone sets the other to 1; neither: one device, no mesh.

Several hosts (processes): start the same command on every host, adding
`--coordinator HOST:PORT --num-processes N --process-id I` (I = 0 .. N-1; HOST:PORT is
where process 0 listens). `jax.distributed.initialize` runs first, before anything touches
a device; the mesh then spans every process's devices (`jax.devices()` is global). Every
process loads the model, tokenizes the same prompts and runs the same host loop: the
engine is deterministic, so the schedules agree step for step, and each reads the same
replicated outputs. Only process 0 prints completions, stats and progress; errors are
printed by the process that meets them.

    host0$ inkling-generate --model /ckpt --tp 8 --ep 2 --coordinator host0:1234 --num-processes 2 --process-id 0
    host1$ inkling-generate --model /ckpt --tp 8 --ep 2 --coordinator host0:1234 --num-processes 2 --process-id 1
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from pallas_kernels._common import pow2_ceil as _pow2

from .config import InklingConfig
from .tokenizer import ByteTokenizer, tokenizer_for

PRESETS = ("tiny", "small", "bench")
DEFAULT_MODEL = "shakespeare"  # shipped trained weights (inkling_jax/models)

# A shared opening: longer than a few checkpoint intervals, so later requests that start with
# it are served from the prefix cache.
_SCENE = "ACT I. SCENE I. A room in the castle.\n\n"
DEFAULT_PROMPTS = [
    _SCENE + "HAMLET. To be, or not to be",
    "ROMEO. But soft, what light through yonder window breaks?",
    _SCENE + "KING. Now, my good lord,",
    "Friends, Romans, countrymen,",
    _SCENE + "QUEEN. Good Hamlet,",
    _SCENE + "HAMLET. To be, or not to be",  # an exact repeat
]


class CliError(Exception):
    """A problem with the command line's request: printed as one line, exit status 2."""


# --------------------------------------------------------------------------- model / prompts


def default_dtype() -> str:
    return "bfloat16" if jax.default_backend() in ("gpu", "tpu") else "float32"


def load_model(spec: str, dtype=jnp.float32, mesh=None):
    """(cfg, params) for a preset name (random weights from jax.random.key(0)), a shipped
    model's name or a model directory (with a mesh: read onto it in the sharded layout,
    each device's slices only)."""
    if spec in PRESETS:
        from .model import init_params

        cfg = getattr(InklingConfig, spec)()
        return cfg, init_params(cfg, jax.random.key(0), dtype=dtype)
    import os

    from .models import SHIPPED, model_dir
    from .weights import load_pretrained

    if spec in SHIPPED:
        try:
            spec = model_dir(spec)
        except FileNotFoundError as e:
            raise CliError(str(e)) from None
    if not os.path.isfile(os.path.join(spec, "config.json")):
        raise CliError(f"--model {spec!r} is neither a preset ({', '.join(PRESETS)}), a shipped model "
                       f"({', '.join(SHIPPED)}) nor a model directory with a config.json")
    return load_pretrained(spec, dtype=dtype, mesh=mesh)


# ----------------------------------------------------------------------------- devices


def init_distributed(args: argparse.Namespace) -> None:
    """`jax.distributed.initialize` from --coordinator / --num-processes / --process-id (all
    three, or none: one process). Must run before anything touches a device."""
    given = {name: getattr(args, name) for name in ("coordinator", "num_processes", "process_id")}
    if all(v is None for v in given.values()):
        return
    missing = [f"--{k.replace('_', '-')}" for k, v in given.items() if v is None]
    if missing:
        raise CliError(f"several processes need --coordinator, --num-processes and --process-id together "
                       f"(missing {', '.join(missing)})")
    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise CliError(f"--coordinator must be HOST:PORT, got {args.coordinator!r}")
    if args.num_processes < 1:
        raise CliError(f"--num-processes must be >= 1, got {args.num_processes}")
    if not 0 <= args.process_id < args.num_processes:
        raise CliError(f"--process-id must be in [0, {args.num_processes}), got {args.process_id}")
    try:
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id)
    except Exception as e:  # noqa: BLE001 - no coordinator, a port in use, devices already started
        raise CliError(f"jax.distributed.initialize({args.coordinator}, {args.num_processes} processes, "
                       f"process {args.process_id}) failed: {type(e).__name__}: {e}") from None


def build_mesh(args: argparse.Namespace):
    """The serving mesh of --tp / --ep (None when neither is given)."""
    if args.tp is None and args.ep is None:
        return None
    from .parallel import make_mesh

    tp, ep = (1 if args.tp is None else args.tp), (1 if args.ep is None else args.ep)
    for name, value in (("tp", tp), ("ep", ep)):
        if value < 1:
            raise CliError(f"--{name} must be >= 1, got {value}")
    try:
        return make_mesh(tp=tp, ep=ep)
    except ValueError as e:
        raise CliError(str(e)) from None


def parse_logit_bias(items: list[str]) -> dict[int, float]:
    """--logit-bias "ID=BIAS" ... -> {ID: BIAS} (CliError naming a malformed item)."""
    out = {}
    for item in items:
        tid, sep, bias = item.partition("=")
        try:
            if not sep:
                raise ValueError
            out[int(tid)] = float(bias)
        except ValueError:
            raise CliError(f"--logit-bias takes ID=BIAS items (e.g. 42=-5), got {item!r}") from None
    return out


def read_prompts(path: str) -> list[str]:
    """One prompt per non-empty line ('-': standard input); a literal \\n in a line is a newline."""
    try:
        text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
    except OSError as e:
        raise CliError(f"cannot read --prompts-file: {e}") from None
    except UnicodeDecodeError as e:
        raise CliError(f"--prompts-file {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    prompts = [line.replace("\\n", "\n") for line in text.splitlines() if line.strip()]
    if not prompts:
        raise CliError(f"--prompts-file {path}: no prompts (one per non-empty line)")
    return prompts


def engine_config(args: argparse.Namespace, prompt_lens: list[int]):
    """EngineConfig for this run: one bucket per dimension (two compiled steps in all)."""
    from .engine import EngineConfig

    page_size = args.page_size
    interval = args.track_interval or 2 * page_size
    running = max(1, min(args.max_running, len(prompt_lens)))
    chunk = args.chunk_size or interval
    step_tokens = _pow2(max(running * chunk, running))
    context = _pow2(max(max(prompt_lens) + args.max_new_tokens + args.spec_steps, 2 * page_size))
    pages_per_request = context // page_size
    # every running request at full length, plus as much again for the prefix cache; slots for
    # the running requests (active + two checkpoints each) and some cached checkpoints
    num_pages = 2 * running * pages_per_request
    num_slots = 3 * running + min(4 * len(prompt_lens), 32)
    return EngineConfig(
        max_running=running, num_slots=num_slots, num_pages=num_pages, page_size=page_size,
        pool=args.pool, prefix_cache=not args.no_prefix_cache, track_interval=interval,
        ping_pong="lazy" if args.lazy else "eager", spec_steps=args.spec_steps,
        **({} if args.decode_steps is None else {"decode_steps": args.decode_steps}),
        chunk_size=min(chunk, step_tokens), max_step_tokens=step_tokens, max_context=context,
        min_context_bucket=context, min_token_bucket=step_tokens, min_batch_bucket=running)


# ------------------------------------------------------------------------------------ run


@dataclass
class RunResult:
    completions: list  # list[Completion]
    stats: dict
    wall_s: float  # submit -> last token
    compile_s: float  # compile seconds inside that wall time
    ttft_s: list[float]


def run(engine, prompts: list[list[int]], sampling, progress: bool = True, printer=None) -> RunResult:
    """Submit every prompt, step the engine until all finish (a tqdm bar counts tokens), or,
    with a `printer` (`StreamPrinter`), stream the completions through it. On several
    processes every process runs this same loop (only one shows the bar or prints)."""
    from tqdm import tqdm

    before = engine.stats()
    t0 = time.perf_counter()
    try:
        requests = engine.submit(prompts, sampling)
    except ValueError as e:  # bad input (token id out of range, prompt too long): nothing was queued
        raise CliError(str(e)) from None
    if printer is not None:
        for delta in engine.stream_requests(requests):
            printer.add(delta)
    else:
        total = len(requests) * sampling.max_new_tokens
        # delay: the bar appears only when the run lasts longer than a second
        with tqdm(total=total, unit="tok", desc="generating", disable=not progress, delay=1.0,
                  file=sys.stderr, dynamic_ncols=True) as bar:
            done = 0
            while any(r.finish_reason is None for r in requests):
                engine.step()
                n = sum(len(r.out_tokens) for r in requests)
                bar.update(n - done)
                done = n
                finished = sum(r.finish_reason is not None for r in requests)
                bar.set_postfix(done=f"{finished}/{len(requests)}", refresh=False)
    wall = time.perf_counter() - t0
    after = engine.stats()
    return RunResult([r.completion() for r in requests], after, wall,
                     after["compile_seconds"] - before["compile_seconds"],
                     [r.first_token_at - r.submitted for r in requests])


def label(c, n: int) -> str:
    return f"[{c.index}]" if n == 1 else f"[{c.index}.{c.sample}]"


def shown(c, tok, eos: int | None) -> tuple[str, str]:
    """(the completion's text, its finish reason as printed)."""
    why = c.finish_reason
    if why == "stop" and c.stop_reason == eos:
        why = "stop at eos"
    elif why == "stop" and isinstance(c.stop_reason, str):
        why = f"stop at {c.stop_reason!r}"
    elif why == "error":
        why = f"error: {c.error}"
    tokens = c.tokens[:-1] if why == "stop at eos" else c.tokens
    return (c.text if c.text is not None else tok.decode(tokens)), why


def describe(c, tok, eos: int | None, logprobs: int) -> list[str]:
    """The lines printed under a completion: ids past the byte range, the count line, top alternatives."""
    lines = []
    _, why = shown(c, tok, eos)
    if isinstance(tok, ByteTokenizer) and any(t >= 256 for t in c.tokens):  # ids past the byte range
        lines.append(f"       ids {c.tokens[:24]}{' ...' if len(c.tokens) > 24 else ''}")
    lines.append(f"       ({len(c.tokens)} token{'s' * (len(c.tokens) != 1)}, {why}, "
                 f"{c.cached_tokens} prompt tokens cached)")
    for t, lp, top in list(zip(c.tokens, c.logprobs, c.top_logprobs or []))[:8 if logprobs else 0]:
        alts = ", ".join(f"{tok.decode([a])!r} {alp:.2f}" for a, alp in top)
        lines.append(f"       {tok.decode([t])!r:>8} {lp:7.2f}   top: {alts}")
    return lines


class StreamPrinter:
    """Prints streamed completions in order, as they come: the first unfinished one live, the
    deltas of the ones after it kept until its turn (so the output reads as the batch print
    does, each completion as soon as it can be shown)."""

    def __init__(self, texts: list[str], n: int, out=None):
        self.texts, self.n = texts, n
        self.out = out or sys.stdout
        self.order = [(i, j) for i in range(len(texts)) for j in range(n)]
        self.pending: dict = {k: [] for k in self.order}  # deltas not printed yet
        self.done: set = set()
        self.current = 0  # index into order of the completion printing live
        self.started = False

    def add(self, delta) -> None:
        key = (delta.index, delta.sample)
        self.pending[key].append(delta.text)
        if delta.finish_reason is not None:
            self.done.add(key)
        while self.current < len(self.order):
            key = self.order[self.current]
            if not self.started:
                i, j = key
                self.out.write(f"{f'[{i}]' if self.n == 1 else f'[{i}.{j}]'} {self.texts[i]!r}\n    -> ")
                self.started = True
            self.out.write("".join(self.pending[key]))
            self.pending[key] = []
            self.out.flush()
            if key not in self.done:
                return
            self.out.write("\n")
            self.current, self.started = self.current + 1, False


def format_stats(res: RunResult, num_prompt_tokens: int, warmup_s: float, spec_steps: int) -> str:
    s = res.stats
    gen = sum(len(c.tokens) for c in res.completions)
    run_s = max(res.wall_s - res.compile_s, 1e-9)
    ttft = res.ttft_s
    cached = sum(c.cached_tokens for c in res.completions)
    if spec_steps:
        accept = f"{s['mean_accept_length']:.2f} tokens per verify round ({s.get('verify_steps', 0)} verify dispatches"
        if s.get("depth_acceptance"):
            accept += ", acceptance by depth " + " ".join(f"{a:.2f}" for a in s["depth_acceptance"])
        accept += ")"
    else:
        accept = "- (speculative decoding off)"
    rows = [
        ("requests", f"{len(res.completions)}"),
        ("generated tokens", f"{gen}"),
        ("wall time", f"{res.wall_s:.3f} s ({res.compile_s:.2f} s of it waiting for compiled programs)"),
        ("tokens/s", f"{gen / run_s:.1f} (generated tokens / wall time excluding compile)"),
        ("time to first token", f"mean {1e3 * sum(ttft) / len(ttft):.1f} ms, max {1e3 * max(ttft):.1f} ms"),
        ("steps", f"{s['steps']} (extend {s['extend_steps']}, decode {s['decode_steps']})"),
        ("compiles", f"{s['compiles']} step programs ({s['compile_seconds']:.2f} s waiting for programs; "
                     f"{warmup_s:.2f} s of warm-up before the run)"),
        ("cache-hit tokens", f"{cached} of {num_prompt_tokens} prompt tokens"),
        ("accept length", accept),
        ("pool", f"{s['live_slots']} slots / {s['live_pages']} pages live, "
                 f"{s['compaction_moves']} compaction moves"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(["stats:"] + [f"  {k:<{width}}  {v}" for k, v in rows])


# ----------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="inkling-generate",
        description="Generate with the Inkling serving engine (continuous batching, prefix cache) and "
                    "print the completions and a stats table. With no arguments: the shipped trained "
                    "model (shakespeare, byte-level) on built-in prompts.")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a shipped model (shakespeare: trained), a preset "
                    "(tiny, small, bench: random weights) or a model directory (config.json + safetensors, "
                    f"tokenizer.json if present). Default: {DEFAULT_MODEL}")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prompt", nargs="+", action="extend", metavar="TEXT",
                     help="prompt text (repeatable; several after one flag)")
    src.add_argument("--prompts-file", metavar="F", help="one prompt per non-empty line ('-' = stdin)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--min-p", type=float, default=0.0, help="keep tokens with p >= MIN_P * p_max (0 = off)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument("--n", type=int, default=1, help="samples of each prompt (sharing its prefill; seeds seed + j)")
    ap.add_argument("--repetition-penalty", type=float, default=1.0,
                    help="> 1 discourages tokens of the prompt and the output (HF semantics; 1 = off)")
    ap.add_argument("--presence-penalty", type=float, default=0.0,
                    help="subtracted from tokens already in the output, in [-2, 2] (OpenAI semantics)")
    ap.add_argument("--frequency-penalty", type=float, default=0.0,
                    help="subtracted per occurrence in the output, in [-2, 2] (OpenAI semantics)")
    ap.add_argument("--logit-bias", nargs="+", action="extend", default=[], metavar="ID=BIAS",
                    help="add BIAS to token ID's logit (repeatable)")
    ap.add_argument("--min-tokens", type=int, default=0, help="no stop (eos, stop ids, stop strings) before this")
    ap.add_argument("--stop", nargs="+", action="extend", default=[], metavar="TEXT",
                    help="stop strings, matched on the decoded text (repeatable; a literal \\n is a newline)")
    ap.add_argument("--include-stop-str", action="store_true", help="keep the matched stop string in the text")
    ap.add_argument("--logprobs", type=int, default=0, metavar="K",
                    help="print the top K alternatives of each token (of the first 8 tokens of each completion)")
    ap.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                    help="print each completion's text as it is generated (default); --no-stream prints them "
                         "all at the end")
    ap.add_argument("--spec-steps", type=int, default=0, help="MTP draft tokens per round (0 = off)")
    ap.add_argument("--decode-steps", type=int, default=None,
                    help="decode steps per dispatch, a device loop (default: EngineConfig's)")
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--lazy", action="store_true", help="lazy ping-pong checkpoints and lazy compaction")
    ap.add_argument("--pool", choices=("unified", "static"), default="unified")
    ap.add_argument("--max-running", type=int, default=4, help="requests decoded together (default 4)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--track-interval", type=int, default=0, help="checkpoint cadence (default 2 pages)")
    ap.add_argument("--chunk-size", type=int, default=0, help="prefill chunk (default: the track interval)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                    help="parameter dtype (default: bfloat16 on GPU/TPU, float32 on CPU)")
    ap.add_argument("--ignore-eos", action="store_true", help="generate max-new-tokens even past eos")
    ap.add_argument("--no-warmup", action="store_true", help="compile lazily inside the run")
    ap.add_argument("--compile-cache", metavar="DIR", default=None,
                    help="persistent XLA compilation cache directory: later runs with the same shapes load "
                         "the compiled steps instead of compiling them (off by default)")
    ap.add_argument("--clear-compile-cache", action="store_true",
                    help="remove this library's compiled programs (the executable cache: $INKLING_JAX_EXECUTABLE_CACHE "
                         "or ~/.cache/inkling-jax/executables; and its XLA cache ~/.cache/inkling-jax/xla) and exit")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--session-dir", metavar="DIR", default=None,
                    help="chat across runs: the prompts are turns of one session, continued from the save in "
                         "DIR if there is one (its session and prefix cache, restored exactly) and saved there "
                         "afterwards (inkling_jax/cli_session.py)")
    mesh = ap.add_argument_group("mesh", "serve on several devices (Engine(..., mesh=make_mesh(tp, ep)))")
    mesh.add_argument("--tp", type=int, default=None, help="tensor-parallel devices: heads, MLP widths, vocab")
    mesh.add_argument("--ep", type=int, default=None, help="expert-parallel devices: routed experts")
    hosts = ap.add_argument_group("several processes", "jax.distributed.initialize; the same command on every host, "
                                  "only process 0 prints")
    hosts.add_argument("--coordinator", metavar="HOST:PORT", default=None, help="process 0's address")
    hosts.add_argument("--num-processes", type=int, default=None, metavar="N")
    hosts.add_argument("--process-id", type=int, default=None, metavar="I", help="this process: 0 .. N-1")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.clear_compile_cache:
        from .compile_cache import clear_library_xla_cache, executable_cache_dir
        from .programs import clear_executable_cache

        removed = clear_executable_cache()
        print(f"removed {removed} executable cache entries from {executable_cache_dir() or '(off)'}")
        path = clear_library_xla_cache()
        if path:
            print(f"removed the XLA compilation cache {path}")
        return 0
    try:
        init_distributed(args)  # first: before anything touches a device
        return _main(args)
    except CliError as e:
        print(f"inkling-generate: error: {e}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    from .engine import Engine, SamplingParams

    printing = jax.process_index() == 0  # several processes: one prints

    def say(*a, **kw) -> None:
        if printing:
            print(*a, **kw)

    if args.prompt:
        texts = list(args.prompt)
    elif args.prompts_file:
        texts = read_prompts(args.prompts_file)
    else:
        texts = list(DEFAULT_PROMPTS)
    for name in ("max_new_tokens", "max_running", "page_size"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

    for name in ("track_interval", "chunk_size", "spec_steps"):
        if getattr(args, name) < 0:
            raise CliError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    dtype = args.dtype or default_dtype()
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    mesh = build_mesh(args)

    t0 = time.perf_counter()
    try:
        cfg, params = load_model(args.model, dtype=jnp.dtype(dtype), mesh=mesh)
    except CliError:
        raise
    except Exception as e:  # noqa: BLE001 - any unreadable model is one line, not a traceback
        raise CliError(f"cannot load model {args.model!r}: {type(e).__name__}: {e}") from None
    try:
        tok = ByteTokenizer(cfg) if args.model in PRESETS else tokenizer_for(args.model, cfg)
    except ImportError as e:
        raise CliError(f"{args.model}/tokenizer.json needs the `tokenizers` package "
                       f"(pip install 'inkling-jax[tokenizers]'): {e}") from None
    except ValueError as e:  # a vocab too small for bytes and no tokenizer.json
        raise CliError(f"no tokenizer for {args.model!r}: {e}") from None
    prompts = [tok.encode(t) for t in texts]
    empty = [i for i, p in enumerate(prompts) if not p]
    if empty:
        raise CliError(f"prompt {empty[0]} is empty")
    try:
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                  stop_at_eos=not args.ignore_eos, n=args.n, min_p=args.min_p,
                                  repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                                  frequency_penalty=args.frequency_penalty,
                                  logit_bias=parse_logit_bias(args.logit_bias), min_tokens=args.min_tokens,
                                  stop=[x.replace("\\n", "\n") for x in args.stop],
                                  include_stop_str=args.include_stop_str, logprobs=args.logprobs)
        if args.session_dir:  # a chat across runs: its own engine (restored or new) and output
            from .cli_session import chat

            return chat(args, cfg, params, tok, texts, prompts, sampling, mesh, say, CliError)
        econf = engine_config(args, [len(p) for p in prompts])
        engine = Engine(cfg, params, econf, mesh=mesh, tokenizer=tok)
    except (ValueError, NotImplementedError) as e:
        raise CliError(str(e)) from None
    except MemoryError as e:
        raise CliError(f"out of host memory building the engine: {e}") from None
    load_s = time.perf_counter() - t0

    say(f"model {args.model} ({dtype}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"vocab {cfg.unpadded_vocab_size}) loaded in {load_s:.2f} s")
    if engine.plan is not None:
        say(f"mesh: tp={engine.plan.tp} x ep={engine.plan.ep} over {engine.mesh.devices.size} "
            f"{engine.mesh.devices.flat[0].platform} devices, {jax.process_count()} process(es); "
            f"{engine.plan.describe()}")
    say(f"engine: {econf.pool} pool, prefix cache {'on' if econf.prefix_cache else 'off'}, "
        f"{econf.ping_pong} ping-pong, max_running {econf.max_running}, page_size {econf.page_size}, "
        f"track_interval {econf.track_interval}, context {econf.max_context}, "
        f"{econf.decode_steps} decode step(s) per dispatch, {'pallas' if engine.runner.use_pallas else 'jnp'} kernels")
    warmup_s = 0.0
    if not args.no_warmup:
        t1 = time.perf_counter()
        engine.warmup(wait=False)  # in the background: the first step waits only for its own program
        warmup_s = time.perf_counter() - t1

    printer = StreamPrinter(texts, args.n) if args.stream and printing else None
    if printer is not None:
        say()
    res = run(engine, prompts, sampling, progress=printing and not args.no_progress, printer=printer)

    if not printing:
        return 0
    print()
    for c in res.completions:
        lines = "\n".join(describe(c, tok, cfg.eos_token_id, args.logprobs))
        if printer is None:  # the batch print: each completion's text, then its lines
            print(f"{label(c, args.n)} {texts[c.index]!r}")
            print(f"    -> {shown(c, tok, cfg.eos_token_id)[0]!r}")
            print(lines)
        else:  # streamed: the texts were printed; their lines follow, in the same order
            print(f"{label(c, args.n)} {lines.lstrip()}")
    print()
    print(format_stats(res, sum(len(p) for p in prompts), warmup_s, econf.spec_steps))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

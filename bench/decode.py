"""Decode and prefill throughput of the compiled serving steps on the bench model, against the
HBM roofline, the jnp path and HF transformers' Inkling, in one run.

    python bench/decode.py [--out FILE]   # GPU: InklingConfig.bench() trunk in bf16 (~5 min on an H200)
    python bench/decode.py --smoke        # tiny config, fp32, on CPU (jnp steps, HF on CPU; ~1 min)

Sections (each printed, and written to --out, as soon as it is done; progress lines carry
timestamps):

1. Setup: random weights (leaves of 1M+ elements drawn on the device with jax.random:
   `init_params` samples every number with numpy on the host, ~1 min for the bench model's
   2.64 B parameters even on a fast host), the device copy bandwidth (a jitted copy of a 2 GB
   array, read + write counted, as bench/kernels.py), one serving state (unit arena) sized for
   the largest batch and context, random contents, identity id tables (virtual == physical).
2. Compiles: every step shape the run uses, lowered one by one on the main thread, each
   compiled in a thread pool as soon as it is lowered (XLA compiles release the GIL): lower
   and compile seconds per shape, the wall time of all, and XLA's temp-buffer size and
   bytes-accessed estimate per step (a copy of the whole donated arena would show there).
3. Prefill: a 4k prompt in 1k chunks (extend steps with B=1, page bucket 4k) and 8 x 1k
   prompts in one extend step; tokens/s = prompt tokens / wall time of the steps (host batch
   building, transfers and the final token read included), median of 3 after a warm-up.
4. Correctness, before any decode timing: 8 prompts of (1k - N) random tokens, prefilled in
   one extend step and decoded greedily for N - 1 steps with a host loop as the engine runs
   it (numpy batch per step, tokens read back every step), once through the Pallas steps and
   once through the jnp steps from a copy of the same state: tokens, log-probs and the rows'
   state (conv windows, rings, pages) are compared. Row 0's prompt alone (B = 1 steps) too.
5. Decode: for every (B, L) the compiled decode step for that bucket runs with B requests
   whose new token sits at position L - 1 (it attends over L tokens: L/page_size pages, the
   engine's page bucket) on a state with random contents; the same positions are decoded
   again and again (each step rewrites the same K/V rows and shifts the conv windows, so it
   costs exactly a decode at context L), each step's sampled tokens fed to the next on the
   device. ms/step = median over N steps of dispatch -> block_until_ready (synchronous, as
   the engine's loop); pipelined = N steps dispatched back to back / N. Roofline = bytes that
   must move per step / copy bandwidth: weights actually read (B embedding rows; every
   attention / dense-MLP / norm / conv / router / unembed weight; the shared experts; routed
   experts at the expected number of distinct experts B tokens touch per MoE layer,
   E * (1 - (1 - k/E)^B), i.e. uniform independent routing), K/V read (full layers: L tokens;
   sliding layers: min(L, window)) and the new token's K/V write, conv windows read + written.
   Shapes in --jnp-decode are also timed through the jnp (non-Pallas) step.
6. HF transformers' InklingForCausalLM (torch, CUDA, bf16; its default attention and experts
   implementations, then the eager per-expert loop) with the same weights, mapped in memory
   (DLPack; fp32 where `from_pretrained` keeps fp32; every weight is bf16-exact so nothing is
   rounded differently; the smoke run checks the mapping against save_pretrained ->
   from_pretrained). Correctness: bf16 runs of a random MoE model diverge after near-ties
   (a flipped expert choice moves the hidden state a lot), so both ours and HF's greedy
   tokens are scored against an fp32 oracle (HF in float32, teacher-forced on each one's own
   tokens): picks equal to the oracle's argmax, the worst gap, |log p - oracle log p|; plus
   plain token agreement. Speed: greedy `generate` at batch 1 and 8 from the prompts of
   section 4; HF ms/step = (time(generate N) - time(generate 1)) / (N - 1); ours from section
   5 (steady-state step) and section 4 (host loop). A failure here prints a message and
   keeps the tables above.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n")[:2]))
    p.add_argument("--smoke", action="store_true", help="tiny config, fp32, on CPU (jnp steps; HF on CPU)")
    p.add_argument("--out", default="", help="also write the markdown tables to this file")
    p.add_argument("--batches", default="", help="decode batch sizes (default 1,8,32,128)")
    p.add_argument("--contexts", default="", help="decode contexts in tokens (default 1024,4096)")
    p.add_argument("--iters", type=int, default=0, help="timed decode steps per shape (default 100)")
    p.add_argument("--hf-new", type=int, default=0, help="tokens HF (and the correctness run) generate (default 24)")
    p.add_argument("--jnp-decode", default=None, help="BxL decode shapes also timed on the jnp path (default 8x1024)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers section")
    p.add_argument("--smoke-pallas", action="store_true",
                   help="smoke: also run the Pallas-vs-jnp decode check (interpret mode: slow to compile on a CPU)")
    p.add_argument("--workers", type=int, default=0, help="compile threads (default min(shapes, cpus))")
    p.add_argument("--budget", type=float, default=0,
                   help="seconds; HF speed runs are skipped past it, the eager-experts ones 120 s before (default 480)")
    p.add_argument("--cache-dir", default="", help="jax persistent compilation cache (compile times: cache hits)")
    p.add_argument("--trace", default="", help="write a jax profiler trace of a few decode steps per shape here")
    return p.parse_args(argv)


ARGS = parse_args()
if ARGS.smoke:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
if ARGS.cache_dir:
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", ARGS.cache_dir)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import inkling_jax as ik  # noqa: E402
from inkling_jax.cache.layout import ArenaLayout  # noqa: E402
from inkling_jax.cache.state import ServingState, page_rows, read_field, slot_rows  # noqa: E402
from inkling_jax.model.params import is_shape, leaf_dtype, param_shapes  # noqa: E402
from inkling_jax.steps import StepBatch, StepShape, check_batch, compile_lowered, compile_step  # noqa: E402

HEAD_STD = 0.2  # unembed std: logits O(1), so greedy picks are not near-ties in bf16


# ---------------------------------------------------------------------------- setup


@dataclass
class Setup:
    cfg: ik.InklingConfig
    dtype: object
    page_size: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    prefill_long: int  # one long prompt, prefilled in chunks
    prefill_chunk: int
    prefill_batch: int  # rows of the batched prefill (= the correctness / HF batch)
    hf_context: int  # context of the correctness / HF runs (prompt + new tokens)
    hf_new: int
    hf_batches: tuple[int, ...]
    iters: int
    warmup: int
    copy_elems: int
    interpret: bool
    jnp_decode: tuple[tuple[int, int], ...]
    budget: float
    smoke: bool
    main_pallas: bool  # the path of the timed steps (Pallas on GPU; jnp in the CPU smoke run)

    @property
    def pages_per_row(self) -> int:
        return max(max(self.contexts), self.prefill_long) // self.page_size


def make_setup(args) -> Setup:
    if args.smoke:
        cfg = ik.InklingConfig.tiny(num_mtp_layers=0, mtp_local_layer_ids=())
        # Pallas interpret mode compiles slowly on a CPU: the smoke run times the jnp steps and
        # runs Pallas (interpret) only in the Pallas-vs-jnp decode check
        s = Setup(cfg, jnp.float32, 4, (1, 2), (16,), prefill_long=32, prefill_chunk=8, prefill_batch=2,
                  hf_context=16, hf_new=6, hf_batches=(1, 2), iters=3, warmup=1, copy_elems=1 << 22,
                  interpret=True, jnp_decode=(), budget=600, smoke=True, main_pallas=False)
    else:
        cfg = ik.InklingConfig.bench(num_mtp_layers=0, mtp_local_layer_ids=())
        s = Setup(cfg, jnp.bfloat16, 64, (1, 8, 32, 128), (1024, 4096), prefill_long=4096, prefill_chunk=1024,
                  prefill_batch=8, hf_context=1024, hf_new=24, hf_batches=(1, 8), iters=100, warmup=3,
                  copy_elems=1 << 30, interpret=False, jnp_decode=((8, 1024),), budget=480, smoke=False,
                  main_pallas=True)
    if args.batches:
        s.batches = tuple(int(b) for b in args.batches.split(","))
    if args.contexts:
        s.contexts = tuple(int(c) for c in args.contexts.split(","))
    if args.iters:
        s.iters = args.iters
    if args.hf_new:
        s.hf_new = args.hf_new
    if args.jnp_decode is not None:
        s.jnp_decode = tuple(tuple(int(v) for v in x.split("x")) for x in args.jnp_decode.split(",") if x)
    if args.budget:
        s.budget = args.budget
    need = [(s.prefill_batch in s.batches, "prefill_batch must be one of the decode batches"),
            (s.hf_context in s.contexts, "the HF context must be one of the decode contexts"),
            (all(c % s.page_size == 0 for c in s.contexts + (s.prefill_long, s.prefill_chunk)), "page multiples"),
            (s.prefill_long % s.prefill_chunk == 0, "prefill_long must be a multiple of prefill_chunk"),
            (max(s.hf_batches) == s.prefill_batch and 1 in s.hf_batches, "hf batches: 1 and prefill_batch"),
            (all(b in s.batches and c in s.contexts for b, c in s.jnp_decode), "jnp shapes must be in the sweep")]
    for ok, msg in need:
        if not ok:
            raise SystemExit(f"bad setup: {msg}")
    return s


def device_params(cfg: ik.InklingConfig, seed: int, dtype, std: float = 0.02) -> dict:
    """Random params with init_params' distributions (norms and scales 1, router bias 0, conv
    taps N(0, 0.3), matrices N(0, std)) but the unembed at N(0, HEAD_STD). Leaves of 1M+
    elements are drawn on the device (one small jit per distinct shape), the rest with numpy.
    Every value is bf16-exact (fp32 leaves too), so HF's bf16 copies hold the same numbers."""
    import ml_dtypes

    paths, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(cfg), is_leaf=is_shape)
    keys = jax.random.split(jax.random.key(seed), len(paths))
    rng = np.random.default_rng(seed)
    makers: dict = {}

    def on_device(shape, dt, key, scale):
        k = (shape, jnp.dtype(dt).name)
        if k not in makers:
            makers[k] = jax.jit(lambda key, scale: (scale * jax.random.normal(key, shape, jnp.float32)).astype(
                jnp.bfloat16).astype(dt))
        return makers[k](key, jnp.float32(scale))

    leaves = []
    for (path, shape), key in zip(paths, keys):
        shape = tuple(shape)
        name = next((str(e.key) for e in reversed(path) if isinstance(e, jax.tree_util.DictKey)), "")
        dt = leaf_dtype(name, dtype)
        if name.endswith("norm") or name in ("global_scale", "router_scale"):
            leaves.append(jnp.ones(shape, dt))
        elif name == "router_bias":
            leaves.append(jnp.zeros(shape, dt))
        else:
            scale = 0.3 if name.endswith("conv") else HEAD_STD if name == "unembed" else std
            if math.prod(shape) >= 1 << 20:
                leaves.append(on_device(shape, dt, key, scale))
            else:
                x = (scale * rng.standard_normal(shape, np.float32)).astype(ml_dtypes.bfloat16).astype(np.float32)
                leaves.append(jnp.asarray(x, dt))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def copy_bandwidth(s: Setup) -> float:
    """Device copy bandwidth in bytes (read + write) per second (as bench/kernels.py)."""
    x = jnp.ones((s.copy_elems,), jnp.bfloat16)
    f = jax.jit(lambda a: a.copy())
    jax.block_until_ready(f(x))
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        times.append(time.perf_counter() - t0)
    bw = 2 * x.nbytes / statistics.median(times)
    del x
    return bw


@dataclass
class Arena:
    layout: ArenaLayout
    num_slots: int
    num_pages: int
    pages_per_row: int

    def slot(self, row: int) -> int:  # virtual slot of request row r (0 is the sink)
        return row + 1

    def pages(self, row: int, n: int) -> np.ndarray:  # virtual pages of row r covering n * page_size tokens
        return (1 + row * self.pages_per_row + np.arange(n)).astype(np.int32)


def make_state(s: Setup) -> tuple[Arena, ServingState]:
    """One state for every shape: slots 1..max(B), pages for max(B) rows of the longest
    context, identity id tables (virtual == physical), random contents (no NaN/inf)."""
    lay = ArenaLayout.build(s.cfg, s.page_size)
    rows = max(s.batches)
    ar = Arena(lay, rows, rows * s.pages_per_row, s.pages_per_row)
    num_units = (ar.num_slots + 1) * lay.slot_units + (ar.num_pages + 1) * lay.page_units

    @jax.jit
    def build(key):
        return jax.random.normal(key, (num_units, lay.unit_elems), jnp.float32).astype(s.dtype)

    state = ServingState(arena=build(jax.random.key(7)),
                         slot_v2p=jnp.arange(ar.num_slots + 1, dtype=jnp.int32),
                         page_v2p=jnp.arange(ar.num_pages + 1, dtype=jnp.int32))
    return ar, state


# ---------------------------------------------------------------------------- batches


def make_batch(s: Setup, shape: StepShape, rows: list[tuple[int, int, np.ndarray, np.ndarray]]) -> StepBatch:
    """A StepBatch (numpy) as Engine._build_batch packs one: rows = (virtual slot, seq_start,
    new tokens, virtual pages); padding tokens point at the last row past its new tokens;
    greedy, no checkpoints, no copy-on-write."""
    b, t, p = shape.batch, shape.tokens, shape.pages
    tokens = np.zeros(t, np.int32)
    token_row = np.full(t, b - 1, np.int32)
    token_offset = np.full(t, shape.query + s.cfg.conv_kernel_size, np.int32)
    slot, seq_start, num_new, query_start = (np.zeros(b, np.int32) for _ in range(4))
    has_state = np.zeros(b, bool)
    pages = np.zeros((b, p), np.int32)
    pos = 0
    for i, (sl, start, toks, pg) in enumerate(rows):
        n = len(toks)
        tokens[pos:pos + n] = toks
        token_row[pos:pos + n] = i
        token_offset[pos:pos + n] = np.arange(n)
        slot[i], has_state[i], seq_start[i], num_new[i], query_start[i] = sl, start > 0, start, n, pos
        pages[i, :len(pg)] = pg
        pos += n
    assert pos <= t and len(rows) <= b
    fill = dict(tokens=tokens, token_row=token_row, token_offset=token_offset, slot=slot, has_state=has_state,
                seq_start=seq_start, num_new=num_new, query_start=query_start, pages=pages)
    if hasattr(StepBatch, "empty"):  # newer steps.py: more (speculative) fields, an all-padding constructor
        batch = dataclasses.replace(StepBatch.empty(shape), **fill)
    else:
        z = lambda: np.zeros(b, np.int32)
        batch = StepBatch(**fill, track_slot=z(), track_len=z(), cow_src=z(), temperature=np.zeros(b, np.float32),
                          top_k=z(), top_p=np.ones(b, np.float32), seed=z())
    check_batch(batch, shape)
    return batch


def decode_shape(s: Setup, b: int, ctx: int) -> StepShape:
    return StepShape("decode", b, b, 1, ctx // s.page_size)


def extend_long_shape(s: Setup) -> StepShape:
    return StepShape("extend", 1, s.prefill_chunk, s.prefill_chunk, s.prefill_long // s.page_size)


def extend_batch_shape(s: Setup) -> StepShape:
    c = s.hf_context
    return StepShape("extend", s.prefill_batch, s.prefill_batch * c, c, c // s.page_size)


# ---------------------------------------------------------------------------- compiles


@dataclass
class Compiled:
    fn: object  # None when lowering or compiling failed (error says why)
    lower_s: float
    compile_s: float
    temp_bytes: float | None = None  # XLA's temp buffer size (a full arena copy would show here)
    xla_bytes: float | None = None  # XLA's cost-analysis estimate of bytes accessed
    error: str = ""


def compile_all(s: Setup, params, state, specs: list[tuple[StepShape, bool]], workers: int) -> dict:
    """{(shape, pallas): Compiled}: lowered one by one on this thread, each handed to a
    compile thread as soon as it is lowered (XLA compiles release the GIL)."""
    lay = ArenaLayout.build(s.cfg, s.page_size)

    def comp(key, low, lower_s):
        t0 = time.perf_counter()
        try:
            fn = compile_lowered(low)
        except Exception as exc:  # noqa: BLE001 - report; the sections needing it say so
            traceback.print_exc()
            log(f"  FAILED to compile {label(*key)}: {type(exc).__name__}: {exc}")
            return key, Compiled(None, lower_s, time.perf_counter() - t0, error=f"{type(exc).__name__}: {exc}"[:200])
        dt = time.perf_counter() - t0
        temp = xla = None
        try:
            temp = float(fn.memory_analysis().temp_size_in_bytes)
        except Exception:  # noqa: BLE001 - not every backend reports it
            pass
        try:
            ca = fn.cost_analysis()
            ca = ca[0] if isinstance(ca, (list, tuple)) else ca
            xla = float(ca.get("bytes accessed")) if ca and ca.get("bytes accessed") is not None else None
        except Exception:  # noqa: BLE001
            pass
        log(f"  compiled {label(*key)} in {dt:.1f}s")
        return key, Compiled(fn, lower_s, dt, temp, xla)

    futures = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        failed = []
        for shape, pallas in specs:
            t0 = time.perf_counter()
            try:
                jitted = compile_step(s.cfg, lay, shape, use_pallas=pallas, interpret=s.interpret and pallas)
                low = jitted.lower(params, state, make_batch(s, shape, []))
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                log(f"  FAILED to lower {label(shape, pallas)}: {type(exc).__name__}: {exc}")
                failed.append(((shape, pallas), Compiled(None, time.perf_counter() - t0, 0.0,
                                                          error=f"{type(exc).__name__}: {exc}"[:200])))
                continue
            dt = time.perf_counter() - t0
            log(f"  lowered {label(shape, pallas)} in {dt:.1f}s")
            futures.append(pool.submit(comp, (shape, pallas), low, dt))
        return dict([f.result() for f in futures] + failed)


def step_fn(compiled: dict, shape: StepShape, pallas: bool):
    c = compiled.get((shape, pallas))
    if c is None or c.fn is None:
        raise RuntimeError(f"{label(shape, pallas)} did not compile: {c.error if c else 'not requested'}")
    return c.fn


def label(shape: StepShape, pallas: bool) -> str:
    path = "Pallas" if pallas else "jnp"
    if shape.mode == "decode":
        return f"decode B={shape.batch} P={shape.pages} ({path})"
    return f"extend B={shape.batch} T={shape.tokens} Q={shape.query} P={shape.pages} ({path})"


# ---------------------------------------------------------------------------- runs


def sync(x):
    return jax.block_until_ready(x)


def prefill(s: Setup, fn, shape: StepShape, state, prompts: list[np.ndarray], first_row: int, ar: Arena):
    """Prefill prompts (rows first_row..) in chunks of shape.query through one extend shape.
    Returns (state, greedy next tokens [n], logprobs [n], seconds)."""
    n_chunks = math.ceil(max(len(p) for p in prompts) / shape.query)
    t0 = time.perf_counter()
    out = None
    for c in range(n_chunks):
        rows = []
        for i, p in enumerate(prompts):
            r = first_row + i
            chunk = p[c * shape.query:(c + 1) * shape.query]
            rows.append((ar.slot(r), c * shape.query, chunk, ar.pages(r, shape.pages)))
        batch = make_batch(s, shape, rows)
        out, state = fn(params_ref[0], state, batch)
    tokens, logprobs = jax.device_get((out.tokens, out.logprobs))
    dt = time.perf_counter() - t0
    return state, tokens[:len(prompts)], logprobs[:len(prompts)], dt


def greedy_decode(s: Setup, fn, shape: StepShape, state, prompt_lens: list[int], first: np.ndarray, steps: int,
                  ar: Arena):
    """Host loop (as the engine runs it): one numpy batch per step, tokens read back each step.
    Returns (state, tokens [n, steps + 1] incl. `first`, logprobs [n, steps], seconds per step)."""
    n = len(prompt_lens)
    toks = [np.asarray(first)]
    lps, times = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        rows = [(ar.slot(r), prompt_lens[r] + i, toks[-1][r:r + 1], ar.pages(r, shape.pages)) for r in range(n)]
        out, state = fn(params_ref[0], state, make_batch(s, shape, rows))
        t, lp = jax.device_get((out.tokens, out.logprobs))
        times.append(time.perf_counter() - t0)
        toks.append(t[:n])
        lps.append(lp[:n])
    return state, np.stack(toks, 1), np.stack(lps, 1) if lps else np.zeros((n, 0)), times


def time_decode(s: Setup, fn, shape: StepShape, state, ctx: int, ar: Arena, rng, trace_dir: str = ""):
    """Steady-state decode at position ctx - 1 for every row. Returns (state, median synced
    seconds per step, pipelined seconds per step)."""
    b = shape.batch
    rows = [(ar.slot(r), ctx - 1, rng.randint(3, s.cfg.unpadded_vocab_size, 1), ar.pages(r, shape.pages))
            for r in range(b)]
    batch = jax.device_put(make_batch(s, shape, rows))
    params = params_ref[0]
    for _ in range(s.warmup):
        out, state = fn(params, state, batch)
        batch = dataclasses.replace(batch, tokens=out.tokens)
    sync((out, state))
    times = []
    for _ in range(s.iters):
        t0 = time.perf_counter()
        out, state = fn(params, state, batch)
        sync((out, state))
        times.append(time.perf_counter() - t0)
        batch = dataclasses.replace(batch, tokens=out.tokens)
    t0 = time.perf_counter()
    for _ in range(s.iters):
        out, state = fn(params, state, batch)
        batch = dataclasses.replace(batch, tokens=out.tokens)
    sync((out, state))
    pipelined = (time.perf_counter() - t0) / s.iters
    if trace_dir:
        with jax.profiler.trace(os.path.join(trace_dir, f"decode_B{b}_L{ctx}")):
            for _ in range(5):
                out, state = fn(params, state, batch)
                batch = dataclasses.replace(batch, tokens=out.tokens)
            sync((out, state))
    return state, statistics.median(times), pipelined


params_ref: list = [None]  # the params (one global so the step helpers stay short)


# ---------------------------------------------------------------------------- roofline


def expected_experts(cfg: ik.InklingConfig, b: int) -> float:
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return e * (1.0 - (1.0 - k / e) ** b)


def decode_bytes(cfg: ik.InklingConfig, params, b: int, ctx: int) -> dict[str, float]:
    """Bytes one decode step must move (see the module docstring)."""
    item = jnp.dtype(params["unembed"].dtype).itemsize  # the arena's dtype
    h = cfg.hidden_size
    out = dict(weights=0.0, experts=0.0, kv=0.0, conv=0.0)
    frac = expected_experts(cfg, b) / cfg.n_routed_experts if cfg.has_moe else 0.0
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = [str(e.key) for e in path if isinstance(e, jax.tree_util.DictKey)]
        itemsize = jnp.dtype(x.dtype).itemsize
        nbytes = math.prod(x.shape) * itemsize
        if names[-1] == "embed":
            out["weights"] += min(b, x.shape[0]) * x.shape[1] * itemsize
        elif names[-2:] in (["mlp", "w13"], ["mlp", "w2"]) and x.ndim == 3:  # routed experts [E, ., .]
            out["experts"] += frac * nbytes
        else:
            out["weights"] += nbytes
    k1 = cfg.conv_kernel_size - 1
    for i in range(cfg.num_layers):
        g = cfg.layer_geometry(i)
        keys = ctx if g.window is None else min(ctx, g.window)
        out["kv"] += b * (keys + 1) * 2 * g.kv_dim * item  # read the context, write the new token
        out["conv"] += b * 2 * k1 * (2 * g.kv_dim + 2 * h) * item  # windows read + written
    out["total"] = sum(out.values())
    return out


def state_diff(ar: Arena, a, b, rows: int, n_pages: int) -> float:
    """Max |a - b| over the conv windows and sliding rings of rows 0..rows-1's slots and the
    full-attention K/V of their first n_pages pages (padding elements and sinks left out)."""
    lay = ar.layout
    slots = jnp.asarray([ar.slot(r) for r in range(rows)], jnp.int32)  # virtual == physical
    pages = jnp.asarray(np.concatenate([ar.pages(r, n_pages) for r in range(rows)]), jnp.int32)

    @jax.jit
    def diff(a, b):
        out = jnp.float32(0)
        d = lambda x, y: jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))
        for i, f in enumerate(lay.target):
            for fld in (f.conv, f.ring):
                if fld is not None:
                    r = slot_rows(lay, slots, fld)
                    out = jnp.maximum(out, d(read_field(a, lay, r, fld), read_field(b, lay, r, fld)))
            if lay.target_page_layer[i] is not None:
                pr = page_rows(lay, a.shape[0], pages, lay.target_page_layer[i])
                out = jnp.maximum(out, d(a[pr], b[pr]))
        return out

    return float(diff(a, b))


# ---------------------------------------------------------------------------- report


class Report:
    """Markdown sections, printed as they come and rewritten to `path` each time (a section
    added again under the same key replaces the earlier version)."""

    def __init__(self, path: str):
        self.path = path
        self.sections: dict[str, str] = {}

    def add(self, text: str, key: str | None = None) -> None:
        self.sections[key or f"_{len(self.sections)}"] = text.rstrip() + "\n"
        print("\n" + text.rstrip() + "\n", flush=True)
        if self.path:
            with open(self.path, "w") as f:
                f.write("\n".join(self.sections.values()))


def table(header: list[str], rows: list[list], align: str = "") -> str:
    align = align or "l" + "r" * (len(header) - 1)
    sep = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def agreement(a: np.ndarray, b: np.ndarray) -> tuple[str, str, str]:
    """(first-token matches, position-wise matches, mean common prefix) of [n, t] token arrays."""
    n, t = a.shape
    first = int((a[:, 0] == b[:, 0]).sum())
    same = int((a == b).sum())
    prefix = [int(np.argmin(np.append(a[r] == b[r], False))) for r in range(n)]
    return f"{first}/{n}", f"{same}/{n * t} ({100 * same / (n * t):.0f}%)", f"{np.mean(prefix):.1f} / {t}"


# ---------------------------------------------------------------------------- HF


def hf_text_config(cfg: ik.InklingConfig):
    from transformers.models.inkling import InklingTextConfig

    d = dict(cfg.to_hf()["text_config"])
    d.pop("model_type")
    return InklingTextConfig(**d)


def hf_state_dict(cfg: ik.InklingConfig, params, device) -> dict:
    """Our params as InklingForCausalLM tensors (transformers naming; see weights.py), built in
    memory with torch (DLPack from the device arrays where it works, else through the host)."""
    import torch

    def T(x):
        try:
            t = torch.from_dlpack(x)
        except Exception:  # noqa: BLE001 - any DLPack problem: go through the host
            a = np.asarray(jax.device_get(x))
            t = torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16) if a.dtype == jnp.bfloat16 else \
                torch.from_numpy(np.ascontiguousarray(a))
        return t.to(device)

    def conv(x):  # [K, D] -> [D, 1, K]
        return T(x).t().unsqueeze(1)

    sd = {"model.embed_tokens.weight": T(params["embed"]), "model.norm.weight": T(params["final_norm"]),
          "lm_head.weight": T(params["unembed"]).t()}
    if cfg.use_embed_norm:
        sd["model.embed_tokens.embed_norm.weight"] = T(params["embed_norm"])
    for i, p in enumerate(params["layers"]):
        g = cfg.layer_geometry(i)
        pre = f"model.layers.{i}."
        sa = pre + "self_attn."
        a = p["attn"]
        sd[pre + "input_layernorm.weight"] = T(p["attn_norm"])
        sd[pre + "post_attention_layernorm.weight"] = T(p["mlp_norm"])
        sd[pre + "attn_sconv.conv1d.weight"] = conv(p["attn_conv"])
        sd[pre + "mlp_sconv.conv1d.weight"] = conv(p["mlp_conv"])
        parts = torch.split(T(a["wqkvr"]), [g.q_dim, g.kv_dim, g.kv_dim, g.num_heads * cfg.d_rel], dim=1)
        for name, w in zip(("q_proj", "k_proj", "v_proj", "r_proj"), parts):
            sd[sa + name + ".weight"] = w.t()
        sd[sa + "o_proj.weight"] = T(a["wo"]).t()
        sd[sa + "q_norm.weight"] = T(a["q_norm"])
        sd[sa + "k_norm.weight"] = T(a["k_norm"])
        sd[sa + "k_sconv.conv1d.weight"] = conv(a["k_conv"])
        sd[sa + "v_sconv.conv1d.weight"] = conv(a["v_conv"])
        sd[sa + "rel_logits_proj.proj"] = T(a["rel_proj"])
        m, mp = p["mlp"], pre + "mlp."
        if cfg.is_dense(i):
            w13, half = T(m["w13"]), cfg.dense_intermediate_size
            sd[mp + "gate_proj.weight"] = w13[:, :half].t()
            sd[mp + "up_proj.weight"] = w13[:, half:].t()
            sd[mp + "down_proj.weight"] = T(m["w2"]).t()
            if "global_scale" in m:
                sd[mp + "global_scale"] = T(m["global_scale"])
            continue
        if not (cfg.shared_expert_sink and cfg.norm_after_topk and cfg.n_shared_experts):
            raise NotImplementedError("HF mapping written for the sink-shared-expert layout only")
        f = cfg.expert_intermediate_size
        sd[mp + "gate.weight"] = T(m["router"]).t()
        sd[mp + "gate.e_score_correction_bias"] = T(m["router_bias"])
        sd[mp + "gate.global_scale"] = T(m["router_scale"])
        sd[mp + "experts.gate_up_proj"] = T(m["w13"]).transpose(1, 2)
        sd[mp + "experts.down_proj"] = T(m["w2"]).transpose(1, 2)
        sw13 = T(m["shared_w13"])
        sd[mp + "shared_experts.gate_proj"] = sw13[..., :f].transpose(1, 2)
        sd[mp + "shared_experts.up_proj"] = sw13[..., f:].transpose(1, 2)
        sd[mp + "shared_experts.down_proj"] = T(m["shared_w2"]).transpose(1, 2)
    return sd


def build_hf_model(cfg: ik.InklingConfig, params, torch_dtype, device):
    """InklingForCausalLM with our weights: built on the meta device, tensors assigned, dtypes
    as from_pretrained(dtype=torch_dtype) gives them (its keep-in-fp32 modules fp32)."""
    import re

    import torch
    from transformers.models.inkling import InklingForCausalLM

    with torch.device("meta"):
        model = InklingForCausalLM(hf_text_config(cfg))
    keep32 = list(getattr(model, "_keep_in_fp32_modules_strict", None) or []) + \
        list(getattr(model, "_keep_in_fp32_modules", None) or [])
    keep = re.compile("|".join(re.escape(k) for k in keep32)) if keep32 else None
    expected = model.state_dict()
    sd = hf_state_dict(cfg, params, device)
    missing, extra = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
    bad = [f"{k}: {tuple(sd[k].shape)} vs {tuple(expected[k].shape)}" for k in sd
           if k in expected and tuple(sd[k].shape) != tuple(expected[k].shape)]
    if missing or extra or bad:
        raise ValueError(f"HF state dict mismatch: missing {missing[:5]}, unexpected {extra[:5]}, shapes {bad[:5]}")
    for k in sd:
        dt = torch.float32 if keep is not None and keep.search(k) else torch_dtype
        sd[k] = sd[k].to(dtype=dt).contiguous().clone()
    model.load_state_dict(sd, strict=True, assign=True)
    left = [n for n, x in list(model.named_parameters()) + list(model.named_buffers()) if x.is_meta]
    if left:
        raise ValueError(f"HF model tensors left on the meta device: {left[:5]}")
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.generation_config.pad_token_id = 0
    return model.eval()


def hf_generate(model, prompts: np.ndarray, n: int, device, logits: bool = False):
    """Greedy generate of n tokens: (new tokens [B, n], seconds[, log p of each under the model])."""
    import torch

    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    kw = dict(return_dict_in_generate=True, output_logits=True) if logits else {}
    with torch.no_grad():
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             **kw)
        if device != "cpu":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    seq = out.sequences if logits else out
    new = seq[:, prompts.shape[1]:]
    if not logits:
        return new.cpu().numpy(), dt
    lp = torch.log_softmax(torch.stack(out.logits, 1).float(), -1)
    return new.cpu().numpy(), dt, lp.gather(-1, new[:, :lp.shape[1], None])[..., 0].cpu().numpy()


def oracle_scores(oracle, prompts: np.ndarray, new: np.ndarray, device) -> dict:
    """Teacher-forced fp32 oracle over prompt ++ new tokens: per new token its log p, the
    best log p at that position and whether it is the oracle's argmax."""
    import torch

    seq = np.concatenate([prompts, new], 1)
    ids = torch.tensor(seq[:, :-1], dtype=torch.long, device=device)
    with torch.no_grad():
        logits = oracle(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=new.shape[1]).logits
        lp = torch.log_softmax(logits.float(), -1)
        chosen = lp.gather(-1, torch.tensor(new, dtype=torch.long, device=device)[..., None])[..., 0]
        best, arg = lp.max(-1)
    return dict(lp=chosen.cpu().numpy(), best=best.cpu().numpy(), argmax=arg.cpu().numpy())


def accuracy_row(who: str, new: np.ndarray, own_lp: np.ndarray | None, o: dict) -> list:
    gap = o["best"] - o["lp"]
    top = int((new == o["argmax"]).sum())
    d = np.abs(own_lp - o["lp"]) if own_lp is not None else None
    return [who, f"{top}/{new.size}", f"{gap.max():.3f}", f"{np.median(d):.4f}" if d is not None else "",
            f"{d.max():.3f}" if d is not None else ""]


def hf_section(s: Setup, params, prompts: np.ndarray, ours: dict, decode_rows: dict, report: Report) -> None:
    import torch
    import transformers

    device = "cuda" if (torch.cuda.is_available() and not s.smoke) else "cpu"
    torch_dtype = {jnp.dtype(jnp.bfloat16): torch.bfloat16, jnp.dtype(jnp.float32): torch.float32}[jnp.dtype(s.dtype)]
    log(f"HF: torch {torch.__version__}, transformers {transformers.__version__} "
        f"({os.path.dirname(transformers.__file__)}), device {device}")
    n = s.hf_new
    pb = s.prefill_batch

    # the fp32 oracle (HF, fp32 copies of the same bf16-exact weights), teacher-forced
    acc_rows, agree_rows = [], []
    t0 = time.perf_counter()
    try:
        oracle = build_hf_model(s.cfg, params, torch.float32, device)
        log(f"HF fp32 oracle built in {time.perf_counter() - t0:.1f}s")
        for b in (pb, 1):
            if f"tokens_B{b}" in ours:
                o = oracle_scores(oracle, prompts[:b], ours[f"tokens_B{b}"], device)
                acc_rows.append(accuracy_row(f"ours ({ours['path']} steps, {jnp.dtype(s.dtype).name}), B={b}",
                                             ours[f"tokens_B{b}"], ours.get(f"logprobs_B{b}"), o))
    except Exception as exc:  # noqa: BLE001 - the speed comparison can still run
        traceback.print_exc()
        oracle = None
        acc_rows.append([f"fp32 oracle FAILED: {type(exc).__name__}: {exc}"[:200], "", "", "", ""])

    t0 = time.perf_counter()
    model = build_hf_model(s.cfg, params, torch_dtype, device)
    log(f"HF model built in {time.perf_counter() - t0:.1f}s: attention {model.config._attn_implementation}, "
        f"experts {model.config._experts_implementation}")
    if s.smoke:  # cross-check the in-memory mapping against save_pretrained -> from_pretrained
        import tempfile

        from transformers.models.inkling import InklingForCausalLM

        with tempfile.TemporaryDirectory() as d:
            ik.save_pretrained(d, s.cfg, params, naming="transformers")
            ref = InklingForCausalLM.from_pretrained(d, dtype=torch_dtype)
        ref_sd, got_sd = ref.state_dict(), model.state_dict()
        diff = [k for k in ref_sd if not torch.equal(ref_sd[k].to(got_sd[k].dtype), got_sd[k].cpu())]
        log(f"HF mapping vs save_pretrained/from_pretrained: {'identical' if not diff else f'DIFFER: {diff[:5]}'}")
    hf_generate(model, prompts[:1, :16], 2, device)  # warm-up
    for b in (pb, 1):
        toks, _, lp = hf_generate(model, prompts[:b], n, device, logits=True)
        if oracle is not None:
            o = oracle_scores(oracle, prompts[:b], toks, device)
            acc_rows.append(accuracy_row(f"HF ({model.config._experts_implementation}, {torch_dtype}), B={b}",
                                         toks, lp, o))
        ref = ours.get(f"tokens_B{b}")
        if ref is not None:
            m = min(toks.shape[1], ref.shape[1])
            agree_rows.append([f"ours ({ours['path']} steps) vs HF generate, B={b}",
                               *agreement(ref[:, :m], toks[:, :m])])
    del oracle
    if device != "cpu":
        torch.cuda.empty_cache()
    accuracy = (f"Accuracy against an fp32 oracle (HF InklingForCausalLM in float32 with the same weights, teacher-"
                f"forced on each implementation's own greedy tokens; {jnp.dtype(s.dtype).name} implementations "
                "diverge from each other after a near-tie, so each is scored against the oracle along its own "
                "sequence): picks equal to the oracle's argmax; the worst oracle log-prob gap between the best token "
                "and a pick (a near-tie is a small gap); |log p(pick) under the implementation - under the "
                "oracle|.\n\n"
                + table(["implementation", "picks = oracle argmax", "max oracle gap (nats)", "median |dlogp|",
                         "max |dlogp|"], acc_rows, "lrrrr")
                + "\n\nGreedy token agreement, ours vs HF (same prompts):\n\n"
                + table(["", "first token", "tokens equal", "mean common prefix"], agree_rows, "lrrr"))
    report.add(f"### HF transformers: correctness\n\n{accuracy}", key="hf_acc")

    impls = [model.config._experts_implementation]
    if impls[0] != "eager" and not s.smoke:
        impls.append("eager")  # the per-expert loop, for reference
    rows = []
    for impl in impls:
        if time.perf_counter() - _T0 > s.budget - 120 and impl != impls[0]:
            log(f"HF: skipping experts={impl} (too close to the {s.budget:.0f}s budget)")
            break
        if impl != model.config._experts_implementation:
            model.set_experts_implementation(impl)
        hf_generate(model, prompts[:1, :16], 2, device)
        for b in sorted(s.hf_batches, reverse=True):
            if time.perf_counter() - _T0 > s.budget:
                log(f"HF: skipping experts={impl} B={b} (past the {s.budget:.0f}s budget)")
                continue
            p = prompts[:b]
            hf_generate(model, p, 2, device)  # warm-up at this batch size
            t1 = min(hf_generate(model, p, 1, device)[1] for _ in range(2))
            tn = min(hf_generate(model, p, n, device)[1] for _ in range(2))
            dec = (tn - t1) / (n - 1)
            hf_tps = b / dec
            log(f"HF experts={impl} B={b}: generate 1 tok {t1:.2f}s, {n} tok {tn:.2f}s -> {1e3 * dec:.2f} ms/step, "
                f"{hf_tps:.0f} tok/s")
            ours_step = decode_rows.get((b, s.hf_context))
            loop = ours.get(f"loop_ms_B{b}")
            rows.append([impl, b, s.hf_context, f"{1e3 * dec:.2f}", f"{hf_tps:.0f}",
                         f"{b / ours_step:.0f}" if ours_step else "",
                         f"{b / ours_step / hf_tps:.1f}x" if ours_step else "",
                         f"{1e3 * b / loop:.0f}" if loop else "", f"{1e3 * b / loop / hf_tps:.1f}x" if loop else ""])
        report.add(f"### HF transformers (torch {torch.__version__}, {device}, {torch_dtype}, attention "
                   f"{model.config._attn_implementation}) vs ours: greedy decode, {s.hf_context - n}-token prompts "
                   f"+ {n} new tokens\n\n"
                   "HF ms/step = (generate(N) - generate(1)) / (N - 1), best of 2 each; ours step = the steady-state "
                   "compiled decode step at the same B and L (decode table, synced median); ours loop = the host loop "
                   "of the correctness run (numpy batch + token read-back every step, as the engine).\n\n"
                   + table(["HF experts impl", "B", "L", "HF ms/step", "HF tok/s", "ours step tok/s", "speedup",
                            "ours loop tok/s", "speedup (loop)"], rows, "lrrrrrrrr"), key="hf_speed")


# ---------------------------------------------------------------------------- main


def main() -> int:
    s = make_setup(ARGS)
    report = Report(ARGS.out)
    cfg = s.cfg
    dev = jax.devices()[0]
    if not s.smoke and jax.default_backend() != "gpu":
        print(f"backend is {jax.default_backend()!r}: run on a GPU, or pass --smoke", file=sys.stderr)
        return 2
    log(f"jax {jax.__version__}, {jax.default_backend()} {dev.device_kind}; config "
        f"{'tiny' if s.smoke else 'bench'}, {jnp.dtype(s.dtype).name}")

    # 1. setup
    t0 = time.perf_counter()
    params = device_params(cfg, 0, s.dtype)
    sync(params)
    params_ref[0] = params
    t_params = time.perf_counter() - t0
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    p_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
    log(f"params: {n_params / 1e9:.3f} B ({p_bytes / 1e9:.2f} GB) drawn on the device in {t_params:.1f}s")
    bw = copy_bandwidth(s)
    log(f"copy bandwidth: {bw / 1e9:.0f} GB/s (read + write)")
    ar, state = make_state(s)
    sync(state)
    lay = ar.layout
    log(f"arena: {state.arena.shape[0]} units x {lay.unit_elems} ({state.arena.nbytes / 1e9:.2f} GB); "
        f"{lay.describe()}; {ar.num_slots} slots, {ar.num_pages} pages")
    report.add(f"## Decode benchmark (`bench/decode.py{' --smoke' if s.smoke else ''}`)\n\n"
               f"- Device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}.\n"
               f"- Model: `InklingConfig.{'tiny' if s.smoke else 'bench'}()` trunk (no MTP), {cfg.num_layers} layers "
               f"({len(cfg.full_layer_ids)} full, {len(cfg.local_layer_ids)} sliding, window {cfg.sliding_window}), "
               f"hidden {cfg.hidden_size}, {cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok} + "
               f"{cfg.n_shared_experts} shared; {n_params / 1e9:.3f} B params, {p_bytes / 1e9:.2f} GB in "
               f"{jnp.dtype(s.dtype).name} (random, drawn on the device in {t_params:.1f}s).\n"
               f"- Copy bandwidth: {bw / 1e9:.0f} GB/s (read + write).\n"
               f"- State: one arena of {state.arena.nbytes / 1e9:.2f} GB ({lay.describe()}), page size "
               f"{s.page_size}; timed steps use the {'Pallas' if s.main_pallas else 'jnp'} conv-state ops"
               f"{' (smoke: Pallas, in interpret mode, only in the Pallas-vs-jnp decode check)' if s.smoke else ''}.")

    # 2. compiles
    main_p = s.main_pallas
    e1, e8 = extend_long_shape(s), extend_batch_shape(s)
    d_check = decode_shape(s, s.prefill_batch, s.hf_context)
    # the correctness check: path A (prefill, decode) vs path B (jnp, jnp)
    check_a = ((e8, main_p), (d_check, True if not s.smoke or ARGS.smoke_pallas else main_p))
    check_b = ((e8, False), (d_check, False))
    specs = [(e8, main_p), (e1, main_p)] + [(decode_shape(s, b, c), main_p) for c in s.contexts for b in s.batches]
    specs += [check_a[1], *check_b] + [(decode_shape(s, b, c), False) for b, c in s.jnp_decode]
    specs = list(dict.fromkeys(specs))
    workers = ARGS.workers or max(1, min(len(specs), os.cpu_count() or 1))
    t0 = time.perf_counter()
    compiled = compile_all(s, params, state, specs, workers)
    wall = time.perf_counter() - t0
    mb = lambda x: f"{x / 1e6:.0f}" if x is not None else "n/a"
    report.add(f"### Compiles ({len(specs)} step shapes, lowered one by one, each compiled in a pool of {workers} "
               f"threads as soon as lowered: {wall:.1f}s wall"
               + (f"; persistent compilation cache {ARGS.cache_dir}: compile times may be cache hits" if ARGS.cache_dir
                  else "") + ")\n\n"
               "compile s is measured while other shapes compile too. XLA temp MB: the compiled step's scratch "
               "buffers (a copy of the whole donated arena would show up here); XLA MB accessed: its cost-analysis "
               "estimate of bytes read + written per step.\n\n"
               + table(["step", "lower s", "compile s", "XLA temp MB", "XLA MB accessed"],
                       [[label(*k) + (f" FAILED: {c.error}" if c.error else ""), f"{c.lower_s:.1f}",
                         f"{c.compile_s:.1f}", mb(c.temp_bytes), mb(c.xla_bytes)] for k, c in compiled.items()]))

    rng = np.random.RandomState(0)
    vocab = cfg.unpadded_vocab_size
    path = "Pallas" if main_p else "jnp"

    # 3. prefill
    rows = []
    for shape, n_rows, length in ((e1, 1, s.prefill_long), (e8, s.prefill_batch, s.hf_context)):
        prompts = [rng.randint(3, vocab, length) for _ in range(n_rows)]
        try:
            fn = step_fn(compiled, shape, main_p)
            times = []
            for rep in range(4):
                state, _, _, dt = prefill(s, fn, shape, state, prompts, 0, ar)
                if rep:
                    times.append(dt)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            rows.append([f"{n_rows} x {length}", f"ERROR {type(exc).__name__}: {exc}"[:160], "", "", ""])
            continue
        dt = statistics.median(times)
        tokens = n_rows * length
        log(f"prefill {n_rows} x {length}: {dt * 1e3:.1f} ms, {tokens / dt:.0f} tok/s")
        rows.append([f"{n_rows} x {length}", label(shape, main_p), math.ceil(length / shape.query),
                     f"{dt * 1e3:.1f}", f"{tokens / dt:.0f}"])
    report.add(f"### Prefill (extend steps, {path}; wall time incl. host batch building and the final read, median "
               "of 3 after a warm-up; every chunk of the long prompt attends over the shape's full page bucket)\n\n"
               + table(["prompts", "step", "steps", "ms", "tok/s"], rows))

    # 4. correctness: path A vs jnp, B = prefill_batch; B = 1 (tokens kept for HF)
    ours: dict = {"path": path}
    steps = s.hf_new - 1
    plen = s.hf_context - s.hf_new
    hf_prompts = rng.randint(3, vocab, (s.prefill_batch, plen)).astype(np.int64)
    lens = [plen] * s.prefill_batch
    check_rows = []
    pb = s.prefill_batch
    try:
        compare = check_a != check_b
        state_b = jax.tree_util.tree_map(lambda x: x.copy(), state) if compare else None
        res = {}
        for name, ((es, ep), (ds, dp)) in (("a", check_a), ("b", check_b))[:2 if compare else 1]:
            st = state if name == "a" else state_b
            st, first, lp0, _ = prefill(s, step_fn(compiled, es, ep), es, st, list(hf_prompts), 0, ar)
            st, toks, lps, times = greedy_decode(s, step_fn(compiled, ds, dp), ds, st, lens, first, steps, ar)
            res[name] = (toks, np.concatenate([lp0[:, None], lps], 1), st, times)
            if name == "a":
                state = st
            else:
                state_b = st
        ta, lpa, sta, times_a = res["a"]
        ours[f"tokens_B{pb}"] = ta
        ours[f"logprobs_B{pb}"] = lpa
        ours[f"loop_ms_B{pb}"] = 1e3 * statistics.median(times_a)
        if compare:
            tb, lpb, stb, times_b = res["b"]
            diff = state_diff(ar, sta.arena, stb.arena, pb, s.hf_context // s.page_size)
            del state_b, stb
            what = ("prefill + " if check_a[0][1] != check_b[0][1] else "") + f"{steps} decode steps"
            check_rows.append([f"Pallas vs jnp steps, B={pb} ({what})", *agreement(ta, tb),
                               f"{np.max(np.abs(lpa - lpb)):.2e}", f"{diff:.2e}"])
            log(f"Pallas vs jnp ({what}): tokens {agreement(ta, tb)}, max |dlogprob| "
                f"{np.max(np.abs(lpa - lpb)):.2e}, state max |diff| {diff:.2e}; host loop "
                f"{ours[f'loop_ms_B{pb}']:.2f} ms/step (Pallas), {1e3 * statistics.median(times_b):.2f} (jnp)")
        else:
            check_rows.append(["Pallas vs jnp: skipped (smoke run without --smoke-pallas)", "", "", "", "", ""])
        del res
        # B = 1: row 0's prompt alone (long-prefill shape, B=1 decode steps)
        d1 = decode_shape(s, 1, s.hf_context)
        state, first, lp0, _ = prefill(s, step_fn(compiled, e1, main_p), e1, state, [hf_prompts[0]], 0, ar)
        state, t1, lp1, times1 = greedy_decode(s, step_fn(compiled, d1, main_p), d1, state, lens[:1], first, steps, ar)
        ours["tokens_B1"] = t1
        ours["logprobs_B1"] = np.concatenate([lp0[:, None], lp1], 1)
        ours["loop_ms_B1"] = 1e3 * statistics.median(times1)
        check_rows.append([f"B=1 vs B={pb} steps, row 0 ({path})", *agreement(t1, ta[:1]), "", ""])
        log(f"B=1 vs B={pb}, row 0: {agreement(t1, ta[:1])}; host loop {ours['loop_ms_B1']:.2f} ms/step")
    except Exception as exc:  # noqa: BLE001 - report and carry on to the timings
        traceback.print_exc()
        check_rows.append([f"ERROR {type(exc).__name__}: {exc}"[:200], "", "", "", "", ""])
    report.add(f"### Correctness ({plen}-token random prompts, greedy, {s.hf_new} tokens; accuracy against an fp32 "
               "oracle and agreement with HF in the HF section)\n\nstate max abs diff: conv windows and sliding "
               "rings of the rows' slots and their full-attention pages, after the last step.\n\n"
               + table(["check", "first token", "tokens equal", "mean common prefix", "max abs dlogprob",
                        "state max abs diff"], check_rows, "lrrrrr"))

    # 5. decode sweep
    decode_rows: dict = {}
    jnp_set = set(s.jnp_decode)
    header = ["B", "L", "ms/step", "pipelined ms/step", "tok/s", "MB/step (weights + experts + KV + conv)",
              "roofline ms", "% roofline", "% roofline (pipelined)", "jnp ms/step", "Pallas speedup"]
    rows = []
    intro = (f"### Decode (compiled decode step, {path}; steady state at context L; ms/step = median of {s.iters} "
             f"synced steps, pipelined = {s.iters} back-to-back steps / {s.iters}; tok/s = B / ms/step; roofline = "
             f"bytes below / {bw / 1e9:.0f} GB/s; routed experts at the expected distinct count E(1-(1-k/E)^B))\n\n")
    for c in s.contexts:
        for b in s.batches:
            shape = decode_shape(s, b, c)
            try:
                state, t_sync, t_pipe = time_decode(s, step_fn(compiled, shape, main_p), shape, state, c, ar, rng,
                                                    ARGS.trace)
                decode_rows[(b, c)] = t_sync
                t_jnp = None
                if (b, c) in jnp_set and main_p:
                    state, t_jnp, _ = time_decode(s, step_fn(compiled, shape, False), shape, state, c, ar, rng)
                by = decode_bytes(cfg, params, b, c)
                roof = by["total"] / bw
                rows.append([b, c, f"{t_sync * 1e3:.3f}", f"{t_pipe * 1e3:.3f}", f"{b / t_sync:.0f}",
                             f"{by['total'] / 1e6:.0f} ({by['weights'] / 1e6:.0f} + {by['experts'] / 1e6:.0f} + "
                             f"{by['kv'] / 1e6:.0f} + {by['conv'] / 1e6:.1f})",
                             f"{roof * 1e3:.3f}", f"{100 * roof / t_sync:.1f}%", f"{100 * roof / t_pipe:.1f}%",
                             f"{t_jnp * 1e3:.3f}" if t_jnp else "", f"{t_jnp / t_sync:.2f}x" if t_jnp else ""])
                log(f"decode B={b} L={c}: {t_sync * 1e3:.3f} ms/step (pipelined {t_pipe * 1e3:.3f}), "
                    f"{b / t_sync:.0f} tok/s, roofline {roof * 1e3:.3f} ms ({100 * roof / t_sync:.1f}%)"
                    + (f"; jnp {t_jnp * 1e3:.3f} ms" if t_jnp else ""))
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                rows.append([b, c, f"ERROR {type(exc).__name__}: {exc}"[:160]] + [""] * (len(header) - 3))
            if ARGS.out:  # partial table, in case the run is cut short
                with open(ARGS.out + ".partial", "w") as f:
                    f.write(intro + table(header, rows) + "\n")
    dist = ", ".join(f"B={b}: {expected_experts(cfg, b):.1f}" for b in s.batches)
    report.add(intro + table(header, rows) + f"\n\nExpected distinct routed experts per MoE layer "
               f"({cfg.n_routed_experts} experts, top-{cfg.num_experts_per_tok}): {dist}.")
    if ARGS.out and os.path.exists(ARGS.out + ".partial"):
        os.remove(ARGS.out + ".partial")

    # 6. HF
    if ARGS.no_hf:
        log("HF section skipped (--no-hf)")
    else:
        try:
            hf_section(s, params, hf_prompts, ours, decode_rows, report)
        except Exception as exc:  # noqa: BLE001 - keep our tables
            traceback.print_exc()
            report.add(f"### HF transformers: FAILED ({type(exc).__name__}: {str(exc)[:300]})")
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())

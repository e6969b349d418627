"""Decode and prefill throughput of the compiled serving steps on the bench model, against the
HBM roofline, the jnp path and HF transformers' Inkling, in one run.

    python -m bench.decode.decode [--out FILE]  # GPU: InklingConfig.bench() trunk in bf16 (~5 min on an H200)
    python -m bench.decode.decode --smoke       # tiny config, fp32, on CPU (jnp steps, HF on CPU; ~1 min)

Sections (each printed, and written to --out, as soon as it is done; progress lines carry
timestamps; one function each below, over bench.decode.setup (sizes, state, shapes,
compiles), bench.decode.runs (step runs, roofline, comparisons) and bench.decode.hf (section
6)):

1. Setup: random weights (leaves of 1M+ elements drawn on the device with jax.random:
   `init_params` samples every number with numpy on the host, ~1 min for the bench model's
   2.64 B parameters even on a fast host), the device copy bandwidth (a jitted copy of a 2 GB
   array, read + write counted, as bench.kernels.kernels), one serving state (unit arena) sized
   for the largest batch and context, random contents, identity id tables (virtual == physical).
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
   implementations, then the eager per-expert loop) with the same weights, built in memory by
   `inkling_jax.hf_transformers.causal_lm` (the mapping the parity tests check; fp32 where
   `from_pretrained` keeps fp32; every weight is bf16-exact so nothing is rounded
   differently; the smoke run checks it against save_pretrained -> from_pretrained).
   Correctness: bf16 runs of a random MoE model diverge after near-ties (a flipped expert
   choice moves the hidden state a lot), so both ours and HF's greedy tokens are scored
   against an fp32 oracle (HF in float32, teacher-forced on each one's own tokens): picks
   equal to the oracle's argmax, the worst gap, |log p - oracle log p|; plus plain token
   agreement. Speed: greedy `generate` at batch 1 and 8 from the prompts of
   section 4; HF ms/step = (time(generate N) - time(generate 1)) / (N - 1); ours from section
   5 (steady-state step) and section 4 (host loop). A failure here prints a message and
   keeps the tables above.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from inkling_jax.cache.state import ServingState
from inkling_jax.steps import StepShape

from bench.common.helpers import Report, copy_bandwidth, device_params, log, table
from bench.decode.hf import hf_section
from bench.decode.runs import (agreement, decode_bytes, expected_experts, greedy_decode, prefill, state_diff,
                               time_decode)
from bench.decode.setup import (RowIds, Setup, apply_jax_options, compile_all, compiled_step, decode_shape,
                                extend_batch_shape, extend_long_shape, label, make_setup, make_state, parse_args)


@dataclass
class Run:
    """One run's setup, device objects and the results later sections read."""

    args: object
    s: Setup
    report: Report
    params: dict = None
    ids: RowIds = None
    state: ServingState = None
    bandwidth: float = 0.0  # bytes (read + write) per second
    compiled: dict = field(default_factory=dict)  # {(shape, pallas): Compiled}
    rng: np.random.RandomState = field(default_factory=lambda: np.random.RandomState(0))
    ours: dict = field(default_factory=dict)  # tokens / logprobs / host-loop ms of the correctness run
    hf_prompts: np.ndarray = None  # [prefill_batch, prompt length]
    decode_rows: dict = field(default_factory=dict)  # (B, L) -> synced seconds per decode step

    def step(self, shape: StepShape, pallas: bool):
        return compiled_step(self.compiled, shape, pallas)


def section_setup(run: Run) -> None:
    """1. Params on the device, copy bandwidth, the state."""
    s, cfg = run.s, run.s.cfg
    t0 = time.perf_counter()
    run.params = device_params(cfg, 0, s.dtype)
    jax.block_until_ready(run.params)
    t_params = time.perf_counter() - t0
    leaves = jax.tree_util.tree_leaves(run.params)
    n_params = sum(x.size for x in leaves)
    p_bytes = sum(x.size * x.dtype.itemsize for x in leaves)
    log(f"params: {n_params / 1e9:.3f} B ({p_bytes / 1e9:.2f} GB) drawn on the device in {t_params:.1f}s")
    run.bandwidth = bw = copy_bandwidth(s.copy_elems, jnp.bfloat16)
    log(f"copy bandwidth: {bw / 1e9:.0f} GB/s (read + write)")
    run.ids, run.state = make_state(s)
    jax.block_until_ready(run.state)
    lay, arena = run.ids.layout, run.state.arena
    log(f"arena: {arena.shape[0]} units x {lay.unit_elems} ({arena.nbytes / 1e9:.2f} GB); "
        f"{lay.describe()}; {run.ids.num_slots} slots, {run.ids.num_pages} pages")
    dev = jax.devices()[0]
    run.report.add(
        f"## Decode benchmark (`python -m bench.decode.decode{' --smoke' if s.smoke else ''}`)\n\n"
        f"- Device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}.\n"
        f"- Model: `InklingConfig.{'tiny' if s.smoke else 'bench'}()` trunk (no MTP), {cfg.num_layers} layers "
        f"({len(cfg.full_layer_ids)} full, {len(cfg.local_layer_ids)} sliding, window {cfg.sliding_window}), "
        f"hidden {cfg.hidden_size}, {cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok} + "
        f"{cfg.n_shared_experts} shared; {n_params / 1e9:.3f} B params, {p_bytes / 1e9:.2f} GB in "
        f"{jnp.dtype(s.dtype).name} (random, drawn on the device in {t_params:.1f}s).\n"
        f"- Copy bandwidth: {bw / 1e9:.0f} GB/s (read + write).\n"
        f"- State: one arena of {arena.nbytes / 1e9:.2f} GB ({lay.describe()}), page size "
        f"{s.page_size}; timed steps use the {s.path} conv-state ops"
        f"{' (smoke: Pallas, in interpret mode, only in the Pallas-vs-jnp decode check)' if s.smoke else ''}.")


def correctness_paths(run: Run):
    """((extend, pallas), (decode, pallas)) of path A (the timed path; Pallas decode on the GPU
    or with --smoke-pallas) and of path B (jnp), for the prefill_batch rows."""
    s = run.s
    e8, d_check = extend_batch_shape(s), decode_shape(s, s.prefill_batch, s.hf_context)
    check_a = ((e8, s.main_pallas), (d_check, True if not s.smoke or run.args.smoke_pallas else s.main_pallas))
    return check_a, ((e8, False), (d_check, False))


def section_compiles(run: Run) -> None:
    """2. Every step shape the run uses, lowered one by one, compiled in a thread pool."""
    s, main_p = run.s, run.s.main_pallas
    check_a, check_b = correctness_paths(run)
    specs = [(extend_batch_shape(s), main_p), (extend_long_shape(s), main_p)]
    specs += [(decode_shape(s, b, c), main_p) for c in s.contexts for b in s.batches]
    specs += [check_a[1], *check_b] + [(decode_shape(s, b, c), False) for b, c in s.jnp_decode]
    specs = list(dict.fromkeys(specs))
    workers = run.args.workers or max(1, min(len(specs), os.cpu_count() or 1))
    t0 = time.perf_counter()
    run.compiled = compile_all(s, run.params, run.state, specs, workers)
    wall = time.perf_counter() - t0
    mb = lambda x: f"{x / 1e6:.0f}" if x is not None else "n/a"
    cache = run.args.cache_dir
    run.report.add(
        f"### Compiles ({len(specs)} step shapes, lowered one by one, each compiled in a pool of {workers} "
        f"threads as soon as lowered: {wall:.1f}s wall"
        + (f"; persistent compilation cache {cache}: compile times may be cache hits" if cache else "") + ")\n\n"
        "compile s is measured while other shapes compile too. XLA temp MB: the compiled step's scratch "
        "buffers (a copy of the whole donated arena would show up here); XLA MB accessed: its cost-analysis "
        "estimate of bytes read + written per step.\n\n"
        + table(["step", "lower s", "compile s", "XLA temp MB", "XLA MB accessed"],
                [[label(*k) + (f" FAILED: {c.error}" if c.error else ""), f"{c.lower_s:.1f}",
                  f"{c.compile_s:.1f}", mb(c.temp_bytes), mb(c.xla_bytes)] for k, c in run.compiled.items()]))


def section_prefill(run: Run) -> None:
    """3. A long prompt in chunks (B = 1) and prefill_batch prompts in one extend step."""
    s, main_p = run.s, run.s.main_pallas
    vocab = s.cfg.unpadded_vocab_size
    rows = []
    for shape, n_rows, length in ((extend_long_shape(s), 1, s.prefill_long),
                                  (extend_batch_shape(s), s.prefill_batch, s.hf_context)):
        prompts = [run.rng.randint(3, vocab, length) for _ in range(n_rows)]
        try:
            fn = run.step(shape, main_p)
            times = []
            for rep in range(4):
                run.state, _, _, dt = prefill(fn, run.params, shape, run.state, prompts, 0, run.ids)
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
    run.report.add(f"### Prefill (extend steps, {s.path}; wall time incl. host batch building and the final read, "
                   "median of 3 after a warm-up; every chunk of the long prompt attends over the shape's full page "
                   "bucket)\n\n" + table(["prompts", "step", "steps", "ms", "tok/s"], rows))


def _prefill_and_decode(run: Run, path, state, prompts: list[np.ndarray], lens: list[int]):
    """Prefill prompts through path's extend step, then greedy-decode hf_new - 1 tokens
    through its decode step: (tokens [n, hf_new], logprobs [n, hf_new], state, seconds/step)."""
    (es, ep), (ds, dp) = path
    state, first, lp0, _ = prefill(run.step(es, ep), run.params, es, state, prompts, 0, run.ids)
    state, toks, lps, times = greedy_decode(run.step(ds, dp), run.params, ds, state, lens, first, run.s.hf_new - 1,
                                            run.ids)
    return toks, np.concatenate([lp0[:, None], lps], 1), state, times


def _check_batch_paths(run: Run, lens: list[int]) -> list:
    """Path A vs path B from copies of one state (B = prefill_batch): the table row. Path A's
    tokens, logprobs and host-loop ms go to run.ours."""
    s, pb = run.s, run.s.prefill_batch
    check_a, check_b = correctness_paths(run)
    compare = check_a != check_b
    state_b = jax.tree_util.tree_map(lambda x: x.copy(), run.state) if compare else None
    ta, lpa, run.state, times_a = _prefill_and_decode(run, check_a, run.state, list(run.hf_prompts), lens)
    run.ours.update({f"tokens_B{pb}": ta, f"logprobs_B{pb}": lpa, f"loop_ms_B{pb}": 1e3 * statistics.median(times_a)})
    if not compare:
        return ["Pallas vs jnp: skipped (smoke run without --smoke-pallas)", "", "", "", "", ""]
    tb, lpb, state_b, times_b = _prefill_and_decode(run, check_b, state_b, list(run.hf_prompts), lens)
    diff = state_diff(run.ids, run.state.arena, state_b.arena, pb, s.hf_context // s.page_size)
    del state_b
    what = ("prefill + " if check_a[0][1] != check_b[0][1] else "") + f"{s.hf_new - 1} decode steps"
    log(f"Pallas vs jnp ({what}): tokens {agreement(ta, tb)}, max |dlogprob| "
        f"{np.max(np.abs(lpa - lpb)):.2e}, state max |diff| {diff:.2e}; host loop "
        f"{run.ours[f'loop_ms_B{pb}']:.2f} ms/step (Pallas), {1e3 * statistics.median(times_b):.2f} (jnp)")
    return [f"Pallas vs jnp steps, B={pb} ({what})", *agreement(ta, tb), f"{np.max(np.abs(lpa - lpb)):.2e}",
            f"{diff:.2e}"]


def section_correctness(run: Run) -> None:
    """4. Pallas vs jnp steps on the same prompts and state; row 0 alone at B = 1 (tokens kept
    for the HF section)."""
    s, pb = run.s, run.s.prefill_batch
    plen = s.hf_context - s.hf_new
    run.hf_prompts = run.rng.randint(3, s.cfg.unpadded_vocab_size, (pb, plen)).astype(np.int64)
    lens = [plen] * pb
    run.ours["path"] = s.path
    check_rows = []
    try:
        check_rows.append(_check_batch_paths(run, lens))
        single = ((extend_long_shape(s), s.main_pallas), (decode_shape(s, 1, s.hf_context), s.main_pallas))
        t1, lp1, run.state, times1 = _prefill_and_decode(run, single, run.state, [run.hf_prompts[0]], lens[:1])
        run.ours.update(tokens_B1=t1, logprobs_B1=lp1, loop_ms_B1=1e3 * statistics.median(times1))
        ta = run.ours[f"tokens_B{pb}"]
        check_rows.append([f"B=1 vs B={pb} steps, row 0 ({s.path})", *agreement(t1, ta[:1]), "", ""])
        log(f"B=1 vs B={pb}, row 0: {agreement(t1, ta[:1])}; host loop {run.ours['loop_ms_B1']:.2f} ms/step")
    except Exception as exc:  # noqa: BLE001 - report and carry on to the timings
        traceback.print_exc()
        check_rows.append([f"ERROR {type(exc).__name__}: {exc}"[:200], "", "", "", "", ""])
    run.report.add(
        f"### Correctness ({plen}-token random prompts, greedy, {s.hf_new} tokens; accuracy against an fp32 "
        "oracle and agreement with HF in the HF section)\n\nstate max abs diff: conv windows and sliding "
        "rings of the rows' slots and their full-attention pages, after the last step.\n\n"
        + table(["check", "first token", "tokens equal", "mean common prefix", "max abs dlogprob",
                 "state max abs diff"], check_rows, "lrrrrr"))


DECODE_HEADER = ["B", "L", "ms/step", "pipelined ms/step", "tok/s", "MB/step (weights + experts + KV + conv)",
                 "roofline ms", "% roofline", "% roofline (pipelined)", "jnp ms/step", "Pallas speedup"]


def _decode_row(run: Run, b: int, c: int) -> list:
    """Time the decode step at (B, L) (and its jnp twin where asked): one table row."""
    s, cfg = run.s, run.s.cfg
    shape = decode_shape(s, b, c)
    run.state, t_sync, t_pipe = time_decode(s, run.step(shape, s.main_pallas), run.params, shape, run.state, c,
                                            run.ids, run.rng, run.args.trace)
    run.decode_rows[(b, c)] = t_sync
    t_jnp = None
    if (b, c) in set(s.jnp_decode) and s.main_pallas:
        run.state, t_jnp, _ = time_decode(s, run.step(shape, False), run.params, shape, run.state, c, run.ids,
                                          run.rng)
    by = decode_bytes(cfg, run.params, b, c)
    roof = by["total"] / run.bandwidth
    log(f"decode B={b} L={c}: {t_sync * 1e3:.3f} ms/step (pipelined {t_pipe * 1e3:.3f}), "
        f"{b / t_sync:.0f} tok/s, roofline {roof * 1e3:.3f} ms ({100 * roof / t_sync:.1f}%)"
        + (f"; jnp {t_jnp * 1e3:.3f} ms" if t_jnp else ""))
    return [b, c, f"{t_sync * 1e3:.3f}", f"{t_pipe * 1e3:.3f}", f"{b / t_sync:.0f}",
            f"{by['total'] / 1e6:.0f} ({by['weights'] / 1e6:.0f} + {by['experts'] / 1e6:.0f} + "
            f"{by['kv'] / 1e6:.0f} + {by['conv'] / 1e6:.1f})",
            f"{roof * 1e3:.3f}", f"{100 * roof / t_sync:.1f}%", f"{100 * roof / t_pipe:.1f}%",
            f"{t_jnp * 1e3:.3f}" if t_jnp else "", f"{t_jnp / t_sync:.2f}x" if t_jnp else ""]


def section_decode(run: Run) -> None:
    """5. The decode sweep over (B, L) against the roofline (table also written row by row to
    --out.partial)."""
    s, cfg, out = run.s, run.s.cfg, run.args.out
    intro = (f"### Decode (compiled decode step, {s.path}; steady state at context L; ms/step = median of {s.iters} "
             f"synced steps, pipelined = {s.iters} back-to-back steps / {s.iters}; tok/s = B / ms/step; roofline = "
             f"bytes below / {run.bandwidth / 1e9:.0f} GB/s; routed experts at the expected distinct count "
             "E(1-(1-k/E)^B))\n\n")
    rows = []
    for c in s.contexts:
        for b in s.batches:
            try:
                rows.append(_decode_row(run, b, c))
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                rows.append([b, c, f"ERROR {type(exc).__name__}: {exc}"[:160]] + [""] * (len(DECODE_HEADER) - 3))
            if out:  # partial table, in case the run is cut short
                with open(out + ".partial", "w") as f:
                    f.write(intro + table(DECODE_HEADER, rows) + "\n")
    dist = ", ".join(f"B={b}: {expected_experts(cfg, b):.1f}" for b in s.batches)
    run.report.add(intro + table(DECODE_HEADER, rows) + f"\n\nExpected distinct routed experts per MoE layer "
                   f"({cfg.n_routed_experts} experts, top-{cfg.num_experts_per_tok}): {dist}.")
    if out and os.path.exists(out + ".partial"):
        os.remove(out + ".partial")


def section_hf(run: Run) -> None:
    """6. HF transformers (skipped with --no-hf; a failure keeps the tables above)."""
    if run.args.no_hf:
        log("HF section skipped (--no-hf)")
        return
    try:
        hf_section(run.s, run.params, run.hf_prompts, run.ours, run.decode_rows, run.report)
    except Exception as exc:  # noqa: BLE001 - keep our tables
        traceback.print_exc()
        run.report.add(f"### HF transformers: FAILED ({type(exc).__name__}: {str(exc)[:300]})")


def main(argv=None) -> int:
    args = parse_args(argv, description=" ".join(__doc__.split("\n")[:2]))
    apply_jax_options(args)
    s = make_setup(args)
    if not s.smoke and jax.default_backend() != "gpu":
        print(f"backend is {jax.default_backend()!r}: run on a GPU, or pass --smoke", file=sys.stderr)
        return 2
    log(f"jax {jax.__version__}, {jax.default_backend()} {jax.devices()[0].device_kind}; config "
        f"{'tiny' if s.smoke else 'bench'}, {jnp.dtype(s.dtype).name}")
    run = Run(args, s, Report(args.out))
    for section in (section_setup, section_compiles, section_prefill, section_correctness, section_decode,
                    section_hf):
        section(run)
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())

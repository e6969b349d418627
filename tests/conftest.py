"""Shared fixtures: tiny configs that between them cover Inkling's variants, and the HF
transformers oracle built from them."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import tempfile

import cpu_flags  # first: sets XLA_FLAGS (compile faster) before jax is imported

# first: jaxtyping's hook instruments the library's modules as they are imported
import runtime_types
from runtime_types import TYPECHECKED

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import inkling_jax as ik
from inkling_jax import hf_transformers

# Three tiny configs that between them exercise: full and sliding layers with sequences
# longer than the window and rel_extent, log scaling active (small n_floor), dense and MoE
# layers with top-k > 1 and the sink, and different full/SWA head counts.
PARITY_CONFIGS = {
    # the CPU preset: local 0,1,3 / full 2; window 8, rel_extent 16, n_floor 8; top-2 of 8 + 2 sink
    "tiny": ik.InklingConfig.tiny(),
    # more full heads than SWA heads, K=3, top-3 of 6 + 3 sink, dense layers not a prefix
    "heads": ik.InklingConfig.tiny(
        num_layers=5, num_heads=8, num_kv_heads=2, head_dim=8, swa_num_heads=4, swa_num_kv_heads=1,
        swa_head_dim=16, local_layer_ids=(0, 2, 3), sliding_window=5, rel_extent=12, d_rel=3,
        log_scaling_n_floor=4, log_scaling_alpha=0.3, conv_kernel_size=3, dense_layer_ids=(0, 3),
        n_routed_experts=6, n_shared_experts=3, num_experts_per_tok=3, route_scale=2.5,
        num_mtp_layers=2, mtp_local_layer_ids=()),
    # HF's default layer pattern (local unless (i+1) % 6 == 0), top-1, no log scaling, K=5
    "pattern": ik.InklingConfig.tiny(
        num_layers=6, local_layer_ids=(0, 1, 2, 3, 4), sliding_window=6, rel_extent=10,
        log_scaling_n_floor=None, conv_kernel_size=5, dense_layer_ids=(0, 1), num_experts_per_tok=1,
        n_shared_experts=1, logits_mup_width_multiplier=2.0, num_mtp_layers=1, mtp_local_layer_ids=(0,)),
}


def hf_config(cfg: ik.InklingConfig):
    """transformers' InklingConfig (InklingForConditionalGeneration) of cfg."""
    return hf_transformers.mm_config(cfg)


def hf_text_config(cfg: ik.InklingConfig):
    """transformers' InklingTextConfig (InklingForCausalLM) of cfg."""
    return hf_transformers.text_config(cfg)


def perturb_(model, seed: int = 0, head_std: float = 0.5) -> None:
    """Make a freshly initialised HF model less degenerate: non-unit norms and scales, a
    nonzero router selection bias, conv taps of order 0.3, a larger LM head so logits are O(1)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "global_scale" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            elif "sconv" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            elif name.endswith("lm_head.weight"):
                p.copy_(head_std * torch.randn(p.shape, generator=g, dtype=p.dtype))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.05 * torch.randn(b.shape, generator=g, dtype=b.dtype))


@pytest.fixture(scope="session")
def torch_threads():
    import torch

    torch.set_num_threads(2)
    return torch


def random_tokens(cfg: ik.InklingConfig, shape, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, cfg.unpadded_vocab_size, shape).astype(np.int32)


def device_array(x, dtype=None) -> jax.Array:
    """Host data as a device array, cast on the host: jnp.asarray / .astype / .at[] on host data
    compile a small XLA program per shape and dtype (the kernel tests made thousands). float64
    becomes float32 first, as jnp.asarray makes it without x64; numpy's casts round to nearest
    even, as XLA's convert does."""
    a = np.asarray(x)
    if a.dtype == np.float64:
        a = a.astype(np.float32)
    return jax.device_put(a if dtype is None else a.astype(dtype))


# ------------------------------------------------------------------ engine fixtures

# The tiny preset on two layers, a sliding dense one and a full MoE one, with its three MTP
# depths (the middle one banded): the cheapest model with every kind of target and draft state,
# at half the compile of the preset's four layers. Deeper layer patterns (several sliding and
# full layers, each with its own state fields and pages): test_engine's
# `test_deep_layer_pattern_matches_the_reference`.
TWO_LAYER = ik.InklingConfig.tiny(num_layers=2, local_layer_ids=(0,))
# The engine tests' model: TWO_LAYER without MTP tensors, what HF's save_pretrained
# round-trips, so engine tests and the HF generate test share compiled steps.
TRUNK = TWO_LAYER.replace(num_mtp_layers=0, mtp_local_layer_ids=())

# One pool geometry shared by most engine tests (compiled steps are cached process-wide by
# shape): tiny pages and a short checkpoint interval so windows, rel_extent, pages and
# checkpoints are all crossed by short sequences. One arena size for them all (arena_units):
# a test that narrows the pool (num_slots / num_pages: a smaller budget, more eviction) still
# runs the same compiled steps, and every engine test runs its budget inside a larger arena
# (the pool's budget tests: test_pool.py). 1024 units hold the two-layer models' pools up to
# spec_steps 3 at 16 slots and 64 pages (688 units); a larger pool sets arena_units=None.
ENGINE_KW = dict(max_running=2, num_slots=16, num_pages=64, page_size=4, track_interval=8, chunk_size=8,
                 max_step_tokens=16, min_context_bucket=64, min_batch_bucket=2, arena_units=1024)


def echo_model(cfg: ik.InklingConfig, params, unembed_scale: float = 1.0):
    """cfg's params made into a model whose MTP heads draft well (random ones almost never
    do): every block's output projections scaled by 0.1, so the next token depends mostly on
    the current one, and each depth's input projection reading its token's embedding alone
    (the identity on it, zero on the hidden state), so depth d predicts what the target will
    after the token it reads. `unembed_scale` sharpens the distributions (sampled rows then
    accept drafts too). Measured on SPEC_CFG (test_spec.py) at spec_steps 3: 2.6 to 2.9 tokens
    per greedy round (depth acceptance about 0.8 / 0.5 / 0.45), 3.0 at temperature 1 with
    unembed_scale 30; every accept length occurs."""
    def quiet(block):
        mlp = {k: v * 0.1 if k in ("w2", "shared_w2") else v for k, v in block["mlp"].items()}
        return {**block, "attn": {**block["attn"], "wo": block["attn"]["wo"] * 0.1}, "mlp": mlp}

    h = cfg.hidden_size
    assert cfg.mtp_hidden_states_first  # input_proj's rows: the hidden state's, then the embedding's
    depths = [{**d, "block": quiet(d["block"]),
               "input_proj": np.concatenate([np.zeros((h, h), np.float32), np.eye(h, dtype=np.float32)])}
              for d in params["mtp"]["layers"]]
    return {**params, "layers": [quiet(b) for b in params["layers"]], "mtp": {**params["mtp"], "layers": depths},
            "unembed": params["unembed"] * unembed_scale}


@pytest.fixture(scope="session")
def trunk_params():
    import jax

    return ik.init_params(TRUNK, jax.random.key(0), std=0.1)


# float32 rounding of a differently fused program (a device loop against lone steps; the tokens
# are compared exactly)
LOOP_ATOL = 1e-5


def assert_same_completions(got, want, atol: float = LOOP_ATOL) -> None:
    """Two engines' completions of the same requests agree: tokens, finish reasons and cache
    hits exactly; log-probs, and the top alternatives' log-probs where asked, within atol (their
    ids exactly)."""
    assert [c.tokens for c in got] == [c.tokens for c in want]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
    assert [c.cached_tokens for c in got] == [c.cached_tokens for c in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=atol)
        if w.top_logprobs is not None:
            assert [[t for t, _ in top] for top in g.top_logprobs] == [[t for t, _ in top] for top in w.top_logprobs]
            np.testing.assert_allclose([[lp for _, lp in top] for top in g.top_logprobs],
                                       [[lp for _, lp in top] for top in w.top_logprobs], rtol=0, atol=atol)


def make_engine(params, cfg=None, **overrides):
    return ik.Engine(cfg or TRUNK, params, ik.EngineConfig(**{**ENGINE_KW, **overrides}))


_FORWARD = {}


def reference_forward(params, cfg, tokens):
    """Jitted reference logits for one sequence, padded to a multiple of 64 tokens (the
    model is causal, so trailing padding changes nothing before it): one compile per size."""
    import jax

    n = len(tokens)
    size = -(-n // 64) * 64
    fn = _FORWARD.get(cfg)
    if fn is None:
        fn = _FORWARD[cfg] = jax.jit(lambda p, t: ik.forward(p, cfg, t))
    padded = np.zeros((1, size), np.int32)
    padded[0, :n] = tokens
    return np.asarray(fn(params, padded))[0, :n]


def reference_logprobs(params, cfg, prompt, generated):
    """log p(generated[i] | prompt + generated[:i]) from the reference forward, and its greedy picks."""
    logits = reference_forward(params, cfg, list(prompt) + list(generated))
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    n = len(prompt)
    return np.array([logp[n - 1 + i, t] for i, t in enumerate(generated)]), logp[n - 1:-1].argmax(-1)


def has_cuda_device() -> bool:
    """A CUDA device is present (even when this run's JAX_PLATFORMS picks the CPU: jax then
    refuses `devices("cuda")`, and lowering for CUDA beside the uninitialised plugin fails with
    "No supported GPU devices found", as on the H200 machine with this conftest's default)."""
    if os.path.exists("/dev/nvidiactl"):
        return True
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


# ------------------------------------------------- RMSNorm kernels: GPU sum orders

def row_ulps(got, want) -> float:
    """max |got - want| in units of the dtype's eps times the row's largest |want|."""
    eps = float(jnp.finfo(jnp.asarray(want).dtype).eps)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = np.maximum(np.abs(want).max(axis=-1, keepdims=True), 1e-30)
    return float((np.abs(got - want) / scale).max() / eps)


def sum_in_gpu_order(sq: np.ndarray, threads: int) -> np.float32:
    """fp32 sum of a row's squares in a reduction order a GPU may use: `threads` threads each
    summing a strided slice in turn, then a pairwise tree (threads = len(sq): the pure tree;
    256: the shape of a Triton reduction over 8 warps)."""
    a = sq.astype(np.float32)
    a = np.stack([np.cumsum(a[i::threads], dtype=np.float32)[-1] for i in range(threads)])
    while a.size > 1:
        a = (a[0::2] + a[1::2]).astype(np.float32)
    return a[0]


def rms_norm_with_gpu_sum(x, w, eps: float, threads: int):
    """rms_norm's formula on rows x [n, d] with the mean's sum in `sum_in_gpu_order` (the one
    difference a compiled Triton norm kernel adds; rsqrt is libdevice's in both)."""
    xf = np.asarray(x, np.float32)
    ms = jnp.asarray([sum_in_gpu_order(r * r, threads) for r in xf])[:, None] / xf.shape[-1]
    xs = jnp.asarray(xf) * jax.lax.rsqrt(ms + eps)
    return (w.astype(x.dtype) * xs.astype(x.dtype)).astype(x.dtype)


@contextlib.contextmanager
def count_xla_compiles():
    """Counts XLA backend compiles (every jit, eager op or AOT compile) inside the block."""
    count = [0]

    def listener(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            count[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield count
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
    """Drop every compiled program after each test module. Each XLA:CPU executable keeps
    memory mappings of its code; the suite compiles thousands of programs, and one process
    past the kernel's limit of mappings (vm.max_map_count, 65530) segfaults in its next
    compile (seen at ~90 % of the suite). The run's executable cache (pytest_configure)
    keeps them on disk for the modules and workers after."""
    yield
    ik.clear_program_cache()
    jax.clear_caches()
    gc.collect()


def pytest_report_header(config):
    scope = ", ".join(runtime_types.packages()) if TYPECHECKED else "off"
    return f"annotations checked at run time (jaxtyping + beartype): {scope}"


# ------------------------------------------------ one executable cache per test run

_RUN_CACHE = "inkling_jax_executable_cache"  # workerinput key


def pytest_configure(config):
    """One executable cache directory per test run (`inkling_jax.programs`), shared by the
    pytest-xdist workers and the subprocesses tests start: a program compiled in one module or
    worker is loaded in another. The controller makes it and removes it at the end;
    $INKLING_JAX_EXECUTABLE_CACHE set by the caller wins (a directory kept across runs, or off)."""
    from inkling_jax.compile_cache import EXECUTABLE_CACHE_ENV

    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:  # an xdist worker: the controller's directory
        if workerinput.get(_RUN_CACHE):
            os.environ[EXECUTABLE_CACHE_ENV] = workerinput[_RUN_CACHE]
        return
    if EXECUTABLE_CACHE_ENV not in os.environ:
        config._inkling_run_cache = os.environ[EXECUTABLE_CACHE_ENV] = tempfile.mkdtemp(prefix="inkling-jax-tests-")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist: hand the run's executable cache directory to each worker."""
    from inkling_jax.compile_cache import EXECUTABLE_CACHE_ENV

    node.workerinput[_RUN_CACHE] = os.environ.get(EXECUTABLE_CACHE_ENV, "")


def pytest_unconfigure(config):
    path = getattr(config, "_inkling_run_cache", None)
    if path:
        shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------ tests on 8 host devices

MESH_DEVICES = 8
on_mesh = pytest.mark.skipif(len(jax.devices()) < MESH_DEVICES,
                             reason="runs in an 8-device subprocess (run_on_mesh_devices)")


# the files holding `test_on_mesh_*` tests: one 8-device subprocess runs them all (one process's
# collection, jax start-up and compiled programs: 59 s alone where one subprocess per file took
# 58 + 30 s in make test; ~84 s inside make test, where the other worker shares the cores; 2026-12-07)
MESH_TEST_FILES = ("test_mesh.py", "test_mesh_engine.py")


def run_on_mesh_devices() -> None:
    """Run every `test_on_mesh_*` test of MESH_TEST_FILES in one subprocess with 8 host devices
    (this process started jax with one), and fail with their output unless every one passed
    and every file had some (a file whose tests lost their `on_mesh` name would otherwise pass
    unseen)."""
    import subprocess
    import sys

    if len(jax.devices()) >= MESH_DEVICES:
        pytest.skip("this process has 8 devices: the test_on_mesh_* tests ran directly")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_flags.with_devices(MESH_DEVICES))
    run = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-rp", "-x", "-p", "no:cacheprovider",
                          "-k", "on_mesh", *(os.path.join(here, f) for f in MESH_TEST_FILES)],
                         cwd=os.path.dirname(here), env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    summary = run.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary
    for f in MESH_TEST_FILES:  # -rp: a "PASSED path::test" line per test
        assert f"PASSED tests/{f}::test_on_mesh_" in run.stdout, f"no test_on_mesh_* test of {f} ran"


@pytest.fixture
def verify_triton_modules(monkeypatch):
    """Every Pallas kernel lowered for CUDA in the test is checked by the MLIR verifier (XLA
    parses and verifies the Triton module only when it compiles, on a GPU: an ill-typed
    module, e.g. an scf.for whose bounds differ in type, would otherwise pass a CPU lowering
    test). Yields the list of verified module count (one entry per kernel)."""
    try:
        from jax._src.pallas.triton import lowering, pallas_call_registration as reg
    except ImportError as exc:  # a jaxlib without the Triton dialect
        pytest.skip(f"no Triton lowering here: {exc}")
    original = lowering.lower_jaxpr_to_triton_module
    verified = []

    def checked(*args, **kwargs):
        result = original(*args, **kwargs)
        assert result.module.operation.verify(), "a Triton module failed MLIR verification"
        verified.append(1)
        return result

    monkeypatch.setattr(reg.lowering, "lower_jaxpr_to_triton_module", checked)
    yield verified


# --------------------------------------- xdist --dist loadfile: the longest files first

# With `--dist loadfile` (make test) a file runs whole on one worker, and xdist queues the
# files with the most tests first: the 8-device mesh subprocess, the notebooks and the fuzz
# run (few tests, minutes each) came last, and one worker ran them alone while the other
# idled. Longest first (then xdist's order) balances the two workers: every file of >= 10 s
# in make test's run (2026-12-08, per-test start / end times on 2 workers), so that the last
# files a worker takes are short ones; a file missing here only runs later, nothing is skipped.
LONGEST_FILES = ("test_mesh_engine.py", "test_notebooks.py", "test_spec.py", "test_cli.py", "test_fuzz_modes.py",
                 "test_programs.py", "test_kernels.py", "test_conv_norm_kernel.py", "test_engine.py", "test_train.py",
                 "test_fault_isolation.py", "test_model.py", "test_processors.py", "test_prefix_cache.py",
                 "test_docs.py", "test_moe_kernel.py", "test_bench_smoke.py", "test_decode_attention.py",
                 "test_model_hf.py", "test_host_policy.py", "test_failures.py", "test_persist.py",
                 "test_router_kernel.py", "test_harness.py")


def pytest_collection_modifyitems(config, items):
    """Items grouped by file: LONGEST_FILES in that order, then the rest with the most tests
    first (xdist's own order); a file's items keep their order."""
    import collections

    counts = collections.Counter(item.path.name for item in items)
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    first = {}
    for i, item in enumerate(items):
        first.setdefault(item.path, i)
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -counts[item.path.name], first[item.path]))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile keeps the collection's file order (pytest_collection_modifyitems)
    instead of re-sorting the files by their number of tests."""
    if config.getvalue("dist") == "loadfile":
        config.option.loadscopereorder = False
    return None  # xdist's own scheduler for the mode

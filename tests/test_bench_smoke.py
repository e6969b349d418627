"""The GPU bench scripts (the bench package) import against the library as it is, and their
host-side parts (sizes, request rows, packed batches, kernel inputs, the roofline's byte count)
are right for the tiny config. Nothing is compiled here but in bench.serve.serve's
fresh-process sections (`--smoke`, one subprocess); `python -m bench.<subject>.<script> --smoke`
runs a script end to end on a CPU."""

from __future__ import annotations

import importlib
import os
import pathlib
import pkgutil
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import bench
from inkling_jax.steps import check_batch, pack_batch

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
SUBJECTS = ("common", "kernels", "decode", "serve", "profile", "check", "host")
# sys.path edited in code: a call on it, an item or slice assigned, `+=` or `=`; or a site dir added
SYS_PATH_EDIT = re.compile(r"\bsys\.path\s*(\.\s*(insert|append|extend|remove|pop|clear)\s*\("
                           r"|\[[^\]]*\]\s*=(?!=)|\+=|=(?!=))"
                           r"|\bsite\.addsitedir\b")


def bench_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(bench.__path__, "bench."))


def test_bench_is_a_package_without_sys_path_edits():
    """bench/ is a package of one sub-package per subject, every folder with Python in it a
    package (so every module is found and imports as `bench.<subject>.<module>`), and no file
    under bench/ edits sys.path (scripts run as `python -m` from the repository root)."""
    assert pathlib.Path(bench.__file__).resolve().parent == BENCH  # this checkout's bench
    folders = {p.parent for p in BENCH.rglob("*.py") if "__pycache__" not in p.parts}
    assert {f for f in folders if not (f / "__init__.py").exists()} == set()
    assert {f.name for f in folders if f != BENCH} == set(SUBJECTS)
    files = {str(p.relative_to(BENCH).with_suffix("")).replace(os.sep, ".") for p in BENCH.rglob("*.py")
             if "__pycache__" not in p.parts}
    assert {f"bench.{f}".removesuffix(".__init__") for f in files if f != "__init__"} == set(bench_modules())
    edits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in sorted(BENCH.rglob("*"))
             if p.is_file() and "__pycache__" not in p.parts
             for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if SYS_PATH_EDIT.search(line)]
    assert edits == []
    for ok in ("sys.path", "on `sys.path`: a run", "sys.path == x"):
        assert not SYS_PATH_EDIT.search(ok)
    for bad in ("sys.path.insert(0, d)", "sys.path[:0] = [d]", "sys.path += [d]", "sys.path = [d]",
                "site.addsitedir(d)"):
        assert SYS_PATH_EDIT.search(bad), bad


@pytest.mark.parametrize("name", bench_modules())
def test_bench_module_imports(name):
    """Every bench module imports on a CPU (the GPU-only scripts too: nothing runs at import)."""
    importlib.import_module(name)


def test_decode_rows_pack_into_each_shape():
    from bench.decode import setup as S

    s = S.make_setup(S.parse_args(["--smoke"]))
    ids, state = S.make_state(s)
    assert state.slot_v2p.shape == (ids.num_slots + 1,) and state.page_v2p.shape == (ids.num_pages + 1,)
    assert state.arena.shape[0] == ids.layout.arena_units(ids.num_slots, ids.num_pages)
    for shape in (S.extend_long_shape(s), S.extend_batch_shape(s), S.decode_shape(s, max(s.batches), s.hf_context)):
        n = min(shape.batch, max(s.batches))
        per_row = shape.tokens // shape.batch
        rows = [ids.row(r, 5 * r, np.arange(per_row) + 3, shape) for r in range(n)]
        batch = pack_batch(shape, rows)
        check_batch(batch, shape)
        assert batch.slots.virtual_slot[:n].tolist() == [r + 1 for r in range(n)]
        assert batch.layout.has_state[:n].tolist() == [r > 0 for r in range(n)]
        # every row's page table covers the shape's pages, each row its own pages, none the sink
        pages = batch.slots.virtual_pages[:n]
        assert pages.shape[1] == shape.pages and (pages > 0).all() and len(np.unique(pages)) == pages.size
        assert pages.max() <= ids.num_pages


def test_decode_roofline_bytes():
    import jax

    import inkling_jax as ik
    from bench.decode import runs as R

    cfg = ik.InklingConfig.tiny(num_mtp_layers=0, mtp_local_layer_ids=())
    assert R.expected_experts(cfg, 1) == pytest.approx(cfg.num_experts_per_tok)
    assert R.expected_experts(cfg, 10_000) == pytest.approx(cfg.n_routed_experts)
    params = ik.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16)
    one, two = R.decode_bytes(cfg, params, 1, 16), R.decode_bytes(cfg, params, 2, 16)
    assert one["total"] == pytest.approx(sum(v for k, v in one.items() if k != "total"))
    assert two["kv"] == 2 * one["kv"] and two["conv"] == 2 * one["conv"] and two["experts"] > one["experts"]


def test_kernel_rows_are_packed_as_the_steps_pack_them():
    from bench.kernels import cases as K

    rng = np.random.RandomState(0)
    for q, mixed in ((1, True), (4, True), (4, False)):
        kr, t = K.make_rows(rng, 6, q, 3, padded=True, track=True, mixed=mixed)
        rows = kr.rows
        token_row, token_offset = np.asarray(rows.token_row), np.asarray(rows.token_offset)
        row_tokens, active = np.asarray(rows.row_tokens), np.asarray(kr.active)
        assert t == len(token_row) == 6 * q
        for b in np.flatnonzero(active):  # a real row's tokens: row_tokens points at them in order
            n = int(np.sum((token_row == b) & (token_offset < q)))
            assert (token_row[row_tokens[b, :n]] == b).all() and (token_offset[row_tokens[b, :n]] == np.arange(n)).all()
        used = np.concatenate([active[active > 0], np.asarray(kr.track_dest)[np.asarray(kr.track_dest) > 0]])
        assert len(np.unique(used)) == len(used)  # active and checkpoint slots pairwise distinct
        assert (np.asarray(rows.commit_len) <= q).all() and (np.asarray(rows.track_len) <= q).all()


def test_serve_decode_steps_option():
    from bench.serve import loop as L

    assert L.parse_decode_steps("1") == [1]
    for bad in ("0", "1,x", ""):
        with pytest.raises(SystemExit):
            L.parse_decode_steps(bad)
    if L.has_decode_steps():
        assert L.parse_decode_steps("1,4,8") == [1, 4, 8]
    else:  # an engine without EngineConfig.decode_steps decodes one token per dispatch
        with pytest.raises(SystemExit, match="K must be 1"):
            L.parse_decode_steps("1,4")


def test_serve_child_error_line():
    from bench.serve import fresh as F

    glog = "some log\nF1204 05:39:24.552522    4333 parse_flags_from_env.cc:234] Unknown flag in XLA_FLAGS: --x=1\n"
    assert F.error_line(glog, 1) == "Unknown flag in XLA_FLAGS: --x=1"
    trace = "Traceback (most recent call last):\n  File ...\nValueError: a | b\n"
    assert F.error_line(trace, 1) == "ValueError: a / b"
    assert F.error_line("", 3) == "exit status 3"


def test_serve_fresh_process_sections(tmp_path):
    """`python -m bench.serve.serve --smoke`'s startup section (import; init_params, Engine and the first
    generate with an empty, then the filled compile cache, each in a fresh process) and flags
    section (a working and an unknown XLA flag: the failure is a table cell, the run goes on);
    and the verify section's row (a plain and a speculative engine, same greedy outputs)."""
    out = tmp_path / "serve.md"
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    proc = subprocess.run([sys.executable, "-m", "bench.serve.serve", "--smoke", "--sections", "startup,flags,verify",
                           "--flag-variants", ";--xla_no_such_flag=1", "--decode-batches", "1", "--decode-reps", "1",
                           "--spec-steps", "1",
                           "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(env, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    text = out.read_text()
    lines = text.splitlines()
    cold = next(line for line in lines if "cold compile cache (0 entries)" in line)
    warm = next(line for line in lines if "warm compile cache" in line)
    for row in (cold, warm):
        assert float(row.split("|")[2]) > 0 and row.split("|")[4].strip() in ("yes", "no")
    assert any(line.startswith("| init_params, tiny model") for line in lines)
    base = next(line for line in lines if line.startswith("| (inherited only) | 1 | 1 |"))
    assert float(base.split("|")[4]) > 0 and base.split("|")[5].strip() == "1.000"
    bad = next(line for line in lines if line.startswith("| `--xla_no_such_flag=1` | 1 | 1 |"))
    assert "failed: Unknown flag in XLA_FLAGS" in bad
    verify = next(line.split("|") for line in lines if line.startswith("| 1 | 1 | 0.5 |"))
    assert float(verify[4].split()[0]) > 0 and float(verify[5].split()[0]) > 0 and verify[10].strip() == "yes"


def test_ab_decode_reads_serve_tables():
    """bench.decode.ab_decode reads serve.py's decode table by its headers (a run of this
    session's format: median with the range of the timed runs, and a cell without a range)."""
    from bench.decode import ab_decode

    table = """## Decode

| B | K | overlap | prefill tok/s | prefill steps | decode ms/step | decode tok/s | dispatches / token steps |
| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
| 1 | 8 | on | 48237 | 1 | 1.560 (1.558-1.561) | 641 | 16 / 127 |
| 32 | 8 | on | 105373 | 8 | 2.899 | 11039 | 16 / 127 |

| B | mesh (1, 1) ms/step |
| --- | ---: |
| 1 | 3.87 |
"""
    assert ab_decode.parse_decode_table(table) == {(1, 8): (1.560, 1.558, 1.561), (32, 8): (2.899, 2.899, 2.899)}
    with_outputs = table.replace("token steps |\n", "token steps | outputs |\n").replace(
        "| 16 / 127 |\n| 32", "| 16 / 127 | 0123abcdef |\n| 32")
    rows = ab_decode.parse_decode_rows(with_outputs)
    assert rows[(1, 8)] == ((1.560, 1.558, 1.561), "0123abcdef") and rows[(32, 8)][1] == ""
    assert ab_decode.parse_trees(["base=ab/base", "new=."]) == [("base", "ab/base"), ("new", ".")]
    with pytest.raises(SystemExit):
        ab_decode.parse_trees(["base=x", "base=y"])


def test_ab_decode_links_large_identical_files(tmp_path):
    """prepare's share_large_files: a large file identical to the working tree's becomes a relative
    link to it; a different one, a small one and a file the working tree lacks stay copies."""
    from bench.decode import ab_decode

    repo, tree = tmp_path / "repo", tmp_path / "repo" / "ab" / "t"
    big = bytes(range(256)) * 8
    for root in (repo, tree):
        (root / "models").mkdir(parents=True)
        (root / "models" / "same.bin").write_bytes(big)
        (root / "small.txt").write_text("x")
    (repo / "models" / "other.bin").write_bytes(big)
    (tree / "models" / "other.bin").write_bytes(big[::-1])
    (tree / "models" / "only_here.bin").write_bytes(big)
    assert ab_decode.share_large_files(str(tree), str(repo), min_bytes=1024) == ["models/same.bin"]
    link = tree / "models" / "same.bin"
    assert link.is_symlink() and not os.path.isabs(os.readlink(link)) and link.read_bytes() == big
    assert not any(p.is_symlink() for p in [tree / "small.txt", tree / "models" / "other.bin",
                                            tree / "models" / "only_here.bin"])


def test_ab_decode_runs_each_tree_as_it_expects(tmp_path):
    """run's command for a tree: `python -m bench.serve.serve` in a tree with the bench package
    (this one), `python bench/serve.py` in one from before it (flat bench/, e.g. an old base)."""
    from bench.decode import ab_decode

    assert ab_decode.serve_command(str(ROOT)) == [sys.executable, "-m", "bench.serve.serve"]
    old = tmp_path / "old"
    (old / "bench").mkdir(parents=True)
    (old / "bench" / "serve.py").write_text("")
    assert ab_decode.serve_command(str(old)) == [sys.executable, "bench/serve.py"]
    with pytest.raises(SystemExit, match="neither"):
        ab_decode.serve_command(str(tmp_path))

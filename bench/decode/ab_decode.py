"""Side-by-side decode timing of several source trees in one device call (A/B runs).

Runs of one tree on different GPU machines moved by up to 0.17 ms per batch-1 token step, so a
change is judged only against its base measured in the same call, one tree after the other,
alternated for several rounds (BENCHMARKS.md's side-by-side tables were made this way).

    # here (git): each base revision as a plain tree under ab/ (keep ab/ git-ignored); files
    # over 1 MiB identical to the working tree's (the shipped model) become links to it, so
    # about six trees fit in a device call's 64 MiB carry
    python -m bench.decode.ab_decode prepare base=db548be
    # on the GPU (carry ab/): every tree's serve script's decode section, alternated
    python -m bench.decode.ab_decode run base=ab/base new=. --rounds 2 --batches 1,32 --out ab.md

`run` calls `python -m bench.serve.serve --sections decode --decode-batches B --decode-steps K
--decode-reps R --cache-dir "" --out F` in the root of each tree (`python bench/serve.py` in a
tree from before the bench package; the tree's own serve.py, model and kernels; a fresh
process per run) and writes one table: decode ms per token step per tree, batch and round (the
median of the run's R timed repeats, with their range), and each tree's ratio to the first
tree in the same round. The per-run logs go to a temporary directory whose
path the table names; a run that fails shows its last error line in the table. With
`--cache-dir DIR` each tree compiles into its own persistent cache DIR/NAME, so only the first
round pays the compiles.
`--smoke` passes `--smoke` on (CPU, tiny model).
"""

from __future__ import annotations

import argparse
import filecmp
import os
import re
import subprocess
import sys
import tempfile

from bench import REPO

DECODE_MS = re.compile(r"^([\d.]+)(?: \(([\d.]+)-([\d.]+)\))?$")


def parse_decode_table(markdown: str) -> dict[tuple[int, int], tuple[float, float, float]]:
    """{(B, K): (median, low, high)} decode ms per token step from serve.py's decode table
    (columns found by their headers "B", "K" and "decode ms/step"; a cell without a range
    reads as a range of one value)."""
    return {key: cells[0] for key, cells in parse_decode_rows(markdown).items()}


def parse_decode_rows(markdown: str) -> dict[tuple[int, int], tuple[tuple[float, float, float], str]]:
    """{(B, K): ((median, low, high), outputs digest or "")}: `parse_decode_table` plus the
    "outputs" column where the table has one."""
    out: dict[tuple[int, int], tuple[tuple[float, float, float], str]] = {}
    header: list[str] | None = None
    for line in markdown.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            continue
        if not {"B", "K", "decode ms/step"} <= set(header) or set(cells[0]) <= set("-: "):
            continue
        row = dict(zip(header, cells))
        m = DECODE_MS.match(row["decode ms/step"])
        if m is None:
            continue
        med = float(m.group(1))
        lo, hi = (float(m.group(2)), float(m.group(3))) if m.group(2) else (med, med)
        out[(int(row["B"]), int(row["K"]))] = ((med, lo, hi), row.get("outputs", ""))
    return out


def parse_trees(specs: list[str]) -> list[tuple[str, str]]:
    """["name=path", ...] -> [(name, path)], names unique."""
    trees = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"a tree is NAME=PATH, not {spec!r}")
        trees.append((name, path))
    if len({n for n, _ in trees}) != len(trees):
        raise SystemExit("tree names must differ")
    return trees


def share_large_files(tree: str, repo: str = REPO, min_bytes: int = 1 << 20) -> list[str]:
    """Replace each file of `tree` of at least `min_bytes` that is byte-identical to the same path
    in `repo` by a relative symlink to it; returns the paths shared.

    The device call carries at most 64 MiB; each tree is ~17 MB, ~15 of it the shipped model
    (which the decode benchmark does not read: it times the bench preset's random weights), so
    without sharing only two archived trees fit beside the working tree. A link travels as a
    link (the device tool's README); relative and pointing inside the checkout, it resolves
    there too."""
    shared = []
    for root, _, files in os.walk(tree):
        for fname in files:
            path = os.path.join(root, fname)
            rel = os.path.relpath(path, tree)
            twin = os.path.join(repo, rel)
            if (os.path.islink(path) or os.path.getsize(path) < min_bytes or not os.path.isfile(twin)
                    or os.path.getsize(twin) != os.path.getsize(path) or not filecmp.cmp(path, twin, shallow=False)):
                continue
            os.remove(path)
            os.symlink(os.path.relpath(twin, root), path)
            shared.append(rel)
    return sorted(shared)


def prepare(args) -> None:
    for name, rev in parse_trees(args.trees):
        dest = os.path.join(args.dir, name)
        if os.path.exists(dest):
            raise SystemExit(f"{dest} exists: remove it first")
        os.makedirs(dest)
        archive = subprocess.run(["git", "-C", REPO, "archive", rev], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
        shared = share_large_files(dest) if args.share_large else []
        print(f"{name}: {rev} -> {dest}" + (f" (linked to the working tree's copy: {', '.join(shared)})"
                                            if shared else ""))


def serve_command(path: str) -> list[str]:
    """How the tree at `path` runs its serve script, from its root: `python -m bench.serve.serve`
    (the bench package), or `python bench/serve.py` in a tree from before it (flat bench/)."""
    if os.path.isfile(os.path.join(path, "bench", "serve", "serve.py")):
        return [sys.executable, "-m", "bench.serve.serve"]
    if os.path.isfile(os.path.join(path, "bench", "serve.py")):
        return [sys.executable, "bench/serve.py"]
    raise SystemExit(f"{path}: neither bench/serve/serve.py nor bench/serve.py")


def run_tree(path: str, args, out_md: str, log: str, name: str = "tree") -> str:
    """One serve.py decode run inside the tree at `path`; returns '' or its last error line."""
    # a persistent compilation cache per tree (--cache-dir): later rounds skip the compiles
    cache = os.path.join(os.path.abspath(args.cache_dir), name) if args.cache_dir else ""
    cmd = serve_command(path) + ["--sections", "decode", "--decode-batches", args.batches, "--decode-steps",
                                 args.steps, "--decode-reps", str(args.reps), "--cache-dir", cache, "--out", out_md]
    if args.smoke:
        cmd.append("--smoke")
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=os.path.abspath(path), stdout=f, stderr=subprocess.STDOUT,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if proc.returncode == 0 and os.path.exists(out_md):
        return ""
    lines = [ln for ln in open(log).read().splitlines() if ln.strip()]
    return (lines[-1] if lines else f"exit {proc.returncode}")[:160]


def run(args) -> None:
    trees = parse_trees(args.trees)
    logs = tempfile.mkdtemp(prefix="ab_decode_")
    results: dict[tuple[str, int], dict] = {}
    errors: dict[tuple[str, int], str] = {}
    for rnd in range(1, args.rounds + 1):
        for name, path in trees:
            md, log = (os.path.join(logs, f"{name}.{rnd}.{ext}") for ext in ("md", "log"))
            print(f"round {rnd}: {name} ({path})", flush=True)
            err = run_tree(path, args, md, log, name)
            results[(name, rnd)] = parse_decode_rows(open(md).read()) if not err else {}
            errors[(name, rnd)] = err
    keys = sorted({k for r in results.values() for k in r})
    first = trees[0][0]
    rows = []
    for b, k in keys:
        for name, _ in trees:
            cells, ratios, digests = [], [], []
            for rnd in range(1, args.rounds + 1):
                row = results[(name, rnd)].get((b, k))
                if row is None:
                    cells.append(errors[(name, rnd)] or "-")
                    continue
                got, digest = row
                digests.append(digest)
                cells.append(f"{got[0]:.3f} ({got[1]:.3f}-{got[2]:.3f})")
                base = results[(first, rnd)].get((b, k))
                if base:
                    ratios.append(f"{got[0] / base[0][0]:.3f}")
            outputs = " ".join(dict.fromkeys(d for d in digests if d)) or "-"
            rows.append(f"| {name} | {b} | {k} | " + " | ".join(cells) + f" | {', '.join(ratios) or '-'} | {outputs} |")
    rounds = " | ".join(f"round {r}" for r in range(1, args.rounds + 1))
    text = "\n".join([
        f"Decode ms per token step, the trees run one after the other, {args.rounds} round(s) "
        f"(median of {args.reps} timed runs, range); ratio: to {first} in the same round; outputs: serve.py's "
        f"digest of the greedy tokens (one per round where they differ). Logs: {logs}", "",
        f"| tree | B | K | {rounds} | vs {first} | outputs |",
        "| --- | ---: | ---: | " + " | ".join("---:" for _ in range(args.rounds)) + " | --- | --- |",
        *rows]) + "\n"
    if not keys:
        text += "".join(f"\n{n} round {r}: {e}" for (n, r), e in errors.items() if e) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pp = sub.add_parser("prepare", help="git archive each NAME=REV into DIR/NAME")
    pp.add_argument("trees", nargs="+")
    pp.add_argument("--dir", default=os.path.join(REPO, "ab"))
    pp.add_argument("--no-share-large", dest="share_large", action="store_false",
                    help="keep full copies of files over 1 MiB identical to the working tree's (see share_large_files)")
    pr = sub.add_parser("run", help="serve.py's decode section in each NAME=PATH tree, alternated")
    pr.add_argument("trees", nargs="+")
    pr.add_argument("--rounds", type=int, default=2)
    pr.add_argument("--batches", default="1,32")
    pr.add_argument("--steps", default="8", help="K decode steps per dispatch (serve.py --decode-steps)")
    pr.add_argument("--reps", type=int, default=3)
    pr.add_argument("--out", default="")
    pr.add_argument("--smoke", action="store_true")
    pr.add_argument("--cache-dir", default="",
                    help="a persistent compilation cache under DIR/<tree>, so rounds after the first compile nothing "
                         "(default: none, every run compiles)")
    args = p.parse_args(argv)
    prepare(args) if args.command == "prepare" else run(args)


if __name__ == "__main__":
    main()

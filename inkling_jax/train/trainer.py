"""The training loop: AdamW on fp32 master weights with bf16 compute, resumable orbax
checkpoints, periodic validation, a JSON-lines log, a wall-clock budget.

State (one pytree, donated to the jitted step):
    params     fp32 master weights (`init_params` layout)
    opt_state  optax state of clip_by_global_norm -> adamw, fp32, the learning rate injected
    step       int32 [], optimizer steps taken

The learning rate follows `optax.warmup_cosine_decay_schedule` (linear warm-up from 0, cosine
down to `min_lr_ratio * lr` at the last step). The host evaluates the schedule once into a
table and hands the step its rate as an argument, so the schedule can be re-planned (see
`--time-budget`) without recompiling. Weight decay applies to matrices, not to norms, scales,
biases or conv taps.

Checkpoints (`out/checkpoints/<step>/`, `orbax.checkpoint.CheckpointManager`) hold the state
and, as JSON, the batch sampler's generator, the planned step count and the settings: a
resumed run draws the same batches and takes the same steps as an uninterrupted one.

Log (`out/train_log.jsonl`, one JSON object per line, `event` says which):
    start  settings, model size, corpus split, device      plan   the planned step count
    train  step, loss, trunk, mtp [D], grad_norm, lr, tokens_per_s, ms_per_step
    eval   step, val_loss, val_bpb, val_mtp [D], eval_s     end    steps, tokens, wall time
Bits per byte = nats / ln 2 (one token per byte).

Time budget: with `time_budget` seconds, the loop measures its step time after
`calibrate_steps` steps and, if the planned steps would not fit before the deadline (less a
reserve for the final evaluation, checkpoint and export), shortens the schedule so the cosine
still ends at the last step; it also stops at the deadline whatever the plan said.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..config import InklingConfig
from ..model.layers import param_count
from ..model.params import cast_params, init_params, is_shape, param_shapes
from .batches import WindowSampler, validation_windows, window_length
from .corpus import CorpusSplit
from .loss import training_loss, window_losses

Params = dict[str, Any]
State = dict[str, Any]
LN2 = math.log(2.0)


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides what a run computes (resuming requires the same values)."""

    batch_size: int = 64
    seq_len: int = 512
    steps: int = 8000  # the schedule's length; a time budget may shorten it
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 200
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.95
    mtp_weight: float = 0.3
    seed: int = 0
    compute_dtype: str = "bfloat16"
    val_windows: int = 1024

    def validate(self) -> None:
        for name in ("batch_size", "seq_len", "steps", "val_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.warmup < 0 or self.mtp_weight < 0 or self.weight_decay < 0 or self.clip_norm <= 0:
            raise ValueError("warmup, mtp_weight and weight_decay must be >= 0 and clip_norm > 0")
        if self.compute_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"compute_dtype must be bfloat16 or float32, got {self.compute_dtype!r}")


@dataclass(frozen=True)
class LoopConfig:
    """How often the loop reports and saves (free to change when resuming)."""

    eval_every: int = 250
    ckpt_every: int = 1000
    log_every: int = 10
    calibrate_steps: int = 20
    time_budget: float | None = None  # seconds from `start_time`
    progress: bool = True


# ------------------------------------------------------------------------- optimizer


def decay_mask(params: Params) -> Params:
    """True for the leaves weight decay applies to: matrices, but not conv taps."""
    def decays(path, x):
        name = str(path[-1].key) if isinstance(path[-1], jax.tree_util.DictKey) else ""
        return x.ndim >= 2 and not name.endswith("conv")
    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """clip_by_global_norm -> adamw, with the learning rate an injected hyperparameter."""
    def build(learning_rate):
        return optax.chain(
            optax.clip_by_global_norm(tc.clip_norm),
            optax.adamw(learning_rate, b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay, mask=decay_mask))
    return optax.inject_hyperparams(build)(learning_rate=tc.lr)


def lr_table(tc: TrainConfig, total_steps: int) -> np.ndarray:
    """float32 [total_steps]: the rate of step s (0-based) is the schedule at s + 1, so the
    first step already moves and the last one uses the end value."""
    warmup = min(tc.warmup, max(total_steps - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=tc.lr, warmup_steps=warmup, decay_steps=max(total_steps, 1),
        end_value=tc.lr * tc.min_lr_ratio)
    return np.asarray(schedule(np.arange(1, total_steps + 1)), np.float32)


def init_state(cfg: InklingConfig, tc: TrainConfig, tx: optax.GradientTransformation) -> State:
    params = init_params(cfg, jax.random.key(tc.seed), dtype=jnp.float32)
    return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}


def make_train_step(cfg: InklingConfig, tc: TrainConfig, tx: optax.GradientTransformation):
    """(state, window int32 [B, T+1+D], lr float32 []) -> (state, metrics); jitted, state donated."""
    compute_dtype = jnp.dtype(tc.compute_dtype)

    def step(state: State, window: jax.Array, lr: jax.Array) -> tuple[State, dict[str, jax.Array]]:
        grads, metrics = jax.grad(training_loss, has_aux=True)(state["params"], cfg, window, compute_dtype,
                                                               tc.mtp_weight)
        opt_state = state["opt_state"]
        opt_state = opt_state._replace(hyperparams={**opt_state.hyperparams, "learning_rate": lr})
        updates, opt_state = tx.update(grads, opt_state, state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = dict(metrics, grad_norm=optax.global_norm(grads), lr=lr)
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    return jax.jit(step, donate_argnums=0)


def make_eval_step(cfg: InklingConfig, tc: TrainConfig):
    """(params fp32, window [B, T+1+D]) -> (trunk loss, MTP losses [D]), in the compute dtype."""
    compute_dtype = jnp.dtype(tc.compute_dtype)

    def evaluate(params: Params, window: jax.Array):
        return window_losses(cast_params(params, compute_dtype), cfg, window)

    return jax.jit(evaluate)


@functools.lru_cache(maxsize=8)
def compiled_steps(cfg: InklingConfig, tc: TrainConfig, eval_batch: int):
    """(train step, eval step), compiled ahead of time (so compile time is measured apart from
    step time) and once per process for a model, settings and eval batch."""
    tx = make_optimizer(tc)
    window = window_length(tc.seq_len, cfg.num_mtp_layers)
    params = jax.tree_util.tree_map(lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32), param_shapes(cfg),
                                    is_leaf=is_shape)
    state = {"params": params, "opt_state": jax.eval_shape(tx.init, params),
             "step": jax.ShapeDtypeStruct((), jnp.int32)}
    train = make_train_step(cfg, tc, tx).lower(
        state, jax.ShapeDtypeStruct((tc.batch_size, window), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.float32)).compile()
    evaluate = make_eval_step(cfg, tc).lower(
        state["params"], jax.ShapeDtypeStruct((eval_batch, window), jnp.int32)).compile()
    return train, evaluate


# ------------------------------------------------------------------------------ log


class RunLog:
    """Append-only JSON-lines log; on resume, records past the restored step are dropped."""

    def __init__(self, path: str, resume_step: int | None = None):
        self.path = path
        if resume_step is None:
            open(path, "w").close()
        else:  # what the resumed run will write again (its evals and end) goes
            kept = [r for r in read_log(path) if r["event"] == "start" or r.get("step", 0) < resume_step
                    or (r.get("step") == resume_step and r["event"] in ("train", "plan"))]
            with open(path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, **fields}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        return record


def read_log(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# --------------------------------------------------------------------------- trainer


@dataclass
class RunSummary:
    step: int
    planned_steps: int
    stop_reason: str  # "steps", "time budget" or "stop_at"
    train_loss: float | None
    val_loss: float
    val_bpb: float
    val_mtp: list[float]
    tokens_seen: int
    wall_s: float


class Trainer:
    """One training run in `out_dir` (checkpoints/, train_log.jsonl, loss_curve.png)."""

    def __init__(self, cfg: InklingConfig, tc: TrainConfig, split: CorpusSplit, out_dir: str,
                 loop: LoopConfig = LoopConfig(), resume: bool = False, start_time: float | None = None,
                 run_info: dict[str, Any] | None = None):
        import orbax.checkpoint as ocp

        tc.validate()
        self.cfg, self.tc, self.loop = cfg, tc, loop
        self.start_time = time.monotonic() if start_time is None else start_time
        self.out_dir = os.path.abspath(out_dir)
        os.makedirs(self.out_dir, exist_ok=True)
        self.window = window_length(tc.seq_len, cfg.num_mtp_layers)
        self.sampler = WindowSampler(split.train, self.window, tc.batch_size, tc.seed)
        self.val_windows = validation_windows(split.val, self.window, tc.val_windows)
        self.eval_batch = min(tc.batch_size, len(self.val_windows))
        self.tx = make_optimizer(tc)
        self.ckpt = ocp.CheckpointManager(
            os.path.join(self.out_dir, "checkpoints"),
            options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
        self.state = init_state(cfg, tc, self.tx)
        self._host_step = 0
        self.planned_steps = tc.steps
        self.calibrated = loop.time_budget is None
        self.train_seconds = 0.0  # summed over resumed runs
        self._segment_t0: float | None = None  # start of this process's training loop
        resume_step = None
        if resume:
            resume_step = self._restore()
        self.log = RunLog(os.path.join(self.out_dir, "train_log.jsonl"), resume_step)
        self.lrs = lr_table(tc, self.planned_steps)
        self.run_info = dict(run_info or {})
        self.log.write(
            "start", step=self.step, resumed=resume_step is not None, time=time.strftime("%Y-%m-%d %H:%M:%S"),
            model=self.cfg.to_hf(), param_count=param_count(self.state["params"]),
            train=dataclasses.asdict(tc), loop=dataclasses.asdict(loop), window=self.window,
            tokens_per_step=tc.batch_size * tc.seq_len, corpus=split.summary(),
            val_windows=int(len(self.val_windows)), device=jax.devices()[0].device_kind,
            backend=jax.default_backend(), jax_version=jax.__version__, **self.run_info)
        t0 = time.monotonic()
        self._train_step, self._eval_step = compiled_steps(cfg, tc, self.eval_batch)
        self.compile_s = time.monotonic() - t0

    # ---------------------------------------------------------------- checkpoints

    @property
    def step(self) -> int:
        """Steps taken, counted on the host (reading state["step"] would wait for the device)."""
        return self._host_step

    def _meta(self) -> dict[str, Any]:
        running = 0.0 if self._segment_t0 is None else time.monotonic() - self._segment_t0
        return {"step": self.step, "sampler": self.sampler.state_dict(), "planned_steps": self.planned_steps,
                "calibrated": self.calibrated, "train_seconds": self.train_seconds + running,
                "train": dataclasses.asdict(self.tc), "model": self.cfg.to_hf()}

    def save_checkpoint(self) -> float:
        """Save this step (unless it is saved already); returns the seconds the call blocked."""
        import orbax.checkpoint as ocp

        t0 = time.monotonic()
        if self.step in self.ckpt.all_steps():
            return 0.0
        self.ckpt.save(self.step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(self.state), meta=ocp.args.JsonSave(self._meta())))
        return time.monotonic() - t0

    def _restore(self) -> int:
        import orbax.checkpoint as ocp

        latest = self.ckpt.latest_step()
        if latest is None:
            raise FileNotFoundError(f"no checkpoint to resume in {self.ckpt.directory}")
        abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.state)
        restored = self.ckpt.restore(latest, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        meta = restored["meta"]
        if meta["train"] != json.loads(json.dumps(dataclasses.asdict(self.tc))):
            diff = {k: (v, getattr(self.tc, k)) for k, v in meta["train"].items() if getattr(self.tc, k, None) != v}
            raise ValueError(f"the checkpointed run used other settings (saved, given): {diff}")
        if meta["model"] != json.loads(json.dumps(self.cfg.to_hf())):
            raise ValueError("the checkpointed run trained another model config")
        self.state = restored["state"]
        self._host_step = int(self.state["step"])
        self.sampler.load_state_dict(meta["sampler"])
        self.planned_steps = int(meta["planned_steps"])
        self.calibrated = bool(meta["calibrated"]) or self.loop.time_budget is None
        self.train_seconds = float(meta["train_seconds"])
        return latest

    # -------------------------------------------------------------------- metrics

    def evaluate(self) -> dict[str, Any]:
        """Validation losses over the fixed windows (whole eval batches): trunk and per depth."""
        t0 = time.monotonic()
        n = len(self.val_windows) // self.eval_batch
        parts = [self._eval_step(self.state["params"], self.val_windows[i * self.eval_batch:(i + 1) * self.eval_batch])
                 for i in range(n)]
        trunk = float(np.mean([float(p[0]) for p in parts]))
        mtp = np.mean(np.stack([np.asarray(p[1], np.float32) for p in parts]), axis=0).tolist()
        return {"val_loss": trunk, "val_bpb": trunk / LN2, "val_mtp": mtp, "eval_s": time.monotonic() - t0}

    def _deadline_left(self) -> float:
        return math.inf if self.loop.time_budget is None else \
            self.start_time + self.loop.time_budget - time.monotonic()

    def _replan(self, step_s: float, eval_s: float, ckpt_s: float, reserve_s: float) -> None:
        """Fit the schedule into the time left: steps plus their share of evals and checkpoints."""
        per_step = step_s + eval_s / self.loop.eval_every + ckpt_s / self.loop.ckpt_every
        fit = self.step + int(max(self._deadline_left() - reserve_s, 0.0) / per_step)
        planned = max(min(self.tc.steps, fit), self.step + 1)
        self.log.write("plan", step=self.step, planned_steps=planned, requested_steps=self.tc.steps,
                       ms_per_step=1e3 * step_s, eval_s=eval_s, reserve_s=reserve_s)
        if planned != self.planned_steps:
            self.planned_steps = planned
            self.lrs = lr_table(self.tc, planned)
        self.calibrated = True

    # ----------------------------------------------------------------------- loop

    def run(self, stop_at: int | None = None) -> RunSummary:
        """Train to the planned step count (or `stop_at`, or the deadline), evaluating, logging
        and checkpointing on the way; ends with an evaluation and a checkpoint."""
        from tqdm import tqdm

        loop, tc = self.loop, self.tc
        tokens_per_step = tc.batch_size * tc.seq_len
        ckpt_s = 1.0  # until one is measured
        last_eval = self.evaluate()
        last_eval_step = self.step
        self.log.write("eval", step=self.step, **last_eval)
        eval_s = last_eval["eval_s"]
        pending: list[dict[str, jax.Array]] = []
        last_train: dict[str, Any] | None = None
        calib_from: tuple[int, float] | None = None
        step_s = 0.0  # latest measured seconds per step
        interval_t0, interval_step = time.monotonic(), self.step
        stop_reason = "steps"
        bar = tqdm(total=self.planned_steps, initial=self.step, unit="step", desc="training",
                   disable=not loop.progress, file=sys.stderr, dynamic_ncols=True)
        self._segment_t0 = time.monotonic()
        while self.step < self.planned_steps:
            if stop_at is not None and self.step >= stop_at:
                stop_reason = "stop_at"
                break
            reserve_s = eval_s + ckpt_s + 15.0  # final eval, checkpoint, export and plot
            if self.loop.time_budget is not None:
                # up to log_every steps are in flight: leave time for them too
                if self._deadline_left() - reserve_s < step_s * (loop.log_every + 1):
                    stop_reason = "time budget"
                    break
            batch = self.sampler.next_batch()
            self.state, metrics = self._train_step(self.state, batch, self.lrs[self.step])
            self._host_step += 1
            pending.append(metrics)
            bar.update(1)
            step = self.step
            if not self.calibrated:
                if calib_from is None:  # start timing once the first step is done
                    jax.block_until_ready(self.state["step"])
                    calib_from = (step, time.monotonic())
                elif step - calib_from[0] >= loop.calibrate_steps:
                    jax.block_until_ready(self.state["step"])
                    step_s = (time.monotonic() - calib_from[1]) / (step - calib_from[0])
                    self._replan(step_s, eval_s, ckpt_s, reserve_s)
                    bar.total = self.planned_steps
                    bar.refresh()
            if step % loop.log_every == 0 or step == self.planned_steps:
                fetched = jax.device_get(pending)
                pending = []
                now = time.monotonic()
                dt = (now - interval_t0) / max(step - interval_step, 1)
                interval_t0, interval_step = now, step
                step_s = dt
                last_train = self.log.write(
                    "train", step=step, loss=_mean(fetched, "loss"), trunk=_mean(fetched, "trunk"),
                    mtp=np.mean([m["mtp"] for m in fetched], axis=0).tolist(),
                    grad_norm=_mean(fetched, "grad_norm"), lr=float(fetched[-1]["lr"]),
                    ms_per_step=1e3 * dt, tokens_per_s=tokens_per_step / dt)
                bar.set_postfix(loss=f"{last_train['trunk']:.3f}", tok_s=f"{last_train['tokens_per_s']:.3g}",
                                ms=f"{last_train['ms_per_step']:.0f}", refresh=False)
            if step % loop.eval_every == 0 and step < self.planned_steps:
                last_eval, last_eval_step = self.evaluate(), step
                eval_s = last_eval["eval_s"]
                self.log.write("eval", step=step, **last_eval)
                bar.write(f"step {step}: val loss {last_eval['val_loss']:.4f} nats, "
                          f"{last_eval['val_bpb']:.3f} bits/byte", file=sys.stderr)
                interval_t0, interval_step = time.monotonic(), step  # keep eval time out of the step timing
            if step % loop.ckpt_every == 0 and step < self.planned_steps:
                ckpt_s = self.save_checkpoint()
                interval_t0, interval_step = time.monotonic(), step
        bar.close()
        if pending:  # steps since the last log record
            fetched = jax.device_get(pending)
            last_train = self.log.write(
                "train", step=self.step, loss=_mean(fetched, "loss"), trunk=_mean(fetched, "trunk"),
                mtp=np.mean([m["mtp"] for m in fetched], axis=0).tolist(), grad_norm=_mean(fetched, "grad_norm"),
                lr=float(fetched[-1]["lr"]))
        jax.block_until_ready(self.state["step"])
        self.train_seconds += time.monotonic() - self._segment_t0
        self._segment_t0 = None
        if last_eval_step != self.step:
            last_eval = self.evaluate()
            self.log.write("eval", step=self.step, **last_eval)
        self.save_checkpoint()
        self.ckpt.wait_until_finished()
        summary = RunSummary(
            step=self.step, planned_steps=self.planned_steps, stop_reason=stop_reason,
            train_loss=None if last_train is None else last_train["trunk"], val_loss=last_eval["val_loss"],
            val_bpb=last_eval["val_bpb"], val_mtp=last_eval["val_mtp"], tokens_seen=self.step * tokens_per_step,
            wall_s=time.monotonic() - self.start_time)
        self.log.write("end", step=self.step, planned_steps=self.planned_steps, stop_reason=stop_reason,
                       tokens_seen=summary.tokens_seen, train_s=self.train_seconds, wall_s=summary.wall_s,
                       compile_s=self.compile_s)
        return summary

    def close(self) -> None:
        self.ckpt.wait_until_finished()
        self.ckpt.close()


def _mean(records: list[dict[str, Any]], key: str) -> float:
    return float(np.mean([float(r[key]) for r in records]))

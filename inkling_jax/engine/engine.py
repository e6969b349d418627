"""The Engine: the public API over the host policy and the device runner.

    host policy   admission.py    admission and eviction over the pool and the prefix tree
                  checkpoints.py  which boundaries are checkpointed, what the tree gets
                  scheduler.py    each step's rows, and what its outputs change
    device side   runner.py       serving state, buckets, compiled steps, compaction moves

One `Engine.step()`:
  1. admit waiting requests while rows are free (prefix match, slots, pages; evict from the
     tree when short; roll back exactly what was taken and defer when still short);
  2. plan each running request's new tokens (a prefill chunk, or its one pending token) and
     checkpoint, grow page tables, pack a padded `StepBatch` (numpy, `steps.pack_batch`);
  3. apply pending compaction moves and id tables, run the compiled step for the bucket;
  4. read sampled tokens and log-probs (one transfer), update records, donate or insert
     checkpoints, finish requests.

A step is a transaction. The donated arena and the record that the step's outputs are
pending change together (`interrupts.critical`: a Ctrl-C lands before or after, never
between); if reading the outputs fails, they stay pending and the next call finishes the
step; admission and planning (which take slots and pages and record their owners), the host
commit and the other calls' host changes (submit, abort, close_session, evict_all, compact)
are critical sections; compaction moves are acknowledged only after their device copy. Should the
device state itself be lost (an exception after the arena was donated, outputs that cannot be read
twice), `reset` restarts every request from its tokens (the state is a pure function of them) with
an empty prefix cache: outputs stay exact.

One engine, one lock: every public method holds it, so calls from several threads are
serialized step by step (two threads calling `generate` share steps).

On a mesh (`Engine(cfg, params, config, mesh=ik.make_mesh(tp=2, ep=4))`) only the device
side changes: params are placed in the `ShardPlan`'s sharded layout, the arena is sharded
over "tp" and the steps run under `shard_map` (`inkling_jax/parallel/serving.py`). The
host side plans in the per-device layout's units, the same on every device; on several
hosts every process runs this same host loop (the engine is deterministic) and reads the
same replicated outputs.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from ..cache.layout import ArenaLayout
from ..cache.pool import UnitPool
from ..cache.prefix_tree import PrefixTree
from ..config import InklingConfig
from ..model.params import check_params
from ..parallel.plan import ShardPlan
from ..parallel.planner import plan_memory, pool_sizes
from ..parallel.serving import place_params
from ..steps import StepOutput, pack_batch
from ..steps.counts import host_rows
from .config import EngineConfig, SamplingParams, is_int
from .interrupts import critical
from .records import Request, ScoreResult, Session, StreamDelta
from .requests import Requests
from .runner import DecodeFeed, StepRunner, check_arena_fits, check_arena_fits_per_device
from .scheduler import HostOutputs, Scheduler, StepPlan
from .stats import EngineStats
from .text import TextState


@dataclass
class InFlight:
    """A step dispatched to the device whose outputs are not committed yet."""

    plan: StepPlan
    out: StepOutput
    failed_reads: int = 0


class Engine:
    """The serving engine (see the module docstring and API.md).

    cfg: the model's config. params: its params: unsharded (numpy or on one device), or, with
    a mesh, already in the mesh's sharded layout (`load_pretrained(path, mesh=mesh)`).
    mesh: None (one device), or a `make_mesh(tp, ep)` mesh to serve on: params are placed
    by `ShardPlan(cfg, mesh)` (ValueError naming the config field when the mesh cannot split
    the model), the arena is sized per device and refused when it does not fit the devices'
    free memory. A mesh of one device gives the same outputs as none.

    Attributes: `plan` (the ShardPlan, None without a mesh), `params` (as placed), `layout`
    (the arena layout of one device), `state` (the device serving state).

    `runner_cls`: the device side (`StepRunner`); a subclass may swap in another with its
    interface, e.g. `fake_runner.FakeRunner` (numpy, no XLA) to test the host policy.

    `tokenizer`: any object with `decode(list[int]) -> str` (e.g. `inkling_jax.tokenizer`'s);
    with one, completions and stream deltas carry text and `SamplingParams.stop` strings work."""

    runner_cls = StepRunner

    def __init__(self, cfg: InklingConfig, params: Any, config: EngineConfig | None = None,
                 mesh: Mesh | None = None, tokenizer: Any = None):
        config = config or EngineConfig()
        if not isinstance(config, EngineConfig):
            raise ValueError(f"config must be an EngineConfig, got {type(config).__name__}")
        config.validate()
        if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
            raise ValueError(f"tokenizer must have a decode(list[int]) -> str method, got {type(tokenizer).__name__}")
        self.tokenizer = tokenizer
        if mesh is not None and not isinstance(mesh, Mesh):
            raise ValueError(f"mesh must be a jax.sharding.Mesh (ik.make_mesh(tp=, ep=)), got {type(mesh).__name__}")
        self.plan = None if mesh is None else ShardPlan(cfg, mesh)  # ValueError naming the field that does not split
        if self.plan is None:
            try:
                check_params(cfg, params)
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"params do not fit the config: {exc}") from None
        elif not isinstance(params, dict) or "unembed" not in params:
            raise ValueError("params do not fit the config: expected a params dict (init_params / load_pretrained)")
        if config.spec_steps > cfg.num_mtp_layers:
            no_mtp = "; the checkpoint has no MTP weights" if not cfg.num_mtp_layers else ""
            raise ValueError(f"spec_steps={config.spec_steps} exceeds the model's MTP depths "
                             f"({cfg.num_mtp_layers}{no_mtp})")
        if config.spec_steps and "mtp" not in params:
            raise ValueError("spec_steps > 0 but the params hold no MTP weights")
        if config.spec_steps and config.track_interval <= config.spec_steps + 1:
            raise ValueError("track_interval must exceed spec_steps + 1 (one checkpoint per verify at most)")
        if self.plan is not None:
            params = place_params(self.plan, params)
        self.cfg, self.params, self.config = cfg, params, config
        # A plain engine's programs take the trunk alone (MTP fields and weights left out): they
        # are those of the same model without MTP depths (and its ring holds the trunk's windows)
        run_cfg, run_params = cfg, params
        if not config.spec_steps and cfg.num_mtp_layers and self.plan is None:
            run_cfg, run_params = cfg.trunk(), {k: v for k, v in params.items() if k != "mtp"}
        # one device's layout: with a mesh, each device's arena serves the local config
        step_cfg = run_cfg if self.plan is None else self.plan.local_cfg
        self.layout = lay = ArenaLayout.build(step_cfg, config.page_size, config.spec_steps)
        budget = lay.arena_units(config.num_slots, config.num_pages)
        num_units = budget if config.arena_units is None else config.arena_units
        if num_units < budget:
            raise ValueError(f"EngineConfig: arena_units={num_units} is smaller than the {budget} units that "
                             f"num_slots={config.num_slots} and num_pages={config.num_pages} need "
                             f"({lay.slot_units} units a slot, {lay.page_units} a page, plus the two sinks)")
        # before any host table of that size
        if self.plan is None:
            check_arena_fits(num_units, lay, params["unembed"].dtype)
        else:
            memory = plan_memory(cfg, params["unembed"].dtype, self.plan, pool_sizes(config))
            local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
            check_arena_fits_per_device(memory, local)
        self.pool = UnitPool(num_units, lay.slot_units, lay.page_units, unified=config.pool == "unified",
                             lazy=config.ping_pong == "lazy", num_slots=config.num_slots,
                             num_pages=config.num_pages, budget_units=budget)
        self.tree = PrefixTree(config.page_size, config.evict_policy) if config.prefix_cache else None
        self._stats = EngineStats(accepted_at_depth=[0] * config.spec_steps)
        self.requests = Requests(config, self.pool, self.tree, self._stats)
        self.admission, self.checkpoints = self.requests.admission, self.requests.checkpoints
        if self.pool.unified:  # the longest sequence: every page but those of one request's slots
            page_cap = (budget - (1 + self.admission.slots_per_request) * lay.slot_units) // lay.page_units - 1
        else:
            page_cap = config.num_pages
        self.max_context = min(config.max_context or page_cap * config.page_size, page_cap * config.page_size)
        self.runner = self.runner_cls(run_cfg, run_params, config, lay, self.pool, self.max_context,
                                      extend_checkpoints=self.checkpoints.max_per_step, plan=self.plan)
        if not self._own_drafts():  # a subclass's drafts_for: one verify round per dispatch (warmup's bucket too)
            self.runner.verify_rounds = 1
        self.scheduler = Scheduler(cfg, config, self.requests, self._stats, decode_steps=self.runner.decode_steps)
        self._lock = threading.RLock()
        self._flights: list[InFlight] = []  # dispatched, outputs not committed yet (oldest first)
        if config.warmup:
            self.warmup()

    # ------------------------------------------------------------------ public API

    @property
    def running(self) -> list[Request]:
        """Admitted requests (read only: `requests.Requests` owns the lists)."""
        return self.requests.running

    @property
    def waiting(self) -> list[Request]:
        """Submitted requests waiting for admission (read only)."""
        return self.requests.waiting

    @property
    def sessions(self) -> dict[int, Session]:
        """Open sessions by id (read only)."""
        return self.requests.sessions

    @property
    def state(self):
        """The device serving state (arena and id tables). With a mesh the arena is the global
        [num_units, tp, unit_elems_local] array sharded over "tp" (see `parallel/serving.py`)."""
        return self.runner.state

    @property
    def mesh(self) -> Mesh | None:
        return None if self.plan is None else self.plan.mesh

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | None = None,
                 session: int | None = None, n: int | None = None,
                 on_delta: Callable[[StreamDelta], Any] | None = None) -> list:
        """Generate for every prompt (continuous batching); returns completions in order.

        prompts: a list of token-id sequences (lists, tuples or 1-D numpy integer arrays).
        n (or `sampling.n`): samples per prompt; with n > 1 each prompt's entry is a list of n
        Completions (sample j draws as a request with seed `sampling.seed + j`).
        on_delta: a stream consumer the engine calls with each `StreamDelta` as the steps
        commit tokens (as `stream` yields them). If it raises (an Exception) for a request's
        delta, that request fails alone ("on_delta raised ...") and gets no more deltas.
        A request that failed alone (non-finite logits, an exception from a hook or from
        on_delta) is returned with finish_reason "error" and the reason in `Completion.error`;
        the others are exactly what they would have been without it."""
        sampling = self._sampling(sampling, n)
        requests = self.submit(prompts, sampling, session)
        if on_delta is None:
            while any(r.finish_reason is None and r.error is None for r in requests):
                self.step()
        else:
            by_id, failed = {r.rid: r for r in requests}, set()
            for delta in self.stream_requests(requests):
                if delta.request_id in failed:
                    continue
                try:
                    on_delta(delta)
                except Exception as exc:  # noqa: BLE001 - user code: its request fails, the others go on
                    failed.add(delta.request_id)
                    self._fail(by_id[delta.request_id], f"on_delta raised {type(exc).__name__}: {exc}")
        self._raise_given_up(requests)
        done = [r.completion() for r in requests]
        k = sampling.n
        return done if k == 1 else [done[i * k:(i + 1) * k] for i in range(len(done) // k)]

    def stream(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | None = None,
               session: int | None = None, n: int | None = None) -> Iterator[StreamDelta]:
        """Generate as `generate` does, yielding each request's new tokens as the steps commit
        them: a `StreamDelta` (prompt index, sample, token ids, their log-probs and top
        alternatives, the decoded text delta, the finish reason) per request per step that added
        something (a multi-step decode or a verify round adds several tokens at once). The
        requests are submitted (and validated) by this call; leaving the loop early (break,
        an exception, Ctrl-C, `close()`) aborts the ones not finished, and the engine stays
        exact. Text is held back while it may still be the start of a stop string."""
        return self.stream_requests(self.submit(prompts, self._sampling(sampling, n), session))

    def stream_requests(self, requests: list[Request]) -> Iterator[StreamDelta]:
        """`stream` over requests already submitted (`submit`): steps the engine until they
        finish, yielding their deltas; leaving early aborts the unfinished ones."""
        sent = [(0, 0, False)] * len(requests)  # (tokens, text characters, finish) reported
        try:
            while True:
                for i, r in enumerate(requests):
                    n_tok, n_text, finished = sent[i]
                    text = "" if r.text is None else r.text.visible()
                    done = r.finish_reason is not None
                    if len(r.out_tokens) > n_tok or len(text) > n_text or (done and not finished):
                        tops = r.out_tops[n_tok:] if r.sampling.logprobs else None
                        yield StreamDelta(r.index, r.sample, r.out_tokens[n_tok:], r.out_logprobs[n_tok:], tops,
                                          text[n_text:], r.finish_reason, r.rid)
                        sent[i] = (len(r.out_tokens), len(text), done)
                if all(r.finish_reason is not None or r.error is not None for r in requests):
                    self._raise_given_up(requests)
                    return
                self.step()
        finally:  # the loop was left early (or failed): its requests must not run on
            for r in requests:
                if r.finish_reason is None and r.error is None:
                    self.abort(r)

    def score(self, contexts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
              top_logprobs: int = 0) -> list[ScoreResult]:
        """log p(continuation[i] | context, continuation[:i]) for every token of each
        continuation (batched: one request per pair, scheduled like any other), with the
        `top_logprobs` most likely tokens at each position. Computed by extend steps that
        score their tokens; a request may start from a prefix-cache hit on its context (never
        deeper: the positions it scores run in its own steps). The values equal the
        reference forward's log-softmax within fp32 rounding (api.md, "Scoring"). A pair whose
        request failed alone (non-finite logits) has the reason in `ScoreResult.error` and None
        where no log-prob was computed; the others are unaffected."""
        if isinstance(contexts, (str, bytes)) or isinstance(continuations, (str, bytes)) \
                or len(contexts) != len(continuations):
            raise ValueError("score takes two lists of token-id sequences of the same length (contexts, continuations)")
        ctx, cont = self._checked_prompts(list(contexts)), self._checked_prompts(list(continuations))
        sp = SamplingParams(max_new_tokens=1, stop_at_eos=False, prompt_logprobs=top_logprobs)
        requests = self._submit([a + b for a, b in zip(ctx, cont)], sp, None, score_from=[len(a) for a in ctx])
        while any(r.finish_reason is None and r.error is None for r in requests):
            self.step()
        self._raise_given_up(requests)
        return [ScoreResult(b, r.prompt_lps[len(a):], r.prompt_tops[len(a):] if top_logprobs else None, r.cached,
                            error=r.error if r.finish_reason == "error" else None)
                for a, b, r in zip(ctx, cont, requests)]

    @staticmethod
    def _sampling(sampling: SamplingParams | None, n: int | None) -> SamplingParams:
        sampling = SamplingParams() if sampling is None else sampling
        if n is not None:
            if not isinstance(sampling, SamplingParams):
                raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
            sampling = dataclasses.replace(sampling, n=n)  # validated by SamplingParams
        return sampling

    @staticmethod
    def _raise_given_up(requests: list[Request]) -> None:
        """RuntimeError for a request the engine gave up on (it can never be admitted:
        finish_reason None); a request that failed alone (finish_reason "error") is returned."""
        failed = [r for r in requests if r.finish_reason is None and r.error is not None]
        if failed:
            raise RuntimeError(f"request {failed[0].rid} was given up: {failed[0].error}")

    def submit(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
               session: int | None = None) -> list[Request]:
        """Validate and queue requests (nothing changes if anything is bad): one per prompt, or
        `sampling.n` per prompt (prompt-major, sample j seeded `sampling.seed + j`)."""
        return self._submit(prompts, sampling, session)

    def _submit(self, prompts, sampling: SamplingParams, session: int | None,
                score_from: list[int] | None = None) -> list[Request]:
        with self._lock:
            if not isinstance(sampling, SamplingParams):
                raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
            sampling.validate()
            self._check_sampling(sampling, session)
            prompts = self._checked_prompts(prompts)
            sess = self._session_for_turn(session, len(prompts))
            now = time.perf_counter()
            out = []
            for i, p in enumerate(prompts):
                tokens = (sess.tokens + p) if sess else p
                first = None
                for j in range(sampling.n):
                    r = Request(self.requests.new_rid(), list(tokens), len(tokens), sampling, session=sess,
                                submitted=now, seed=((sampling.seed + j) * 7919 + i) % (1 << 31), index=i, sample=j,
                                fork_parent=first)
                    if score_from is not None:
                        r.score_from = score_from[i]
                    elif sampling.prompt_logprobs is not None:
                        r.score_from = max(1, len(sess.tokens) if sess else 1)
                    if r.score_from is not None:
                        r.prompt_top = sampling.prompt_logprobs or 0
                        r.prompt_lps, r.prompt_tops = [None] * len(tokens), [None] * len(tokens)
                    if self.tokenizer is not None:
                        r.text = TextState(self.tokenizer, sampling.stop, sampling.include_stop_str)
                    if j == 0 and sampling.n > 1 and self.tree is not None:
                        # the deepest page boundary before the prompt's last token: its siblings start there
                        r.fork_depth = (len(tokens) - 1) // self.config.page_size * self.config.page_size
                        first = r
                    if j == 0:
                        self._check_fits(i, r)
                    out.append(r)
            with critical():  # (host records: a Ctrl-C lands before or after, as in every call below)
                self.requests.queue(out, sess)
            return out

    def _check_sampling(self, sampling: SamplingParams, session: int | None) -> None:
        """ValueError naming what this engine cannot do for `sampling` (beyond its own checks)."""
        stops = sampling.stop_token_ids + ((self.cfg.eos_token_id,) if sampling.stop_at_eos else ())
        vocab, c = self.cfg.unpadded_vocab_size, self.config
        if len(stops) > c.max_stop_ids:
            raise ValueError(f"{len(sampling.stop_token_ids)} stop_token_ids (+ eos) exceed the engine's "
                             f"max_stop_ids={c.max_stop_ids}")
        bad = [t for t in sampling.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop token id {bad[0]} out of range [0, {vocab})")
        bad = [t for t, _ in sampling.logit_bias if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} out of range [0, {vocab})")
        if len(sampling.logit_bias) > c.max_logit_bias:
            raise ValueError(f"{len(sampling.logit_bias)} logit_bias entries exceed the engine's "
                             f"max_logit_bias={c.max_logit_bias}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(sampling, name) or 0
            if value > c.max_logprobs:
                raise ValueError(f"{name}={value} exceeds the engine's max_logprobs={c.max_logprobs}")
        if sampling.stop and self.tokenizer is None:
            raise ValueError("stop strings need the engine's tokenizer (Engine(..., tokenizer=...))")
        if sampling.n > 1 and session is not None:
            raise ValueError(f"n={sampling.n} samples cannot share a session turn (a session has one history)")

    def _check_fits(self, i: int, r: Request) -> None:
        total = len(r.tokens) + r.sampling.max_new_tokens + self.config.spec_steps
        if total > self.max_context:
            raise ValueError(f"prompt {i}: {len(r.tokens)} tokens + {r.sampling.max_new_tokens} new exceed the "
                             f"longest sequence the pool can ever hold ({self.max_context} tokens; "
                             f"{self.bytes_for_tokens(total) / 2**30:.2f} GiB would be needed)")
        problem = self.admission.never_fits(r)
        if problem:
            raise ValueError(f"prompt {i} can never be admitted: it {problem}")

    def _checked_prompts(self, prompts) -> list[list[int]]:
        """Prompts as lists of ints; ValueError naming the first bad one (the type or the id)."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a list of token-id sequences, got {type(prompts).__name__}")
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, np.ndarray):
                if p.ndim != 1 or not np.issubdtype(p.dtype, np.integer):
                    raise ValueError(f"prompt {i} must be a 1-D integer array, got {p.dtype} of shape {p.shape}")
                p = p.tolist()
            if isinstance(p, (str, bytes)) or not isinstance(p, (list, tuple)):
                raise ValueError(f"prompt {i} must be a sequence of token ids, got {type(p).__name__} "
                                 f"(prompts is a list of prompts; tokenize text first)")
            if not p:
                raise ValueError(f"prompt {i} is empty")
            wrong = [t for t in p if not is_int(t)]
            if wrong:
                raise ValueError(f"prompt {i}: token ids must be ints, got {type(wrong[0]).__name__} {wrong[0]!r}")
            bad = [t for t in p if not 0 <= t < self.cfg.unpadded_vocab_size]
            if bad:
                raise ValueError(f"prompt {i}: token id {bad[0]} out of range [0, {self.cfg.unpadded_vocab_size})")
            out.append([int(t) for t in p])
        return out

    def _session_for_turn(self, session: int | None, num_prompts: int) -> Session | None:
        if session is None:
            return None
        sess = self.requests.session(session)
        if num_prompts != 1:
            raise ValueError(f"a session turn takes exactly one prompt, got {num_prompts}")
        if sess.turn is not None:
            raise ValueError(f"session {session} already has a turn in flight")
        return sess

    def bytes_for_tokens(self, tokens: int) -> int:
        """Arena bytes one request of `tokens` positions occupies (its slots and pages; per
        device on a mesh)."""
        lay = self.layout
        units = self.admission.slots_per_request * lay.slot_units + self.admission.pages_for(tokens) * lay.page_units
        return units * lay.unit_elems * np.dtype(self.runner.dtype).itemsize

    # ------------------------------------------------------------------- the step

    def step(self) -> None:
        """Admit, run one compiled step over the running requests, commit its outputs.

        With overlap (`EngineConfig.overlap`) a decode dispatch is left in flight when the
        call returns, and the next call dispatches the one after it (planned ahead,
        `Scheduler.plan_ahead`) before it reads and commits it: the host's work of a dispatch
        runs while the device computes the next. Admission, prefill and checkpoint steps
        settle everything first, as without overlap."""
        with self._lock:
            with critical():  # planning takes slots and pages: a Ctrl-C waits until each has its owner
                ahead = self._plan_ahead()
            if ahead is not None:
                self._dispatch(ahead, feed_from=self._flights[-1])
                self._stats.overlapped_dispatches += 1
                self._settle(keep_last=True)
                return
            self._settle()
            with critical():  # (as above; a plan not dispatched gives its slots back: `_dispatch`)
                self.requests.admit_waiting()  # (a request that never fits is given up with the reason)
                self._write_count_rows()
                plan = self.scheduler.plan(self.drafts_for, self._verify_rounds())
            if plan is None:
                return
            self._dispatch(plan)
            if not (self.runner.overlap and plan.mode == "decode"):
                self._settle()

    def _plan_ahead(self):
        """The next decode dispatch, planned before the one in flight is read; None unless
        overlapping applies: one decode dispatch in flight, nothing waiting that a free row
        could admit."""
        if not self.runner.overlap or len(self._flights) != 1 or self._flights[0].failed_reads:
            return None
        if self.waiting and len(self.running) < self.config.max_running:
            return None
        return self.scheduler.plan_ahead(self._flights[0].plan)

    def _write_count_rows(self) -> None:
        """Write the count-table rows of requests admitted with a penalty (their prompt, and
        their outputs so far after a reset) before their first step (`steps/counts.py`)."""
        todo = self.requests.take_count_resets()
        if not todo:
            return
        rows = host_rows([r.tokens[:r.prompt_len] for r in todo], [r.out_tokens for r in todo],
                         self.cfg.unpadded_vocab_size)
        try:
            self.runner.reset_counts(np.array([r.count_row for r in todo], np.int32), rows)
        except BaseException:
            if self.runner.state_lost():
                self.reset()
            raise
        self.requests.count_resets_done(todo)

    def _dispatch(self, plan: StepPlan, feed_from: InFlight | None = None) -> None:
        """Pack and run `plan`; it joins the steps in flight (its outputs are not read here)."""
        try:
            shape = self.runner.shape(plan.mode, len(plan.rows), sum(plan.new_tokens), plan.max_pages, score=plan.score,
                                      rounds=plan.rounds)
            batch = pack_batch(shape, plan.rows, self.config.spec_steps, self.config.max_stop_ids,
                               self.config.max_logit_bias)
            feed = None if feed_from is None else DecodeFeed(feed_from.out, np.asarray(plan.feed_rows, np.int32),
                                                            np.asarray(plan.feed_steps, np.int32))
            self._apply_pool()
            with critical():  # the donated arena and the in-flight record change together
                out = self.runner.run(shape, batch, feed)
                self._flights.append(InFlight(plan, out))
        except BaseException:
            if not any(f.plan is plan for f in self._flights):
                self.scheduler.abandon(plan)
                if self.runner.state_lost():
                    self.reset()
            raise

    def _settle(self, keep_last: bool = False) -> None:
        """Commit the dispatched steps whose outputs were not read yet, oldest first (an
        earlier call was interrupted, or overlap left one in flight), but the newest with
        keep_last; and make sure the device state is whole."""
        if not self._flights:
            if self.runner.state_lost():
                self.reset()
            return
        while len(self._flights) > (1 if keep_last else 0):
            flight = self._flights[0]
            try:
                host = self._fetch(flight.out)
            except KeyboardInterrupt:
                raise  # the outputs are still on the device: the next call reads them
            except Exception:
                flight.failed_reads += 1
                if flight.failed_reads >= 2:  # they cannot be read: restart from the tokens
                    self.reset()
                raise
            with critical():
                self.scheduler.commit(flight.plan, host)
                self._flights.pop(0)
            self._apply_pool()

    def _fetch(self, out: StepOutput) -> HostOutputs:
        """The step's outputs on the host (the one device-to-host transfer of a step; the
        outputs the step's shape makes empty, e.g. drafts without speculation or top
        alternatives without logprobs, are made on the host instead of transferred)."""
        outs = (out.tokens, out.logprobs, out.num_accepted, out.accepted_logprobs, out.drafts, out.row_ok, out.top_ids,
                out.top_logprobs, out.prompt_logprobs, out.prompt_top_ids, out.prompt_top_logprobs)
        fetched = iter(jax.device_get([x for x in outs if x.size]))
        return HostOutputs(*(next(fetched) if x.size else np.zeros(x.shape, x.dtype) for x in outs))

    def _apply_pool(self) -> None:
        try:
            self.runner.apply_pool(self.pool)
        except BaseException:
            if self.runner.state_lost():
                self.reset()
            raise

    def reset(self) -> None:
        """Rebuild the device state from the host records after it was lost: every running
        request and session restarts from its tokens (outputs stay exact: the state is a
        pure function of them), the prefix cache is emptied, a step in flight is dropped."""
        with self._lock, critical():
            for flight in self._flights:
                self.scheduler.abandon(flight.plan)
            self._flights.clear()
            self.requests.restart_all()
            self.pool.compact()
            self.runner.rebuild_state(self.pool)
            self._stats.resets += 1

    def abort(self, request: Request | int) -> None:
        """Cancel a queued or running request (a Request or its id): it finishes with
        finish_reason "abort" and what it held is released (a running session turn hands its
        state back to the session, as a finished one does; the turn's tokens stay in the
        session's history). Nothing of other requests changes."""
        with self._lock:
            self._settle()
            if isinstance(request, Request) and (request.finish_reason is not None or request.error is not None):
                return  # it finished (perhaps in the step just settled): nothing to cancel
            # (a running one's freed slots are compacted on the device by the next step)
            with critical():
                self.requests.abort(request.rid if isinstance(request, Request) else request)

    def _fail(self, r: Request, reason: str) -> None:
        """r fails alone between steps (`Requests.fail`), unless it has finished meanwhile."""
        with self._lock:
            self._settle()
            if r.finish_reason is None and r.error is None:
                with critical():
                    self.requests.fail(r, reason)

    def _own_drafts(self) -> bool:
        """The verify steps check the MTP heads' drafts: `drafts_for` is not overridden (by a
        subclass or on the instance)."""
        return getattr(self.drafts_for, "__func__", None) is Engine.drafts_for

    def _verify_rounds(self) -> int:
        """R of the next verify dispatch: the runner's (decode_steps) with the MTP heads' own
        drafts, whose rounds after the first check what the device proposed; 1 with a
        `drafts_for` hook (the hook sees every round's drafts)."""
        return self.runner.verify_rounds if self._own_drafts() else 1

    def drafts_for(self, r: Request) -> list[int]:
        """The draft tokens a verify step checks for r: the MTP chain's proposals from the last
        step. A documented hook: subclasses may return other drafts (tests force every accept
        length with oracle drafts); any drafts give the same greedy output, only speed differs.
        With an override every verify dispatch runs one round (without, up to decode_steps
        rounds, the later ones checking the drafts the device proposed: `_verify_rounds`)."""
        return list(r.drafts)

    # -------------------------------------------------------------------- sessions

    def open_session(self) -> int:
        with self._lock:
            return self.requests.open_session()

    def close_session(self, sid: int, abort: bool = False) -> None:
        """Close a session and free its state. A turn in flight is an error, unless abort=True
        (the turn is aborted first)."""
        with self._lock:
            sess = self.requests.session(sid)
            if sess.turn is not None and abort:
                self.abort(sess.turn)
            with critical():
                self.requests.close_session(sid)

    # ------------------------------------------------------------- durable state

    def save(self, path, prefix_cache: bool = True) -> dict:
        """Write the open sessions (their histories and kept state) and the prefix cache (all
        of it, or with prefix_cache=False only the entries the sessions' prefixes lock) under
        the directory `path`, with orbax, atomically: a process killed meanwhile leaves the
        previous save loadable (`engine/persist.py`). Requests and session turns in flight
        are not saved (such a session is saved as its history before the turn). Returns the
        save's figures (path, slots, pages, bytes, seconds)."""
        from . import persist

        with self._lock:
            if self.plan is not None:
                raise ValueError("save: an engine on a mesh cannot be saved (save / restore is single-device)")
            self._settle()
            self._apply_pool()
            return persist.save(self, path, prefix_cache)

    def load(self, path) -> dict:
        """Restore a save into this engine, which must be idle (nothing queued or running, no
        session open): its sessions (with their ids) and prefix cache come back (the engine's
        own cache entries are dropped first). ValueError,
        with nothing changed, for a missing or partial save, another model's, one of another
        layout or engine settings (`persist.MUST_MATCH`), or a pool too small for it."""
        from . import persist

        with self._lock:
            return persist.load(self, path)

    @classmethod
    def restore(cls, path, cfg: InklingConfig, params: Any, config: EngineConfig | None = None,
                **kw: Any) -> "Engine":
        """A new engine with the sessions and prefix cache saved under `path` (`save`):
        `config` None takes the saved EngineConfig. Errors as for `load`."""
        from . import persist

        if config is None:
            _, state = persist.read_state(path)
            config = EngineConfig(**state["config"])
        engine = cls(cfg, params, config, **kw)
        engine.load(path)
        return engine

    # ---------------------------------------------------------------- the rest

    def warmup(self, wait: bool = True) -> None:
        """Compile everything serving can use: every step bucket (decode or verify, and
        extend) and the compaction copy for every move count, concurrently; afterwards nothing
        compiles. wait=False: return at once and let them compile in the background (a step
        waits only for its own program)."""
        with self._lock:
            self.runner.warmup(max_move_units=self.pool.budget_units, overlap=self.runner.overlap, wait=wait)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            s = dict(self._stats.as_dict(), **dataclasses.asdict(self.runner.stats))
            s["free_slots"] = self.pool.free_count("slot")
            s["free_pages"] = self.pool.free_count("page")
            s["live_slots"] = self.pool.live_count("slot")
            s["live_pages"] = self.pool.live_count("page")
            s["compaction_moves"] = self.pool.moves_done
            return s

    def compact(self) -> None:
        """Close every hole in the pool now (lazy mode) and apply the moves on the device."""
        with self._lock:
            with critical():
                self.pool.compact()
            self._apply_pool()

    def evict_all(self) -> None:
        """Drop every unlocked prefix-cache entry."""
        with self._lock:
            with critical():
                self.admission.evict_all()
            self._apply_pool()

    def read_slot(self, virtual_slot: int) -> dict[str, np.ndarray]:
        """A slot's contents for inspection (see `StepRunner.read_slot`), through the live table."""
        with self._lock:
            self._apply_pool()
            physical_slot = self.pool.physical_slot(virtual_slot)
            if physical_slot == 0:
                raise ValueError(f"slot {virtual_slot} is not allocated")
            return self.runner.read_slot(physical_slot)

    # ------------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """Raise AssertionError if accounting or aliasing is broken, or the device state is not
        what the host records say. After a failed call the engine may hold work it finishes
        on the next call (a step in flight, compaction moves not yet copied): that is checked
        to be recorded consistently."""
        with self._lock:
            self._check_invariants()

    def _check_invariants(self) -> None:
        pending = self.pool.has_pending_moves()
        self.pool.check(allow_pending_moves=True)
        owners_s: dict[int, str] = {}
        owners_p: dict[int, str] = {}

        def own(table, ids, who):
            for i in ids:
                assert i > 0, f"{who} holds a sink or absent id {i}"
                assert i not in table, f"id {i} owned by both {table[i]} and {who}"
                table[i] = who

        if self.tree is not None:
            self.tree.check()
            ts, tp = self.tree.owned()
            own(owners_s, ts, "tree")
            own(owners_p, tp, "tree")
        holders = [(f"session {s.sid}", s.held) for s in self.sessions.values() if s.held is not None]
        holders += [(f"request {r.rid}", r.held) for r in self.running]
        for who, held in holders:
            own(owners_s, held.slots(), who)
            own(owners_p, held.owned_pages, who)
            assert held.owned_pages <= set(held.virtual_pages), f"{who} owns pages outside its table"
        for kind, owners in (("slot", owners_s), ("page", owners_p)):
            live = set((self.pool.slots if kind == "slot" else self.pool.pages).p2v.values())
            assert live == set(owners), (f"{kind} accounting: live {sorted(live)} != owned {sorted(owners)} "
                                         f"(leaked {sorted(live - set(owners))}, unowned {sorted(set(owners) - live)})")
        assert self.admission.outstanding_reservations() >= 0
        # the device: whole, its id tables the pool's, every move copied (pool.check), so every
        # live virtual id's data sits at the row its table entry names
        assert not self.runner.state_lost(), "the device arena was lost (reset() rebuilds it)"
        slot_table, page_table = self.pool.tables()
        for name, host, recorded, device in () if pending else (
                ("slot", slot_table, self.runner.tables_on_device[0], self.runner.state.slot_v2p),
                ("page", page_table, self.runner.tables_on_device[1], self.runner.state.page_v2p)):
            if self.pool.tables_dirty:  # changed since the last step: the next step pushes them
                continue
            assert np.array_equal(host, recorded) and np.array_equal(host, np.asarray(device)), \
                f"the device's {name} id table differs from the pool's"
        for flight in self._flights:
            # a dispatch planned ahead (overlap) may hold requests that finished when the one
            # before it was committed: the device runs their rows as padding
            assert all(r in self.running or (flight.plan.feed_rows is not None and r.finish_reason is not None)
                       for r in flight.plan.requests), "a step in flight lost a request"

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
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Sequence

import jax
import numpy as np

from ..cache.layout import ArenaLayout
from ..cache.pool import UnitPool
from ..cache.prefix_tree import PrefixTree
from ..config import InklingConfig
from ..steps import pack_batch
from .admission import Admission
from .checkpoints import CheckpointPolicy
from .config import EngineConfig, SamplingParams
from .records import Completion, Request, Session
from .runner import StepRunner
from .scheduler import HostOutputs, Scheduler


class Engine:
    def __init__(self, cfg: InklingConfig, params: Any, config: EngineConfig | None = None):
        config = config or EngineConfig()
        config.validate()
        if config.spec_steps > cfg.num_mtp_layers:
            raise ValueError(f"spec_steps={config.spec_steps} exceeds the model's MTP depths "
                             f"({cfg.num_mtp_layers}{'; the checkpoint has no MTP weights' if not cfg.num_mtp_layers else ''})")
        if config.spec_steps and "mtp" not in params:
            raise ValueError("spec_steps > 0 but the params hold no MTP weights")
        if config.spec_steps and config.track_interval <= config.spec_steps + 1:
            raise ValueError("track_interval must exceed spec_steps + 1 (one checkpoint per verify at most)")
        self.cfg, self.params, self.config = cfg, params, config
        self.layout = lay = ArenaLayout.build(cfg, config.page_size, config.spec_steps)
        num_units = lay.arena_units(config.num_slots, config.num_pages)
        self.pool = UnitPool(num_units, lay.slot_units, lay.page_units, unified=config.pool == "unified",
                             lazy=config.ping_pong == "lazy", num_slots=config.num_slots,
                             num_pages=config.num_pages)
        self.tree = PrefixTree(config.page_size) if config.prefix_cache else None
        self._stats = dict(steps=0, extend_steps=0, decode_steps=0, cache_hit_tokens=0, verify_steps=0,
                           verify_rows=0, accepted_draft_tokens=0, generated_tokens=0, prompt_tokens=0,
                           evicted_slots=0, evicted_pages=0, deferred=0)
        self.admission = Admission(config, self.pool, self.tree, self._stats)
        if self.pool.unified:  # the longest sequence: every page but those of one request's slots
            page_cap = (num_units - (1 + self.admission.slots_per_request) * lay.slot_units) // lay.page_units - 1
        else:
            page_cap = config.num_pages
        self.max_context = min(config.max_context or page_cap * config.page_size, page_cap * config.page_size)
        self.checkpoints = CheckpointPolicy(config, self.tree, self.admission)
        self.scheduler = Scheduler(cfg, config, self.admission, self.checkpoints, self._stats)
        self.runner = StepRunner(cfg, params, config, lay, self.pool, self.max_context)
        self.waiting: list[Request] = []
        self.sessions: dict[int, Session] = {}
        self._rids = itertools.count()
        self._sids = itertools.count(1)
        if config.warmup:
            self.warmup()

    # ------------------------------------------------------------------ public API

    @property
    def running(self) -> list[Request]:
        return self.admission.running

    @property
    def state(self):
        """The device serving state (arena and id tables)."""
        return self.runner.state

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | None = None,
                 session: int | None = None) -> list[Completion]:
        """Generate for every prompt (continuous batching); returns completions in order."""
        sampling = sampling or SamplingParams()
        requests = self.submit(prompts, sampling, session)
        while any(r.finish_reason is None for r in requests):
            self.step()
        return [r.completion() for r in requests]

    def submit(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
               session: int | None = None) -> list[Request]:
        """Validate and queue requests (nothing changes if any prompt is bad)."""
        sampling.validate()
        prompts = [list(map(int, p)) for p in prompts]
        sess = None
        if session is not None:
            sess = self.sessions.get(session)
            if sess is None:
                raise ValueError(f"session {session} is not open")
            if len(prompts) != 1:
                raise ValueError(f"a session turn takes exactly one prompt, got {len(prompts)}")
            if sess.turn is not None:
                raise ValueError(f"session {session} already has a turn in flight")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in p if not 0 <= t < self.cfg.unpadded_vocab_size]
            if bad:
                raise ValueError(f"prompt {i}: token id {bad[0]} out of range [0, {self.cfg.unpadded_vocab_size})")
            history = len(sess.tokens) if sess else 0
            total = history + len(p) + sampling.max_new_tokens + self.config.spec_steps
            if total > self.max_context:
                raise ValueError(f"prompt {i}: {history + len(p)} tokens + {sampling.max_new_tokens} new exceed the "
                                 f"longest sequence the pool can ever hold ({self.max_context} tokens)")
        out = []
        now = time.perf_counter()
        for i, p in enumerate(prompts):
            tokens = (sess.tokens + p) if sess else p
            r = Request(next(self._rids), tokens, len(tokens), sampling, session=sess, submitted=now,
                        seed=(sampling.seed * 7919 + i) % (1 << 31))
            self._stats["prompt_tokens"] += len(p)
            self.waiting.append(r)
            out.append(r)
        if sess:
            sess.turn = out[0]
        return out

    def step(self) -> None:
        """Admit, run one compiled step over every running request, process the outputs."""
        self.admission.admit_waiting(self.waiting)
        plan = self.scheduler.plan(self.drafts_for)
        if plan is None:
            return
        shape = self.runner.shape(plan.mode, len(plan.rows), sum(plan.new_tokens), plan.max_pages)
        batch = pack_batch(shape, plan.rows, self.config.spec_steps, self.config.max_stop_ids)
        self.runner.apply_pool(self.pool)
        out = self.runner.run(shape, batch)
        host = HostOutputs(*jax.device_get((out.tokens, out.logprobs, out.num_accepted, out.accepted_logprobs,
                                            out.drafts)))
        self.scheduler.commit(plan, host)
        self.runner.apply_pool(self.pool)

    def drafts_for(self, r: Request) -> list[int]:
        """The draft tokens a verify step checks for r: the MTP chain's proposals from the last
        step. A documented hook: subclasses may return other drafts (tests force every accept
        length with oracle drafts); any drafts give the same greedy output, only speed differs."""
        return list(r.drafts)

    def open_session(self) -> int:
        sid = next(self._sids)
        self.sessions[sid] = Session(sid)
        return sid

    def close_session(self, sid: int) -> None:
        sess = self.sessions.get(sid)
        if sess is None:
            raise ValueError(f"session {sid} is not open")
        if sess.turn is not None:
            raise ValueError(f"session {sid} has a turn in flight")
        del self.sessions[sid]
        if sess.held is not None:
            self.admission.release(sess.held)
        self.runner.apply_pool(self.pool)

    def warmup(self) -> None:
        """Compile every bucket the scheduler can pick."""
        self.runner.warmup()

    def stats(self) -> dict[str, Any]:
        s = dict(self._stats, **self.runner.stats)
        s["free_slots"] = self.pool.free_count("slot")
        s["free_pages"] = self.pool.free_count("page")
        s["live_slots"] = self.pool.live_count("slot")
        s["live_pages"] = self.pool.live_count("page")
        s["compaction_moves"] = self.pool.moves_done
        rows = s["verify_rows"]
        s["mean_accept_length"] = (s["accepted_draft_tokens"] + rows) / rows if rows else 0.0  # bonus included
        s["depth_acceptance"] = [a / rows if rows else 0.0 for a in self.scheduler.accepted_at_depth]
        return s

    # ------------------------------------------------------------- pool and cache

    def compact(self) -> None:
        """Close every hole in the pool now (lazy mode) and apply the moves on the device."""
        self.pool.compact()
        self.runner.apply_pool(self.pool)

    def evict_all(self) -> None:
        """Drop every unlocked prefix-cache entry."""
        self.admission.evict_all()
        self.runner.apply_pool(self.pool)

    def read_slot(self, virtual_slot: int) -> dict[str, np.ndarray]:
        """A slot's contents for inspection (see `StepRunner.read_slot`), through the live table."""
        self.runner.apply_pool(self.pool)
        physical_slot = self.pool.physical_slot(virtual_slot)
        if physical_slot == 0:
            raise ValueError(f"slot {virtual_slot} is not allocated")
        return self.runner.read_slot(physical_slot)

    # ------------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """Raise AssertionError if accounting or aliasing is broken."""
        self.pool.check()
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

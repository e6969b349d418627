"""The host loop: admission, continuous batching with chunked prefill, prefix caching,
checkpoint bookkeeping, sessions, and the compiled steps.

One `Engine.step()`:
  1. admit waiting requests while rows are free (prefix match, slots, pages; evict from the
     tree when short; roll back exactly what was taken and defer when still short);
  2. pick each running request's new tokens (a prefill chunk, or its one pending token),
     plan checkpoints, grow page tables, and build a padded `StepBatch` (numpy);
  3. apply pending compaction moves and id tables, run the compiled step for the bucket;
  4. read sampled tokens and log-probs (one transfer), update records, donate or insert
     checkpoints, finish requests.

Memory accounting closes at all times (see `check_invariants`): every live slot and page is
owned by exactly one of the prefix tree, a session, or a running request.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .cache.layout import ArenaLayout
from .cache.pool import PoolExhausted, UnitPool
from .cache.prefix_tree import Node, PrefixTree
from .cache.state import ServingState, init_state
from .config import InklingConfig
from .steps import StepBatch, StepShape, check_batch, compile_lowered, compile_step


@dataclass(frozen=True)
class EngineConfig:
    max_running: int = 8  # requests decoded together (rows of a step)
    num_slots: int = 64  # conv-state slots (virtual ids 1..; 0 is the sink)
    num_pages: int = 256  # full-attention K/V pages
    page_size: int = 16
    pool: str = "unified"  # "unified" or "static"
    prefix_cache: bool = True
    track_interval: int = 64  # checkpoint cadence in tokens (a multiple of page_size)
    ping_pong: str = "eager"  # or "lazy"
    spec_steps: int = 0  # MTP draft tokens per round (0 = off)
    use_pallas: Any = "auto"  # True / False / "auto" (Pallas on GPU, jnp elsewhere)
    pallas_interpret: bool = False  # run the Pallas kernels in interpret mode (CPU tests)
    chunk_size: int = 64  # most new tokens one request adds in one step
    max_step_tokens: int = 256  # most packed tokens in one step
    max_context: int | None = None  # longest sequence served (default: all pages of one request)
    min_context_bucket: int = 128  # smallest context (tokens) a compiled step attends over
    min_token_bucket: int = 16  # smallest packed-token count of an extend step
    min_batch_bucket: int = 1  # smallest row count of a step (fewer buckets, more padding)
    warmup: bool = False  # compile every bucket at construction

    def validate(self) -> None:
        def need(cond, msg):
            if not cond:
                raise ValueError(f"EngineConfig: {msg}")
        need(self.max_running >= 1, "max_running must be >= 1")
        need(self.num_slots >= 1 and self.num_pages >= 1, "num_slots and num_pages must be >= 1")
        need(self.page_size >= 1, "page_size must be >= 1")
        need(self.pool in ("unified", "static"), f"pool must be 'unified' or 'static', got {self.pool!r}")
        need(self.ping_pong in ("eager", "lazy"), f"ping_pong must be 'eager' or 'lazy', got {self.ping_pong!r}")
        need(self.track_interval >= self.page_size and self.track_interval % self.page_size == 0,
             "track_interval must be a positive multiple of page_size")
        need(self.spec_steps >= 0, "spec_steps must be >= 0")
        need(1 <= self.chunk_size <= self.max_step_tokens, "need 1 <= chunk_size <= max_step_tokens")
        need(self.max_step_tokens >= self.max_running, "max_step_tokens must be >= max_running")


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int = 0
    stop_at_eos: bool = True  # stop after the model's eos token
    stop_token_ids: tuple[int, ...] = ()  # further tokens that end a generation (kept in the output)

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0 or self.top_k < 0 or not (0 < self.top_p <= 1):
            raise ValueError("SamplingParams: need temperature >= 0, top_k >= 0, 0 < top_p <= 1")


@dataclass
class Completion:
    tokens: list[int]
    logprobs: list[float]  # log p of each chosen token under the model
    cached_tokens: int  # prompt tokens served from the prefix cache
    finish_reason: str  # "length" or "stop"


@dataclass
class Session:
    sid: int
    slot: int  # virtual active slot (holds state for positions < committed)
    track: list[int]  # ping-pong checkpoint slots (virtual, -1 = absent)
    next_track: int
    pages: list[int]
    own_pages: set[int]
    tokens: list[int]  # history; tokens[committed:] are pending (the last sampled token)
    committed: int
    prefix_node: Node | None
    turn: "Request | None" = None  # the turn in flight (it holds the resources meanwhile)


@dataclass
class Request:
    rid: int
    tokens: list[int]  # everything known: prompt (after session history) + generated
    prompt_len: int  # len(tokens) when submitted
    sampling: SamplingParams
    slot: int = 0
    track: list[int] = field(default_factory=lambda: [-1, -1])
    next_track: int = 0
    last_ckpt: tuple[int, int] | None = None  # (depth, index into track) of the newest checkpoint
    pages: list[int] = field(default_factory=list)  # page table, virtual ids, position order
    own_pages: set[int] = field(default_factory=set)  # pages this request owns (the rest: tree)
    reserved_pages: int = 0  # pages promised at admission, not yet allocated
    committed: int = 0  # positions [0, committed) are in the state
    cached: int = 0
    cow_src: int = 0
    prefix_node: Node | None = None
    session: Session | None = None
    out_tokens: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    drafts: list[int] = field(default_factory=list)  # speculative: the next round's draft tokens
    accept_lengths: list[int] = field(default_factory=list)  # speculative: drafts accepted per verify round
    seed: int = 0
    submitted: float = 0.0
    first_token_at: float | None = None

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.committed

    def completion(self) -> Completion:
        return Completion(list(self.out_tokens), list(self.out_logprobs), self.cached, self.finish_reason)


# Compiled steps shared by engines of the same model, layout and state geometry (a process-wide
# jit cache: an engine rebuilt with the same shapes does not compile again).
_COMPILED: dict[Any, Any] = {}


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def _ladder(top: int, start: int = 1) -> list[int]:
    out, v = [], start
    while v < top:
        out.append(v)
        v *= 2
    return out + [top]


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
        if config.use_pallas == "auto":
            self.use_pallas = jax.default_backend() == "gpu"
        elif isinstance(config.use_pallas, bool):
            self.use_pallas = config.use_pallas
            if self.use_pallas and jax.default_backend() != "gpu" and not config.pallas_interpret:
                raise ValueError("use_pallas=True needs a GPU (or pallas_interpret=True for interpret mode)")
        else:
            raise ValueError(f"use_pallas must be True, False or 'auto', got {config.use_pallas!r}")
        from pallas_kernels import conv_ops  # (pallas_kernels imports inkling_jax.cache)

        self.ops = conv_ops(self.use_pallas, config.pallas_interpret)
        self.dtype = params["unembed"].dtype
        self.layout = ArenaLayout.build(cfg, config.page_size, config.spec_steps)
        lay = self.layout
        num_units = (config.num_slots + 1) * lay.slot_units + (config.num_pages + 1) * lay.page_units
        self.pool = UnitPool(num_units, lay.slot_units, lay.page_units, unified=config.pool == "unified",
                             lazy=config.ping_pong == "lazy", num_slots=config.num_slots,
                             num_pages=config.num_pages)
        self.state: ServingState = init_state(lay, num_units, len(self.pool.slots.v2p) - 1,
                                              len(self.pool.pages.v2p) - 1, self.dtype)
        self.tree = PrefixTree(config.page_size) if config.prefix_cache else None
        self.slots_per_request = 1 + (2 if config.ping_pong == "eager" else 1) if config.prefix_cache else 1
        # bucket ladders
        if self.pool.unified:
            page_cap = (num_units - (1 + self.slots_per_request) * lay.slot_units) // lay.page_units - 1
        else:
            page_cap = config.num_pages
        self.max_context = min(config.max_context or page_cap * config.page_size, page_cap * config.page_size)
        top_b = _pow2(config.max_running)
        self.batch_buckets = _ladder(top_b, min(top_b, _pow2(config.min_batch_bucket)))
        top_t = _pow2(config.max_step_tokens)
        self.token_buckets = _ladder(top_t, min(top_t, _pow2(max(config.min_token_bucket, config.max_running))))
        top_p = _pow2(math.ceil(self.max_context / config.page_size))
        self.page_buckets = _ladder(top_p, min(top_p, _pow2(math.ceil(config.min_context_bucket / config.page_size))))
        self._compiled: dict[StepShape, Any] = {}
        self._move_fns: dict[int, Any] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.sessions: dict[int, Session] = {}
        self._rids = itertools.count()
        self._sids = itertools.count(1)
        self._stats = dict(compiles=0, compile_seconds=0.0, steps=0, extend_steps=0, decode_steps=0,
                           cache_hit_tokens=0, verify_steps=0, verify_rows=0, accepted_draft_tokens=0,
                           generated_tokens=0, prompt_tokens=0, evicted_slots=0, evicted_pages=0, deferred=0)
        self._accepted_at_depth = [0] * config.spec_steps
        # tests may replace the drafts a verify step checks: f(request, drafts) -> drafts
        self.draft_override = None
        if config.warmup:
            self.warmup()

    # ------------------------------------------------------------------ public API

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

    def open_session(self) -> int:
        sid = next(self._sids)
        self.sessions[sid] = Session(sid, 0, [-1, -1], 0, [], set(), [], 0, None)
        return sid

    def close_session(self, sid: int) -> None:
        sess = self.sessions.get(sid)
        if sess is None:
            raise ValueError(f"session {sid} is not open")
        if sess.turn is not None:
            raise ValueError(f"session {sid} has a turn in flight")
        del self.sessions[sid]
        self._release(slot=sess.slot, track=sess.track, own_pages=sess.own_pages, node=sess.prefix_node)
        self._sync_pool()

    def stats(self) -> dict[str, Any]:
        s = dict(self._stats)
        s["free_slots"] = self.pool.free_count("slot")
        s["free_pages"] = self.pool.free_count("page")
        s["live_slots"] = self.pool.live_count("slot")
        s["live_pages"] = self.pool.live_count("page")
        s["compaction_moves"] = self.pool.moves_done
        rows = s["verify_rows"]
        s["mean_accept_length"] = (s["accepted_draft_tokens"] + rows) / rows if rows else 0.0  # bonus included
        s["depth_acceptance"] = [a / rows if rows else 0.0 for a in self._accepted_at_depth]
        return s

    # ------------------------------------------------------------------ resources

    def _outstanding_reservations(self) -> int:
        return sum(r.reserved_pages for r in self.running)

    def _try_alloc(self, slots: int, pages: int, reserve: int = 0) -> tuple[list[int], list[int]] | None:
        """Allocate slots and pages (leaving `reserve` pages free for promises), evicting
        from the tree when short. None, with nothing taken, when it cannot be done."""
        need_pages = pages + reserve + self._outstanding_reservations()
        if not self.pool.can_alloc(slots, need_pages) and self.tree is not None:
            self._evict_for(slots, need_pages)
        if not self.pool.can_alloc(slots, need_pages):
            return None
        got_s, got_p = [], []
        try:
            for _ in range(slots):
                got_s.append(self.pool.alloc_slot())
            for _ in range(pages):
                got_p.append(self.pool.alloc_page())
        except PoolExhausted:  # cannot happen after can_alloc; roll back exactly what was taken
            for s in got_s:
                self.pool.free_slot(s)
            for p in got_p:
                self.pool.free_page(p)
            return None
        return got_s, got_p

    def _evict_for(self, slots: int, pages: int) -> None:
        """Evict LRU tree leaves until `slots` and `pages` fit (or nothing is left)."""
        while not self.pool.can_alloc(slots, pages):
            ev_pages, ev_slots = self.tree.evict(need_slots=1 if slots else 0, need_pages=1 if pages else 0)
            if not ev_pages and not ev_slots:
                return
            for p in ev_pages:
                self.pool.free_page(p)
            for s in ev_slots:
                self.pool.free_slot(s)
            self._stats["evicted_pages"] += len(ev_pages)
            self._stats["evicted_slots"] += len(ev_slots)

    def compact(self) -> None:
        """Close every hole in the pool now (lazy mode) and apply the moves on the device."""
        self.pool.compact()
        self._sync_pool()

    def read_slot(self, virtual: int) -> dict[str, np.ndarray]:
        """A slot's contents for inspection: {"target.3.conv": [K-1, C], "target.0.ring":
        [ring, 2, kv_heads, head_dim], "draft.1.hidden": [H], ...}, read through the live table."""
        from .cache.state import read_field, slot_rows

        self._sync_pool()
        lay = self.layout
        phys = jnp.asarray([self.pool.physical_slot(virtual)])
        if int(phys[0]) == 0:
            raise ValueError(f"slot {virtual} is not allocated")
        out = {}
        for tag, blocks in (("target", lay.target), ("draft", lay.draft)):
            for i, fs in enumerate(blocks):
                for name in ("conv", "ring", "hidden"):
                    f = getattr(fs, name)
                    if f is not None:
                        out[f"{tag}.{i}.{name}"] = np.asarray(
                            read_field(self.state.arena, lay, slot_rows(lay, phys, f), f))[0]
        return out

    def evict_all(self) -> None:
        """Drop every unlocked prefix-cache entry."""
        if self.tree is None:
            return
        pages, slots = self.tree.evict(need_slots=1 << 30, need_pages=1 << 30)
        for p in pages:
            self.pool.free_page(p)
        for s in slots:
            self.pool.free_slot(s)
        self._sync_pool()

    def _release(self, slot: int, track: list[int], own_pages: set[int], node: Node | None) -> None:
        """Free a request's or session's real (non -1, nonzero) slots and its own pages."""
        if slot > 0:
            self.pool.free_slot(slot)
        for s in track:
            if s > 0:
                self.pool.free_slot(s)
        for p in sorted(own_pages):
            self.pool.free_page(p)
        if node is not None:
            self.tree.unlock(node)

    def _pages_for(self, length: int) -> int:
        return math.ceil(length / self.config.page_size)

    # ------------------------------------------------------------------- admission

    def _admit(self, r: Request) -> bool:
        """Give r its slots, pages and prefix; False (nothing changed) if it must wait."""
        ps = self.config.page_size
        final_len = len(r.tokens) + r.sampling.max_new_tokens + self.config.spec_steps
        if r.session is not None and r.session.slot > 0:
            sess = r.session
            need_track = [i for i, s in enumerate(sess.track) if s == -1] \
                if self.config.ping_pong == "eager" and self.tree is not None else []
            total_pages = max(self._pages_for(final_len) - len(sess.pages), 0)
            got = self._try_alloc(len(need_track), 0, reserve=total_pages)
            if got is None:
                return False
            for i, s in zip(need_track, got[0]):
                sess.track[i] = s
            r.slot, r.track, r.next_track = sess.slot, list(sess.track), sess.next_track
            r.pages, r.own_pages, r.committed = list(sess.pages), set(sess.own_pages), sess.committed
            r.prefix_node, r.reserved_pages = sess.prefix_node, total_pages
            sess.slot, sess.track, sess.pages, sess.own_pages, sess.prefix_node = 0, [-1, -1], [], set(), None
            return True

        match = None
        if self.tree is not None:
            match = self.tree.match(r.tokens, max_depth=len(r.tokens) - 1)
            if match.depth > 0:
                self.tree.lock(match.node)
        depth = match.depth if match else 0
        n_slots = self.slots_per_request
        total_pages = self._pages_for(final_len) - depth // ps
        got = self._try_alloc(n_slots, 0, reserve=total_pages)
        if got is None:
            if match and match.depth > 0:
                self.tree.unlock(match.node)
            return False
        slots = got[0]
        r.slot = slots[0]
        if self.tree is not None:
            r.track = slots[1:] + [-1] * (3 - n_slots)
        r.reserved_pages = total_pages
        if depth:
            r.pages = list(match.pages)
            r.prefix_node = match.node
            r.cow_src = match.node.checkpoint
            r.committed = r.cached = depth
            self._stats["cache_hit_tokens"] += depth
        return True

    def _admit_waiting(self) -> None:
        while self.waiting and len(self.running) < self.config.max_running:
            r = self.waiting[0]
            if not self._admit(r):
                self._stats["deferred"] += 1
                if not self.running:
                    raise RuntimeError("a request cannot be admitted into an idle engine: pool too small")
                return
            self.waiting.pop(0)
            self.running.append(r)

    # ----------------------------------------------------------------------- steps

    def _shape(self, mode: str, rows: int, tokens: int, pages: int) -> StepShape:
        b = next(x for x in self.batch_buckets if x >= rows)
        p = next(x for x in self.page_buckets if x >= pages)
        if mode == "decode":
            return StepShape("decode", b, b, 1, p)
        if mode == "verify":
            q = self.config.spec_steps + 1
            return StepShape("verify", b, b * q, q, p)
        t = next(x for x in self.token_buckets if x >= max(tokens, b))
        return StepShape("extend", b, t, min(self.config.chunk_size, t), p)

    def _compiled_step(self, shape: StepShape):
        fn = self._compiled.get(shape)
        if fn is None:
            key = (self.cfg, self.layout, shape, self.use_pallas, self.config.pallas_interpret,
                   jax.tree_util.tree_structure(self.params),
                   tuple((x.shape, str(x.dtype)) for x in jax.tree_util.tree_leaves((self.params, self.state))))
            fn = _COMPILED.get(key)
            if fn is None:
                t0 = time.perf_counter()
                jitted = compile_step(self.cfg, self.layout, shape, self.use_pallas, self.config.pallas_interpret)
                fn = compile_lowered(jitted.lower(self.params, self.state, self._dummy_batch(shape)))
                self._stats["compile_seconds"] += time.perf_counter() - t0
                _COMPILED[key] = fn
            self._stats["compiles"] += 1  # executables this engine needed (process-wide cache hits included)
            self._compiled[shape] = fn
        return fn

    def warmup(self) -> None:
        """Compile every bucket the scheduler can pick."""
        for b in self.batch_buckets:
            for p in self.page_buckets:
                self._compiled_step(self._shape("decode", b, b, p))
                for t in self.token_buckets:
                    if t >= b:
                        self._compiled_step(self._shape("extend", b, t, p))

    def _dummy_batch(self, shape: StepShape) -> StepBatch:
        return StepBatch.empty(shape, self.config.spec_steps)

    def _sync_pool(self) -> None:
        """Apply planned compaction moves and refreshed id tables to the device state."""
        src, dst = self.pool.take_moves()
        if len(src):
            n = _pow2(len(src))
            pad = n - len(src)
            src = np.concatenate([src, np.zeros(pad, np.int32)])  # sink -> sink: inert
            dst = np.concatenate([dst, np.zeros(pad, np.int32)])
            fn = self._move_fns.get(n)
            if fn is None:
                fn = jax.jit(self.ops.move_units, donate_argnums=(0,))
                self._move_fns[n] = fn
            self.state = self.state.replace(arena=fn(self.state.arena, src, dst))
        if self.pool.tables_dirty:
            slot_t, page_t = self.pool.tables()
            self.state = self.state.replace(slot_v2p=jnp.asarray(slot_t), page_v2p=jnp.asarray(page_t))

    def step(self) -> None:
        """Admit, run one compiled step over every running request, process the outputs."""
        self._admit_waiting()
        if not self.running:
            return
        cfg = self.config
        spec = cfg.spec_steps
        prefill = any(r.pending > 1 for r in self.running)
        mode = "extend" if prefill else ("verify" if spec else "decode")
        plan: list[tuple[Request, int]] = []
        if mode == "verify":
            plan = [(r, spec + 1) for r in self.running]
        else:
            budget = cfg.max_step_tokens
            for r in self.running:
                n = max(min(r.pending, cfg.chunk_size, budget - (len(self.running) - len(plan) - 1)), 1)
                plan.append((r, n))
                budget -= n
        for r, n in plan:
            self._grow_pages(r, r.committed + n)
        max_pages = max(len(r.pages) for r, _ in plan)
        shape = self._shape(mode, len(plan), sum(n for _, n in plan), max_pages)
        tracks = [self._plan_checkpoint(r, n) for r, n in plan]
        batch = self._build_batch(shape, plan, tracks)
        check_batch(batch, shape, spec)
        self._sync_pool()
        fn = self._compiled_step(shape)
        out, self.state = fn(self.params, self.state, batch)
        tokens, logprobs, n_acc, draft_lp, drafts = jax.device_get(
            (out.tokens, out.logprobs, out.num_accepted, out.accepted_logprobs, out.drafts))
        self._stats["steps"] += 1
        self._stats[f"{mode}_steps"] += 1
        now = time.perf_counter()
        for i, (r, n) in enumerate(plan):
            r.cow_src = 0
            if mode == "verify":
                a = int(n_acc[i])
                q0 = int(batch.query_start[i])
                emitted = [int(t) for t in batch.tokens[q0 + 1:q0 + 1 + a]] + [int(tokens[i])]
                lps = [float(x) for x in draft_lp[i, :a]] + [float(logprobs[i])]
                r.committed += a + 1
                for tok, lp in zip(emitted, lps):
                    self._emit(r, tok, lp, now)
                r.accept_lengths.append(a)
                self._stats["verify_rows"] += 1
                self._stats["accepted_draft_tokens"] += a
                for d in range(a):
                    self._accepted_at_depth[d] += 1
                if tracks[i] and a + 1 >= tracks[i][1]:
                    self._after_checkpoint(r, tracks[i])
                r.drafts = [int(t) for t in drafts[i]]
                continue
            r.committed += n
            if tracks[i]:
                self._after_checkpoint(r, tracks[i])
            if r.committed == len(r.tokens):  # the row reached the end: its sample is the next token
                self._emit(r, int(tokens[i]), float(logprobs[i]), now)
                if spec:
                    r.drafts = [int(t) for t in drafts[i]]
        for r in [r for r in self.running if r.finish_reason is not None]:
            self._finish(r)
        self._sync_pool()

    def _grow_pages(self, r: Request, length: int) -> None:
        need = self._pages_for(length) - len(r.pages)
        for _ in range(need):
            if r.reserved_pages <= 0:
                raise RuntimeError("request outgrew its page reservation")
            page = self.pool.alloc_page()  # reserved at admission: cannot fail
            r.reserved_pages -= 1
            r.pages.append(page)
            r.own_pages.add(page)

    def _plan_checkpoint(self, r: Request, n: int) -> tuple[int, int] | None:
        """(track index, track_len) when this step crosses a checkpoint boundary, else None."""
        if self.tree is None:
            return None
        interval = self.config.track_interval
        boundary = (r.committed + n) // interval * interval
        if boundary <= r.committed:
            return None
        idx = r.next_track
        if r.track[idx] == -1:  # lazy: take the second slot only around a boundary
            got = self._try_alloc(1, 0)
            if got is None:
                return None
            r.track[idx] = got[0][0]
        return idx, boundary - r.committed

    def _after_checkpoint(self, r: Request, track: tuple[int, int]) -> None:
        idx, _ = track
        depth = r.committed // self.config.track_interval * self.config.track_interval
        if self.config.ping_pong == "lazy":
            other = 1 - idx
            if r.track[other] > 0:
                self.pool.free_slot(r.track[other])
                r.track[other] = -1
        r.last_ckpt = (depth, idx)
        r.next_track = 1 - idx
        if r.committed < r.prompt_len and r.session is None:
            self._donate(r)

    def _donate(self, r: Request) -> None:
        """A request still in prefill hands its newest checkpoint (and pages) to the tree."""
        depth, idx = r.last_ckpt
        slot = r.track[idx]
        npages = depth // self.config.page_size
        dup_pages, dup_slots, node = self.tree.insert(r.tokens[:depth], r.pages[:npages], slot)
        r.own_pages -= set(r.pages[:npages]) - set(dup_pages)
        # lock the new path before anything can evict: the request still reads those pages
        self.tree.lock(node)
        if r.prefix_node is not None:
            self.tree.unlock(r.prefix_node)
        r.prefix_node = node
        if not dup_slots:  # the tree took the checkpoint slot: replace it
            got = self._try_alloc(1, 0) if self.config.ping_pong == "eager" else None
            r.track[idx] = got[0][0] if got else -1  # -1: taken again at the next boundary
            r.last_ckpt = None

    def _emit(self, r: Request, token: int, logprob: float, now: float) -> None:
        r.tokens.append(token)  # the state's history, even past a stop (it is committed)
        if r.finish_reason is not None:
            return
        if r.first_token_at is None:
            r.first_token_at = now
        r.out_tokens.append(token)
        r.out_logprobs.append(logprob)
        self._stats["generated_tokens"] += 1
        if (r.sampling.stop_at_eos and token == self.cfg.eos_token_id) or token in r.sampling.stop_token_ids:
            r.finish_reason = "stop"
        elif len(r.out_tokens) >= r.sampling.max_new_tokens:
            r.finish_reason = "length"

    def _finish(self, r: Request) -> None:
        self.running.remove(r)
        r.reserved_pages = 0
        if r.session is not None:
            sess = r.session
            sess.slot, sess.track, sess.next_track = r.slot, r.track, r.next_track
            sess.pages, sess.own_pages, sess.committed = r.pages, r.own_pages, r.committed
            sess.tokens, sess.prefix_node, sess.turn = r.tokens, r.prefix_node, None
            return
        track = list(r.track)
        if self.tree is not None and r.last_ckpt is not None:
            depth, idx = r.last_ckpt
            npages = depth // self.config.page_size
            dup_pages, dup_slots, node = self.tree.insert(r.tokens[:depth], r.pages[:npages], track[idx])
            r.own_pages -= set(r.pages[:npages]) - set(dup_pages)
            if not dup_slots:
                track[idx] = -1  # now the tree's
        self._release(r.slot, track, r.own_pages, r.prefix_node)

    def _build_batch(self, shape: StepShape, plan: list[tuple[Request, int]],
                     tracks: list[tuple[int, int] | None]) -> StepBatch:
        spec = self.config.spec_steps
        batch = StepBatch.empty(shape, spec)
        b = batch  # numpy arrays, filled in place
        b.token_offset[:] = shape.query + self.cfg.conv_kernel_size  # padding: past every tap and num_new
        pos = 0
        for i, (r, n) in enumerate(plan):
            if shape.mode == "verify":
                drafts = list(r.drafts)
                if self.draft_override is not None:
                    drafts = list(self.draft_override(r, drafts))
                row_tokens = [r.tokens[r.committed]] + drafts
                remaining = r.sampling.max_new_tokens - len(r.out_tokens)
                b.max_accept[i] = max(0, min(spec, remaining - 1))
                b.sample_next[i] = True
            else:
                row_tokens = r.tokens[r.committed:r.committed + n]
                end = r.committed + n
                ahead = r.tokens[end:end + spec + 1]
                b.lookahead[i, :len(ahead)] = ahead
                b.sample_next[i] = end == len(r.tokens)
            b.tokens[pos:pos + n] = row_tokens
            b.token_row[pos:pos + n] = i
            b.token_offset[pos:pos + n] = np.arange(n)
            b.slot[i] = r.slot
            b.has_state[i] = r.committed > 0
            b.seq_start[i] = r.committed
            b.num_new[i] = n
            b.query_start[i] = pos
            b.pages[i, :len(r.pages)] = r.pages
            if tracks[i]:
                b.track_slot[i] = r.track[tracks[i][0]]
                b.track_len[i] = tracks[i][1]
            b.cow_src[i] = r.cow_src
            b.temperature[i] = r.sampling.temperature
            b.top_k[i] = r.sampling.top_k
            b.top_p[i] = r.sampling.top_p
            b.seed[i] = r.seed
            stops = ([self.cfg.eos_token_id] if r.sampling.stop_at_eos and self.cfg.eos_token_id is not None else []) \
                + list(r.sampling.stop_token_ids)
            b.stop_ids[i, :min(len(stops), b.stop_ids.shape[1])] = stops[:b.stop_ids.shape[1]]
            pos += n
        return batch

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
        for sess in self.sessions.values():
            own(owners_s, [s for s in [sess.slot, *sess.track] if s > 0], f"session {sess.sid}")
            own(owners_p, sess.own_pages, f"session {sess.sid}")
        for r in self.running:
            own(owners_s, [s for s in [r.slot, *r.track] if s > 0], f"request {r.rid}")
            own(owners_p, r.own_pages, f"request {r.rid}")
            assert set(r.own_pages) <= set(r.pages), f"request {r.rid} owns pages outside its table"
        for kind, owners in (("slot", owners_s), ("page", owners_p)):
            live = set((self.pool.slots if kind == "slot" else self.pool.pages).p2v.values())
            assert live == set(owners), (f"{kind} accounting: live {sorted(live)} != owned {sorted(owners)} "
                                         f"(leaked {sorted(live - set(owners))}, unowned {sorted(set(owners) - live)})")
        reserved = self._outstanding_reservations()
        assert reserved >= 0

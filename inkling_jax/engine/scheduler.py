"""Host policy of one step: what every running request adds, and what its outputs change.

    plan = scheduler.plan()          # mode, each row's new tokens and checkpoint, RowPlans
    ... the runner runs pack_batch(plan.rows) ...
    scheduler.commit(plan, outputs)  # records, checkpoints, emitted tokens, finished requests

Modes: `extend` while any running request has more than one pending token (prefill chunks;
decoding rows ride along with one token), else `verify` with speculative decoding, else
`decode` (up to `EngineConfig.decode_steps` steps per dispatch, a device loop: a row runs
until its budget of new tokens, a stop token, the dispatch's last step or the step before
its second checkpoint boundary; requests that arrive meanwhile wait for the dispatch). With
the MTP heads' own drafts a verify dispatch runs up to `decode_steps` rounds likewise (a
device loop, `steps/verify_loop.py`: a row runs until its budget, a committed stop token, the
dispatch's last round or the last round that cannot reach its second checkpoint boundary);
with drafts from a `drafts_for` hook, one round.
With speculative decoding a decoding row never rides in an extend step: prefill
and verify steps alternate, so a sampled request draws the same tokens alone and batched
(a verify round and a plain sample draw differently). A request's pending tokens are the
ones not yet in the state: its prompt's rest, or the last sampled token.

A plan may take checkpoint slots (`Resources.step_slots`); `abandon` gives them back when
the step is not committed.

A request fails alone (`Requests.fail`, finish_reason "error") when its row's logits are not
finite (`HostOutputs.row_ok`, computed on the device) or when user code the engine calls for
it raises (the `drafts_for` hook): the other rows commit as if it had not been there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..config import InklingConfig
from ..steps import RowPlan
from .checkpoints import Checkpoint
from .config import EngineConfig, is_int
from .records import Request
from .requests import Requests
from .stats import EngineStats

DraftSource = Callable[[Request], list[int]]  # the drafts a verify step checks for a request


@dataclass
class HostOutputs:
    """A step's outputs on the host (numpy)."""

    tokens: np.ndarray  # [B] (a K-step decode: [B, K]; an R-round verify: [B, R, S+1])
    logprobs: np.ndarray  # as tokens
    num_accepted: np.ndarray  # [B] (verify: drafts accepted; K-step decode: steps run; R-round verify: [B, R],
    #                           drafts accepted per round, -1 where the row did not run it)
    accepted_logprobs: np.ndarray  # [B, S]
    drafts: np.ndarray  # [B, S]
    row_ok: np.ndarray  # [B] bool: the row's logits were finite (False: its request fails)
    top_ids: np.ndarray  # [B, L] (K-step decode: [B, K, L]; verify: [B, S+1, L]; R-round verify: [B, R, S+1, L])
    top_logprobs: np.ndarray  # as top_ids
    prompt_logprobs: np.ndarray  # [T] (a scoring extend step; else [0])
    prompt_top_ids: np.ndarray  # [T, L]
    prompt_top_logprobs: np.ndarray  # [T, L]


@dataclass
class StepPlan:
    mode: str
    requests: list[Request]
    new_tokens: list[int]  # per request: tokens this step adds (verify: 1 + spec_steps candidates)
    checkpoints: list[list[Checkpoint]]  # per request: the checkpoints the step writes
    rows: list[RowPlan] = field(default_factory=list)
    # planned ahead (`plan_ahead`): row i continues row feed_rows[i] of the previous dispatch,
    # planned for feed_steps[i] steps; its token and activity come from that dispatch's outputs
    feed_rows: list[int] | None = None
    feed_steps: list[int] | None = None
    score: bool = False  # an extend step that scores its tokens (a row wants prompt log-probs)
    rounds: int = 1  # verify: the rounds the dispatch runs (R of its shape; each row's own are its num_steps)

    @property
    def max_pages(self) -> int:
        return max(len(r.virtual_pages) for r in self.rows)


class Scheduler:
    def __init__(self, cfg: InklingConfig, config: EngineConfig, requests: Requests, stats: EngineStats,
                 decode_steps: int = 1):
        self.cfg, self.config, self.requests, self.stats = cfg, config, requests, stats
        self.admission, self.checkpoints = requests.admission, requests.checkpoints
        self.decode_steps = decode_steps  # K of a decode dispatch (the runner's shape)
        self.last_mode = "decode"

    @property
    def running(self) -> list[Request]:
        return self.requests.running

    # ------------------------------------------------------------------ planning

    def plan(self, drafts_for: DraftSource, verify_rounds: int = 1) -> StepPlan | None:
        """The next step over every running request (None when nothing runs). `verify_rounds`:
        R of a verify dispatch (> 1 only where the drafts are the MTP heads' own: the rounds
        after the first check the drafts the device proposed)."""
        running = self.running
        if not running:
            return None
        cfg, spec = self.config, self.config.spec_steps
        for r in running:  # a plan that failed half-way left slots; eager slots the tree took
            self.checkpoints.abandon(r)
            self.checkpoints.refill(r)
        prefilling = [r for r in running if self.needs_extend(r)]
        if spec and prefilling and len(prefilling) < len(running):  # alternate prefill and verify
            mode = "verify" if self.last_mode == "extend" else "extend"
            running = [r for r in running if self.needs_extend(r) == (mode == "extend")]
        else:
            mode = "extend" if prefilling else ("verify" if spec else "decode")
        self.last_mode = mode
        drafts = {}
        if mode == "verify":  # the hook is user code: one that raises fails its request alone
            for r in running:
                try:
                    drafts[id(r)] = self._checked_drafts(r, drafts_for)
                except Exception as exc:  # noqa: BLE001 - reported on the request
                    self.requests.fail(r, f"drafts_for raised {type(exc).__name__}: {exc}")
            running = [r for r in running if id(r) in drafts]
            if not running:
                return None
        new_tokens, checkpoints, budget, rounds = [], [], cfg.max_step_tokens, {}
        for r in running:
            if mode == "verify":
                rounds[id(r)] = self._rounds_for(r, verify_rounds)
                n = self._verify_reach(r, rounds[id(r)])
            elif mode == "decode":  # the steps the row may run in this dispatch (its one token first),
                # crossing one checkpoint boundary at most (a dispatch writes one per row)
                first = (r.committed // cfg.track_interval + 1) * cfg.track_interval
                n = min(self.decode_steps, r.sampling.max_new_tokens - len(r.out_tokens),
                        first + cfg.track_interval - 1 - r.committed)
            else:
                n = max(min(r.pending, cfg.chunk_size, budget - (len(running) - len(new_tokens) - 1)), 1)
                if r.score_from is not None:  # scored chunks start at multiples of chunk_size, with a
                    n = min(n, cfg.chunk_size - r.committed % cfg.chunk_size)  # cache hit or without
            n, cks = self.checkpoints.plan(r, n)  # may cut the chunk at a checkpoint
            new_tokens.append(n)
            checkpoints.append(cks)
            budget -= n
        for r, n in zip(running, new_tokens):
            self.admission.grow_pages(r.held, r.committed + n)
        if mode == "verify":  # the packed tokens: the last one and the drafts
            new_tokens = [spec + 1] * len(running)
        plan = StepPlan(mode, list(running), new_tokens, checkpoints, rounds=verify_rounds if mode == "verify" else 1)
        plan.score = mode == "extend" and any(self._scored(r, r.committed, n) for r, n in zip(running, new_tokens))
        plan.rows = [self._row_plan(mode, r, n, cks, drafts.get(id(r)), rounds=rounds.get(id(r), 1))
                     for r, n, cks in zip(running, new_tokens, checkpoints)]
        return plan

    def _rounds_for(self, r: Request, most: int) -> int:
        """The rounds r's row runs in a verify dispatch of `most` rounds: no more than it has
        tokens left (each round commits one at least), nor than can commit S + 1 tokens each
        without reaching its second checkpoint boundary (a dispatch writes one checkpoint per
        row; `steps/verify_loop.py` writes it in the round that crosses the first)."""
        interval, spec = self.config.track_interval, self.config.spec_steps
        first = (r.committed // interval + 1) * interval
        remaining = r.sampling.max_new_tokens - len(r.out_tokens)
        return max(1, min(most, remaining, (first + interval - 1 - r.committed) // (spec + 1)))

    def _verify_reach(self, r: Request, rounds: int) -> int:
        """The positions after r.committed that a verify dispatch of `rounds` rounds may write:
        each round writes its S + 1 tokens at the committed length; the last round the row runs
        starts at most remaining - 1 tokens on (its budget), so min(rounds (S + 1),
        remaining + S). One round: S + 1. Its pages must cover them; checkpoints are planned
        over them (the one reached is written)."""
        spec = self.config.spec_steps
        remaining = r.sampling.max_new_tokens - len(r.out_tokens)
        return min(rounds * (spec + 1), remaining + spec)

    @staticmethod
    def _scored(r: Request, start: int, n: int) -> bool:
        """A chunk of r over positions [start, start + n) yields prompt log-probs it wants: the
        next tokens of some of them are prompt tokens at or after `score_from`."""
        return r.score_from is not None and max(start + 1, r.score_from) <= min(start + n, r.prompt_len - 1)

    def needs_extend(self, r: Request) -> bool:
        """r's next step is an extend step: it has pending tokens besides its last, or (with
        speculation) no drafts for its last one. A verify row is its last token and the drafts
        the step that reached that token proposed; a prompt whose last token is pending alone
        (chunking left it, or a prefix hit one token short of the prompt) has none yet."""
        return r.pending > 1 or (self.config.spec_steps > 0 and not r.drafts)

    def plan_ahead(self, prev: StepPlan) -> StepPlan | None:
        """The decode dispatch after `prev`, planned before prev's outputs are read (overlap):
        as if every row of prev ran all its planned steps without stopping (the device feed
        turns rows that stopped into padded ones, `steps/feed.py`). None when nothing can be
        planned ahead: prev is not a decode dispatch, it writes a checkpoint (the ping-pong
        rotation it implies is not applied yet), or no row continues (each reaches its
        max_new_tokens in prev)."""
        if prev.mode != "decode" or self.config.spec_steps or any(prev.checkpoints):
            return None
        interval = self.config.track_interval
        requests, new_tokens, checkpoints, starts, feed_rows, feed_steps = [], [], [], [], [], []
        for i, (r, n_prev) in enumerate(zip(prev.requests, prev.new_tokens)):
            remaining = r.sampling.max_new_tokens - len(r.out_tokens) - n_prev
            if r.finish_reason is not None or remaining <= 0:
                continue
            start = r.committed + n_prev
            first = (start // interval + 1) * interval
            n = min(self.decode_steps, remaining, first + interval - 1 - start)
            n, cks = self.checkpoints.plan(r, n, start=start)
            requests.append(r)
            new_tokens.append(n)
            checkpoints.append(cks)
            starts.append(start)
            feed_rows.append(i)
            feed_steps.append(n_prev)
        if not requests:
            return None
        for r, n, start in zip(requests, new_tokens, starts):
            self.admission.grow_pages(r.held, start + n)
        plan = StepPlan("decode", requests, new_tokens, checkpoints, feed_rows=feed_rows, feed_steps=feed_steps)
        plan.rows = [self._row_plan("decode", r, n, cks, None, start=start)
                     for r, n, cks, start in zip(requests, new_tokens, checkpoints, starts)]
        return plan

    def abandon(self, plan: StepPlan) -> None:
        """The planned step will not be committed: give back the slots it took (requests that
        finished meanwhile gave back everything already)."""
        live = {id(r) for r in self.running}
        for r in plan.requests:
            if id(r) in live:
                self.checkpoints.abandon(r)

    def stop_ids(self, r: Request) -> list[int]:
        eos = [self.cfg.eos_token_id] if r.sampling.stop_at_eos and self.cfg.eos_token_id is not None else []
        return eos + list(r.sampling.stop_token_ids)

    def _row_plan(self, mode: str, r: Request, n: int, checkpoints: list[Checkpoint],
                  drafts: list[int] | None, start: int | None = None, rounds: int = 1) -> RowPlan:
        """r's row (`drafts`: verify, the checked drafts; `rounds`: verify, the rounds it runs);
        `start`: planned ahead, the row starts at that position (its token is fed on the device,
        a placeholder here)."""
        held, spec = r.held, self.config.spec_steps
        seq_start = held.committed if start is None else start
        row = RowPlan(tokens=[], seq_start=seq_start, virtual_slot=held.virtual_slot,
                      virtual_pages=held.virtual_pages, virtual_cow_slot=r.virtual_cow_slot if start is None else 0,
                      sampling=r.sampling, seed=r.seed, stop_ids=self.stop_ids(r)[:self.config.max_stop_ids],
                      virtual_track_slots=[ck.virtual_slot for ck in checkpoints],
                      track_lens=[ck.depth - seq_start for ck in checkpoints], count_row=r.count_row,
                      out_len=len(r.out_tokens) + (seq_start - held.committed),
                      prompt_top_logprobs=r.prompt_top if mode == "extend" and self._scored(r, seq_start, n) else 0)
        if start is not None:
            row.tokens, row.num_steps, row.sample_next = [0], n, True
            return row
        if mode == "verify":
            row.tokens = [r.tokens[held.committed]] + drafts
            remaining = r.sampling.max_new_tokens - len(r.out_tokens)
            row.max_accept = max(0, min(spec, remaining - 1))
            row.tokens_left, row.num_steps = remaining, rounds
            row.sample_next = True
        else:
            end = held.committed + n
            row.tokens = r.tokens[held.committed:end]
            row.lookahead = r.tokens[end:end + spec + 1]
            row.sample_next = end == len(r.tokens)
            if mode == "decode":  # one pending token; n = the steps it may run
                row.num_steps, row.sample_next = n, True
        return row

    def _checked_drafts(self, r: Request, drafts_for: DraftSource) -> list[int]:
        """The drafts a verify row checks for r: exactly spec_steps token ids (ValueError naming
        the hook otherwise: a short row would shift every later row's packed tokens; `plan`
        fails the request with it)."""
        drafts = list(drafts_for(r))
        spec, vocab = self.config.spec_steps, self.cfg.unpadded_vocab_size
        if len(drafts) != spec or not all(is_int(t) and 0 <= t < vocab for t in drafts):
            raise ValueError(f"drafts_for(request {r.rid}) returned {drafts!r}: a verify step takes exactly "
                             f"spec_steps={spec} token ids in [0, {vocab})")
        return [int(t) for t in drafts]

    # -------------------------------------------------------------------- commit

    def commit(self, plan: StepPlan, out: HostOutputs) -> list[Request]:
        """Apply a step's outputs to the records; returns the requests that finished. A row
        whose logits were not finite (`out.row_ok`) fails its request alone (`Requests.fail`):
        nothing of this step is committed for it."""
        self.stats.count_step(plan.mode)
        now = time.perf_counter()
        live = {id(r) for r in self.running}
        packed = 0  # the row's first packed token (rows are packed in order)
        for i, (r, n, cks) in enumerate(zip(plan.requests, plan.new_tokens, plan.checkpoints)):
            q0, packed = packed, packed + len(plan.rows[i].tokens)
            if id(r) not in live:  # planned ahead, then finished (or aborted) before this step: the
                continue           # device ran its row as padding (steps/feed.py), its slots are gone
            if not out.row_ok[i]:
                self.requests.fail(r, f"non-finite logits (NaN or inf) at position {r.committed} ({plan.mode} "
                                      f"step): its state was dropped and nothing of it was cached")
                continue
            r.virtual_cow_slot = 0
            if plan.mode == "verify":
                self._commit_verify(r, plan.rows[i], out, i, now)
                self.checkpoints.after(r, cks)
                continue
            if out.tokens.ndim == 2:  # a K-step decode: the row ran num_accepted steps
                ran = int(out.num_accepted[i])
                self._advance(r, ran)
                self.checkpoints.after(r, cks)
                for j in range(ran):
                    self.emit(r, int(out.tokens[i, j]), float(out.logprobs[i, j]), now,
                              self._top(r, out.top_ids[i, j], out.top_logprobs[i, j]))
                continue
            if plan.score and r.score_from is not None:
                self._record_scores(r, r.held.committed, n, out, q0)
            self._advance(r, n)
            self.checkpoints.after(r, cks)
            if r.committed == len(r.tokens):  # the row reached the end: its sample is the next token
                self.emit(r, int(out.tokens[i]), float(out.logprobs[i]), now,
                          self._top(r, out.top_ids[i], out.top_logprobs[i]))
                if self.config.spec_steps:
                    r.drafts = [int(t) for t in out.drafts[i]]
        if plan.mode == "verify" and out.num_accepted.ndim == 2 and np.any(out.num_accepted[:len(plan.rows), 1:] >= 0):
            self.stats.multi_round_verify_steps += 1
        running = {id(r) for r in self.running}  # (a failed request has left already)
        finished = [r for r in plan.requests if r.finish_reason is not None and id(r) in running]
        for r in finished:
            self.requests.finish(r)
        return finished

    def _advance(self, r: Request, n: int) -> None:
        """r's state took n more tokens (counted in `prompt_tokens_computed` where they are
        prompt tokens)."""
        before = r.held.committed
        r.held.committed += n
        self.stats.prompt_tokens_computed += max(0, min(r.held.committed, r.prompt_len) - before)

    @staticmethod
    def _top(r: Request, ids: np.ndarray, logprobs: np.ndarray) -> list[tuple[int, float]] | None:
        """The alternatives r asked for (SamplingParams.logprobs) from a step's top-L outputs."""
        k = r.sampling.logprobs
        return [(int(t), float(lp)) for t, lp in zip(ids[:k], logprobs[:k])] if k else None

    @staticmethod
    def _record_scores(r: Request, start: int, n: int, out: HostOutputs, q0: int) -> None:
        """Prompt log-probs of a scoring step: packed token q0 + j (position start + j) gives the
        log-prob of the prompt token at start + j + 1."""
        for j in range(n):
            pos = start + j + 1
            if r.score_from <= pos < r.prompt_len:
                r.prompt_lps[pos] = float(out.prompt_logprobs[q0 + j])
                if r.prompt_top:
                    r.prompt_tops[pos] = [(int(t), float(lp)) for t, lp in
                                          zip(out.prompt_top_ids[q0 + j, :r.prompt_top],
                                              out.prompt_top_logprobs[q0 + j, :r.prompt_top])]

    def _commit_verify(self, r: Request, row: RowPlan, out: HostOutputs, i: int, now: float) -> None:
        """Apply r's verify rounds in order, each as its own dispatch would: its accepted drafts
        and bonus emitted (a stop or max_new_tokens finishes r; the tokens after it are still
        committed state, `emit`), its accept length recorded while r had not finished before
        it. The next dispatch checks the drafts the last round proposed."""
        if out.tokens.ndim == 3:  # R rounds: each round's committed tokens, -1: not run
            rounds = [(int(a), out.tokens[i, j, :a + 1], out.logprobs[i, j, :a + 1], j)
                      for j, a in enumerate(out.num_accepted[i]) if a >= 0]
            tops = lambda j, c: self._top(r, out.top_ids[i, j, c], out.top_logprobs[i, j, c])
        else:
            a = int(out.num_accepted[i])
            rounds = [(a, list(row.tokens[1:1 + a]) + [out.tokens[i]],
                       list(out.accepted_logprobs[i, :a]) + [out.logprobs[i]], 0)]
            tops = lambda j, c: self._top(r, out.top_ids[i, c], out.top_logprobs[i, c])
        for a, tokens, lps, j in rounds:
            if r.finish_reason is None:  # R separate dispatches would have run this round
                r.accept_lengths.append(a)
                self.stats.count_verify_row(a)
            self._advance(r, a + 1)
            for c, (tok, lp) in enumerate(zip(tokens, lps)):
                self.emit(r, int(tok), float(lp), now, tops(j, c))
        r.drafts = [int(t) for t in out.drafts[i]]

    def emit(self, r: Request, token: int, logprob: float, now: float,
             top: list[tuple[int, float]] | None = None) -> None:
        r.tokens.append(token)  # the state's history, even past a stop (it is committed)
        if r.finish_reason is not None:
            return
        if r.first_token_at is None:
            r.first_token_at = now
        r.out_tokens.append(token)
        r.out_logprobs.append(logprob)
        if top is not None:
            r.out_tops.append(top)
        self.stats.generated_tokens += 1
        sp = r.sampling
        may_stop = len(r.out_tokens) > sp.min_tokens  # min_tokens: the device suppressed stop ids until then
        eos = may_stop and sp.stop_at_eos and token == self.cfg.eos_token_id
        # the text: every token but an eos that ends the request (as a special token, not decoded)
        matched = r.text.push(token, may_stop) if r.text is not None and not eos else None
        if matched is not None:
            r.finish_reason, r.stop_reason = "stop", matched
        elif eos or (may_stop and token in sp.stop_token_ids):
            r.finish_reason, r.stop_reason = "stop", token
        elif len(r.out_tokens) >= sp.max_new_tokens:
            r.finish_reason = "length"
        if r.finish_reason is not None and r.text is not None:
            r.text.finish()

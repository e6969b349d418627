"""The one owner of request lifecycles and of sessions between turns (host policy, no device).

    queued ──admit_waiting──> running ──finish──> done (its state to its session, or released)
       │                        │
       ├──give_up (never fits)  ├──abort──> done ("abort"; a session turn hands its state back)
       ├──abort                 └──fail───> done ("error"; its state is dropped, nothing cached)
       └──fail

Every change of `waiting`, `running`, `sessions` and of a session's turn in flight goes
through a method here; the resource side of each transition (slots, pages, checkpoints, the
prefix tree) is delegated to `Admission` and `CheckpointPolicy`, which this object builds and
owns. `Engine` reads the lists; nothing else writes them.

Beside the pool, a running request with a count-based penalty holds a row of the device's
count table (`Request.count_row`, rows 1..max_running; `steps/counts.py`): taken at
admission, written before its first step (`take_count_resets`), given back when it leaves.

n samples of one prompt (`SamplingParams.n`): sample 0 checkpoints its prompt at the last page
boundary before the prompt's last token (`Request.fork_depth`), and the other samples wait in
the queue until it has (or has left): they are then admitted as prefix hits on that boundary,
so the shared part of the prompt is computed once. Each sample is otherwise a request of its
own (seed + j), so its output is the one a separate request with that seed gives.

The capacity contract: a request accepted at submit (`Admission.never_fits` found room beside
what open sessions may keep, `Admission.session_holdings`) is eventually admitted; admission
is first come, first served, so only the requests ahead of it can grow a session first. A
last guard gives up what still cannot be admitted when nothing runs (an accounting bug if it
ever fires; the host-policy fuzz asserts it never does).
"""

from __future__ import annotations

import itertools

from ..cache.pool import UnitPool
from ..cache.prefix_tree import PrefixTree
from .admission import Admission
from .checkpoints import CheckpointPolicy
from .config import EngineConfig, is_int
from .records import Request, Resources, Session
from .stats import EngineStats


class Requests:
    def __init__(self, config: EngineConfig, pool: UnitPool, tree: PrefixTree | None, stats: EngineStats):
        self.config, self.stats = config, stats
        self.waiting: list[Request] = []  # submitted, not admitted yet (first come, first served)
        self.running: list[Request] = []  # admitted: each holds its resources (`Request.held`)
        self.sessions: dict[int, Session] = {}  # open sessions by id
        self.admission = Admission(config, pool, tree, stats, self)
        self.checkpoints = CheckpointPolicy(config, tree, self.admission, stats)
        self._rids = itertools.count()
        self.next_sid = 1  # the id the next open_session gives
        self.free_count_rows = list(range(config.max_running, 0, -1))  # pop() gives the smallest
        self.count_resets: list[Request] = []  # admitted with a count row not written yet

    def new_rid(self) -> int:
        return next(self._rids)

    # ------------------------------------------------------------------ sessions

    def open_session(self) -> int:
        sid = self.next_sid
        self.next_sid += 1
        self.sessions[sid] = Session(sid)
        return sid

    def session(self, sid) -> Session:
        """The open session `sid` (ValueError if it is not open)."""
        sess = self.sessions.get(sid) if is_int(sid) else None
        if sess is None:
            raise ValueError(f"session {sid} is not open")
        return sess

    def close_session(self, sid: int) -> None:
        """Close a session with no turn in flight and free its state (compacted on the device
        by the next step)."""
        sess = self.session(sid)
        if sess.turn is not None:
            raise ValueError(f"session {sid} has a turn in flight (close_session(..., abort=True) cancels it)")
        del self.sessions[sid]
        if sess.held is not None:
            self.admission.release(sess.held)

    def adopt_session(self, sid: int, tokens: list[int], held: Resources | None) -> Session:
        """Open session `sid` with a history and the state it keeps (a restored save,
        `engine/persist.py`)."""
        if sid in self.sessions:
            raise ValueError(f"session {sid} is open already")
        self.sessions[sid] = sess = Session(sid, list(tokens), held)
        self.next_sid = max(self.next_sid, sid + 1)
        return sess

    # ----------------------------------------------------------------- lifecycle

    def queue(self, requests: list[Request], session: Session | None = None) -> None:
        """Requests validated and accepted at submit join the queue (a session's turn: one)."""
        for r in requests:
            if not r.sample:  # n samples: one prompt
                self.stats.prompt_tokens += r.prompt_len - (len(session.tokens) if session else 0)
            self.waiting.append(r)
        if session is not None:
            session.turn = requests[0]

    def admit_waiting(self) -> list[Request]:
        """Admit queued requests in order while rows are free; a request that must wait holds
        up the ones behind it while others run (they will free room). With nothing running, a
        request is admitted whenever `never_fits` says it fits (with a shallower cached prefix,
        or none, if its deepest one pins too much); one that does not is given up with the
        reason. The last guard: should nothing run and nothing be admitted all the same,
        every waiting request is given up rather than waited on forever. Returns the
        given-up requests."""
        given_up = []
        i = 0
        while i < len(self.waiting) and len(self.running) < self.config.max_running:
            r = self.waiting[i]
            if self._waits_for_fork(r) and self.running:
                break  # FCFS: the samples behind it wait too
            if self.admission.admit(r, shallower=not self.running):
                self.waiting.pop(i)
                self.running.append(r)
                if r.sampling.penalized:
                    r.count_row = self.free_count_rows.pop()
                    self.count_resets.append(r)
                continue
            self.stats.deferred += 1
            if self.running:
                break
            problem = self.admission.never_fits(r)
            if problem:
                self._give_up(i, problem)
                given_up.append(r)
            else:
                i += 1
        if self.waiting and not self.running:  # nothing runs, nothing was admitted: no step can free room
            pool = self.admission.pool
            reason = (f"cannot be admitted: nothing is running and the pool has {pool.free_count('slot')} free "
                      f"slots and {pool.free_count('page')} free pages after evicting the prefix cache (open "
                      f"sessions and the prefixes they hold keep the rest; close a session or ask for fewer new "
                      f"tokens)")
            while self.waiting:
                given_up.append(self.waiting[0])
                self._give_up(0, reason)
        return given_up

    @staticmethod
    def _waits_for_fork(r: Request) -> bool:
        """A sample of n waits while sample 0 runs or waits and has not yet checkpointed the
        shared prompt boundary (its prefill stops there first, `Scheduler.plan`)."""
        p = r.fork_parent
        return (p is not None and p.finish_reason is None and p.error is None and p.fork_depth > 0
                and p.committed < p.fork_depth)

    def take_count_resets(self) -> list[Request]:
        """The running requests whose count rows must be written before the next step (the
        caller writes them, then `count_resets_done`)."""
        return [r for r in self.count_resets if r.count_row]

    def count_resets_done(self, done: list[Request]) -> None:
        self.count_resets = [r for r in self.count_resets if r not in done]

    def _release_count_row(self, r: Request) -> None:
        if r.count_row:
            self.free_count_rows.append(r.count_row)
            r.count_row = 0
        if r in self.count_resets:
            self.count_resets.remove(r)

    def _give_up(self, index: int, reason: str) -> None:
        r = self.waiting.pop(index)
        r.error = reason
        if r.session is not None:
            r.session.turn = None

    def finish(self, r: Request) -> None:
        """A finished (or aborted) running request leaves: its state goes to its session, or
        its newest checkpoint to the tree and everything else back to the pool."""
        self.running.remove(r)
        self._release_count_row(r)
        held = r.held
        held.reserved_pages = 0
        if r.session is not None:
            sess, end = r.session, r.output_end
            sess.tokens, sess.turn = r.tokens[:end], None
            if held.committed <= end:
                sess.held = held
            else:  # a stop string cut the output before what the state holds: the next turn
                sess.held = None  # rebuilds from the history (perhaps from the prefix cache)
                self.admission.release(held)
            return
        kept = self.checkpoints.insert_at_finish(r)
        self.admission.release(held, keep_track=kept)

    def fail(self, r: Request, reason: str) -> None:
        """r fails alone: it finishes with finish_reason "error" and `reason` in r.error, and
        nothing it wrote is kept: its slots (checkpoint slots included) and own pages go back
        to the pool, its prefix lock is released, no checkpoint of it reaches the prefix tree.
        A session turn drops the session's kept state (the turn wrote into it) and leaves the
        history as it was before the turn, so the next turn recomputes the state from the
        tokens (a prefix hit where the cache has one): exact, as after a reset. Queued or
        running; the one entry point for a request that goes wrong (the step's non-finite
        check, an exception from user code the engine calls for it)."""
        r.finish_reason, r.error = "error", reason
        self.stats.failed_requests += 1
        if r in self.waiting:  # nothing written: a session keeps its state
            self.waiting.remove(r)
        elif r in self.running:
            self.running.remove(r)
            self._release_count_row(r)
            r.held.reserved_pages = 0
            self.admission.release(r.held)
            if r.session is not None:
                r.session.held = None  # the turn had taken it over (released above)
        if r.session is not None:
            r.session.turn = None

    def abort(self, rid: int) -> Request:
        """Cancel a queued or running request by id: it finishes with "abort" (a running
        session turn hands its state to the session, its tokens so far stay in the history;
        a queued one leaves the history as it was). ValueError if it is neither."""
        for i, r in enumerate(self.waiting):
            if r.rid == rid:
                self.waiting.pop(i)
                if r.session is not None:
                    r.session.turn = None
                r.finish_reason = "abort"
                return r
        for r in self.running:
            if r.rid == rid:
                r.finish_reason = "abort"
                self.finish(r)
                return r
        raise ValueError(f"request {rid} is not queued or running")

    def restart_all(self) -> None:
        """The device state was lost: every running request goes back to the front of the
        queue (in the order they ran) holding nothing, every session's kept state and the
        prefix cache are released (they restart from their tokens: the state is a pure
        function of them)."""
        for r in self.running:
            self.admission.release(r.held)
            self._release_count_row(r)
            r.held, r.virtual_cow_slot, r.drafts = Resources(), 0, []
        self.waiting[:0] = self.running
        self.running.clear()
        for sess in self.sessions.values():
            if sess.held is not None:
                self.admission.release(sess.held)
                sess.held = None
        self.admission.evict_all()

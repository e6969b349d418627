"""Admission and eviction over the unit pool and the prefix tree (host policy, no device).

A request is admitted when its slots (the state's slot, plus checkpoint slots) and the pages
of its longest possible sequence fit, evicting least-recently-used tree entries when short;
otherwise nothing it took is kept and it waits. Pages are *reserved* at admission and taken
as the sequence grows, so a running request never runs out.

Accounting closes at all times: every live slot and page is owned by exactly one of the
prefix tree, a session, or a running request (`Engine.check_invariants`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..cache.pool import PoolExhausted, UnitPool
from ..cache.prefix_tree import PrefixTree
from .config import EngineConfig
from .records import Request, Resources, Session
from .stats import EngineStats

if TYPE_CHECKING:
    from .requests import Requests


class Admission:
    """Capacity: allocation with eviction, admission of one request, and what can never fit.
    `requests` (the lifecycle owner, `requests.py`) is read for the running requests'
    reservations and the open sessions; admission itself changes no list."""

    def __init__(self, config: EngineConfig, pool: UnitPool, tree: PrefixTree | None, stats: EngineStats,
                 requests: "Requests"):
        self.config, self.pool, self.tree, self.stats, self.requests = config, pool, tree, stats, requests
        # the state's slot, plus its checkpoint slots (eager: both ping-pong slots at once)
        tracks = (2 if config.ping_pong == "eager" else 1) if tree is not None else 0
        self.slots_per_request = 1 + tracks

    def pages_for(self, length: int) -> int:
        return math.ceil(length / self.config.page_size)

    def outstanding_reservations(self) -> int:
        return sum(r.held.reserved_pages for r in self.requests.running)

    # ---------------------------------------------------------------- allocation

    def try_alloc(self, slots: int, pages: int, reserve: int = 0) -> tuple[list[int], list[int]] | None:
        """Allocate slots and pages (leaving `reserve` pages free for promises), evicting
        from the tree when short. None, with nothing taken, when it cannot be done."""
        need_pages = pages + reserve + self.outstanding_reservations()
        if not self.pool.can_alloc(slots, need_pages) and self.tree is not None:
            self.evict_for(slots, need_pages)
        if not self.pool.can_alloc(slots, need_pages):
            return None
        got_s, got_p = [], []
        try:
            for _ in range(slots):
                got_s.append(self.pool.alloc_slot())
            for _ in range(pages):
                got_p.append(self.pool.alloc_page())
        except BaseException as exc:  # roll back exactly what was taken (I9), then report
            self.free(got_s, got_p)
            if isinstance(exc, PoolExhausted):  # cannot happen after can_alloc
                return None
            raise
        return got_s, got_p

    def evict_for(self, slots: int, pages: int) -> None:
        """Evict tree leaves (in the tree's policy order) until `slots` and `pages` fit (or
        nothing is left)."""
        while not self.pool.can_alloc(slots, pages):
            ev_pages, ev_slots = self.tree.evict(need_slots=1 if slots else 0, need_pages=1 if pages else 0)
            if not ev_pages and not ev_slots:
                return
            self.free(ev_slots, ev_pages)
            self.stats.evicted_pages += len(ev_pages)
            self.stats.evicted_slots += len(ev_slots)

    def evict_all(self) -> None:
        """Drop every unlocked prefix-cache entry."""
        if self.tree is not None:
            pages, slots = self.tree.evict(need_slots=1 << 30, need_pages=1 << 30)
            self.free(slots, pages)

    def free(self, slots, pages) -> None:
        for s in slots:
            self.pool.free_slot(s)
        for p in pages:
            self.pool.free_page(p)

    def release(self, held: Resources, keep_track: set[int] = frozenset()) -> None:
        """Free what `held` owns (real slots but those in keep_track, its own pages) and unlock
        its tree path."""
        self.free([s for s in held.slots() if s not in keep_track], sorted(held.owned_pages))
        if held.prefix_node is not None:
            self.tree.unlock(held.prefix_node)

    def grow_pages(self, held: Resources, length: int) -> None:
        """Take reserved pages until the page table covers `length` positions."""
        for _ in range(self.pages_for(length) - len(held.virtual_pages)):
            if held.reserved_pages <= 0:
                raise RuntimeError("request outgrew its page reservation")
            page = self.pool.alloc_page()  # reserved at admission: cannot fail
            held.reserved_pages -= 1
            held.virtual_pages.append(page)
            held.owned_pages.add(page)

    # ----------------------------------------------------------------- admission

    def final_length(self, r: Request) -> int:
        return len(r.tokens) + r.sampling.max_new_tokens + self.config.spec_steps

    def admit(self, r: Request, shallower: bool = False) -> bool:
        """Give r its slots, pages and prefix; False (nothing changed but evictions) if it must
        wait. It tries its deepest cached prefix; with `shallower` (nothing runs, so no step
        will free room) also each shallower cached prefix, then none. A locked prefix pins
        every checkpoint on its path, so a deep hit can need room the request without it does
        not: `never_fits` counts no prefix, and with `shallower` admission agrees with it."""
        sess = r.session
        if sess is not None and sess.held is not None and r.score_from is not None \
                and sess.held.committed >= r.score_from:  # the kept state is past what the turn scores:
            self.release(sess.held)  # rebuild it (its tokens are the history; the prefix cache may serve)
            sess.held = None
        if sess is not None and sess.held is not None:
            return self._admit_session_turn(r)
        # a request that wants prompt log-probs from position p must run position p - 1 itself
        cap = len(r.tokens) - 1 if r.score_from is None else min(len(r.tokens) - 1, r.score_from - 1)
        found = self.tree.matches(r.tokens, max_depth=cap) if self.tree is not None else []
        options = found[:1] if found and not shallower else found + [None]
        return any(self._admit_with(r, match) for match in options)

    def _admit_with(self, r: Request, match) -> bool:
        """Admit r reading `match`'s cached prefix (None: nothing cached); False, with nothing
        taken and the prefix unlocked again, if it does not fit."""
        depth = match.depth if match is not None else 0
        total_pages = self.pages_for(self.final_length(r)) - depth // self.config.page_size
        if depth:
            self.tree.lock(match.node)  # eviction for this request's slots must spare its prefix
        try:
            got = self.try_alloc(self.slots_per_request, 0, reserve=total_pages)
        except BaseException:
            if depth:
                self.tree.unlock(match.node)
            raise
        if got is None:
            if depth:
                self.tree.unlock(match.node)
            return False
        slots = got[0]
        held = Resources(virtual_slot=slots[0], reserved_pages=total_pages)
        if self.tree is not None:
            held.virtual_track_slots = slots[1:] + [-1] * (3 - self.slots_per_request)
        if depth:
            held.virtual_pages = list(match.pages)
            held.prefix_node = match.node
            held.committed = depth
            r.virtual_cow_slot = match.node.checkpoint
            self.tree.record_hit(match.node)
            r.cached = depth
            self.stats.cache_hit_tokens += depth
        r.held = held
        return True

    def _track_slots_needed(self, held: Resources) -> list[int]:
        """The checkpoint slots a session turn takes back at admission (eager ping-pong keeps
        both at hand; lazy takes them around boundaries)."""
        if self.config.ping_pong != "eager" or self.tree is None:
            return []
        return [i for i, s in enumerate(held.virtual_track_slots) if s == -1]

    def _admit_session_turn(self, r: Request) -> bool:
        """A session's next turn takes over the state its last turn left (plus any checkpoint
        slots eager ping-pong needs back)."""
        held = r.session.held
        need_track = self._track_slots_needed(held)
        total_pages = max(self.pages_for(self.final_length(r)) - len(held.virtual_pages), 0)
        got = self.try_alloc(len(need_track), 0, reserve=total_pages)
        if got is None:
            return False
        for i, s in zip(need_track, got[0]):
            held.virtual_track_slots[i] = s
        held.reserved_pages = total_pages
        r.held, r.session.held = held, None
        return True

    # ------------------------------------------------------------- capacity checks

    def session_holdings(self, sessions, exclude: Session | None = None) -> tuple[int, int, int, int]:
        """(slots, pages, tree slots, tree pages) open sessions may keep from other requests,
        the capacity contract's one description of what is pinned: a session between turns
        keeps what it owns and the prefix-cache entries its locked prefix pins (every
        checkpoint and page on that path, each counted once); a session with a turn in flight
        counts what it will keep when the turn ends, at the turn's worst case (its
        `final_length`: the turn may grow its pages up to there and take back eager checkpoint
        slots; a first turn may lock a cached path of up to its prompt's checkpoints). The
        first two include the last two. `exclude`: the session whose turn is being judged
        (its growth is that request's own need, `needs`).

        Why worst cases: a request that fits beside this count at submit must still fit
        when its turn comes, whatever the turns ahead of it do meanwhile (admission is
        first come, first served, so only they can grow a session first)."""
        slots = pages = 0
        locked = []
        for sess in sessions:
            held, turn = sess.held, sess.turn
            if sess is exclude:
                turn = None
            if turn is not None and turn.held.virtual_slot:  # running: the turn holds the state
                held = turn.held
                slots += max(len(held.slots()), self.slots_per_request)
                pages += len(held.owned_pages) + held.reserved_pages
            elif turn is not None and held is not None:  # queued behind a kept state
                slots += len(held.slots()) + len(self._track_slots_needed(held))
                pages += len(held.owned_pages) + max(self.pages_for(self.final_length(turn))
                                                     - len(held.virtual_pages), 0)
            elif turn is not None:  # a queued first turn: it may lock a cached path (pages it
                # then reads instead of owning, and the checkpoints on it)
                slots += self.slots_per_request + (len(turn.tokens) - 1) // self.config.track_interval
                pages += self.pages_for(self.final_length(turn))
            elif held is not None:
                slots += len(held.slots())
                pages += len(held.owned_pages)
            if held is not None and held.prefix_node is not None:
                locked.append(held.prefix_node)
        tree_s, tree_p = self.tree.pinned_by(locked) if self.tree is not None else (0, 0)
        return slots + tree_s, pages + tree_p, tree_s, tree_p

    def needs(self, r: Request) -> tuple[int, int]:
        """(slots, pages) r needs at admission in the worst case (nothing cached)."""
        if r.session is not None and r.session.held is not None:
            held = r.session.held
            return len(self._track_slots_needed(held)), \
                max(self.pages_for(self.final_length(r)) - len(held.virtual_pages), 0)
        return self.slots_per_request, self.pages_for(self.final_length(r))

    def never_fits(self, r: Request) -> str | None:
        """Why r could not be admitted even with nothing running and the prefix cache evicted
        down to what open sessions pin (r's own session included), or None when it can: then
        `admit(r, shallower=True)` succeeds with nothing running."""
        slots, pages = self.needs(r)
        held_s, held_p, tree_s, tree_p = self.session_holdings(self.requests.sessions.values(), exclude=r.session)
        pinned = f", {tree_s} slots and {tree_p} pages of them in prefix-cache entries their prefixes lock" \
            if tree_s or tree_p else ""
        pool = self.pool
        if pool.unified:
            need = slots * pool.slots.units + pages * pool.pages.units
            have = pool.budget_units - pool.slots.units - pool.pages.units - held_s * pool.slots.units \
                - held_p * pool.pages.units
            if need > have:
                return (f"needs {slots} slots and {pages} pages ({need} arena units), but at most {have} units can "
                        f"be free (open sessions hold {held_s} slots and {held_p} pages{pinned})")
            return None
        free_s = pool.capacity("slot") - held_s
        free_p = pool.capacity("page") - held_p
        if slots > free_s or pages > free_p:
            return (f"needs {slots} slots and {pages} pages, but at most {free_s} slots and {free_p} pages can be "
                    f"free (open sessions hold {held_s} slots and {held_p} pages{pinned})")
        return None

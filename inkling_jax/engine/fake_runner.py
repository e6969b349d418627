"""A fake device runner: the runner's interface over numpy, with a model made of hashes.

The host policy (admission, scheduler, checkpoints, prefix tree, requests, pool compaction)
does not need XLA to be tested: `FakeRunner` takes the same batches as `StepRunner` and
keeps a numpy arena with the same unit geometry, translated through the same id tables,
moved by the same compaction copies. Its "model" is a rolling hash of a sequence's tokens:

    state after tokens t_0..t_{n-1}:  (n, h_n),  h_0 = SEED,  h_{i+1} = mix(h_i, t_i)
    a slot's first unit row holds (n, h_n); a page's first unit row holds its tokens
    greedy next token = greedy_token(h_n); a sample = sampled_token(h_n, seed, position)

and every step checks what a real model would silently get wrong: a row's slot state holds
exactly `seq_start` tokens, and the hash of the tokens its page table reads back equals the
slot's (so a wrong slot, a stale copy-on-write, a missed compaction move, a page that is not
the row's or a checkpoint written at the wrong depth raises `FakeStateError` inside the
step). `fake_generate` is the oracle: what plain decoding of a history gives. `poison` (a class
attribute: token ids, empty by default) stands for a token whose embedding is NaN: a row whose
committed inputs contain one has non-finite logits (`row_ok` False, as the real step reports)
and marks what it wrote (its slot, checkpoints and page positions) as garbage, so a later row
that reads any of it (the host cached or kept it) raises `FakeStateError`. Speculative
rows get drafts from the true continuation, wrong at depths chosen by the hash, so every
accept length occurs; the acceptance rule is greedy's (a sampled row accepts a draft equal
to its sample), so outputs equal plain decoding's in every mode. A verify dispatch of R > 1
rounds runs them as `steps/verify_loop.py` does: round j checks round j - 1's drafts from
the state round j - 1 left (checked, as every round's), until the row's rounds, a committed
stop token or its token budget run out.

Of the logits processors the fake emulates those whose bookkeeping is the host's: min_tokens
(the row's stop ids are banned while its output is shorter) and the count-based penalties
(repetition_penalty != 1 bans tokens of the prompt and the output, presence / frequency != 0
bans tokens of the output), read from a numpy count table the engine writes through
`reset_counts` and the steps update, as the device's (`steps/counts.py`); a banned choice
moves to the next token id that is not. It reports top alternatives (the L tokens of highest
fake log-prob) and, in scoring steps, each packed token's next-token log-prob. min_p and
logit_bias it refuses (ValueError).

    class FakeEngine(ik.Engine):
        runner_cls = FakeRunner
    engine = FakeEngine(cfg, fake_params(cfg), config)   # shapes only, no XLA compile

Nothing here compiles an XLA program (tests assert it with JAX's compile events).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..cache.pool import UnitPool
from ..model.params import param_shapes
from ..steps import StepBatch, StepShape, check_batch
from .runner import DecodeFeed, StepRunner

MASK = (1 << 61) - 1
SEED = 0x1234567


class FakeStateError(AssertionError):
    """The fake step found state a real step would have computed garbage from."""


def fake_params(cfg, dtype: Any = np.float32) -> dict:
    """The params tree of cfg as shapes (`jax.ShapeDtypeStruct`): what `Engine` checks and sizes
    the arena by, without a byte of weights."""
    import jax

    return jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, dtype), param_shapes(cfg),
                        is_leaf=lambda x: isinstance(x, tuple))


def mix(h: int, token: int) -> int:
    return ((h ^ (token + 0x9E37)) * 0x100000001B3 + 0x2545F491) & MASK


def fold(tokens, h: int = SEED) -> int:
    for t in tokens:
        h = mix(h, int(t))
    return h


def greedy_token(h: int, vocab: int) -> int:
    return (h >> 17) % vocab


def sampled_token(h: int, seed: int, position: int, vocab: int) -> int:
    return (mix(mix(h, seed + 7), position) >> 19) % vocab


def token_logprob(h: int, token: int) -> float:
    return -float(mix(h, token) % 997) / 100.0


def next_token(h: int, temperature: float, seed: int, position: int, vocab: int, banned=()) -> int:
    t = greedy_token(h, vocab) if temperature == 0 else sampled_token(h, seed, position, vocab)
    for _ in range(vocab):  # the emulated processors: the next id that is not banned
        if t not in banned:
            break
        t = (t + 1) % vocab
    return t


def top_tokens(h: int, k: int, vocab: int) -> list[tuple[int, float]]:
    """The fake's k most likely next tokens after hash h (ties: the smaller id): `token_logprob`
    of every token at once (uint64 arithmetic wraps mod 2^64, and 2^61 | 2^64, so the masked
    products are the Python ints')."""
    t = np.arange(vocab, dtype=np.uint64)
    mixed = ((np.uint64(h) ^ (t + np.uint64(0x9E37))) * np.uint64(0x100000001B3) + np.uint64(0x2545F491)) \
        & np.uint64(MASK)
    logprob = -(mixed % np.uint64(997)).astype(np.float64) / 100.0
    order = np.lexsort((t, -logprob))[:k]
    return [(int(i), float(logprob[i])) for i in order]


def banned_tokens(counts: np.ndarray | None, out_index: int, min_tokens: int, stops, repetition: bool,
                  output_penalty: bool) -> set[int]:
    """What the emulated processors ban for a choice at output index `out_index` (counts: the
    row's count-table row, 2 * output count + prompt bit)."""
    banned = set(stops) if out_index < min_tokens else set()
    if counts is not None and repetition:
        banned |= set(np.nonzero(counts > 0)[0].tolist())
    elif counts is not None and output_penalty:
        banned |= set(np.nonzero(counts >= 2)[0].tolist())
    return banned


def draft_is_wrong(h: int, depth: int) -> bool:
    """Whether the fake MTP chain gets the draft at `depth` wrong (about one in three)."""
    return mix(h, 1000 + depth) % 3 == 0


def fake_generate(history, max_new_tokens: int, *, vocab: int, temperature: float = 0.0, seed: int = 0,
                  stop_ids=(), min_tokens: int = 0, repetition: bool = False,
                  output_penalty: bool = False) -> tuple[list[int], list[float], str]:
    """Plain decoding of `history` by the fake model: (tokens, logprobs, finish_reason).
    `seed` is the request's (`Request.seed`); stop_ids include eos when it stops there;
    min_tokens, repetition (repetition_penalty != 1), output_penalty (presence or frequency
    penalty != 0): the emulated processors (module docstring)."""
    h, pos = fold(history), len(history)
    tokens, logprobs = [], []
    counts = np.zeros(vocab, np.int64)
    counts[np.asarray(history, np.int64)] = 1
    while True:
        banned = banned_tokens(counts, len(tokens), min_tokens, stop_ids, repetition, output_penalty)
        t = next_token(h, temperature, seed, pos, vocab, banned)
        tokens.append(t)
        counts[t] += 2
        logprobs.append(token_logprob(h, t))
        if t in stop_ids and len(tokens) > min_tokens:
            return tokens, logprobs, "stop"
        if len(tokens) >= max_new_tokens:
            return tokens, logprobs, "length"
        h, pos = mix(h, t), pos + 1


@dataclass
class FakeState:
    arena: np.ndarray  # [num_units, width] int64
    slot_v2p: np.ndarray
    page_v2p: np.ndarray
    counts: np.ndarray  # [max_running + 1, vocab] int64: the penalties' count table


@dataclass
class FakeOutput:
    """What a step returns (numpy, the same fields as `steps.StepOutput`)."""

    tokens: np.ndarray
    logprobs: np.ndarray
    num_accepted: np.ndarray
    accepted_logprobs: np.ndarray
    drafts: np.ndarray
    row_ok: np.ndarray  # [B] bool: no poison token among the row's committed inputs
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    prompt_logprobs: np.ndarray
    prompt_top_ids: np.ndarray
    prompt_top_logprobs: np.ndarray


class FakeRunner(StepRunner):
    """`StepRunner`'s interface (buckets and shapes are StepRunner's own) over a numpy arena.

    `steps_run` counts the batches it ran per mode; `lose_state()` makes the next `run` lose
    the arena as a failed donation would (for the engine's reset path). `poison`: token ids
    that make a row's logits non-finite (module docstring; set it on a subclass)."""

    poison: frozenset = frozenset()

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.vocab = self.cfg.unpadded_vocab_size
        self.steps_run: dict[str, int] = {"extend": 0, "decode": 0, "verify": 0}
        self._lost = False

    # ------------------------------------------------------------ device state

    def _zero_state(self, pool: UnitPool) -> FakeState:
        width = max(self.config.page_size, 2)
        return FakeState(np.zeros((pool.num_units, width), np.int64), np.zeros(len(pool.slots.v2p), np.int32),
                         np.zeros(len(pool.pages.v2p), np.int32),
                         np.zeros((self.config.max_running + 1, self.cfg.unpadded_vocab_size), np.int64))

    def _device_table(self, table: np.ndarray) -> np.ndarray:
        return np.array(table, np.int32)

    def apply_pool(self, pool: UnitPool) -> None:
        src, dst = pool.pending_moves()
        if not len(src) and not pool.tables_dirty:
            return
        if self._lost:
            raise RuntimeError("fake runner: the arena was lost")
        slot_table, page_table = pool.tables()
        arena = self.state.arena
        if len(src):
            arena = self.move_units(arena, src, dst)
        self.state = FakeState(arena, slot_table, page_table, self.state.counts)
        self.tables_on_device = (slot_table, page_table)
        pool.ack_moves()
        pool.tables_dirty = False

    def move_units(self, arena: np.ndarray, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        out = arena.copy()
        out[dst] = arena[src]  # one gather, then one scatter
        return out

    def reset_counts(self, rows: np.ndarray, values: np.ndarray) -> None:
        if self._lost:
            raise RuntimeError("fake runner: the arena was lost")
        counts = self.state.counts.copy()
        counts[rows] = values
        self.state = FakeState(self.state.arena, self.state.slot_v2p, self.state.page_v2p, counts)

    def read_rows(self, rows: np.ndarray) -> np.ndarray:
        return self.state.arena[np.asarray(rows, np.int64)].copy()

    def write_rows(self, rows: np.ndarray, data: np.ndarray) -> None:
        arena = self.state.arena.copy()
        arena[np.asarray(rows, np.int64)] = data
        self.state = FakeState(arena, self.state.slot_v2p, self.state.page_v2p, self.state.counts)

    def compiled_step(self, shape: StepShape):
        self.compiled[shape] = None
        return None

    def warmup(self, max_move_units: int, overlap: bool = False, wait: bool = True) -> None:
        return None

    def state_lost(self) -> bool:
        return self._lost

    def lose_state(self) -> None:
        self._lost = True

    def rebuild_state(self, pool: UnitPool) -> None:
        self._lost = False
        super().rebuild_state(pool)

    def read_slot(self, physical_slot: int) -> dict[str, np.ndarray]:
        row = self.arena_slot_row(physical_slot)
        return {"fake.length": self.state.arena[row, 0:1].copy(), "fake.hash": self.state.arena[row, 1:2].copy()}

    # ------------------------------------------------------------ the step

    def arena_slot_row(self, physical_slot: int) -> int:
        return physical_slot * self.layout.slot_units

    def arena_page_row(self, physical_page: int) -> int:
        return self.state.arena.shape[0] - (physical_page + 1) * self.layout.page_units

    def run(self, shape: StepShape, batch: StepBatch, feed: DecodeFeed | None = None) -> FakeOutput:
        check_batch(batch, shape, self.config.spec_steps, self.config.max_stop_ids, self.config.max_logit_bias)
        if self._lost:
            raise RuntimeError("fake runner: the arena was lost")
        sp = batch.sampling
        live = batch.layout.num_new > 0
        if np.any(live & (sp.min_p > 0)) or np.any(live[:, None] & (sp.bias_ids >= 0)):
            raise ValueError("the fake runner does not emulate min_p or logit_bias")
        self.steps_run[shape.mode] += 1
        if feed is not None:
            batch = self._fed(batch, feed)
        b, spec, k = shape.batch, self.config.spec_steps, shape.top_logprobs
        width = shape.steps if shape.mode == "decode" and shape.steps > 1 else None
        rounds = shape.steps if shape.mode == "verify" and shape.steps > 1 else None
        per_row = (b, width) if width else (b, spec + 1) if shape.mode == "verify" else (b,)
        emitted = (b, width) if width else (b, rounds, spec + 1) if rounds else (b,)
        if rounds:
            per_row = (b, rounds, spec + 1)
        t = shape.tokens if shape.score else 0
        out = FakeOutput(np.zeros(emitted, np.int32), np.zeros(emitted, np.float32),
                         np.full((b, rounds), -1, np.int32) if rounds else np.zeros(b, np.int32),
                         np.zeros((b, spec), np.float32),
                         np.zeros((b, spec), np.int32), np.ones(b, bool), np.zeros(per_row + (k,), np.int32),
                         np.zeros(per_row + (k,), np.float32), np.zeros(t, np.float32), np.zeros((t, k), np.int32),
                         np.zeros((t, k), np.float32))
        arena = self.state.arena.copy()  # a step is all or nothing, like the donated arena
        counts = self.state.counts.copy()
        for i in range(b):
            if batch.layout.num_new[i] > 0:
                self._row(arena, counts, shape, batch, i, out, width)
        self.state = FakeState(arena, self.state.slot_v2p, self.state.page_v2p, counts)
        return out

    def _fed(self, batch: StepBatch, feed: DecodeFeed) -> StepBatch:
        """`steps/feed.py`'s rule on the host: each fed row's token and activity from the
        previous dispatch's outputs."""
        from dataclasses import replace

        lay = batch.layout
        tokens, num_new, num_steps = lay.tokens.copy(), lay.num_new.copy(), lay.num_steps.copy()
        for i, (src, planned) in enumerate(zip(feed.rows, feed.steps)):
            token = int(feed.prev.tokens[src, max(planned - 1, 0)])
            stopped = token in [s for s in batch.sampling.stop_ids[i] if s >= 0]
            tokens[i] = token
            if not (int(feed.prev.num_accepted[src]) == planned and not stopped and feed.prev.row_ok[src]):
                num_new[i] = num_steps[i] = 0
        return replace(batch, layout=replace(batch.layout, tokens=tokens, num_new=num_new, num_steps=num_steps))

    def _translate_slot(self, virtual: int) -> int:
        return int(self.state.slot_v2p[virtual]) if virtual > 0 else 0

    def _row(self, arena: np.ndarray, counts: np.ndarray, shape: StepShape, batch: StepBatch, i: int, out: FakeOutput,
             width: int | None) -> None:
        slot = self._translate_slot(int(batch.slots.virtual_slot[i]))
        if slot == 0:
            raise FakeStateError(f"row {i}: a live row on the sink slot")
        pages = [int(self.state.page_v2p[v]) if v > 0 else 0 for v in batch.slots.virtual_pages[i]]
        cow = self._translate_slot(int(batch.slots.virtual_cow_slot[i]))
        if cow:
            rows = slice(self.arena_slot_row(cow), self.arena_slot_row(cow) + self.layout.slot_units)
            arena[self.arena_slot_row(slot):self.arena_slot_row(slot) + self.layout.slot_units] = arena[rows]
        start = int(batch.layout.seq_start[i])
        length, h = (int(arena[self.arena_slot_row(slot), 0]), int(arena[self.arena_slot_row(slot), 1])) \
            if batch.layout.has_state[i] else (0, SEED)
        if length != start:
            raise FakeStateError(f"row {i}: its slot holds {length} tokens, the step starts at {start}")
        if fold(self._read_pages(arena, pages, 0, start)) != h:
            raise FakeStateError(f"row {i}: the tokens its pages hold are not its slot's history")
        tracks = [(int(v), int(n)) for v, n in zip(batch.slots.virtual_track_slot[i], batch.slots.track_len[i])
                  if n > 0]
        q0, n = int(batch.layout.query_start[i]), int(batch.layout.num_new[i])
        new = [int(t) for t in batch.layout.tokens[q0:q0 + n]]
        sp = batch.sampling
        temp, seed = float(sp.temperature[i]), int(sp.seed[i])
        stops = {int(s) for s in sp.stop_ids[i] if s >= 0}
        row, out_len, k = int(sp.count_row[i]), int(sp.out_len[i]), int(out.top_ids.shape[-1])
        repetition = float(sp.repetition_penalty[i]) != 1
        output_penalty = float(sp.presence_penalty[i]) != 0 or float(sp.frequency_penalty[i]) != 0
        want_top = k and int(sp.top_logprobs[i]) > 0

        def choose(h, pos, out_index, extra=()):
            """The row's next token after hash h at `pos`, its out_index-th (extra: drafts
            counted as generated)."""
            c = None
            if row and (repetition or output_penalty):
                c = counts[row].copy()
                for t in extra:
                    c[t] += 2
            return next_token(h, temp, seed, pos, self.vocab, banned_tokens(
                c, out_index, int(sp.min_tokens[i]), stops, repetition, output_penalty))

        def emitted(tokens):
            for t in tokens:
                if row:
                    counts[row, t] += 2

        def top(h):
            return top_tokens(h, k, self.vocab) if want_top else [(0, 0.0)] * k

        def advance(h, pos, tokens, tracks_at):
            for j, t in enumerate(tokens):
                self._write_page_token(arena, pages, pos + j, t)
                h = mix(h, t)
                for v, at in tracks_at:
                    if at == j + 1:
                        self._write_slot(arena, self._translate_slot(v), pos + j + 1, h)
            return h

        if shape.mode == "verify":
            def verify_round(h, start, new, out_len, max_accept, tracks):
                """One verify round from hash h at `start` (row tokens `new`): (accepted, the
                committed tokens' log-probs, their top alternatives, the round's bonus, its
                next drafts, the hash after its commits), or None when it is poisoned."""
                drafts = new[1:]
                hh = mix(h, new[0])
                hashes, lps = [hh], []  # the hash before each emitted position
                accepted = 0
                for d in range(len(drafts)):
                    want = choose(hh, start + 1 + d, out_len + d, drafts[:d])
                    if drafts[d] != want or accepted >= max_accept:
                        break
                    lps.append(token_logprob(hh, drafts[d]))
                    accepted += 1
                    if drafts[d] in stops:
                        break
                    hh = mix(hh, drafts[d])
                    hashes.append(hh)
                stop_hit = accepted and drafts[accepted - 1] in stops
                commit = accepted + 1 - (1 if stop_hit else 0)
                if self._poisoned(arena, new[:commit], i, out, slot, pages, start, len(new), tracks):
                    return None
                h_end = advance(h, start, new[:commit], [(v, at) for v, at in tracks if at <= commit])
                for j in range(commit, len(new)):  # K/V of rejected drafts: rewritten before any read
                    self._write_page_token(arena, pages, start + j, new[j])
                self._write_slot(arena, slot, start + commit, h_end)
                if stop_hit:  # the accepted stop draft is the last token: it becomes the bonus
                    a, bonus = accepted - 1, drafts[accepted - 1]
                else:
                    a, bonus = accepted, choose(h_end, start + commit, out_len + accepted, drafts[:accepted])
                emitted(drafts[:a] + [bonus])
                lps = lps[:a] + [token_logprob(h_end, bonus)]
                return a, lps, [top(hashes[j]) for j in range(a + 1)], bonus, \
                    self._drafts(mix(h_end, bonus), temp, seed, start + commit + 1), h_end

            if shape.steps == 1:
                got = verify_round(h, start, new, out_len, int(batch.spec.max_accept[i]), tracks)
                if got is None:
                    return
                a, lps, tops, bonus, out.drafts[i], _ = got
                out.tokens[i], out.logprobs[i], out.num_accepted[i] = bonus, lps[-1], a
                out.accepted_logprobs[i, :a] = lps[:a]
                for j in range(a + 1):
                    self._put_top(out.top_ids[i, j], out.top_logprobs[i, j], tops[j])
                return
            # R rounds (steps/verify_loop.py): round j checks round j - 1's drafts from where it
            # left, until its rounds, a stop token or its token budget run out
            done, left = 0, int(batch.spec.tokens_left[i])
            for j in range(int(batch.layout.num_steps[i])):
                length, h_slot = int(arena[self.arena_slot_row(slot), 0]), int(arena[self.arena_slot_row(slot), 1])
                if j and (length, h_slot) != (start + done, h):
                    raise FakeStateError(f"row {i}: round {j} finds {length} tokens in its slot, not {start + done}")
                max_accept = min(int(batch.spec.max_accept[i]), left - done - 1)
                got = verify_round(h, start + done, new, out_len + done, max_accept,
                                   [(v, at - done) for v, at in tracks if at - done > 0])
                if got is None:
                    return
                a, lps, tops, bonus, drafts, h = got
                out.tokens[i, j, :a + 1] = new[1:1 + a] + [bonus]
                out.logprobs[i, j, :a + 1] = lps
                out.num_accepted[i, j] = a
                for c in range(a + 1):
                    self._put_top(out.top_ids[i, j, c], out.top_logprobs[i, j, c], tops[c])
                out.drafts[i] = drafts
                done += a + 1
                new = [bonus] + drafts
                if bonus in stops or done >= left:
                    break
            return
        if width is None:  # extend, or a one-step decode
            if self._poisoned(arena, new, i, out, slot, pages, start, n, tracks):
                return
            if shape.score:
                self._score(out, batch, i, h, new)
            h_end = advance(h, start, new, tracks)
            self._write_slot(arena, slot, start + n, h_end)
            tok = choose(h_end, start + n, out_len)
            out.tokens[i], out.logprobs[i] = tok, token_logprob(h_end, tok)
            if shape.mode == "decode" or batch.spec.sample_next[i]:
                emitted([tok])
            self._put_top(out.top_ids[i], out.top_logprobs[i], top(h_end))
            if self.config.spec_steps:
                out.drafts[i] = self._drafts(mix(h_end, tok), temp, seed, start + n + 1)
            return
        token, pos = new[0], start  # a K-step decode: each step's sample feeds the next
        for j in range(int(batch.layout.num_steps[i])):
            if self._poisoned(arena, [token], i, out, slot, pages, start, pos + 1 - start, tracks):
                out.num_accepted[i] = j + 1  # the failing step ran (decode_loop.py)
                return
            h = advance(h, pos, [token], [(v, at - j) for v, at in tracks if at == j + 1])
            self._write_slot(arena, slot, pos + 1, h)
            token = choose(h, pos + 1, out_len + j)
            out.tokens[i, j], out.logprobs[i, j] = token, token_logprob(h, token)
            emitted([token])
            self._put_top(out.top_ids[i, j], out.top_logprobs[i, j], top(h))
            out.num_accepted[i] = j + 1
            pos += 1
            if token in stops:
                break

    @staticmethod
    def _put_top(ids: np.ndarray, logprobs: np.ndarray, top: list[tuple[int, float]]) -> None:
        for j, (t, lp) in enumerate(top):
            ids[j], logprobs[j] = t, lp

    def _score(self, out: FakeOutput, batch: StepBatch, i: int, h: int, new: list[int]) -> None:
        """A scoring step's row: each packed token's next-token log-prob (and top alternatives)."""
        q0, k = int(batch.layout.query_start[i]), int(batch.sampling.prompt_top_logprobs[i])
        for j, t in enumerate(new):
            h = mix(h, t)
            nxt = new[j + 1] if j + 1 < len(new) else int(batch.spec.lookahead[i, 0])
            out.prompt_logprobs[q0 + j] = token_logprob(h, nxt)
            if k:
                self._put_top(out.prompt_top_ids[q0 + j], out.prompt_top_logprobs[q0 + j],
                              top_tokens(h, out.prompt_top_ids.shape[1], self.vocab))

    def _poisoned(self, arena: np.ndarray, inputs: list[int], i: int, out: FakeOutput, slot: int, pages: list[int],
                  start: int, n: int, tracks: list[tuple[int, int]]) -> bool:
        """If a poison token is among the row's committed inputs: its logits are non-finite
        (row_ok False) and everything it wrote this step is garbage: its slot, its checkpoint
        slots and page positions [start, start + n) are marked so that any later read fails."""
        if not self.poison.intersection(inputs):
            return False
        out.row_ok[i] = False
        for s in [slot] + [self._translate_slot(v) for v, _ in tracks]:
            self._write_slot(arena, s, -1, 0)
        for pos in range(start, start + n):
            if pos // self.config.page_size < len(pages) and pages[pos // self.config.page_size]:
                self._write_page_token(arena, pages, pos, -1)
        return True

    def _drafts(self, h: int, temp: float, seed: int, pos: int) -> list[int]:
        """The fake MTP chain: the true continuation, wrong where `draft_is_wrong` says."""
        out = []
        for d in range(self.config.spec_steps):
            t = next_token(h, temp, seed, pos + d, self.vocab)
            out.append((t + 1) % self.vocab if draft_is_wrong(h, d) else t)
            h = mix(h, t)
        return out

    def _write_slot(self, arena: np.ndarray, slot: int, length: int, h: int) -> None:
        if slot > 0:  # the sink takes writes and is never read
            arena[self.arena_slot_row(slot), 0:2] = (length, h)

    def _write_page_token(self, arena: np.ndarray, pages: list[int], pos: int, token: int) -> None:
        ps = self.config.page_size
        if pos // ps >= len(pages) or pages[pos // ps] == 0:
            raise FakeStateError(f"position {pos} has no page in the row's table")
        arena[self.arena_page_row(pages[pos // ps]), pos % ps] = token

    def _read_pages(self, arena: np.ndarray, pages: list[int], start: int, end: int) -> list[int]:
        ps = self.config.page_size
        out = []
        for pos in range(start, end):
            if pos // ps >= len(pages) or pages[pos // ps] == 0:
                raise FakeStateError(f"position {pos} has no page in the row's table")
            out.append(int(arena[self.arena_page_row(pages[pos // ps]), pos % ps]))
        return out

"""Check 1, request isolation: for every real row r of one step, the gradient of r's logits is
*bitwise zero* w.r.t. every other request's token embeddings, every arena row that is not r's
own slot or r's own pages (other requests' slots and pages, checkpoint slots, the sinks, free
rows) and every padding token; and nonzero on r's own inputs.

One VJP per real row (`step_fns.step_vjp`) pulls back a random Gaussian cotangent supported
on that row's logits: a nonzero Jacobian entry gives a zero product only with probability
zero; a missing dependence gives an exact 0.0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from ..cache.layout import ArenaLayout
from ..cache.state import ServingState
from ..config import InklingConfig
from ..steps import StepBatch, StepShape
from .scenario import Scenario
from .step_fns import Params, StepFn, extend_embeddings, make_step_fn, step_vjp


@dataclass(frozen=True)
class Leak:
    """Row `row`'s logits have a nonzero gradient w.r.t. inputs it must not see."""

    row: int  # the request whose logits leak
    source: str  # e.g. "row 0's slot", "row 2's tokens", "padding tokens", "the sink slot", "a free page"
    source_row: int | None  # the other request, when the source belongs to one
    kind: str  # "token" or "arena"
    count: int  # tokens / arena rows with nonzero gradient
    max_abs_grad: float

    def __str__(self) -> str:
        what = "tokens" if self.kind == "token" else "arena rows"
        return (f"LEAK: row {self.row}'s logits depend on {self.source} "
                f"({self.count} {what}, max |grad| {self.max_abs_grad:.3g})")


@dataclass
class IsolationReport:
    ok: bool
    details: str
    leaks: list[Leak]
    real_rows: list[int]
    max_foreign_grad: float  # max |grad| of any real row's logits outside its own inputs (0.0 when isolated)
    own_token_grad: dict[int, float]  # row -> max |grad| on its own token embeddings
    own_slot_grad: dict[int, float]  # row -> max |grad| on its own slot rows
    own_page_grad: dict[int, float]  # row -> max |grad| on its own page rows
    logits: np.ndarray = field(repr=False)  # [B, V] the step's logits
    token_grad: np.ndarray = field(repr=False)  # [B, T] max over hidden of |d(c_r . logits_r) / d embed_t|
    arena_grad: np.ndarray = field(repr=False)  # [B, U] max over a row's elements of |d(c_r . logits_r) / d arena|
    token_labels: list[str] = field(repr=False)  # owner of each packed token
    unit_labels: list[str] = field(repr=False)  # owner of each arena row
    own_units: np.ndarray = field(repr=False)  # [B, U] bool: the arena rows row r may read
    own_tokens: np.ndarray = field(repr=False)  # [B, T] bool: row r's new tokens

    def __str__(self) -> str:
        return self.details


@dataclass
class Ownership:
    """Who owns each packed token and each arena row of one step (host side, for the checks'
    expectations and the reports' labels). Arena rows come from the layout's formulas."""

    real_rows: list[int]  # rows with new tokens
    own_units: np.ndarray  # [B, U] bool: arena rows row r may read (its slot, copy-on-write source, pages)
    own_tokens: np.ndarray  # [B, T] bool: row r's new tokens
    unit_labels: list[str]  # [U]
    token_labels: list[str]  # [T]
    slot_units: dict[int, set[int]]  # row -> arena rows of its slot (and copy-on-write source)
    page_units: dict[int, set[int]]  # row -> arena rows of its pages


def _object_rows(layout: ArenaLayout, num_units: int):
    """(rows of physical slot p, rows of physical page q) as sets of arena rows."""
    def slot(p):
        return set(range(layout.slot_row(p), layout.slot_row(p) + layout.slot_units))

    def page(q):
        first = layout.page_row(q, num_units, 0)
        return set(range(first, first + layout.page_units))

    return slot, page


def _background_labels(slot_v2p: np.ndarray, page_v2p: np.ndarray, layout: ArenaLayout, num_units: int) -> list[str]:
    """Labels of the rows no request of the step owns: sinks, free slots and pages, unused."""
    slot_rows, page_rows = _object_rows(layout, num_units)
    labels = ["unused"] * num_units
    for p in range(int(slot_v2p.max()) + 1):
        for u in slot_rows(p):
            labels[u] = "the sink slot" if p == 0 else "a free slot"
    for q in range(int(page_v2p.max()) + 1):
        for u in page_rows(q):
            if 0 <= u < num_units:
                labels[u] = "the sink page" if q == 0 else "a free page"
    return labels


def ownership(state: ServingState, batch: StepBatch, layout: ArenaLayout) -> Ownership:
    """Host-side map of who owns each packed token and each arena row."""
    slot_v2p, page_v2p = np.asarray(state.slot_v2p), np.asarray(state.page_v2p)
    num_units = int(state.arena.shape[0])
    num_new = np.asarray(batch.layout.num_new)
    b = len(num_new)
    real = [r for r in range(b) if num_new[r] > 0]
    slot_rows, page_rows = _object_rows(layout, num_units)
    phys_slot = lambda v: int(slot_v2p[v]) if v > 0 else 0
    unit_labels = _background_labels(slot_v2p, page_v2p, layout, num_units)

    slot, cow = np.asarray(batch.slots.virtual_slot), np.asarray(batch.slots.virtual_cow_slot)
    track, track_len = np.asarray(batch.slots.virtual_track_slot), np.asarray(batch.slots.track_len)
    pages = np.asarray(batch.slots.virtual_pages)
    own_units = np.zeros((b, num_units), bool)
    slot_u: dict[int, set[int]] = {}
    page_u: dict[int, set[int]] = {}
    owners: dict[int, list[str]] = {}
    for r in real:
        s = slot_rows(phys_slot(slot[r])) if slot[r] > 0 else set()
        for u in s:
            owners.setdefault(u, []).append(f"row {r}'s slot")
        if cow[r] > 0:  # a copy-on-write restore reads the source slot
            for u in slot_rows(phys_slot(cow[r])):
                owners.setdefault(u, []).append(f"row {r}'s copy-on-write source slot")
                s.add(u)
        for m in np.nonzero((track[r] > 0) & (track_len[r] > 0))[0]:  # written, never read
            for u in slot_rows(phys_slot(track[r, m])):
                owners.setdefault(u, []).append(f"row {r}'s checkpoint slot")
        pg = set()
        for v in pages[r]:
            if v > 0:
                pg |= page_rows(int(page_v2p[v]))
        for u in pg:
            owners.setdefault(u, []).append(f"row {r}'s pages")
        slot_u[r], page_u[r] = s, pg
        own_units[r, sorted(s | pg)] = True
    for u, names in owners.items():
        unit_labels[u] = " / ".join(dict.fromkeys(names))

    token_row, token_offset = np.asarray(batch.layout.token_row), np.asarray(batch.layout.token_offset)
    own_tokens = np.zeros((b, len(token_row)), bool)
    token_labels = []
    for i, r in enumerate(token_row.tolist()):
        if r in real and token_offset[i] < num_new[r]:
            own_tokens[r, i] = True
            token_labels.append(f"row {r}'s tokens")
        else:
            token_labels.append("padding tokens")
    return Ownership(real, own_units, own_tokens, unit_labels, token_labels, slot_u, page_u)


def _row_gradients(params: Params, state: ServingState, batch: StepBatch, step_fn: StepFn, rows: list[int],
                   vocab: int, seed: int):
    """(logits [B, V], token_grad [B, T], arena_grad [B, U]): for each row r in `rows`, the max
    |gradient| of c_r . logits_r (c_r random) per packed token embedding and per arena row."""
    ext_rows, batch_ext = extend_embeddings(params, batch)
    b, t = len(np.asarray(batch.layout.num_new)), len(np.asarray(batch.layout.tokens))
    cot = np.asarray(jax.random.normal(jax.random.key(seed), (b, vocab), jnp.float32))
    zero_arena = jnp.zeros_like(state.arena)
    vjp = step_vjp(step_fn)
    tok = np.zeros((b, t), np.float32)
    ar = np.zeros((b, state.arena.shape[0]), np.float32)
    logits = None
    for r in rows:
        c = np.where(np.arange(b)[:, None] == r, cot, 0.0).astype(np.float32)
        lg, _, _, d_ext, d_arena = vjp(params, ext_rows, state, batch_ext, c, zero_arena)
        logits = np.asarray(lg) if logits is None else logits
        tok[r] = np.max(np.abs(np.asarray(d_ext, np.float32)), axis=-1)
        ar[r] = np.max(np.abs(np.asarray(d_arena, np.float32)), axis=-1)
    return logits, tok, ar


def _leaks_of_row(r: int, tok: np.ndarray, ar: np.ndarray, own: Ownership) -> list[Leak]:
    """Row r's nonzero gradients outside its own inputs, grouped by what they land on."""
    groups: dict[tuple[str, str], list[float]] = {}
    for i in np.nonzero((tok[r] != 0) & ~own.own_tokens[r])[0]:
        groups.setdefault(("token", own.token_labels[i]), []).append(float(tok[r, i]))
    for u in np.nonzero((ar[r] != 0) & ~own.own_units[r])[0]:
        groups.setdefault(("arena", own.unit_labels[u]), []).append(float(ar[r, u]))
    leaks = []
    for (kind, src), vals in sorted(groups.items()):
        src_row = int(src.split()[1][:-2]) if src.startswith("row ") else None
        leaks.append(Leak(r, src, src_row, kind, len(vals), max(vals)))
    return leaks


def check_isolation(params: Params, scenario: Scenario | None = None, *, state: ServingState | None = None,
                    batch: StepBatch | None = None, cfg: InklingConfig | None = None,
                    layout: ArenaLayout | None = None, shape: StepShape | None = None,
                    step_fn: StepFn | None = None, seed: int = 0) -> IsolationReport:
    """Request isolation of one step, by reverse-mode autodiff.

    Pass a `Scenario`, or state / batch / cfg / layout / shape. For every real row r
    (num_new > 0), g_r = d(c_r . logits_r) / d(inputs) for a random cotangent c_r, w.r.t. the
    embedding vector of every packed token and every arena row. ok iff for every r, g_r is
    exactly 0.0 on every token that is not one of r's new tokens and on every arena row outside
    r's own slot (plus its copy-on-write source) and r's own pages, AND g_r is nonzero on r's
    own tokens, on r's slot when it has state, and on r's pages when it has cached context and
    the model has full-attention layers (so the probe is not vacuous). Padded rows' logits are
    not checked (the engine discards them). `step_fn` defaults to `steps.step_logits`."""
    if scenario is not None:
        state, batch, cfg, layout, shape = scenario.state, scenario.batch, scenario.cfg, scenario.layout, scenario.shape
    step_fn = step_fn or make_step_fn(cfg, layout, shape)
    own = ownership(state, batch, layout)
    logits, tok, ar = _row_gradients(params, state, batch, step_fn, own.real_rows, cfg.unpadded_vocab_size, seed)

    leaks: list[Leak] = []
    problems, lines = [], []
    own_tok, own_slot, own_page = {}, {}, {}
    has_state, seq_start = np.asarray(batch.layout.has_state), np.asarray(batch.layout.seq_start)
    has_pages = any(g is not None for g in layout.target_page_layer)
    for r in own.real_rows:
        row_leaks = _leaks_of_row(r, tok, ar, own)
        leaks += row_leaks
        own_tok[r] = float(tok[r][own.own_tokens[r]].max(initial=0.0))
        own_slot[r] = float(max((ar[r, u] for u in own.slot_units[r]), default=0.0))
        own_page[r] = float(max((ar[r, u] for u in own.page_units[r]), default=0.0))
        if own_tok[r] == 0.0:
            problems.append(f"row {r}'s logits show no dependence on its own tokens (vacuous probe)")
        if has_state[r] and own.slot_units[r] and own_slot[r] == 0.0:
            problems.append(f"row {r} has state but its logits do not depend on its slot")
        if seq_start[r] > 0 and own.page_units[r] and has_pages and own_page[r] == 0.0:
            problems.append(f"row {r} has cached context but its logits do not depend on its pages")
        n_out = sum(lk.count for lk in row_leaks)
        lines.append(f"row {r}: max |grad| on own tokens {own_tok[r]:.3g}, own slot {own_slot[r]:.3g}, "
                     f"own pages {own_page[r]:.3g}; everywhere else "
                     + ("exactly 0.0" if not n_out else f"{n_out} nonzero"))
    ok = not leaks and not problems
    head = (f"isolation {'OK' if ok else 'FAILED'}: {len(own.real_rows)} request rows of a {shape.mode} step "
            f"(B {shape.batch}, T {shape.tokens}); gradient of each row's logits w.r.t. {tok.shape[1]} token "
            f"embeddings and {ar.shape[1]} arena rows")
    max_foreign = max((lk.max_abs_grad for lk in leaks), default=0.0)
    details = "\n".join([head] + [str(lk) for lk in leaks] + problems + lines)
    return IsolationReport(ok, details, leaks, own.real_rows, max_foreign, own_tok, own_slot, own_page, logits, tok,
                           ar, own.token_labels, own.unit_labels, own.own_units, own.own_tokens)

"""Differentiable testing harness: properties of the serving path proved with autodiff.

Three checks, each returning a small report (``ok``, human-readable ``details``, and the
measured numbers) instead of only asserting, so tests assert ``report.ok`` and notebooks
print / plot the report:

    check_isolation(params, scenario, step_fn=None) -> IsolationReport
        Request isolation: for every real row r of one step, the gradient of r's logits is
        *bitwise zero* w.r.t. every other request's token embeddings, every arena row that is
        not r's own slot or r's own pages (other requests' slots and pages, checkpoint slots,
        the sinks, free rows) and every padding token; and nonzero on r's own inputs.
    check_conv_receptive_field(cfg, rows=..., conv_update=...) -> ConvReport
        The conv windows a step writes (active and checkpoint) depend, through jax.jvp and
        through jax.vjp, exactly on the last K-1 inputs of each row's stream
        [old window ++ new tokens] and on nothing else.
    check_cached_matches_reference(params, cfg, sequences, schedule=None) -> CachedPathReport
        d loss / d params through the chunked, cached serving path (a chain of step calls
        threading the state from a zero arena, differentiated backwards step by step through
        the state) equals d loss / d params through the reference `forward`, within a stated
        float32 tolerance.

The step under test is any ``step_fn(params, state, batch) -> (logits [B, V], state)`` with the
signature of `steps.step_logits` once cfg / layout / shape are bound; the default is exactly
that (`make_step_fn`). `make_step_fn(..., context_cls=...)` builds the same step with another
`StepContext` class (a subclass with a planted bug, in the tests), through `step_logits`'s own
`context_cls` hook.

Differentiating w.r.t. the token *embeddings* of an unmodified step: the embedding table is
extended by T rows holding the packed tokens' embedding vectors (``ext_rows [T, H]``) and the
batch's token ids are rewritten to V + t. The step computes bitwise the same logits, and the
gradient w.r.t. ``ext_rows[t]`` is the gradient w.r.t. the vector fed in for packed token t
(padding included), without aliasing between tokens that share an id; scattering it back onto
the token ids gives the gradient w.r.t. ``params["embed"]``.

One jitted program per step function serves checks 1 and 3: the VJP of one step w.r.t.
(params, ext_rows, arena) for cotangents on (logits, new arena). Check 1 pulls back a random
Gaussian cotangent supported on one row's logits (a nonzero Jacobian entry gives a zero product
only with probability zero; a missing dependence gives an exact 0.0). Check 3 runs the chain
forward, then backward from the last step to the first, handing each step's arena cotangent
to the step before. Checks 1 and 3 use the same bucket (`Geometry`) by default, so a session
compiles the step's VJP once. On CPU the harness compiles with XLA's backend optimisation off
(about twice as fast to compile; each program runs a handful of times).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from dataclasses import replace as dc_replace
from functools import partial
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import steps
from pallas_kernels.conv_state import ref as conv_ref
from pallas_kernels.conv_state.ref import PackedRows
from pallas_kernels.slot_ops.ref import read_field, write_field

from .cache.layout import ArenaLayout
from .cache.state import ServingState, init_state
from .config import InklingConfig
from .model import forward
from .steps import RowPlan, StepBatch, StepContext, StepShape, pack_batch

Params = dict[str, Any]
StepFn = Callable[[Params, ServingState, StepBatch], tuple[jax.Array, ServingState]]

__all__ = [
    "Geometry", "Scenario", "Leak", "IsolationReport", "ConvReport", "CachedPathReport",
    "check_isolation", "check_conv_receptive_field", "check_cached_matches_reference",
    "make_step_fn", "default_geometry", "isolation_scenario", "step_vjp", "plot_isolation",
]


def _jit(fn: Callable) -> Callable:
    """jax.jit for the checks' programs: on CPU with XLA's backend optimisation off."""
    if jax.default_backend() == "cpu":
        return jax.jit(fn, compiler_options={"xla_backend_optimization_level": 0})
    return jax.jit(fn)


# ------------------------------------------------------------------ step functions


_STEP_FNS: dict[tuple, StepFn] = {}


def make_step_fn(cfg: InklingConfig, layout: ArenaLayout, shape: StepShape, context_cls: type | None = None,
                 use_pallas: bool = False, interpret: bool = False) -> StepFn:
    """step_fn(params, state, batch) -> (logits, state): `steps.step_logits` with the layer
    context class `context_cls` (default `StepContext`; a subclass with a planted bug in the
    tests). The same object is returned for the same arguments, so the harness's compiled
    programs are reused."""
    key = (cfg, layout, shape, context_cls, use_pallas, interpret)
    fn = _STEP_FNS.get(key)
    if fn is None:
        fn = partial(steps.step_logits, cfg=cfg, layout=layout, shape=shape, use_pallas=use_pallas,
                     interpret=interpret, context_cls=context_cls or StepContext)
        _STEP_FNS[key] = fn
    return fn


_VJPS: dict[int, tuple[StepFn, Callable]] = {}


def step_vjp(step_fn: StepFn) -> Callable:
    """The compiled VJP of one step (cached per step function):

        vjp(params, ext_rows [T, H], state, batch_ext, cot_logits [B, V], cot_arena [U, E])
            -> (logits, new_arena, d_params, d_ext_rows, d_arena)

    where the step sees params["embed"] extended by ext_rows and batch_ext.tokens = V + t
    (see the module docstring). d_params["embed"] covers the original table only (zero: no
    token points there); the tokens' share is d_ext_rows."""
    hit = _VJPS.get(id(step_fn))
    if hit is not None and hit[0] is step_fn:
        return hit[1]

    def run(params, ext_rows, state, batch_ext, cot_logits, cot_arena):
        def f(params, ext_rows, arena):
            p = dict(params)
            p["embed"] = jnp.concatenate([params["embed"], ext_rows.astype(params["embed"].dtype)])
            logits, new_state = step_fn(p, state.replace(arena=arena), batch_ext)
            return logits, new_state.arena

        (logits, new_arena), pull = jax.vjp(f, params, ext_rows, state.arena)
        d_params, d_ext, d_arena = pull((cot_logits.astype(logits.dtype), cot_arena.astype(new_arena.dtype)))
        return logits, new_arena, d_params, d_ext, d_arena

    fn = _jit(run)
    _VJPS[id(step_fn)] = (step_fn, fn)
    return fn


def _extended(params: Params, batch: StepBatch) -> tuple[jax.Array, StepBatch]:
    """(ext_rows, batch_ext): the packed tokens' embedding vectors, and the batch pointing at them."""
    tokens = np.asarray(batch.tokens)
    v = params["embed"].shape[0]
    ext_rows = jnp.asarray(params["embed"])[jnp.asarray(tokens)]
    return ext_rows, dc_replace(batch, tokens=np.arange(v, v + len(tokens), dtype=np.int32))


# --------------------------------------------------------------- bucket and scenario


@dataclass(frozen=True)
class Geometry:
    """The bucket the step-level checks compile for: the arena layout, the step shape, and how
    many slots / pages the arena holds (physical = virtual, behind shuffled id tables)."""

    layout: ArenaLayout
    shape: StepShape
    num_slots: int
    num_pages: int

    @property
    def num_units(self) -> int:
        return (self.num_slots + 1) * self.layout.slot_units + (self.num_pages + 1) * self.layout.page_units

    def state(self, arena: np.ndarray | None = None, seed: int = 0, dtype: Any = jnp.float32) -> ServingState:
        """A state of this geometry: zero arena unless given; slot and page tables shuffled
        permutations (virtual 0 -> physical 0, the sinks)."""
        rng = np.random.RandomState(seed)
        st = init_state(self.layout, self.num_units, self.num_slots, self.num_pages, dtype)
        slot_v2p = np.concatenate([[0], rng.permutation(np.arange(1, self.num_slots + 1))]).astype(np.int32)
        page_v2p = np.concatenate([[0], rng.permutation(np.arange(1, self.num_pages + 1))]).astype(np.int32)
        st = st.replace(slot_v2p=jnp.asarray(slot_v2p), page_v2p=jnp.asarray(page_v2p))
        if arena is not None:
            st = st.replace(arena=jnp.asarray(arena, dtype))
        return st


def default_geometry(cfg: InklingConfig, page_size: int = 4) -> Geometry:
    """extend step, B 4 rows, T 16 packed tokens, Q 8 new tokens per row, P 8 pages per row
    (32 positions); 8 slots and 32 pages."""
    return Geometry(ArenaLayout.build(cfg, page_size), StepShape("extend", 4, 16, 8, 8), 8, 32)


@dataclass
class Scenario:
    """One step over several requests, built by hand."""

    cfg: InklingConfig
    geometry: Geometry
    state: ServingState
    batch: StepBatch
    description: str

    @property
    def layout(self) -> ArenaLayout:
        return self.geometry.layout

    @property
    def shape(self) -> StepShape:
        return self.geometry.shape

    def step_fn(self, context_cls: type | None = None) -> StepFn:
        return make_step_fn(self.cfg, self.layout, self.shape, context_cls)


def isolation_scenario(cfg: InklingConfig, geometry: Geometry | None = None, seed: int = 0,
                       dtype: Any = jnp.float32) -> Scenario:
    """An extend step (default geometry: B 4, T 16, Q 8, P 8 with page_size 4) over:

      row 0: a continuing request, 6 cached tokens, 3 new, checkpointing after 2 of them
      row 1: a continuing request, 13 cached tokens (its sliding ring has wrapped), 1 new
      row 2: a fresh request, 5 new (its slot holds a stale entry that it must not read)
      row 3: a padded row (the sink slot and sink pages, no tokens)
      tokens 9..15: padding tokens (on the padded row)

    Virtual slot / page ids go through shuffled tables; the arena is random normal, so any
    row a request reads moves its logits."""
    geometry = geometry or default_geometry(cfg)
    if geometry.shape.batch < 4 or geometry.shape.tokens < 9 or geometry.shape.query < 5 \
            or geometry.shape.pages < 4 or geometry.num_slots < 7 or geometry.num_pages < 12:
        raise ValueError("isolation_scenario needs B >= 4, T >= 9, Q >= 5, P >= 4, 7 slots and 12 pages")
    b, t, p = geometry.shape.batch, geometry.shape.tokens, geometry.shape.pages
    rng = np.random.RandomState(seed)
    state = geometry.state(rng.standard_normal((geometry.num_units, geometry.layout.unit_elems)), seed, dtype)

    def per_row(values, fill=0, dt=np.int32):
        return np.array(list(values) + [fill] * (b - len(values)), dt)

    pages = np.zeros((b, p), np.int32)
    pages[0, :3], pages[1, :4], pages[2, :2] = [3, 9, 1], [4, 6, 11, 12], [8, 10]
    token_row = np.full(t, 3, np.int32)
    token_row[:9] = [0, 0, 0, 1, 2, 2, 2, 2, 2]
    token_offset = np.concatenate([[0, 1, 2, 0, 0, 1, 2, 3, 4], np.arange(t - 9)]).astype(np.int32)
    batch = dc_replace(
        StepBatch.empty(geometry.shape), tokens=rng.randint(3, cfg.unpadded_vocab_size, t).astype(np.int32),
        token_row=token_row, token_offset=token_offset, virtual_slot=per_row([2, 5, 7, 0]),
        has_state=per_row([True, True, False, False], False, bool), seq_start=per_row([6, 13, 0, 0]),
        num_new=per_row([3, 1, 5, 0]), query_start=per_row([0, 3, 4, 9], 9), virtual_pages=pages,
        virtual_track_slot=per_row([3, 0, 0, 0])[:, None], track_len=per_row([2, 0, 0, 0])[:, None])
    description = "\n".join([
        f"extend step, B {b} rows, T {t} packed tokens, Q {geometry.shape.query}, P {p} pages per row:",
        "  row 0: continuing request, 6 cached tokens, 3 new, checkpoint after 2 of them",
        "  row 1: continuing request, 13 cached tokens (its sliding ring has wrapped), 1 new",
        "  row 2: fresh request, 5 new (its slot holds a stale entry it must not read)",
        f"  row 3{'..' + str(b - 1) if b > 4 else ''}: padded (sink slot, sink pages, no tokens)",
        f"  tokens 9..{t - 1}: padding tokens"])
    return Scenario(cfg, geometry, state, batch, description)


# ---------------------------------------------------------- check 1: isolation


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


def _ownership(state: ServingState, batch: StepBatch, layout: ArenaLayout):
    """Host-side map of who owns each packed token and each arena row (labels for reports)."""
    slot_v2p, page_v2p = np.asarray(state.slot_v2p), np.asarray(state.page_v2p)
    num_units = int(state.arena.shape[0])
    num_new = np.asarray(batch.num_new)
    b = len(num_new)
    real = [r for r in range(b) if num_new[r] > 0]
    su, pu = layout.slot_units, layout.page_units

    def phys_slot(v):
        return int(slot_v2p[v]) if v > 0 else 0

    def units_of_slot(p):
        return set(range(layout.slot_row(p), layout.slot_row(p) + su))

    def units_of_page(q):
        first = layout.page_row(q, num_units, 0)
        return set(range(first, first + pu))

    unit_labels = ["unused"] * num_units
    for p in range(int(slot_v2p.max()) + 1):
        for u in units_of_slot(p):
            unit_labels[u] = "the sink slot" if p == 0 else "a free slot"
    for q in range(int(page_v2p.max()) + 1):
        for u in units_of_page(q):
            if 0 <= u < num_units:
                unit_labels[u] = "the sink page" if q == 0 else "a free page"

    slot, cow = np.asarray(batch.virtual_slot), np.asarray(batch.virtual_cow_slot)
    track, track_len, pages = np.asarray(batch.virtual_track_slot), np.asarray(batch.track_len), np.asarray(batch.virtual_pages)
    own_units = np.zeros((b, num_units), bool)
    slot_u: dict[int, set[int]] = {}
    page_u: dict[int, set[int]] = {}
    owners: dict[int, list[str]] = {}
    for r in real:
        s = units_of_slot(phys_slot(slot[r])) if slot[r] > 0 else set()
        for u in s:
            owners.setdefault(u, []).append(f"row {r}'s slot")
        if cow[r] > 0:  # a copy-on-write restore reads the source slot
            for u in units_of_slot(phys_slot(cow[r])):
                owners.setdefault(u, []).append(f"row {r}'s copy-on-write source slot")
                s.add(u)
        for m in range(track.shape[1]):
            if track[r, m] > 0 and track_len[r, m] > 0:  # written, never read
                for u in units_of_slot(phys_slot(track[r, m])):
                    owners.setdefault(u, []).append(f"row {r}'s checkpoint slot")
        pg = set()
        for v in pages[r]:
            if v > 0:
                pg |= units_of_page(int(page_v2p[v]))
        for u in pg:
            owners.setdefault(u, []).append(f"row {r}'s pages")
        slot_u[r], page_u[r] = s, pg
        own_units[r, sorted(s | pg)] = True
    for u, names in owners.items():
        unit_labels[u] = " / ".join(dict.fromkeys(names))

    token_row, token_offset = np.asarray(batch.token_row), np.asarray(batch.token_offset)
    own_tokens = np.zeros((b, len(token_row)), bool)
    token_labels = []
    for i, r in enumerate(token_row.tolist()):
        if r in real and token_offset[i] < num_new[r]:
            own_tokens[r, i] = True
            token_labels.append(f"row {r}'s tokens")
        else:
            token_labels.append("padding tokens")
    return real, own_units, own_tokens, unit_labels, token_labels, slot_u, page_u


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
    real, own_units, own_tokens, unit_labels, token_labels, slot_u, page_u = _ownership(state, batch, layout)
    ext_rows, batch_ext = _extended(params, batch)
    b, t = own_tokens.shape
    cot = np.asarray(jax.random.normal(jax.random.key(seed), (b, cfg.unpadded_vocab_size), jnp.float32))
    zero_arena = jnp.zeros_like(state.arena)
    vjp = step_vjp(step_fn)
    tok = np.zeros((b, t), np.float32)
    ar = np.zeros((b, state.arena.shape[0]), np.float32)
    logits = None
    for r in real:
        c = np.where(np.arange(b)[:, None] == r, cot, 0.0).astype(np.float32)
        lg, _, _, d_ext, d_arena = vjp(params, ext_rows, state, batch_ext, c, zero_arena)
        logits = np.asarray(lg) if logits is None else logits
        tok[r] = np.max(np.abs(np.asarray(d_ext, np.float32)), axis=-1)
        ar[r] = np.max(np.abs(np.asarray(d_arena, np.float32)), axis=-1)

    leaks: list[Leak] = []
    problems, lines = [], []
    own_tok, own_slot, own_page = {}, {}, {}
    has_state, seq_start = np.asarray(batch.has_state), np.asarray(batch.seq_start)
    has_pages = any(g is not None for g in layout.target_page_layer)
    for r in real:
        groups: dict[tuple[str, str], list[float]] = {}
        for i in np.nonzero((tok[r] != 0) & ~own_tokens[r])[0]:
            groups.setdefault(("token", token_labels[i]), []).append(float(tok[r, i]))
        for u in np.nonzero((ar[r] != 0) & ~own_units[r])[0]:
            groups.setdefault(("arena", unit_labels[u]), []).append(float(ar[r, u]))
        for (kind, src), vals in sorted(groups.items()):
            src_row = int(src.split()[1][:-2]) if src.startswith("row ") else None
            leaks.append(Leak(r, src, src_row, kind, len(vals), max(vals)))
        own_tok[r] = float(tok[r][own_tokens[r]].max(initial=0.0))
        own_slot[r] = float(max((ar[r, u] for u in slot_u[r]), default=0.0))
        own_page[r] = float(max((ar[r, u] for u in page_u[r]), default=0.0))
        if own_tok[r] == 0.0:
            problems.append(f"row {r}'s logits show no dependence on its own tokens (vacuous probe)")
        if has_state[r] and slot_u[r] and own_slot[r] == 0.0:
            problems.append(f"row {r} has state but its logits do not depend on its slot")
        if seq_start[r] > 0 and page_u[r] and has_pages and own_page[r] == 0.0:
            problems.append(f"row {r} has cached context but its logits do not depend on its pages")
        n_out = sum(len(x) for x in groups.values())
        lines.append(f"row {r}: max |grad| on own tokens {own_tok[r]:.3g}, own slot {own_slot[r]:.3g}, "
                     f"own pages {own_page[r]:.3g}; everywhere else "
                     + ("exactly 0.0" if not n_out else f"{n_out} nonzero"))
    ok = not leaks and not problems
    head = (f"isolation {'OK' if ok else 'FAILED'}: {len(real)} request rows of a {shape.mode} step "
            f"(B {shape.batch}, T {shape.tokens}); gradient of each row's logits w.r.t. {t} token embeddings "
            f"and {ar.shape[1]} arena rows")
    max_foreign = max((lk.max_abs_grad for lk in leaks), default=0.0)
    details = "\n".join([head] + [str(lk) for lk in leaks] + problems + lines)
    return IsolationReport(ok, details, leaks, real, max_foreign, own_tok, own_slot, own_page, logits, tok, ar,
                           token_labels, unit_labels, own_units, own_tokens)


def plot_isolation(report: IsolationReport, rows: Sequence[int] | None = None, fig=None):
    """|d logits_r / d arena row| per arena row for each real row r (log scale): r's own
    slot and pages shaded green, the other requests' slots and pages grey; gradient on r's own
    rows drawn green, on any other row (a leak) red; exact zeros are not drawn. Returns the
    matplotlib figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = list(report.real_rows if rows is None else rows)
    if fig is None:
        fig = plt.figure(figsize=(10, 1.6 * len(rows) + 0.9))
    axes = fig.subplots(len(rows), 1, sharex=True, squeeze=False)[:, 0]
    u = report.arena_grad.shape[1]
    x = np.arange(u)
    positive = report.arena_grad[rows][report.arena_grad[rows] > 0]
    lo, hi = (positive.min() / 3, positive.max() * 3) if positive.size else (1e-3, 1.0)
    requests = np.array([lab.startswith("row ") for lab in report.unit_labels])
    for ax, r in zip(axes, rows):
        g, own = report.arena_grad[r], report.own_units[r]
        for start, stop in _runs(requests & ~own):
            ax.axvspan(start - 0.5, stop - 0.5, color="0.6", alpha=0.25, lw=0)
        for start, stop in _runs(own):
            ax.axvspan(start - 0.5, stop - 0.5, color="tab:green", alpha=0.2, lw=0)
        ax.scatter(x[(g > 0) & own], g[(g > 0) & own], s=7, color="tab:green", zorder=3)
        ax.scatter(x[(g > 0) & ~own], g[(g > 0) & ~own], s=14, color="tab:red", zorder=3)
        if not (g > 0).any():
            ax.text(0.5, 0.5, "no arena row moves this row's logits", transform=ax.transAxes, ha="center",
                    va="center", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylim(lo, hi)
        ax.set_xlim(-0.5, u - 0.5)
        ax.set_ylabel(f"row {r}")
    fig.suptitle("|d logits_r / d arena row| (max over the row's elements; exact zeros not drawn)", fontsize=10)
    fig.legend(handles=[Patch(color="tab:green", alpha=0.4, label="its own slot / pages"),
                        Patch(color="0.6", alpha=0.5, label="other requests' slots / pages, checkpoint slots"),
                        Patch(color="tab:red", label="gradient outside its own rows: a leak")],
               loc="upper center", bbox_to_anchor=(0.5, 0.955), ncol=3, fontsize=8, frameon=False)
    axes[-1].set_xlabel("arena row (unit): slots from 0 upwards (slot 0: the sink), pages from the top down "
                        "(the top row: the sink page)")
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return fig


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    idx = np.nonzero(mask)[0]
    if not len(idx):
        return []
    splits = np.nonzero(np.diff(idx) > 1)[0]
    starts = np.concatenate([[idx[0]], idx[splits + 1]])
    stops = np.concatenate([idx[splits] + 1, [idx[-1] + 1]])
    return list(zip(starts.tolist(), stops.tolist()))


# -------------------------------------------------- check 2: conv receptive field


@dataclass
class ConvReport:
    ok: bool
    details: str
    kernel_size: int
    max_outside: float  # max |derivative| of any window w.r.t. any input outside its receptive field (0.0)
    min_inside: float  # min over expected dependences of |derivative| (> 0)
    jvp_matches_vjp: bool  # the dependence patterns found forward and reverse agree
    input_labels: list[str] = field(repr=False)
    expected: np.ndarray = field(repr=False)  # [inputs, outputs] bool (outputs: active windows, then checkpoint windows)
    jvp_dependence: np.ndarray = field(repr=False)  # [inputs, outputs] max |d window / d input|
    vjp_dependence: np.ndarray = field(repr=False)
    output_labels: list[str] = field(repr=False)

    def __str__(self) -> str:
        return self.details


def check_conv_receptive_field(
    cfg: InklingConfig, rows: Sequence[tuple[bool, int, int]] = ((True, 1, 1), (True, 2, 0), (True, 6, 4),
                                                                  (False, 2, 1), (False, 5, 3), (True, 0, 0)),
    *, page_size: int = 4, layer: int = 0, stream: str = "attn", padding_tokens: int = 2,
    conv_update: Callable | None = None, modes: Sequence[str] = ("jvp", "vjp"), seed: int = 0,
) -> ConvReport:
    """The conv state a step writes depends only on the last K-1 inputs of each stream.

    rows: (has_state, num_new, track_len) per request row; every row gets its own slot (and
    its own checkpoint slot when track_len > 0), virtual ids shuffled. For row b the stream is
    S_b = [old window (K-1 rows, read from the arena) ++ its num_new new tokens]; a row without
    state reads zeros instead of its (stale) old window. Expected: the new active window is the
    last K-1 rows of S_b (the old window unchanged when num_new == 0) and the checkpoint window
    the last K-1 rows of S_b[:K-1+track_len]; it depends on exactly those inputs (and, for a
    stateless row, not on its stale old window). Measured with jax.jvp (one tangent per
    input: each old-window row of each slot, each packed token including padding tokens) and
    with jax.vjp (one random cotangent per output window); ok iff both patterns are exactly the
    expected one (0.0 outside, nonzero inside) and the arena gradient is 0.0 everywhere else.
    `conv_update` defaults to the jnp reference (`pallas_kernels.conv_state.ref.conv_update`);
    a custom_vjp kernel (Pallas) cannot be pushed forward: pass modes=("vjp",)."""
    conv_update = conv_update or conv_ref.conv_update
    layout = ArenaLayout.build(cfg, page_size)
    fields = layout.target[layer]
    f = fields.conv
    km1 = f.shape[0]
    c0, c1 = fields.channels(stream)
    width = c1 - c0
    b = len(rows)
    has_state = np.array([r[0] for r in rows], bool)
    num_new = np.array([r[1] for r in rows], np.int32)
    track_len = np.array([r[2] for r in rows], np.int32)
    if np.any(track_len > num_new):
        raise ValueError("track_len must not exceed num_new")
    q = max(int(num_new.max()), 1)
    t_real = int(num_new.sum())
    t = t_real + padding_tokens
    rng = np.random.RandomState(seed)

    # ids: row b -> virtual slot b+1, checkpoint virtual slot b+1+B; physical rows shuffled
    n_virtual = 2 * b
    v2p = np.concatenate([[0], rng.permutation(np.arange(1, n_virtual + 1))]).astype(np.int32)
    active = v2p[np.arange(1, b + 1)]
    track_dest = np.where(track_len > 0, v2p[np.arange(b + 1, 2 * b + 1)], 0).astype(np.int32)
    units = (n_virtual + 1) * layout.slot_units
    arena = jnp.asarray(rng.standard_normal((units, layout.unit_elems)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((t, width)), jnp.float32)
    weight = jnp.asarray(rng.standard_normal((km1 + 1, width)), jnp.float32)

    query_start = np.concatenate([[0], np.cumsum(num_new)[:-1]]).astype(np.int32)
    token_row = np.concatenate([np.full(n, i) for i, n in enumerate(num_new)] + [np.full(padding_tokens, b - 1)])
    token_offset = np.concatenate([np.arange(n) for n in num_new]
                                  + [num_new[-1] + np.arange(padding_tokens)]).astype(np.int32)
    row_tokens = np.clip(query_start[:, None] + np.arange(q)[None, :], 0, t - 1).astype(np.int32)
    packed = PackedRows(token_row=jnp.asarray(token_row, jnp.int32), token_offset=jnp.asarray(token_offset),
                        row_tokens=jnp.asarray(row_tokens), has_state=jnp.asarray(has_state),
                        commit_len=jnp.asarray(num_new), track_len=jnp.asarray(track_len)[:, None])
    act_rows = jnp.asarray(layout.slot_row(active, f), jnp.int32)  # first arena row of each row's field
    trk_rows = jnp.asarray(layout.slot_row(track_dest, f), jnp.int32)[:, None]  # one checkpoint column
    tracked = np.nonzero(track_len > 0)[0]

    def windows(x, arena):
        _, new = conv_update(arena, x, weight, packed, act_rows, trk_rows, window_shape=f.shape, channels=(c0, c1),
                             sink_rows=layout.sink_rows)
        act = read_field(new, act_rows, f.shape)[..., c0:c1]
        trk = read_field(new, trk_rows[:, 0], f.shape)[..., c0:c1][tracked]
        return jnp.concatenate([act, trk], axis=0)  # [B + tracked, K-1, width]

    n_out = b + len(tracked)
    output_labels = [f"row {i} active window" for i in range(b)] + [f"row {i} checkpoint window" for i in tracked]

    # inputs: old window rows of every row's slot, then packed tokens
    input_labels = [f"row {i} old window[{j}]" for i in range(b) for j in range(km1)]
    for i in range(t):
        r = int(token_row[i])
        input_labels.append(f"row {r} new[{token_offset[i]}]" if i < t_real else f"padding token {i}")
    n_old = b * km1
    n_in = n_old + t

    # expected dependence
    expected = np.zeros((n_in, n_out), bool)

    def stream_inputs(i):  # input index of each element of S_i; None for a zeroed (stateless) old row
        old = [i * km1 + j if has_state[i] else None for j in range(km1)]
        new = [n_old + query_start[i] + k for k in range(num_new[i])]
        return old + new

    for i in range(b):
        s = stream_inputs(i)
        picked = [i * km1 + j for j in range(km1)] if num_new[i] == 0 else s[num_new[i]:num_new[i] + km1]
        for idx in picked:
            if idx is not None:
                expected[idx, i] = True
    for o, i in enumerate(tracked):
        s = stream_inputs(i)
        for idx in s[track_len[i]:track_len[i] + km1]:
            if idx is not None:
                expected[idx, b + o] = True

    # one jitted program: the jvp pushes (one basis tangent per input: an old window row of a
    # row's slot, all channels; or a packed token, all channels) and the vjp pulls (one random
    # cotangent per output window)
    def owned(i, j):  # arena mask of old window row j of row i's slot, the stream's channels
        full = jnp.zeros((b,) + f.shape, jnp.float32).at[i, j, c0:c1].set(1.0)
        return write_field(jnp.zeros_like(arena), act_rows, full)

    def measure(x, arena):
        res = {}
        if "jvp" in modes:
            def push(xd, ad):
                return jnp.max(jnp.abs(jax.jvp(windows, (x, arena), (xd, ad))[1]), axis=(1, 2))

            a_tan = jax.vmap(lambda k: owned(k // km1, k % km1))(jnp.arange(n_old))
            x_tan = jnp.eye(t, dtype=jnp.float32)[:, :, None] * jnp.ones((1, 1, width), jnp.float32)
            xd = jnp.concatenate([jnp.zeros((n_old, t, width), jnp.float32), x_tan])
            ad = jnp.concatenate([a_tan, jnp.zeros((t,) + arena.shape, jnp.float32)])
            res["jvp"] = jax.vmap(push)(xd, ad)  # [inputs, outputs]
        if "vjp" in modes:
            out, pull = jax.vjp(windows, x, arena)
            cot = jax.random.normal(jax.random.key(seed), out.shape, out.dtype)
            window_mask = sum(owned(i, j) for i in range(b) for j in range(km1)) > 0

            def pull_one(o):
                xb, ab = pull(jnp.where((jnp.arange(n_out) == o)[:, None, None], cot, 0.0))
                old = read_field(ab, act_rows, f.shape)[..., c0:c1]  # [B, K-1, width]
                return (jnp.concatenate([jnp.max(jnp.abs(old), -1).reshape(-1), jnp.max(jnp.abs(xb), -1)]),
                        jnp.max(jnp.abs(jnp.where(window_mask, 0.0, ab))))

            dep, rest = jax.vmap(pull_one)(jnp.arange(n_out))
            res["vjp"], res["rest"] = dep.T, jnp.max(rest)
        return res

    res = jax.device_get(_jit(measure)(x, arena))
    jvp_dep = np.asarray(res["jvp"]) if "jvp" in res else None
    vjp_dep = np.asarray(res["vjp"]) if "vjp" in res else None
    max_elsewhere = float(res.get("rest", 0.0))

    measured = [d for d in (jvp_dep, vjp_dep) if d is not None]
    max_outside = max(float(np.max(np.where(expected, 0.0, d))) for d in measured)
    min_inside = min(float(np.min(np.where(expected, d, np.inf))) for d in measured)
    agree = jvp_dep is None or vjp_dep is None or bool(np.array_equal(jvp_dep != 0, vjp_dep != 0))
    ok = max_outside == 0.0 and min_inside > 0.0 and agree and max_elsewhere == 0.0

    k = km1 + 1
    lines = [f"conv receptive field {'OK' if ok else 'FAILED'}: K = {k}, layer {layer} stream {stream!r} "
             f"({width} channels), {b} rows, {t} packed tokens ({padding_tokens} padding); modes {tuple(modes)}",
             f"max |d window / d input| outside the last K-1 inputs: {max_outside:.3g} (must be exactly 0); "
             f"min inside: {min_inside:.3g}; arena gradient elsewhere: {max_elsewhere:.3g}"]
    if not agree:
        lines.append("jvp and vjp dependence patterns differ")
    ref = measured[0]
    for o in range(n_out):
        want = [input_labels[i] for i in np.nonzero(expected[:, o])[0]]
        got = [input_labels[i] for i in np.nonzero(ref[:, o])[0]]
        row = o if o < b else int(tracked[o - b])
        hs, n = bool(has_state[row]), int(num_new[row])
        kind = "active" if o < b else f"checkpoint (after {track_len[row]} new)"
        mark = "ok" if sorted(want) == sorted(got) else "MISMATCH"
        lines.append(f"  row {row} ({'state' if hs else 'no state'}, {n} new) {kind} window <- "
                     f"{', '.join(got) or 'nothing'} [{mark}]")
        if mark != "ok":
            lines.append(f"    expected {', '.join(want) or 'nothing'}")
    return ConvReport(ok, "\n".join(lines), k, max_outside, min_inside, agree, input_labels, expected,
                      jvp_dep, vjp_dep, output_labels)


# ------------------------------------------- check 3: cached path == reference path


@dataclass
class CachedPathReport:
    ok: bool
    details: str
    max_rel_diff: float  # max over param leaves of max|g_cached - g_ref| / max|g_ref|
    worst_leaf: str
    global_rel_diff: float  # ||g_cached - g_ref|| / ||g_ref|| over all leaves
    tolerance: float
    loss_cached: float
    loss_reference: float
    num_steps: int
    loss_positions: int  # (row, position) pairs in the loss
    schedule: list[list[int]]  # new tokens of each sequence at each step
    state_cotangent_norms: list[float]  # ||d loss / d arena|| handed back into each step's input state
    per_leaf: dict[str, float] = field(repr=False)

    def __str__(self) -> str:
        return self.details


def default_schedule(lens: Sequence[int], query: int, tokens: int) -> list[list[int]]:
    """Uneven chunks: at step k sequence i wants (5, 1, 7, 3, 8, 2, 6, 4)[(k + 3 i) % 8] tokens
    (at most `query`, at most what is left), rows served in order from a budget of `tokens`
    packed tokens, so later rows sometimes sit a step out."""
    pattern = (5, 1, 7, 3, 8, 2, 6, 4)
    done = [0] * len(lens)
    schedule = []
    while any(d < n for d, n in zip(done, lens)):
        budget, step = tokens, []
        for i, n in enumerate(lens):
            take = min(pattern[(len(schedule) + 3 * i) % len(pattern)], n - done[i], query, budget)
            budget -= take
            done[i] += take
            step.append(take)
        schedule.append(step)
    return schedule


_REFERENCE_GRADS: dict[InklingConfig, Callable] = {}


def _reference_value_and_grad(cfg: InklingConfig) -> Callable:
    fn = _REFERENCE_GRADS.get(cfg)
    if fn is None:
        def loss(p, tokens, rows, positions, targets, mask):
            logits = forward(p, cfg, tokens)[rows, positions]  # [N, V]
            logz = jax.nn.logsumexp(logits, axis=-1)
            picked = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
            return jnp.sum(jnp.where(mask, logz - picked, 0.0)) / jnp.maximum(jnp.sum(mask), 1)

        fn = _REFERENCE_GRADS[cfg] = _jit(jax.value_and_grad(loss))
    return fn


def check_cached_matches_reference(
    params: Params, cfg: InklingConfig, sequences: Sequence[Sequence[int]],
    schedule: Sequence[Sequence[int]] | None = None, *, geometry: Geometry | None = None,
    step_fn: StepFn | None = None, tolerance: float = 1e-4, seed: int = 0,
) -> CachedPathReport:
    """Gradient of one loss through the cached, chunked serving path vs the reference forward.

    Cached path: extend steps of the geometry's bucket (default: B 4, T 16, Q 8, P 8, page
    size 4), sequence i in row i with its own slot and pages (shuffled physical ids), state
    threaded from a zero arena; at step k sequence i feeds schedule[k][i] new tokens
    (`default_schedule` when None: uneven chunks, rows idle some steps). Loss: mean
    cross-entropy of each step's last-token logits of every row that fed tokens, against the
    next token of its sequence (the token itself at the sequence end). Its gradient is
    taken backwards step by step with the step's VJP (`step_vjp`): each step gets the loss's
    cotangent on its logits and the arena cotangent handed back by the step after it, and
    returns its parameter share and the arena cotangent for the step before it.
    Reference: the same positions' logits from `forward` on the padded [N, L] token batch,
    differentiated by jax.value_and_grad.
    ok iff for every param leaf max|g_cached - g_ref| <= tolerance * max|g_ref| (float32; a
    leaf whose reference gradient is exactly 0 must be exactly 0 too)."""
    geometry = geometry or default_geometry(cfg)
    layout, shape = geometry.layout, geometry.shape
    n = len(sequences)
    lens = [len(s) for s in sequences]
    p_cols, ps = shape.pages, layout.page_size
    if not 0 < n <= min(shape.batch, geometry.num_slots) or n * p_cols > geometry.num_pages:
        raise ValueError(f"{n} sequences do not fit the bucket (B {shape.batch}, {geometry.num_slots} slots, "
                         f"{geometry.num_pages} pages of which {p_cols} per row)")
    if min(lens) < 1 or max(lens) > p_cols * ps:
        raise ValueError(f"sequence lengths must be in [1, {p_cols * ps}] (P * page_size)")
    schedule = [list(s) for s in (schedule or default_schedule(lens, shape.query, shape.tokens))]
    for k, step in enumerate(schedule):
        if len(step) != n or max(step) > shape.query or sum(step) > shape.tokens or min(step) < 0:
            raise ValueError(f"schedule step {k} {step} does not fit (Q {shape.query}, T {shape.tokens})")
    if [sum(col) for col in zip(*schedule)] != lens:
        raise ValueError("the schedule must feed every sequence exactly once")
    step_fn = step_fn or make_step_fn(cfg, layout, shape)
    vjp = step_vjp(step_fn)
    b = shape.batch

    # the batches, and the loss positions
    batches, rows, positions, targets = [], [], [], []
    done = [0] * n
    for k, step in enumerate(schedule):
        plans = []
        for i, c in enumerate(step):  # sequence i: row i, virtual slot i + 1, its own pages
            s = done[i]
            plans.append(RowPlan(tokens=list(sequences[i][s:s + c]), seq_start=s, virtual_slot=i + 1,
                                 virtual_pages=list(i * p_cols + 1 + np.arange(p_cols))))
            if c:
                rows.append(i)
                positions.append(s + c - 1)
                targets.append(sequences[i][s + c] if s + c < lens[i] else sequences[i][s + c - 1])
                done[i] += c
        batches.append((k, pack_batch(shape, plans)))

    # forward through the chain
    state = geometry.state(seed=seed, dtype=params["unembed"].dtype)
    zero_arena = jnp.zeros_like(state.arena)
    v = cfg.unpadded_vocab_size
    zero_cot = np.zeros((b, v), np.float32)
    states, exts, logits = [], [], []
    for _, batch in batches:
        ext_rows, batch_ext = _extended(params, batch)
        lg, new_arena, _, _, _ = vjp(params, ext_rows, state, batch_ext, zero_cot, zero_arena)
        states.append(state)
        exts.append((ext_rows, batch_ext, np.asarray(batch.tokens)))
        logits.append(np.asarray(lg, np.float64))
        state = state.replace(arena=new_arena)

    # the loss and its cotangent on each step's logits
    count = len(rows)
    cot_logits = [np.zeros((b, v), np.float64) for _ in batches]
    loss = 0.0
    j = 0
    for k, step in enumerate(schedule):
        for i, c in enumerate(step):
            if c:
                lg = logits[k][i]
                m = lg.max()
                prob = np.exp(lg - m)
                z = prob.sum()
                loss += (m + np.log(z) - lg[targets[j]]) / count
                g = prob / z
                g[targets[j]] -= 1.0
                cot_logits[k][i] = g / count
                j += 1

    # backward through the chain, the arena cotangent handed from each step to the one before
    grads = jax.tree_util.tree_map(lambda x: np.zeros(x.shape, np.float64), params)
    cot_arena = zero_arena
    state_norms = []
    for k in reversed(range(len(batches))):
        ext_rows, batch_ext, tokens = exts[k]
        _, _, d_params, d_ext, d_arena = vjp(params, ext_rows, states[k], batch_ext,
                                             cot_logits[k].astype(np.float32), cot_arena)
        grads = jax.tree_util.tree_map(lambda a, g: a + np.asarray(g, np.float64), grads, d_params)
        np.add.at(grads["embed"], tokens, np.asarray(d_ext, np.float64))
        cot_arena = d_arena
        state_norms.append(float(jnp.linalg.norm(d_arena.astype(jnp.float32))))
    state_norms.reverse()

    # the reference
    lmax = max(lens)
    padded = np.zeros((n, lmax), np.int32)
    for i, s in enumerate(sequences):
        padded[i, :len(s)] = s
    loss_ref, g_ref = _reference_value_and_grad(cfg)(
        params, jnp.asarray(padded), jnp.asarray(rows, jnp.int32), jnp.asarray(positions, jnp.int32),
        jnp.asarray(targets, jnp.int32), jnp.ones(count, bool))

    per_leaf: dict[str, float] = {}
    num = den = 0.0
    for (path, gc), gr in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree_util.tree_leaves(g_ref)):
        gr = np.asarray(gr, np.float64)
        diff = float(np.max(np.abs(gc - gr))) if gc.size else 0.0
        scale = float(np.max(np.abs(gr))) if gr.size else 0.0
        per_leaf[jax.tree_util.keystr(path)] = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
        num += float(np.sum((gc - gr) ** 2))
        den += float(np.sum(gr ** 2))
    worst = max(per_leaf, key=per_leaf.get)
    max_rel = per_leaf[worst]
    global_rel = math.sqrt(num / den) if den > 0 else 0.0
    ok = max_rel <= tolerance
    details = "\n".join([
        f"cached path == reference {'OK' if ok else 'FAILED'}: d loss / d params through {len(schedule)} chained "
        f"{shape.mode} steps ({n} sequences of lengths {tuple(lens)}, zero initial state) vs through forward()",
        f"schedule (new tokens per sequence per step): {' '.join('/'.join(map(str, s)) for s in schedule)}",
        f"loss over {count} last-token positions: cached {loss:.7g}, reference {float(loss_ref):.7g}",
        f"max relative gradient difference {max_rel:.3g} (leaf {worst}); tolerance {tolerance:.1g} of each "
        f"leaf's max |grad|; global ||g_cached - g_ref|| / ||g_ref|| {global_rel:.3g}",
        f"||d loss / d state|| handed back into steps 1..{len(schedule) - 1}: "
        + ", ".join(f"{x:.3g}" for x in state_norms[1:]),
    ])
    return CachedPathReport(ok, details, max_rel, worst, global_rel, tolerance, float(loss), float(loss_ref),
                            len(schedule), count, schedule, state_norms, per_leaf)

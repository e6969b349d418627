"""Differentiable testing harness: properties of the serving path proved with autodiff.

Three checks, each returning a small report (``ok``, human-readable ``details``, and the
measured numbers) instead of only asserting, so tests assert ``report.ok`` and notebooks
print / plot the report:

    check_isolation(params, scenario, step_fn=None) -> IsolationReport        (isolation.py)
        Request isolation: for every real row r of one step, the gradient of r's logits is
        *bitwise zero* w.r.t. every other request's token embeddings, every arena row that is
        not r's own slot or r's own pages (other requests' slots and pages, checkpoint slots,
        the sinks, free rows) and every padding token; and nonzero on r's own inputs.
    check_conv_receptive_field(cfg, rows=..., conv_update=...) -> ConvReport  (receptive_field.py)
        The conv windows a step writes (active and checkpoint) depend, through jax.jvp and
        through jax.vjp, exactly on the last K-1 inputs of each row's stream
        [old window ++ new tokens] and on nothing else.
    check_cached_matches_reference(params, cfg, sequences, schedule=None) -> CachedPathReport
        d loss / d params through the chunked, cached serving path (a chain of step calls
        threading the state from a zero arena, differentiated backwards step by step through
        the state) equals d loss / d params through the reference `forward`, within a stated
        float32 tolerance.                                                       (cached_path.py)

The step under test is any ``step_fn(params, state, batch) -> (logits [B, V], state)`` with the
signature of `steps.step_logits` once cfg / layout / shape are bound; the default is exactly
that (`make_step_fn`). `make_step_fn(..., context_cls=...)` builds the same step with another
`StepContext` class (a subclass with a planted bug, in the tests), through `step_logits`'s own
`context_cls` hook. Gradients w.r.t. token embeddings go through an extended embedding table
(`step_fns.py`).

One jitted program per step function serves checks 1 and 3: the VJP of one step w.r.t.
(params, ext_rows, arena) for cotangents on (logits, new arena) (`step_vjp`). Checks 1 and 3
use the same bucket (`Geometry`, `scenario.py`) by default, so a session compiles the step's
VJP once. On CPU the harness compiles with XLA's backend optimisation off (about twice as
fast to compile; each program runs a handful of times).

    scenario.py         Geometry, default_geometry, Scenario, isolation_scenario
    step_fns.py         make_step_fn, step_vjp, the embedding extension
    isolation.py        check 1           receptive_field.py   check 2
    cached_path.py      check 3           plots.py             plot_isolation
"""

from .cached_path import CachedPathReport, check_cached_matches_reference, default_schedule
from .isolation import IsolationReport, Leak, check_isolation
from .plots import plot_isolation
from .receptive_field import ConvReport, check_conv_receptive_field
from .scenario import Geometry, Scenario, default_geometry, isolation_scenario
from .step_fns import StepFn, make_step_fn, step_vjp

__all__ = [
    "Geometry", "Scenario", "Leak", "IsolationReport", "ConvReport", "CachedPathReport",
    "check_isolation", "check_conv_receptive_field", "check_cached_matches_reference",
    "make_step_fn", "default_geometry", "default_schedule", "isolation_scenario", "step_vjp", "plot_isolation",
    "StepFn",
]

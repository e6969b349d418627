"""The differentiable testing harness (`inkling_jax.harness`): its three checks pass on the
real serving step of the tiny model (float32), and they catch planted bugs: a step whose
sliding-window attention reads the previous row's ring (a cross-request read), and a conv
update that keeps one input too many in the window.

Checks 1 and 3 share one compiled program (the step's VJP for the harness's default bucket),
so this file compiles: that VJP, the leaky step's VJP, the reference forward's gradient and two
small conv programs."""

from __future__ import annotations

from dataclasses import replace

import jax.numpy as jnp
import numpy as np
import pytest

from inkling_jax import harness as H
from inkling_jax.steps import StepContext
from pallas_kernels.conv_state import ref as conv_ref

from conftest import TRUNK


@pytest.fixture(scope="module")
def scenario():
    return H.isolation_scenario(TRUNK)


@pytest.fixture(scope="module")
def real_report(trunk_params, scenario):
    return H.check_isolation(trunk_params, scenario)


class RingLeakContext(StepContext):
    """Planted bug: sliding-window attention mixes the previous row's ring keys into each
    row's own (row 0 gets the padded row's, i.e. the sink slot's)."""

    def _ring_keys(self, geom):
        keys, *rest = super()._ring_keys(geom)
        return (keys + 0.05 * jnp.roll(keys, 1, axis=0), *rest)


def test_isolation_holds_on_the_real_step(real_report, scenario):
    rep = real_report
    assert rep.ok, rep.details
    assert rep.real_rows == [0, 1, 2] and not rep.leaks and rep.max_foreign_grad == 0.0
    for r in rep.real_rows:  # bitwise zero outside the row's own inputs, nonzero on them
        assert np.all(rep.arena_grad[r][~rep.own_units[r]] == 0.0)
        assert np.all(rep.token_grad[r][~rep.own_tokens[r]] == 0.0)
        assert np.all(rep.token_grad[r][rep.own_tokens[r]] > 0.0)
    for r in (0, 1):  # continuing requests read their slot (conv windows, ring) and their pages
        assert rep.own_slot_grad[r] > 0.0 and rep.own_page_grad[r] > 0.0
    assert rep.own_slot_grad[2] == 0.0 and rep.own_page_grad[2] == 0.0  # fresh: ignores its stale slot
    checkpoint = [u for u, name in enumerate(rep.unit_labels) if name == "row 0's checkpoint slot"]
    assert checkpoint and np.all(rep.arena_grad[:, checkpoint] == 0.0)  # written, never read
    padding = [i for i, name in enumerate(rep.token_labels) if name == "padding tokens"]
    assert len(padding) == 7 and np.all(rep.token_grad[:, padding] == 0.0)


def test_planted_cross_request_read_is_caught(trunk_params, scenario, real_report):
    rep = H.check_isolation(trunk_params, scenario, step_fn=scenario.step_fn(RingLeakContext))
    assert not rep.ok
    pairs = {(lk.row, lk.source) for lk in rep.leaks}
    assert pairs == {(1, "row 0's slot"), (0, "the sink slot")}, rep.details
    leak = next(lk for lk in rep.leaks if lk.row == 1)
    assert leak.source_row == 0 and leak.kind == "arena" and leak.max_abs_grad > 0
    assert "LEAK: row 1's logits depend on row 0's slot" in rep.details
    # row 2 (no ring to read) is untouched by the bug: the harness's copy of the step, with
    # the leaky context, computes the real step's logits there
    np.testing.assert_allclose(rep.logits[2], real_report.logits[2], rtol=1e-6, atol=1e-6)
    assert not np.allclose(rep.logits[1], real_report.logits[1], rtol=1e-6, atol=1e-6)


def test_conv_receptive_field():
    rep = H.check_conv_receptive_field(TRUNK)
    assert rep.ok, rep.details
    assert rep.kernel_size == TRUNK.conv_kernel_size
    assert rep.max_outside == 0.0 and rep.min_inside > 0.0 and rep.jvp_matches_vjp
    # every row's active window depends on exactly K-1 inputs, except the fresh row with fewer
    # new tokens than K-1 (the zeros it starts from are not inputs)
    assert rep.expected[:, :6].sum(axis=0).tolist() == [3, 3, 3, 2, 3, 3]


def test_conv_receptive_field_catches_a_stale_window():
    def stale_update(arena, x, weight, rows, active_row, track_row, **kw):
        """Planted bug: the window written back keeps one input too many from before."""
        return conv_ref.conv_update(arena, x, weight, replace(rows, commit_len=jnp.maximum(rows.commit_len - 1, 0)),
                                    active_row, track_row, **kw)

    rep = H.check_conv_receptive_field(TRUNK, conv_update=stale_update, modes=("vjp",))
    assert not rep.ok and rep.max_outside > 0.0
    assert "MISMATCH" in rep.details


def test_cached_path_gradient_matches_reference(trunk_params, real_report):
    rng = np.random.RandomState(1)
    sequences = [rng.randint(3, TRUNK.unpadded_vocab_size, n).tolist() for n in (29, 20, 11)]
    rep = H.check_cached_matches_reference(trunk_params, TRUNK, sequences)
    assert rep.ok, rep.details
    assert rep.max_rel_diff < 1e-4 and rep.global_rel_diff < 1e-5
    assert abs(rep.loss_cached - rep.loss_reference) < 1e-5 * abs(rep.loss_reference)
    # longer than the window (8), rel_extent (16) and n_floor (8); chunks uneven, rows idle some steps
    assert max(len(s) for s in sequences) > 16 and any(0 in step for step in rep.schedule)
    assert rep.num_steps == len(rep.schedule) >= 5 and rep.loss_positions > rep.num_steps
    assert all(x > 0 for x in rep.state_cotangent_norms[1:])  # the gradient flows through the state

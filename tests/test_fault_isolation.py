"""One bad request fails alone (issue 35, items 1 and 2).

Kernels: the attention of a row never multiplies a value it does not attend to by a zero
weight: NaN or inf in invalid keys (another row's tokens in the packed step, stale page or
ring rows, padding) leave every output exactly what finite garbage gives, in the jnp
references and the Pallas kernels (interpret mode).

Engine: a copy of the params with one token's embedding row NaN (or, in bf16, large enough
that the trunk overflows to inf); requests whose history holds that token finish with
finish_reason "error" and the reason, every other request's tokens and log-probs equal a run
without the faulty ones (with the prefix cache, in sessions, with speculation, multi-step
decode and overlap), nothing of the faulty ones reaches the prefix cache or a session, and
the accounting closes. The fake runner's poison token fuzzes the host side of the same path.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import decode, decode_ref
from pallas_kernels.attention import pallas as attn
from pallas_kernels.attention import ref as attn_ref

INTERPRET = jax.default_backend() != "gpu"
BAD = {"nan": np.nan, "inf": np.inf}


@pytest.fixture(autouse=True)
def true_float32_references():
    with jax.default_matmul_precision("highest"):
        yield


def same(a, b):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# ------------------------------------------------------------------ kernels


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("case", ["f32_gqa8_beyond_E", "f32_gqa4_ring_window"])
def test_flash_attention_ignores_invalid_values(case, bad):
    """Invalid keys holding NaN / inf: the flash kernel's and the reference's outputs equal
    those with finite garbage there, bit for bit (near blocks and far blocks with invalid
    keys both)."""
    from test_attention_kernel import CASES, SMALL, make_case

    dtype, h, hkv, window, nq, nk, e, layout, q_start, invalid = CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    q, k, v, rel, q_pos, k_pos, k_valid = make_case(rng, b=2, nq=nq, nk=nk, h=h, hkv=hkv, d=16, e=e, dtype=dtype,
                                                    layout=layout, q_start=q_start, invalid_frac=max(invalid, 0.2))
    dead = ~np.asarray(k_valid)[:, :, None, None]
    kb, vb = (jnp.where(dead, BAD[bad], x) for x in (k, v))
    for fn in (partial(attn.attention, **SMALL, interpret=INTERPRET), attn_ref.attention):
        clean = fn(q, k, v, rel, q_pos, k_pos, k_valid, window=window)
        got = fn(q, kb, vb, rel, q_pos, k_pos, k_valid, window=window)
        assert np.isfinite(np.asarray(got)).all()
        same(got, clean)


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("kind", ["ring", "pages"])
def test_decode_attention_ignores_stale_rows(kind, bad):
    """Every arena token row that is not a row's live context (inside live blocks too: a
    page's positions past seq_start, ring rows not written, the sink) and the invalid new keys
    hold NaN / inf: the decode kernels and the reference give exactly what finite garbage
    gives."""
    import test_decode_attention as T

    rows = dict(seq_start=[37, 0, 61]) if kind == "pages" else dict(seq_start=[57, 9, 13],
                                                                       has_state=[True, False, True])
    c = T.Case(np.random.default_rng(3), kind=kind, q_valid=T.Q_VALID[3], **rows)
    tok = c.arena_np.reshape(-1, 2 * T.NKV * T.HD)
    live = np.zeros(tok.shape[0], bool)
    for i in range(c.b):
        s = int(c.seq_start[i])
        if kind == "ring":
            if bool(c.has_state[i]):
                for p in range(max(0, s - c.ring), s):
                    live[int(c.unit_row[i]) * T.UNIT_TOKENS + p % c.ring] = True
        else:
            for p in range(s):
                live[int(c.unit_row[i, p // T.UNIT_TOKENS]) * T.UNIT_TOKENS + p % T.UNIT_TOKENS] = True
    poisoned = jnp.asarray(np.where(live[:, None], tok, BAD[bad]).reshape(c.arena_np.shape))
    dead_new = ~np.asarray(c.q_valid)[:, :, None, None]
    clean_new = (c.k_new, c.v_new)
    for fn, tune in ((decode.ring_attention if kind == "ring" else decode.paged_attention, dict(interpret=INTERPRET)),
                     (decode_ref.ring_attention if kind == "ring" else decode_ref.paged_attention, {})):
        if kind == "ring" and tune:
            tune["bk"] = 16
        call = jax.jit(partial(fn, **c.static(20 if kind == "ring" else None), **tune))
        clean = call(*c.args())
        c.k_new, c.v_new = (jnp.where(dead_new, BAD[bad], x) for x in clean_new)
        got = call(*c.args(arena=poisoned))
        c.k_new, c.v_new = clean_new
        assert np.isfinite(np.asarray(got)).all()
        same(got, clean)

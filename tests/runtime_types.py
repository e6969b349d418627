"""Run-time checks of the library's annotations in the tests: jaxtyping's import hook wraps
every function and dataclass of the instrumented packages in `jaxtyped(typechecker=beartype)`,
so a shape string, dtype or plain type that lies fails the test that calls it. It only
instruments modules imported after it: conftest.py imports this module before anything
imports the library.

INKLING_TESTS_TYPECHECK: "model" (the default) checks the numeric code whose annotations carry
the shapes, `inkling_jax.model` and `pallas_kernels`; "all" the whole library (the engine's API
and host code: some tests hand it values its annotations do not admit on purpose, to see the
library's own ValueError, and numpy where it says Array, so not yet green); "0" none.
"""

from __future__ import annotations

import os
import sys

import numpy as np
from beartype import BeartypeConf, FrozenDict, beartype

SCOPES = {"model": ("inkling_jax.model", "pallas_kernels"), "all": ("inkling_jax", "pallas_kernels")}
ENV = "INKLING_TESTS_TYPECHECK"
# beartype is stricter than the annotations mean: PEP 484's numeric tower (an int passes for a
# float, as in any static checker), and a numpy integer passes for an int (token ids and sizes
# read from numpy arrays; the library converts with int() where it matters)
CONF = BeartypeConf(is_pep484_tower=True, hint_overrides=FrozenDict({int: int | np.integer}))


def typechecker(fn):
    return beartype(fn, conf=CONF)


def packages() -> tuple[str, ...]:
    """The packages to instrument (INKLING_TESTS_TYPECHECK; module docstring)."""
    setting = os.environ.get(ENV, "model")
    if setting in ("0", ""):
        return ()
    if setting not in SCOPES:
        raise ValueError(f"{ENV}={setting!r}: expected one of 0, {', '.join(SCOPES)}")
    return SCOPES[setting]


def install() -> bool:
    """Install the hook (once per process); True when it is live."""
    chosen = packages()
    if not chosen:
        return False
    early = sorted(m for m in sys.modules if any(m == p or m.startswith(p + ".") for p in chosen))
    if early:  # instrumenting is at import: these would silently go unchecked
        raise RuntimeError(f"{ENV}: imported before the jaxtyping hook: {', '.join(early)}")
    from jaxtyping import install_import_hook

    install_import_hook(list(chosen), "runtime_types.typechecker")
    return True


TYPECHECKED = install()

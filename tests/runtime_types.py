"""Run-time checks of the library's annotations in the tests: jaxtyping's import hook wraps
every function and dataclass of `inkling_jax` and `pallas_kernels` in
`jaxtyped(typechecker=beartype)`, so a shape string, dtype or plain type that lies fails
the test that calls it. It only instruments modules imported after it: conftest.py imports
this module before anything imports the library. INKLING_TESTS_TYPECHECK=1 turns it on."""

from __future__ import annotations

import os
import sys

import numpy as np
from beartype import BeartypeConf, FrozenDict, beartype

PACKAGES = ("inkling_jax", "pallas_kernels")
ENV = "INKLING_TESTS_TYPECHECK"
# beartype is stricter than the annotations mean: PEP 484's numeric tower (an int passes for a
# float, as in any static checker), and a numpy integer passes for an int (token ids and sizes
# read from numpy arrays; the library converts with int() where it matters)
CONF = BeartypeConf(is_pep484_tower=True, hint_overrides=FrozenDict({int: int | np.integer}))


def typechecker(fn):
    return beartype(fn, conf=CONF)


def enabled() -> bool:
    # off unless asked (INKLING_TESTS_TYPECHECK=1) until the suite passes with it: some tests still
    # hand the library values its annotations do not admit (issue 32, item 7)
    return os.environ.get(ENV, "0") != "0"


def install() -> bool:
    """Install the hook (once per process); True when it is live."""
    if not enabled():
        return False
    early = sorted(m for m in sys.modules if m.split(".")[0] in PACKAGES)
    if early:  # instrumenting is at import: these would silently go unchecked
        raise RuntimeError(f"{ENV}: imported before the jaxtyping hook: {', '.join(early)}")
    from jaxtyping import install_import_hook

    install_import_hook(list(PACKAGES), "runtime_types.typechecker")
    return True


TYPECHECKED = install()

"""Run-time checks of the library's annotations in the tests: jaxtyping's import hook wraps
every function and dataclass of `inkling_jax` and `pallas_kernels` in
`jaxtyped(typechecker=beartype)`, so a shape string, dtype or plain type that lies fails
the test that calls it. It only instruments modules imported after it: conftest.py imports
this module before anything imports the library. INKLING_TESTS_TYPECHECK=0 turns it off."""

from __future__ import annotations

import os
import sys

PACKAGES = ("inkling_jax", "pallas_kernels")
# PEP 484's numeric tower (an int passes for a float, as in any static checker): beartype is
# stricter by default
TYPECHECKER = "beartype.beartype(conf=beartype.BeartypeConf(is_pep484_tower=True))"
ENV = "INKLING_TESTS_TYPECHECK"


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def install() -> bool:
    """Install the hook (once per process); True when it is live."""
    if not enabled():
        return False
    early = sorted(m for m in sys.modules if m.split(".")[0] in PACKAGES)
    if early:  # instrumenting is at import: these would silently go unchecked
        raise RuntimeError(f"{ENV}: imported before the jaxtyping hook: {', '.join(early)}")
    from jaxtyping import install_import_hook

    install_import_hook(list(PACKAGES), TYPECHECKER)
    return True


TYPECHECKED = install()

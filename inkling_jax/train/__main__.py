"""`python -m inkling_jax.train`: the inkling-train command without installing the package."""

import sys

from .cli import main

sys.exit(main())

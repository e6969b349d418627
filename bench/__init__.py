"""GPU benchmarks of this checkout's engine and kernels (results in BENCHMARKS.md).

Each script is a module run from the repository root, so that it measures the code of this
checkout (`python -m` puts the current directory first on `sys.path`):

    python -m bench.kernels.kernels --smoke        # every script has --smoke (or is GPU only)
    python -m bench.serve.serve --out serve.md

Sub-packages by subject: `common` (reports, tables, device time from a profiler trace),
`kernels` (Pallas kernels against their references, micro benchmarks), `decode` (the compiled
steps; A/B runs of source trees), `serve` (`Engine.generate` end to end), `profile` (where a
step's device time goes), `check` (GPU correctness). bench/README.md lists every script.
"""

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout the scripts measure

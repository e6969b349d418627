"""The XLA flags of every test process (the pytest workers and the subprocesses tests start).

The suite is dominated by XLA:CPU compiles of small programs, so the flags trade the compiled
code's speed for compile time (measured on the 2-core CI machine, jax 0.10.2):
- `--xla_backend_optimization_level=0`: LLVM's backend optimisations roughly double compile
  time and buy nothing at these sizes;
- `--xla_cpu_use_fusion_emitters=false`: XLA:CPU's MLIR fusion emitters cost about a third
  more compile time than the elemental emitters they replaced (27 kernel and engine tests:
  user CPU 160 -> 108 s);
- `--xla_cpu_parallel_codegen_split_count=1`: one LLVM module per program instead of several
  compiled on a thread pool; with two pytest workers on two cores the split only adds work
  (test_spec.py alone: 120.6 s wall at the default, 107.4 / 100.0 s at 1, 97.4 s at 2;
  test_engine.py: 60.3 -> 53.0 s). Users' processes keep the default: there one compile
  has both cores, and the split count changed neither speed nor a bit of `make run`'s output.
They change how programs are compiled, not what they compute up to float rounding: every
program of a run, the oracles' included, is compiled with the same flags.

Importing this module sets them (`setdefault()`), so it is imported before jax; a caller's
XLA_FLAGS wins (e.g. to run the suite as users' processes compile)."""

from __future__ import annotations

import os

TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                  "--xla_cpu_parallel_codegen_split_count=1")


def setdefault() -> None:
    """JAX on the CPU with TEST_XLA_FLAGS unless the environment says otherwise."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_FLAGS", TEST_XLA_FLAGS)


def with_devices(n: int) -> str:
    """XLA_FLAGS for a subprocess with n host devices (the test flags kept)."""
    return f"{os.environ.get('XLA_FLAGS', TEST_XLA_FLAGS)} --xla_force_host_platform_device_count={n}"


setdefault()

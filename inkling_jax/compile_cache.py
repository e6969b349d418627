"""JAX's persistent compilation cache, turned on by the library (process-wide: the config is
JAX's). `init_params` and `Engine` both call `enable_compile_cache`, so the small programs
that draw random weights are cached as well as the serving steps.

    enable_compile_cache(setting) -> the directory in use, or None

setting: "auto" (on a GPU, $XDG_CACHE_HOME (~/.cache)/inkling-jax/xla; elsewhere off: CPU
compiles of small models are fast), a directory, or None (leave JAX's config alone). A
directory the caller configured (JAX_COMPILATION_CACHE_DIR or jax.config) always wins; a
directory this module chose for "auto" gives way to a later explicit one.

Every program is cached, however fast it compiled: a fresh process of the bench model spent
~8 s compiling programs under JAX's default 1 s threshold."""

from __future__ import annotations

import os

import jax

_chosen: str | None = None  # the directory this module configured, if any


def enable_compile_cache(setting: str | None) -> str | None:
    global _chosen
    current = jax.config.jax_compilation_cache_dir
    if setting is None or (current and current != _chosen):
        return current
    if setting == "auto":
        if current:
            return current
        if jax.default_backend() != "gpu":
            return None
        setting = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "inkling-jax",
                               "xla")
    path = os.path.expanduser(setting)
    if path == current:
        return current
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _chosen = path
    try:  # JAX decides at the first compile whether a cache is used: ask it again
        from jax._src import compilation_cache

        compilation_cache.reset_cache()
    except (ImportError, AttributeError):
        pass
    return path

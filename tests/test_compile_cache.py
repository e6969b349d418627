"""The library's persistent compilation cache switch (inkling_jax/compile_cache.py)."""

import jax
import pytest

from inkling_jax import compile_cache


@pytest.fixture
def jax_cache_config(monkeypatch):
    """Restore JAX's cache settings and the module's memory after the test."""
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    saved = {n: getattr(jax.config, n) for n in names}
    monkeypatch.setattr(compile_cache, "_chosen", None)
    jax.config.update("jax_compilation_cache_dir", None)
    yield
    for n, v in saved.items():
        jax.config.update(n, v)
    from jax._src import compilation_cache as jax_cache

    jax_cache.reset_cache()


def test_auto_is_off_on_cpu_and_none_leaves_config(jax_cache_config):
    assert compile_cache.enable_compile_cache("auto") is None
    assert compile_cache.enable_compile_cache(None) is None
    assert not jax.config.jax_compilation_cache_dir


def test_explicit_directory_caches_every_program(jax_cache_config, tmp_path):
    path = str(tmp_path / "a")
    assert compile_cache.enable_compile_cache(path) == path
    assert jax.config.jax_compilation_cache_dir == path
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
    assert jax.config.jax_persistent_cache_min_entry_size_bytes == 0
    # "auto" later (an Engine with the default config) keeps it; a later explicit one replaces it
    assert compile_cache.enable_compile_cache("auto") == path
    other = str(tmp_path / "b")
    assert compile_cache.enable_compile_cache(other) == other
    assert jax.config.jax_compilation_cache_dir == other


def test_callers_directory_wins(jax_cache_config, tmp_path):
    mine = str(tmp_path / "caller")
    jax.config.update("jax_compilation_cache_dir", mine)
    assert compile_cache.enable_compile_cache(str(tmp_path / "lib")) == mine
    assert jax.config.jax_compilation_cache_dir == mine

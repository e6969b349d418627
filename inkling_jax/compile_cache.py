"""The library's compile caches on disk.

1. The executable cache (`ExecutableStore`, used by `inkling_jax/programs.py`): compiled
   programs serialized one file per program key, on by default on every backend under
   $XDG_CACHE_HOME (~/.cache)/inkling-jax/executables ($INKLING_JAX_EXECUTABLE_CACHE: another
   directory, or off), at most $INKLING_JAX_EXECUTABLE_CACHE_BYTES (4 GiB). A later process
   loads a program without tracing, lowering or compiling it.

2. JAX's persistent compilation cache, turned on by the library (process-wide: the config is
   JAX's), a second layer beneath the first (JAX's cache keys on the lowered program, so
   tracing and lowering still run). `init_params` and `Engine` both call
   `enable_compile_cache`, so the small programs that draw random weights are cached as well
   as the serving steps.

    enable_compile_cache(setting) -> the directory in use, or None

setting: "auto" (on a GPU, $XDG_CACHE_HOME (~/.cache)/inkling-jax/xla; elsewhere off: CPU
compiles of small models are fast), a directory, or None (leave JAX's config alone). A
directory the caller configured (JAX_COMPILATION_CACHE_DIR or jax.config) always wins; a
directory this module chose for "auto" gives way to a later explicit one.

Every program is cached, however fast it compiled: a fresh process of the bench model spent
~8 s compiling programs under JAX's default 1 s threshold."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
import warnings

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
        setting = os.path.join(user_cache_dir(), "xla")
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


# ------------------------------------------------------------------ the executable cache

EXECUTABLE_CACHE_ENV = "INKLING_JAX_EXECUTABLE_CACHE"  # a directory, or off / 0 / none
EXECUTABLE_CACHE_BYTES_ENV = "INKLING_JAX_EXECUTABLE_CACHE_BYTES"
DEFAULT_EXECUTABLE_CACHE_BYTES = 4 << 30
_OFF = ("", "0", "off", "none", "false", "no")


class ExecutableCacheWarning(UserWarning):
    """An executable cache entry could not be used (stale, corrupt, truncated, foreign) or
    written: the program is compiled afresh; nothing else changes."""


def user_cache_dir() -> str:
    """$XDG_CACHE_HOME/inkling-jax (default ~/.cache/inkling-jax)."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "inkling-jax")


def clear_library_xla_cache() -> str | None:
    """Remove the XLA cache directory "auto" uses (`user_cache_dir()`/xla); its path, or None
    when there was none. A directory the caller chose is theirs to clear."""
    import shutil

    path = os.path.join(user_cache_dir(), "xla")
    if not os.path.isdir(path):
        return None
    shutil.rmtree(path, ignore_errors=True)
    return path


def executable_cache_dir(setting: str | None = "auto") -> str | None:
    """The executable cache directory a setting names: None (off), a directory, or "auto":
    $INKLING_JAX_EXECUTABLE_CACHE (a directory, or off / 0 / none), else
    `user_cache_dir()`/executables."""
    if setting is None:
        return None
    if setting == "auto":
        env = os.environ.get(EXECUTABLE_CACHE_ENV)
        if env is None:
            return os.path.join(user_cache_dir(), "executables")
        if env.strip().lower() in _OFF:
            return None
        setting = env
    return os.path.abspath(os.path.expanduser(setting))


def env_int(name: str, default: int) -> int:
    """The integer environment variable `name`, or default when it is unset or empty."""
    value = os.environ.get(name)
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def executable_cache_bytes() -> int:
    """The size cap in bytes: $INKLING_JAX_EXECUTABLE_CACHE_BYTES, default 4 GiB."""
    return env_int(EXECUTABLE_CACHE_BYTES_ENV, DEFAULT_EXECUTABLE_CACHE_BYTES)


class ExecutableStore:
    """Serialized executables in one directory, one file per program key.

    An entry is `MAGIC`, a one-line JSON header (format, the full key, the payload's byte
    count and sha256), then the payload. A read checks all of it: an entry of another format,
    written under another key (a renamed file, a version mismatch), truncated or corrupt is
    reported (`ExecutableCacheWarning`), removed, and the caller compiles afresh. Writes go to
    a temporary file in the same directory and `os.replace` it into place, so a reader (in any
    process) sees a whole entry or none. Bounded: past `max_bytes` the least recently used
    entries go first (by mtime; a read touches its entry)."""

    MAGIC = b"inkling-jax executable\n"
    FORMAT = 1
    SUFFIX = ".ikx"
    STALE_TEMP_S = 3600.0  # temporary files older than this are left over by a dead writer

    def __init__(self, path: str, max_bytes: int | None = None):
        self.path = path
        self.max_bytes = executable_cache_bytes() if max_bytes is None else max_bytes

    def entry_path(self, key: str) -> str:
        return os.path.join(self.path, hashlib.sha256(key.encode()).hexdigest()[:40] + self.SUFFIX)

    def read(self, key: str) -> bytes | None:
        """The payload stored under key, or None (no entry, or an unusable one: warned)."""
        path = self.entry_path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._warn(path, f"unreadable ({exc})")
            return None
        problem, payload = self._check(data, key)
        if problem:
            self._warn(path, problem)
            self.remove(path)
            return None
        try:
            os.utime(path)  # recently used: evicted last
        except OSError:
            pass
        return payload

    def _check(self, data: bytes, key: str) -> tuple[str | None, bytes]:
        if not data.startswith(self.MAGIC):
            return "not an executable cache entry (bad magic)", b""
        end = data.find(b"\n", len(self.MAGIC))
        if end < 0:
            return "truncated header", b""
        try:
            header = json.loads(data[len(self.MAGIC):end])
        except ValueError:
            return "corrupt header", b""
        if not isinstance(header, dict) or header.get("format") != self.FORMAT:
            return f"entry format {header.get('format') if isinstance(header, dict) else '?'}, this library reads " \
                   f"format {self.FORMAT}", b""
        if header.get("key") != key:
            return f"written for another program ({_first_difference(str(header.get('key')), key)})", b""
        payload = data[end + 1:]
        if len(payload) != header.get("payload_bytes"):
            return f"truncated ({len(payload)} of {header.get('payload_bytes')} payload bytes)", b""
        if hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
            return "corrupt (payload checksum mismatch)", b""
        return None, payload

    def write(self, key: str, payload: bytes) -> None:
        """Store payload under key (atomically), then evict past the size cap."""
        header = json.dumps({"format": self.FORMAT, "key": key, "payload_bytes": len(payload),
                             "payload_sha256": hashlib.sha256(payload).hexdigest()})
        path = self.entry_path(key)
        tmp = None
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=self.SUFFIX, dir=self.path)
            with os.fdopen(fd, "wb") as f:
                f.write(self.MAGIC + header.encode() + b"\n")
                f.write(payload)
            os.replace(tmp, path)
            tmp = None
        except OSError as exc:
            self._warn(path, f"not written ({exc})")
            return
        finally:
            if tmp is not None:
                self.remove(tmp)
        self.evict(keep=path)

    def entries(self) -> list[tuple[str, int, float]]:
        """(path, bytes, mtime) of every entry."""
        out = []
        try:
            with os.scandir(self.path) as it:
                for e in it:
                    if e.name.endswith(self.SUFFIX) and not e.name.startswith(".tmp-"):
                        try:
                            st = e.stat()
                        except OSError:
                            continue
                        out.append((e.path, st.st_size, st.st_mtime))
        except OSError:
            pass
        return out

    def evict(self, keep: str | None = None) -> list[str]:
        """Remove the least recently used entries until the rest fit max_bytes (never `keep`),
        and temporary files a dead writer left. Returns the removed entries."""
        entries = sorted(self.entries(), key=lambda e: e[2])
        total = sum(size for _, size, _ in entries)
        removed = []
        for path, size, _ in entries:
            if total <= self.max_bytes:
                break
            if path == keep:
                continue
            if self.remove(path):
                removed.append(path)
            total -= size
        now = time.time()
        try:
            with os.scandir(self.path) as it:
                for e in it:
                    if e.name.startswith(".tmp-") and now - e.stat().st_mtime > self.STALE_TEMP_S:
                        self.remove(e.path)
        except OSError:
            pass
        return removed

    def clear(self) -> int:
        """Remove every entry; the number removed."""
        return sum(self.remove(path) for path, _, _ in self.entries())

    @staticmethod
    def remove(path: str) -> bool:
        try:
            os.remove(path)
            return True
        except OSError:  # gone already (another process evicted it), or not ours to remove
            return False

    @staticmethod
    def _warn(path: str, problem: str) -> None:
        warnings.warn(f"executable cache entry {path}: {problem}; compiling the program afresh",
                      ExecutableCacheWarning, stacklevel=4)


def _first_difference(stored: str, wanted: str) -> str:
    """The first line where two keys differ, for the warning."""
    for a, b in zip(stored.splitlines(), wanted.splitlines()):
        if a != b:
            return f"stored {a[:160]!r}, wanted {b[:160]!r}"
    return "keys of different lengths"

"""Compiled programs: who owns them, and not compiling them again.

Every program the engine and `init_params` run (the step of each bucket, the compaction copy
of each padded move count, the zero serving state, the count-table write of each batch
bucket, the decode feed, the weight samplers) comes from `request` / `get`, which look in
three places:

  1. the process's program table, in memory: the `max_programs` most recently used (default
     32, $INKLING_JAX_PROGRAMS_IN_MEMORY), so an engine built again with the same shapes, or a
     second engine beside the first, uses the same executables;
  2. the executable cache on disk (`compile_cache.ExecutableStore`; on by default, under
     $XDG_CACHE_HOME (~/.cache)/inkling-jax/executables; `EngineConfig.executable_cache`,
     $INKLING_JAX_EXECUTABLE_CACHE): the executable is deserialized
     (`jax.experimental.serialize_executable`) without tracing, lowering or compiling;
  3. otherwise it is traced, lowered and compiled (JAX's persistent XLA cache, where it is on,
     is a second layer under this one: it still needs the lowering), then kept in both.

Who owns a program: the engine that uses it (`StepRunner` holds its steps, moves and feeds)
as long as the engine lives, and the table besides, until it falls out of the table's bound.
An executable nobody holds any more is freed with its memory mappings (each XLA:CPU
executable keeps hundreds: ~720 for a step of the tiny preset, of the kernel's 65530 per
process), so a process that builds and drops engines holds its live engines' programs plus at
most `max_programs` more.
`clear_program_cache()` empties the table (`jax.clear_caches()` empties JAX's own jit caches);
`clear_executable_cache()` empties the directory.

The key (`program_key`) holds everything that determines a program: its kind and the spec
its caller gives (the model config, the arena layout, the StepShape, the kernel choice, the
mesh), its arguments' tree structure, shapes, dtypes and shardings (device ids, mesh shape
and axis names), the compile options, JAX's trace-time configuration (matmul precision,
x64, ...), any library module global rebound since import (a test's spy or a benchmark's
constant: such a process compiles its own programs and stores none on disk), and the
environment: jax and jaxlib versions, backend, platform version, devices, processes,
$XLA_FLAGS and a digest of this library's source (inkling_jax and pallas_kernels).

Concurrency: `request(..., background=True)` makes the program in a thread pool and returns
a future; the same program asked for twice while in flight is made once. Jobs start in the
order asked for (a caller asks for what it needs first first). In the pool one job traces and
lowers at a time (that is Python, under the GIL), in the order asked for (so compiles start
in that order too; loads from disk do not wait their turn), while up to `compile_threads()` XLA compiles
run beside it (they release the GIL; default: half the cores, $INKLING_JAX_COMPILE_THREADS,
because an XLA:CPU compile of a large program already keeps ~1.6 cores busy: on 2 cores two
step compiles side by side took longer each than both in turn). A program asked for without
`background` is made at once in the caller's thread, beside the pool's, even one already
queued there (taken out of the queue: a step never waits behind programs it does not need). The pool only fills
the table and the disk cache; the engine takes programs from the futures under its own lock.
Tracing runs in the pool only when the caller's thread has no thread-local JAX configuration
(a `with jax.default_matmul_precision(...)` block): otherwise the caller traces and lowers,
and only the compile goes to the pool.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import hashlib
import logging
import os
import pickle
import re
import sys
import threading
import time
import types
import warnings
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from . import compile_cache as cc

log = logging.getLogger(__name__)

PROGRAMS_ENV = "INKLING_JAX_PROGRAMS_IN_MEMORY"
THREADS_ENV = "INKLING_JAX_COMPILE_THREADS"
DEFAULT_MAX_PROGRAMS = 32  # an XLA:CPU step of the tiny preset keeps ~720 mappings: 32 of them ~23k of 65530

# Packages whose code is traced into programs: a global of theirs rebound after import (a
# monkeypatched kernel, a tuned constant) changes what a program traces.
TRACED_PACKAGES = ("inkling_jax.config", "inkling_jax.model", "inkling_jax.steps", "inkling_jax.cache",
                   "inkling_jax.parallel", "pallas_kernels")


# --------------------------------------------------------------------------- the table


class ProgramTable:
    """The most recently used compiled programs of this process, by key digest (an LRU of at
    most `max_programs`; 0 keeps none beyond what engines hold)."""

    def __init__(self, max_programs: int):
        self.max_programs = max_programs
        self._programs: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.generation = 0  # bumped by clear(): programs made before it are not put back

    def get(self, digest: str) -> Any:
        with self._lock:
            program = self._programs.get(digest)
            if program is not None:
                self._programs.move_to_end(digest)
            return program

    def put(self, digest: str, program: Any, generation: int | None = None) -> None:
        with self._lock:
            if generation is not None and generation != self.generation:
                return
            self._programs[digest] = program
            self._programs.move_to_end(digest)
            while len(self._programs) > max(self.max_programs, 0):
                self._programs.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._programs.clear()
            self.generation += 1

    def values(self) -> list[Any]:
        with self._lock:
            return list(self._programs.values())

    def __len__(self) -> int:
        return len(self._programs)


TABLE = ProgramTable(cc.env_int(PROGRAMS_ENV, DEFAULT_MAX_PROGRAMS))
_LOCK = threading.Lock()
_INFLIGHT: dict[str, "_Job"] = {}
_STATS = dict(memory_hits=0, loaded=0, load_seconds=0.0, compiled=0, lower_seconds=0.0, compile_seconds=0.0,
              stored=0)
_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_STORES: dict[str, cc.ExecutableStore] = {}


def clear_program_cache() -> None:
    """Drop every program the process-wide table holds (programs an engine still uses stay
    with it; the rest are freed). Programs in flight finish but are not kept."""
    TABLE.clear()


def clear_executable_cache(setting: str | None = "auto") -> int:
    """Remove every entry of the executable cache directory `setting` names (as
    `EngineConfig.executable_cache`); the number removed."""
    path = cc.executable_cache_dir(setting)
    return 0 if path is None else cc.ExecutableStore(path).clear()


def program_stats() -> dict[str, Any]:
    """Process-wide counts: programs found in the table (memory_hits), loaded from the disk
    cache (loaded, load_seconds), compiled (compiled, lower_seconds: tracing and lowering,
    compile_seconds), and written to the disk cache (stored)."""
    with _LOCK:
        return dict(_STATS)


TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class compile_events:
    """JAX's monitoring events (durations) recorded inside the block, every thread's:

        with compile_events() as ev:
            ...
        ev.count[COMPILE_EVENT], ev.seconds[TRACE_EVENT]   # XLA compiles; seconds tracing

    (TRACE_EVENT, LOWER_EVENT, COMPILE_EVENT; JAX's persistent cache reports under
    "/jax/compilation_cache/...")."""

    def __init__(self):
        self.count: collections.Counter = collections.Counter()
        self.seconds: collections.Counter = collections.Counter()

    def _listen(self, event: str, duration: float, **kw: Any) -> None:
        self.count[event] += 1
        self.seconds[event] += duration

    def __enter__(self) -> "compile_events":
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc: Any) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listen)


def _count(**kw: float) -> None:
    with _LOCK:
        for k, v in kw.items():
            _STATS[k] += v


# ----------------------------------------------------------------------------- the key


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def canon(x: Any) -> str:
    """A reproducible text of a key part (the same in every process)."""
    if isinstance(x, Mesh):
        return mesh_text(x)
    if isinstance(x, jax.sharding.Sharding):
        return sharding_text(x)
    if isinstance(x, dict):
        items = sorted(x.items(), key=lambda kv: repr(kv[0]))
        return "{" + ", ".join(f"{canon(k)}: {canon(v)}" for k, v in items) + "}"
    if isinstance(x, (list, tuple)):
        return "(" + ", ".join(canon(v) for v in x) + ")"
    if isinstance(x, type) and hasattr(x, "dtype"):  # jnp.float32 and kin
        return str(np.dtype(x.dtype))
    if isinstance(x, np.dtype):
        return str(x)
    text = repr(x)
    if _ADDRESS.search(text):
        raise ValueError(f"program key part {text[:200]} is not reproducible (it names an address)")
    return text


def mesh_text(mesh: Mesh) -> str:
    return (f"mesh[{tuple(mesh.axis_names)} {tuple(mesh.devices.shape)} {[d.id for d in mesh.devices.flat]} "
            f"{getattr(mesh, 'axis_types', '')}]")


def sharding_text(s: Any) -> str:
    if s is None:
        return "host"
    memory = getattr(s, "memory_kind", None)
    if isinstance(s, NamedSharding):
        return f"named[{mesh_text(s.mesh)} {s.spec} {memory}]"
    ids = sorted(d.id for d in s.device_set)
    if isinstance(s, SingleDeviceSharding):
        return f"device[{ids[0]} {memory}]"
    return f"{type(s).__name__}[{ids} {memory} {_ADDRESS.sub('', repr(s))}]"


def abstract(x: Any) -> Any:
    """An argument as lowering needs it: shape, dtype, weak type and (device arrays) sharding;
    host arrays and scalars stay unplaced."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=getattr(x, "weak_type", False))
    return jax.ShapeDtypeStruct(np.shape(x), np.result_type(x))


def args_text(args: Any) -> str:
    leaves, treedef = jax.tree_util.tree_flatten(args)
    parts = [f"{x.dtype}{list(x.shape)}{'w' if getattr(x, 'weak_type', False) else ''}"
             f"@{sharding_text(getattr(x, 'sharding', None))}" for x in leaves]
    return f"{treedef} " + "; ".join(parts)


def trace_context() -> str:
    """JAX's configuration that tracing reads (thread-local settings included)."""
    try:
        from jax._src import config as jax_config

        ctx = jax_config.trace_context()
    except Exception:  # noqa: BLE001 - another jax: the public settings that change a trace
        ctx = tuple(getattr(jax.config, name, None) for name in (
            "jax_default_matmul_precision", "jax_enable_x64", "jax_numpy_rank_promotion",
            "jax_numpy_dtype_promotion", "jax_default_prng_impl", "jax_threefry_partitionable"))
    return _ADDRESS.sub("", repr(ctx))


_BASELINE: dict[str, dict[str, str]] = {}


def _globals_of(module: types.ModuleType) -> dict[str, str]:
    """A module's globals (and its classes' attributes): scalars by value, anything else by
    identity (compared only within this process)."""
    def ident(v):
        if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
            return f"{type(v).__name__} {v!r}"
        return f"id {id(v)}"

    out = {}
    for name, value in list(vars(module).items()):
        if name.startswith("__") or isinstance(value, types.ModuleType):
            continue
        out[name] = ident(value)
        if isinstance(value, type) and value.__module__ == module.__name__:
            for attr, v in list(vars(value).items()):
                if not attr.startswith("__"):
                    out[f"{name}.{attr}"] = ident(v)
    return out


def patches() -> str:
    """The traced packages' globals rebound since they were first seen ("" normally): the
    first sight is `import inkling_jax` (its last line calls this) or, for a module imported
    later, the first program asked for after it."""
    changed = []
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(TRACED_PACKAGES) \
                or getattr(getattr(module, "__spec__", None), "_initializing", False):  # mid-import
            continue
        now = _globals_of(module)
        before = _BASELINE.setdefault(name, now)
        if now is not before:
            changed += [f"{name}.{k}" + ("" if v is None or v.startswith("id ") else f"={v}")
                        for k, v in ((k, now.get(k)) for k in sorted(before)) if v != before[k]]
    return " ".join(changed)

_SOURCE: str | None = None
_ENVIRONMENT: list[str] | None = None


def source_digest() -> str:
    """sha256 of this library's .py files (inkling_jax, pallas_kernels): a changed library
    never loads another version's programs."""
    global _SOURCE
    if _SOURCE is None:
        import pallas_kernels

        import inkling_jax

        h = hashlib.sha256()
        for package in (inkling_jax, pallas_kernels):
            root = os.path.dirname(os.path.abspath(package.__file__))
            for folder, dirs, files in os.walk(root):
                dirs[:] = sorted(d for d in dirs if d != "__pycache__")
                for fname in sorted(files):
                    if fname.endswith(".py"):
                        path = os.path.join(folder, fname)
                        h.update(os.path.relpath(path, os.path.dirname(root)).encode() + b"\0")
                        with open(path, "rb") as f:
                            h.update(f.read() + b"\0")
        _SOURCE = h.hexdigest()[:32]
    return _SOURCE


def environment() -> list[str]:
    """The key lines of the process's environment: versions, backend, devices, flags, source."""
    global _ENVIRONMENT
    if _ENVIRONMENT is None:
        import jaxlib

        devices = jax.devices()
        _ENVIRONMENT = [
            f"env jax={jax.__version__} jaxlib={jaxlib.__version__} python={sys.version_info[0]}.{sys.version_info[1]}",
            f"env backend={jax.default_backend()} platform_version={devices[0].client.platform_version!r}",
            f"env devices={[(d.id, d.device_kind, d.process_index) for d in devices]}",
            f"env processes={jax.process_count()} process={jax.process_index()}",
            f"env XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r} "
            f"LIBTPU_INIT_ARGS={os.environ.get('LIBTPU_INIT_ARGS', '')!r}",
            f"env source={source_digest()}",
        ]
    return _ENVIRONMENT


def program_key(kind: str, spec: Any, args: Any, options: dict | None = None) -> str:
    """The full key of a program (see the module docstring); args: abstract (`abstract`)."""
    return "\n".join([f"kind {kind}", f"spec {canon(spec)}", f"args {args_text(args)}",
                      f"options {canon(dict(options or {}))}", f"trace {trace_context()}",
                      f"patches {patches()}", *environment()])


# ------------------------------------------------------------------------ making them


def compile_threads() -> int:
    """XLA compiles the pool runs at once: $INKLING_JAX_COMPILE_THREADS, default half the cores."""
    return max(1, cc.env_int(THREADS_ENV, (os.cpu_count() or 1) // 2))


# The pool's jobs trace and lower one at a time, in the order they were asked for: a job is
# queued from its submission until it is lowered, loaded from disk, taken by a caller or
# failed, and lowers only at the head. (A plain lock let the threads race: on 2 cores make
# run's decode step was lowered and compiled before the extend step its first token needs in
# 3 of 4 cold runs, first token ~16 s instead of ~11 s.)
_LOWER_QUEUE: collections.deque = collections.deque()
_LOWER_TURN = threading.Condition()
_COMPILE_SLOTS: threading.Semaphore | None = None


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL, _COMPILE_SLOTS
    with _LOCK:
        if _POOL is None:
            _COMPILE_SLOTS = threading.Semaphore(compile_threads())
            # one more worker than compile slots: the next job lowers while the others compile
            _POOL = concurrent.futures.ThreadPoolExecutor(compile_threads() + 1, thread_name_prefix="inkling-programs")
        return _POOL


_POOL_CONTEXT: str | None = None


def _pool_context() -> str:
    """The trace context a pool thread sees (no thread-local settings)."""
    global _POOL_CONTEXT
    if _POOL_CONTEXT is None:
        _POOL_CONTEXT = _pool().submit(trace_context).result()
    return _POOL_CONTEXT


def _store(setting: str | None) -> cc.ExecutableStore | None:
    path = cc.executable_cache_dir(setting)
    if path is None:
        return None
    with _LOCK:
        store = _STORES.get(path)
        if store is None:
            store = _STORES[path] = cc.ExecutableStore(path)
        return store


def _plain_compile(lowered) -> Any:
    return lowered.compile()


def _device_ids(compiled) -> list[int] | None:
    """The ids of the devices an executable runs on, in its order (None: not found)."""
    unloaded = getattr(getattr(compiled, "_executable", None), "_unloaded_executable", None)
    for name in ("device_list", "device_assignment"):  # jax 0.10 / earlier
        devices = getattr(unloaded, name, None)
        if devices is not None:
            return [d.id for d in devices]
    for sharding in jax.tree_util.tree_leaves((compiled.input_shardings, compiled.output_shardings)):
        devices = getattr(sharding, "_device_assignment", None)
        if devices:
            return [d.id for d in devices]
    return None


class _Job:
    """Making one program: load it from the store, or lower (unless given) and compile it
    and store it; then publish it (the table, the future)."""

    def __init__(self, future, key, digest, make, args, compile, store, generation):
        self.future, self.key, self.digest = future, key, digest
        self.make, self.args, self.compile, self.store, self.generation = make, args, compile, store, generation
        self.lowered = None
        self.started = False  # claimed by a thread (under _LOCK): the pool's, or a caller that needs it now
        self.pooled = False  # in the pool: lowering and compiling take turns (see the module docstring)

    def load(self) -> Any:
        if self.store is None:
            return None
        t0 = time.perf_counter()
        payload = self.store.read(self.key)
        if payload is None:
            return None
        try:
            serialized, in_tree, out_tree, device_ids = pickle.loads(payload)
            from jax.experimental.serialize_executable import deserialize_and_load

            by_id = {d.id: d for d in jax.devices()}
            program = deserialize_and_load(serialized, in_tree, out_tree,
                                           execution_devices=[by_id[i] for i in device_ids])
        except Exception as exc:  # noqa: BLE001 - whatever the entry holds, compile instead
            warnings.warn(f"executable cache entry {self.store.entry_path(self.key)}: cannot be loaded "
                          f"({type(exc).__name__}: {exc}); compiling the program afresh", cc.ExecutableCacheWarning)
            self.store.remove(self.store.entry_path(self.key))
            return None
        _count(loaded=1, load_seconds=time.perf_counter() - t0)
        return program

    def lower(self) -> None:
        try:
            if self.pooled:
                self.await_lowering_turn()
            t0 = time.perf_counter()
            self.lowered = self.make().lower(*self.args)
            _count(lower_seconds=time.perf_counter() - t0)
        finally:
            self.leave_lowering_queue()

    def await_lowering_turn(self) -> None:
        """Wait until every pool job asked for before this one is past its lowering (the head
        of the queue holds the turn until it leaves: one lowering at a time)."""
        with _LOWER_TURN:
            while self in _LOWER_QUEUE and _LOWER_QUEUE[0] is not self:
                _LOWER_TURN.wait()

    def leave_lowering_queue(self) -> None:
        with _LOWER_TURN:
            if self in _LOWER_QUEUE:
                _LOWER_QUEUE.remove(self)
                _LOWER_TURN.notify_all()

    def build(self) -> Any:
        if self.lowered is None:
            self.lower()
        with _COMPILE_SLOTS if self.pooled else contextlib.nullcontext():
            t0 = time.perf_counter()
            program = self.compile(self.lowered)
            _count(compiled=1, compile_seconds=time.perf_counter() - t0)
        self.lowered = None
        if self.store is not None:
            self.save(program)
        return program

    def save(self, program) -> None:
        try:
            from jax.experimental.serialize_executable import serialize

            device_ids = _device_ids(program)
            if device_ids is None:
                raise ValueError("its devices are unknown")
            serialized, in_tree, out_tree = serialize(program)
            payload = pickle.dumps((serialized, in_tree, out_tree, device_ids), pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - not serializable here: it stays in memory only
            log.debug("program not serializable (%s: %s); not stored", type(exc).__name__, exc)
            return
        self.store.write(self.key, payload)
        _count(stored=1)

    def run_unless_claimed(self) -> None:
        """The pool's turn: run, unless a caller that needed the program took it first."""
        with _LOCK:
            if self.started:
                return
            self.started = True
        self.run()

    def run(self) -> None:
        """The whole job, by the thread that claimed it (nothing to load once lowered)."""
        self.pooled = threading.current_thread().name.startswith("inkling-programs")
        try:
            program = None if self.lowered is not None else self.load()
            self.future.source = "disk" if program is not None else "compiled"
            if program is None:
                program = self.build()
            else:
                self.leave_lowering_queue()
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the program
            self.fail(exc)
            return
        self.publish(program)

    def load_or_lower(self) -> bool:
        """In the caller's thread: publish the stored program (True), or lower it for the pool
        to compile (False)."""
        try:
            program = self.load()
            self.future.source = "disk" if program is not None else "compiled"
            if program is None:
                self.lower()
                return False
        except BaseException as exc:  # noqa: BLE001
            self.fail(exc)
            return True
        self.publish(program)
        return True

    def publish(self, program) -> None:
        with _LOCK:
            TABLE.put(self.digest, program, self.generation)
            _INFLIGHT.pop(self.digest, None)
        self.future.set_result(program)

    def fail(self, exc: BaseException) -> None:
        self.leave_lowering_queue()
        with _LOCK:
            _INFLIGHT.pop(self.digest, None)
        self.future.set_exception(exc)


def request(kind: str, spec: Any, make: Callable[[], Any], args: tuple = (), *, options: dict | None = None,
            compile: Callable[[Any], Any] | None = None, cache: str | None = "auto",
            background: bool = False) -> concurrent.futures.Future:
    """A future of the compiled program `make().lower(*args)`, compiled by `compile`
    (default: `.compile()`; `options`: the compile options it passes, part of the key). Its
    `source` says where the program came from: "memory" (the table), "disk", "compiled".

    kind, spec: what the program is (spec: anything `canon` reproduces: configs, shapes,
    meshes). args: arrays or ShapeDtypeStructs (only their shapes, dtypes and shardings are
    used). cache: the executable cache setting ("auto", a directory, None).
    background: make it in the compile pool; otherwise it is made before this returns (a
    program already waiting in the pool's queue is taken out and made here, at once)."""
    args = jax.tree_util.tree_map(abstract, tuple(args))
    key = program_key(kind, spec, args, options)
    digest = hashlib.sha256(key.encode()).hexdigest()
    # a process with patched library globals keeps its programs to itself
    store = None if "\npatches \n" not in key else _store(cache)
    pooled = background and trace_context() == _pool_context()
    with _LOCK:
        program = TABLE.get(digest)
        if program is not None:
            _STATS["memory_hits"] += 1
            future = concurrent.futures.Future()
            future.source = "memory"
            future.set_result(program)
            return future
        job = _INFLIGHT.get(digest)
        if job is not None:
            if background or job.started:
                return job.future
            job.started = stolen = True  # queued, not started, and needed now
        else:
            job = _INFLIGHT[digest] = _Job(concurrent.futures.Future(), key, digest, make, args,
                                           compile or _plain_compile, store, TABLE.generation)
            job.started, stolen = not pooled, False
    if stolen or not background:
        job.run()
    elif pooled:
        with _LOWER_TURN:  # queued and submitted in one order (the pool runs jobs first in, first out)
            _LOWER_QUEUE.append(job)
            _pool().submit(job.run_unless_claimed)
    elif not job.load_or_lower():  # thread-local JAX settings: trace here, compile there
        _pool().submit(job.run)
    return job.future


def get(kind: str, spec: Any, make: Callable[[], Any], args: tuple = (), **kw: Any) -> Any:
    """`request(...)`'s program, made now (see request)."""
    return request(kind, spec, make, args, **kw).result()

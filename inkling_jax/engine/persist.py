"""Durable engine state: open sessions and the prefix cache, saved with orbax and restored in a
fresh process (`Engine.save`, `Engine.restore`, `Engine.load`).

What is saved. Every open session: its history and, between turns, the state it keeps (its
slot, checkpoint slots and pages: the arena rows of those objects, and the host record with
the ids remapped). The prefix tree: with `prefix_cache=True` all of it (every node's edge,
pages, checkpoint slot, hits and last use), else only the nodes on the paths the sessions
lock (their pages are part of the sessions' state). Requests in flight are not saved, nor a
session's turn in flight: such a session is saved as its history before the turn, and its
next turn after a restore recomputes the state from it (exact: the state is a pure function
of the tokens). Layout-robust: the saved objects are compacted to a canonical order (the
tree's checkpoints, then the sessions' slots; the tree's pages, then the sessions' own
pages), and a restore allocates them anew wherever the pool puts them, so the restoring
engine may have another pool size or kind.

Format (`FORMAT`): a directory holding numbered saves and a pointer,

    DIR/LATEST               the name of the newest complete save (written last, atomically)
    DIR/save-000007/
        state.json           format, model digest, layout, engine config, sessions, tree
        arrays/              orbax (StandardCheckpointer): "slots" [n, slot_units, unit
                             elems] and "pages" [m, page_units, unit elems] in the arena's
                             dtype (absent when empty)

A save writes `.save-N.tmp-PID/`, fsyncs it, renames it to `save-N/`, then replaces LATEST
(a temporary file, fsync, `os.replace`) and only then removes older saves and leftovers:
a process killed at any point leaves LATEST naming a complete save (the previous one until
the new pointer is in place).

Checks at restore, before anything changes (ValueError naming the mismatch): the directory
and the save LATEST names exist and are complete; the format; the model (its config and a
digest of the params: `model_digest`); the layout (unit, slot and page sizes, page size,
speculative depths, arena dtype); the engine config fields the saved state depends on
(`MUST_MATCH`); the restoring engine is idle (no request queued or running, no session
open) and its pool can hold the saved objects. Single device only (a mesh engine is refused).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..cache.layout import page_unit_row, slot_unit_row
from ..cache.prefix_tree import Node
from .interrupts import critical
from .records import Resources

if TYPE_CHECKING:
    from .engine import Engine

FORMAT = 1
LATEST = "LATEST"
STATE = "state.json"
ARRAYS = "arrays"
# engine config fields the saved state depends on: the layout (page_size, spec_steps), where
# checkpoints sit (track_interval), whether there is a tree (prefix_cache) and what a session
# keeps between turns (ping_pong)
MUST_MATCH = ("page_size", "spec_steps", "track_interval", "prefix_cache", "ping_pong")
SAMPLE = 1 << 16  # params elements hashed per leaf at most (a strided sample past that)


# ------------------------------------------------------------------ identity


def model_digest(cfg, params) -> str:
    """sha256 of the config (its hub dialect) and the params: every leaf's path, shape, dtype
    and values (a strided sample of SAMPLE elements for leaves larger than that; leaves that
    are shapes only, `fake_runner.fake_params`, contribute their shape and dtype)."""
    import jax

    h = hashlib.sha256(json.dumps(cfg.to_hf(), sort_keys=True, default=str).encode())
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        h.update(f"{jax.tree_util.keystr(path)}:{tuple(leaf.shape)}:{leaf.dtype}".encode())
        if isinstance(leaf, jax.ShapeDtypeStruct):
            continue
        size = int(np.prod(leaf.shape))
        if size > SAMPLE:
            import jax.numpy as jnp

            leaf = jnp.ravel(leaf)[::-(-size // SAMPLE)]
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return h.hexdigest()


def model_fields(cfg) -> dict:
    """The model config's fields as JSON values (what a save records and a restore compares)."""
    return json.loads(json.dumps({f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}, default=str))


def layout_record(engine: "Engine") -> dict:
    lay, arena = engine.layout, engine.runner.state.arena
    return dict(unit_elems=lay.unit_elems, slot_units=lay.slot_units, page_units=lay.page_units,
                page_size=lay.page_size, spec_steps=lay.spec_steps, ring=lay.ring, dtype=str(arena.dtype),
                row_shape=list(arena.shape[1:]))


def config_record(config) -> dict:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


# ------------------------------------------------------------------ save


@dataclass
class Snapshot:
    """What a save writes: the host records (ids canonical) and the arena rows of the objects."""

    state: dict
    slots: np.ndarray  # [n, slot_units, *row]
    pages: np.ndarray  # [m, page_units, *row]


def snapshot(engine: "Engine", prefix_cache: bool = True) -> Snapshot:
    """The engine's sessions and (all, or the session-locked part of) its prefix tree, with
    slot and page ids renumbered 0.. in canonical order, and their arena rows. The caller holds
    the engine's lock, with nothing in flight and the pool's moves applied."""
    tree, pool = engine.tree, engine.pool
    slot_ids: dict[int, int] = {}  # virtual -> canonical
    page_ids: dict[int, int] = {}

    def slot(v: int) -> int:
        return slot_ids.setdefault(v, len(slot_ids))

    def page(v: int) -> int:
        return page_ids.setdefault(v, len(page_ids))

    kept = [s for s in engine.sessions.values() if s.held is not None and s.turn is None]
    nodes, index = [], {}
    if tree is not None:
        pinned = set()
        for sess in kept:
            node = sess.held.prefix_node
            while node is not None and node is not tree.root:
                pinned.add(id(node))
                node = node.parent
        stack = [tree.root]
        while stack:  # preorder: parents first
            node = stack.pop()
            if node is not tree.root and (prefix_cache or id(node) in pinned):
                index[id(node)] = len(nodes)
                nodes.append(dict(parent=index.get(id(node.parent), -1), tokens=list(node.tokens),
                                  pages=[page(p) for p in node.pages],
                                  checkpoint=None if node.checkpoint is None else slot(node.checkpoint),
                                  hits=node.hits, last_used=node.last_used))
            stack.extend(reversed(list(node.children.values())))
    sessions = []
    for sid, sess in sorted(engine.sessions.items()):
        rec = dict(sid=sid, tokens=list(sess.tokens), held=None)
        if sess in kept:
            held = sess.held
            assert not held.step_slots and not held.reserved_pages, "a session keeps state between turns only"
            rec["held"] = dict(
                slot=slot(held.virtual_slot), committed=held.committed, next_track=held.next_track,
                track_slots=[slot(s) if s > 0 else None for s in held.virtual_track_slots],  # None: absent
                pages=[page(p) for p in held.virtual_pages], owned=[page(p) for p in sorted(held.owned_pages)],
                prefix_node=None if held.prefix_node is None else index[id(held.prefix_node)],
                last_checkpoint=None if held.last_checkpoint is None else list(held.last_checkpoint))
        sessions.append(rec)
    lay, num_units = engine.layout, pool.num_units
    slot_rows = [slot_unit_row(pool.physical_slot(v), lay.slot_units) for v in slot_ids]
    page_rows = [page_unit_row(pool.physical_page(v), num_units, lay.page_units) for v in page_ids]
    state = dict(format=FORMAT, model=dict(config=model_fields(engine.cfg), digest=engine_digest(engine)),
                 layout=layout_record(engine), config=config_record(engine.config), slots=len(slot_ids),
                 pages=len(page_ids), sessions=sessions, next_sid=engine.requests.next_sid, tree=nodes,
                 clock=max([n["last_used"] for n in nodes], default=0))
    return Snapshot(state, read_units(engine, slot_rows, lay.slot_units), read_units(engine, page_rows, lay.page_units))


def engine_digest(engine: "Engine") -> str:
    """The engine's model digest, computed once."""
    if getattr(engine, "_model_digest", None) is None:
        engine._model_digest = model_digest(engine.cfg, engine.params)
    return engine._model_digest


def read_units(engine: "Engine", first_rows: list[int], units: int) -> np.ndarray:
    """[len(first_rows), units, *row]: runs of arena rows (one device gather and one transfer,
    `StepRunner.read_rows`)."""
    arena = engine.runner.state.arena
    rows = (np.asarray(first_rows, np.int64)[:, None] + np.arange(units)[None, :]).reshape(-1)
    return engine.runner.read_rows(rows).reshape(len(first_rows), units, *arena.shape[1:])


def save(engine: "Engine", path: str | os.PathLike, prefix_cache: bool = True) -> dict:
    """Write the engine's sessions and prefix cache under `path` (module docstring); returns
    {"path", "save", "sessions", "slots", "pages", "bytes", "seconds"}. The engine is not
    changed (steps in flight are committed first)."""
    t0 = time.perf_counter()
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"save: {path} exists and is not a directory")
    snap = snapshot(engine, prefix_cache)
    os.makedirs(path, exist_ok=True)
    version = 1 + max([_version(n) for n in os.listdir(path) if _version(n) is not None], default=0)
    name = f"save-{version:06d}"
    tmp = os.path.join(path, f".{name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    arrays = {k: v for k, v in (("slots", snap.slots), ("pages", snap.pages)) if v.shape[0]}
    if arrays:
        import orbax.checkpoint as ocp

        ckptr = ocp.StandardCheckpointer()
        ckptr.save(os.path.join(tmp, ARRAYS), arrays)
        ckptr.wait_until_finished()
    _write_file(os.path.join(tmp, STATE), json.dumps(snap.state).encode())
    _fsync_tree(tmp)
    os.rename(tmp, os.path.join(path, name))
    _fsync_dir(path)
    _write_file(os.path.join(path, LATEST), name.encode(), atomic=True)
    _fsync_dir(path)
    for other in os.listdir(path):  # older saves and leftovers of interrupted ones
        if other not in (name, LATEST) and (_version(other) is not None or other.startswith((".save-", f"{LATEST}."))):
            full = os.path.join(path, other)
            shutil.rmtree(full, ignore_errors=True) if os.path.isdir(full) else os.remove(full)
    return dict(path=os.path.join(path, name), save=version, sessions=len(snap.state["sessions"]),
                slots=snap.state["slots"], pages=snap.state["pages"], bytes=_tree_bytes(os.path.join(path, name)),
                seconds=time.perf_counter() - t0)


def _version(name: str) -> int | None:
    m = re.fullmatch(r"save-(\d+)", name)
    return int(m.group(1)) if m else None


def _write_file(path: str, data: bytes, atomic: bool = False) -> None:
    target = f"{path}.tmp-{os.getpid()}" if atomic else path
    with open(target, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if atomic:
        os.replace(target, path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: str) -> None:
    for root, dirs, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(root)


def _tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


# ------------------------------------------------------------------ restore


def read_state(path: str | os.PathLike) -> tuple[str, dict]:
    """(the directory of the save LATEST names, its state.json); ValueError when there is no
    complete save at `path`."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise ValueError(f"restore: no engine save at {path} (no such directory)")
    latest = os.path.join(path, LATEST)
    if not os.path.isfile(latest):
        raise ValueError(f"restore: {path} holds no complete engine save (no {LATEST} file: nothing was saved "
                         f"there, or the first save was interrupted)")
    name = open(latest, encoding="utf-8", errors="replace").read().strip()
    where = os.path.join(path, name)
    if _version(name) is None or not os.path.isfile(os.path.join(where, STATE)):
        raise ValueError(f"restore: {path}: {LATEST} names {name!r}, which is not a complete save (partial or "
                         f"removed directory)")
    try:
        with open(os.path.join(where, STATE), encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"restore: {where}/{STATE} is unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"restore: {where} is not an engine save of format {FORMAT} "
                         f"(format {state.get('format') if isinstance(state, dict) else None!r})")
    return where, state


def check_compatible(engine: "Engine", state: dict) -> None:
    """ValueError naming every difference between the saved model, layout and config and the
    engine's (or the engine serves on a mesh)."""
    problems = []
    if engine.plan is not None:
        problems.append("the engine serves on a mesh (save / restore is single-device)")
    theirs, ours = state["model"]["config"], model_fields(engine.cfg)
    if theirs != ours:
        diff = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
        problems.append("another model's save: the config differs in " + ", ".join(
            f"{k} (saved {theirs.get(k)!r}, here {ours.get(k)!r})" for k in diff[:6]))
    elif state["model"]["digest"] != engine_digest(engine):
        problems.append("another model's save: the config is the same but the params differ (model digest "
                        f"{state['model']['digest'][:12]}, here {engine_digest(engine)[:12]})")
    ours = layout_record(engine)
    for k, v in state["layout"].items():
        if ours.get(k) != v:
            problems.append(f"a save from another layout: {k} is {v!r} there, {ours.get(k)!r} here")
    for k in MUST_MATCH:
        if state["config"].get(k) != getattr(engine.config, k):
            problems.append(f"EngineConfig.{k} is {state['config'].get(k)!r} in the save, "
                            f"{getattr(engine.config, k)!r} here")
    if problems:
        raise ValueError("restore: " + "; ".join(problems))


def check_room(engine: "Engine", state: dict) -> None:
    """ValueError unless the engine is idle and its pool can hold the saved objects."""
    if engine.running or engine.waiting or engine.sessions or engine._flights:
        raise ValueError(f"restore: the engine is not idle ({len(engine.running)} running, {len(engine.waiting)} "
                         f"queued, {len(engine.sessions)} sessions open): restore into a new engine")
    pool, lay = engine.pool, engine.layout
    n, m = state["slots"], state["pages"]
    if pool.unified:
        fits = (lay.arena_units(n, m) <= pool.budget_units and n <= pool.slots.max_virtual
                and m <= pool.pages.max_virtual)
    else:
        fits = n <= pool.capacity("slot") and m <= pool.capacity("page")
    if not fits:
        raise ValueError(f"restore: the save holds {n} slots and {m} pages; this engine's pool "
                         f"({engine.config.pool}, {pool.budget_units} units) cannot hold them")


def read_arrays(where: str, state: dict, engine: "Engine") -> tuple[np.ndarray, np.ndarray]:
    """The saved slots' and pages' arena rows, checked against the state's counts and the
    engine's layout (ValueError otherwise)."""
    lay, arena = engine.layout, engine.runner.state.arena
    want = {"slots": (state["slots"], lay.slot_units, *arena.shape[1:]),
            "pages": (state["pages"], lay.page_units, *arena.shape[1:])}
    got = {}
    if state["slots"] or state["pages"]:
        import orbax.checkpoint as ocp

        try:
            got = ocp.StandardCheckpointer().restore(os.path.join(where, ARRAYS))
        except Exception as exc:  # noqa: BLE001 - a missing or damaged orbax directory
            raise ValueError(f"restore: {where}/{ARRAYS} is missing or damaged ({type(exc).__name__}: {exc})") from None
    out = []
    for key, shape in want.items():
        a = np.asarray(got[key]) if shape[0] else np.zeros(shape, arena.dtype)
        if a.shape != shape or a.dtype != np.dtype(arena.dtype):
            raise ValueError(f"restore: {where}: {key} has shape {a.shape} {a.dtype}, expected {shape} {arena.dtype}")
        out.append(a)
    return out[0], out[1]


def load(engine: "Engine", path: str | os.PathLike) -> dict:
    """Restore a save into `engine` (idle, same model, layout and MUST_MATCH config): its
    sessions (same ids) and prefix tree come back; returns {"path", "sessions", "slots",
    "pages", "seconds"}. Every check runs before anything changes (ValueError); should the
    device write fail afterwards, the engine resets (its sessions then restart from their
    histories: exact, as after any reset)."""
    t0 = time.perf_counter()
    where, state = read_state(path)
    check_compatible(engine, state)
    slots_data, pages_data = read_arrays(where, state, engine)
    check_room(engine, state)
    pool, lay, tree = engine.pool, engine.layout, engine.tree
    with critical():  # the host records: all or nothing
        engine.admission.evict_all()
        pool.compact()
        slot_ids = [pool.alloc_slot() for _ in range(state["slots"])]
        page_ids = [pool.alloc_page() for _ in range(state["pages"])]
        nodes: list[Node] = []
        for rec in state["tree"]:
            parent = tree.root if rec["parent"] < 0 else nodes[rec["parent"]]
            nodes.append(tree.add_child(parent, rec["tokens"], [page_ids[p] for p in rec["pages"]],
                                        None if rec["checkpoint"] is None else slot_ids[rec["checkpoint"]],
                                        hits=rec["hits"], last_used=rec["last_used"]))
        if tree is not None:
            tree.advance_clock(state["clock"])
        for rec in state["sessions"]:
            held = None
            if rec["held"] is not None:
                h = rec["held"]
                held = Resources(virtual_slot=slot_ids[h["slot"]],
                                 virtual_track_slots=[-1 if s is None else slot_ids[s] for s in h["track_slots"]],
                                 next_track=h["next_track"], virtual_pages=[page_ids[p] for p in h["pages"]],
                                 owned_pages={page_ids[p] for p in h["owned"]}, committed=h["committed"],
                                 prefix_node=None if h["prefix_node"] is None else nodes[h["prefix_node"]],
                                 last_checkpoint=None if h["last_checkpoint"] is None else tuple(h["last_checkpoint"]))
                if held.prefix_node is not None:
                    tree.lock(held.prefix_node)
            engine.requests.adopt_session(rec["sid"], rec["tokens"], held)
        engine.requests.next_sid = max(engine.requests.next_sid, state["next_sid"])
    try:
        engine._apply_pool()
        rows_s = [slot_unit_row(pool.physical_slot(v), lay.slot_units) for v in slot_ids]
        rows_p = [page_unit_row(pool.physical_page(v), pool.num_units, lay.page_units) for v in page_ids]
        write_units(engine, rows_s, slots_data)
        write_units(engine, rows_p, pages_data)
    except BaseException:
        engine.reset()
        raise
    return dict(path=where, sessions=len(state["sessions"]), slots=state["slots"], pages=state["pages"],
                seconds=time.perf_counter() - t0)


def write_units(engine: "Engine", first_rows: list[int], data: np.ndarray) -> None:
    """arena[first_rows[i] + u] = data[i, u] for every saved object (one device scatter, the
    arena donated: `StepRunner.write_rows`)."""
    if not len(first_rows):
        return
    arena = engine.runner.state.arena
    units = data.shape[1]
    rows = (np.asarray(first_rows, np.int64)[:, None] + np.arange(units)[None, :]).reshape(-1)
    engine.runner.write_rows(rows, data.reshape(len(rows), *arena.shape[1:]))

"""How one parameter leaf is laid out over the mesh: its *sharded layout*.

A leaf sharded along a dimension is stored as the concatenation of its shards' local
tensors, so that the contiguous shard a `NamedSharding` hands device j *is* the tensor the
single-device program on the local config expects. For most leaves that is the original
layout cut evenly (wo rows, embed rows, w2 rows, the expert axis). Fused tensors need their
columns reordered: `wqkvr` [H, q|k|v|r] becomes [H, (q_0|k_0|v_0|r_0)|(q_1|k_1|v_1|r_1)|..],
gate|up becomes (gate_0|up_0)|(gate_1|up_1)|... And when a layer has fewer kv heads than
tp shards, each kv head is repeated on the shards whose q heads use it, so the sharded
dimension is longer than the original one.

One `DimLayout` describes one dimension: a list of `Part`s (contiguous runs of original
indices, in order) each cut into pieces; shard j holds, for every part, piece
j // (shards / pieces). From it come the index maps (for reading a shard's slice from disk
or from host memory) and reshape-based relayouts (for arrays already on the devices).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec


@dataclass(frozen=True)
class Part:
    """Original indices [start, start + width), cut into `pieces` equal contiguous pieces."""

    start: int
    width: int
    pieces: int

    @property
    def piece_width(self) -> int:
        return self.width // self.pieces


@dataclass(frozen=True)
class DimLayout:
    """One dimension split over the `shards` shards of mesh axis `axis`.

    parts tile the original dimension [0, n) in order; every part's pieces divides shards
    (a part with fewer pieces than shards has each piece repeated on consecutive shards)."""

    axis: str
    shards: int
    parts: tuple[Part, ...]

    def __post_init__(self):
        start = 0
        for p in self.parts:
            if p.start != start or p.pieces < 1 or self.shards % p.pieces or p.width % p.pieces:
                raise ValueError(f"DimLayout: part {p} does not tile / divide {self.shards} shards")
            start += p.width

    @staticmethod
    def even(axis: str, shards: int, size: int) -> "DimLayout":
        """The plain contiguous split: shard j holds [j * size / shards, (j + 1) * size / shards)."""
        return DimLayout(axis, shards, (Part(0, size, shards),))

    @property
    def original_size(self) -> int:
        return sum(p.width for p in self.parts)

    @property
    def local_size(self) -> int:
        return sum(p.piece_width for p in self.parts)

    @property
    def size(self) -> int:
        """Length of the dimension in the sharded layout (shards * local_size)."""
        return self.shards * self.local_size

    def shard_indices(self, shard: int) -> np.ndarray:
        """Original indices held by `shard`, in its local order."""
        runs = []
        for p in self.parts:
            piece = shard // (self.shards // p.pieces)
            lo = p.start + piece * p.piece_width
            runs.append(np.arange(lo, lo + p.piece_width))
        return np.concatenate(runs)

    def layout_index(self) -> np.ndarray:
        """For every position of the sharded dimension, the original index it holds."""
        return np.concatenate([self.shard_indices(j) for j in range(self.shards)])

    @property
    def is_identity(self) -> bool:
        return self.size == self.original_size and bool(np.all(self.layout_index() == np.arange(self.size)))

    def first_position(self) -> np.ndarray:
        """For every original index, the first sharded position holding it (the inverse map)."""
        index = self.layout_index()
        first = np.full(self.original_size, -1)
        for pos in range(len(index) - 1, -1, -1):
            first[index[pos]] = pos
        assert (first >= 0).all()
        return first

    # reshape-based relayouts (numpy or jax.numpy; `xp` is the module), dimension moved last

    def to_sharded(self, xp: Any, x: Any, dim: int) -> Any:
        x = xp.moveaxis(x, dim, -1)
        lead = x.shape[:-1]
        blocks = []
        for p in self.parts:
            y = x[..., p.start:p.start + p.width].reshape(*lead, p.pieces, p.piece_width)
            if self.shards > p.pieces:
                y = xp.repeat(y, self.shards // p.pieces, axis=-2)
            blocks.append(y)
        y = xp.concatenate(blocks, axis=-1).reshape(*lead, self.size)
        return xp.moveaxis(y, -1, dim)

    def from_sharded(self, xp: Any, x: Any, dim: int) -> Any:
        """The original layout back, reading every repeated piece from its first shard."""
        x = xp.moveaxis(x, dim, -1)
        lead = x.shape[:-1]
        x = x.reshape(*lead, self.shards, self.local_size)
        out, offset = [], 0
        for p in self.parts:
            w = p.piece_width
            y = x[..., offset:offset + w].reshape(*lead, p.pieces, self.shards // p.pieces, w)
            out.append(y[..., 0, :].reshape(*lead, p.width))
            offset += w
        return xp.moveaxis(xp.concatenate(out, axis=-1), -1, dim)


@dataclass(frozen=True)
class LeafLayout:
    """A leaf's original shape and, per dimension, its DimLayout (None: not sharded)."""

    shape: tuple[int, ...]
    dims: tuple[DimLayout | None, ...]

    def __post_init__(self):
        if len(self.dims) != len(self.shape):
            raise ValueError(f"LeafLayout: {len(self.dims)} dim layouts for shape {self.shape}")
        for n, d in zip(self.shape, self.dims):
            if d is not None and d.original_size != n:
                raise ValueError(f"LeafLayout: dim layout of size {d.original_size} for a dimension of {n}")

    @staticmethod
    def replicated(shape: tuple[int, ...]) -> "LeafLayout":
        return LeafLayout(tuple(shape), (None,) * len(shape))

    @property
    def spec(self) -> PartitionSpec:
        """The PartitionSpec of the sharded-layout array."""
        return PartitionSpec(*(d.axis if d is not None else None for d in self.dims))

    @property
    def sharded_shape(self) -> tuple[int, ...]:
        return tuple(d.size if d is not None else n for n, d in zip(self.shape, self.dims))

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(d.local_size if d is not None else n for n, d in zip(self.shape, self.dims))

    @property
    def is_sharded(self) -> bool:
        return any(d is not None for d in self.dims)

    @property
    def is_identity(self) -> bool:
        """The sharded layout is the original one (only the device placement differs)."""
        return all(d is None or d.is_identity for d in self.dims)

    def original_spec(self) -> PartitionSpec:
        """A PartitionSpec for the *original*-layout array that cuts each sharded dimension
        evenly where it divides (replicated where not): how a checkpoint in the original
        layout is read before `to_sharded` moves columns to their devices."""
        return PartitionSpec(*(d.axis if d is not None and n % d.shards == 0 else None
                               for n, d in zip(self.shape, self.dims)))

    def original_indices(self, index: tuple[slice, ...]) -> tuple[np.ndarray, ...]:
        """Original indices, per dimension, of a block (slices) of the sharded-layout array."""
        out = []
        for n, d, s in zip(self.sharded_shape, self.dims, index):
            positions = np.arange(n)[s]
            out.append(d.layout_index()[positions] if d is not None else positions)
        return tuple(out)

    def to_sharded(self, xp: Any, x: Any) -> Any:
        for dim, d in enumerate(self.dims):
            if d is not None and not d.is_identity:
                x = d.to_sharded(xp, x, dim)
        return x

    def from_sharded(self, xp: Any, x: Any) -> Any:
        for dim, d in enumerate(self.dims):
            if d is not None and not d.is_identity:
                x = d.from_sharded(xp, x, dim)
        return x

    def local_bytes(self, itemsize: int) -> int:
        return math.prod(self.local_shape) * itemsize

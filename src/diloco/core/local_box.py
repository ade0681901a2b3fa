"""Which elements of a global tensor one rank of a DTensor holds, from the placements alone.

A DTensor's ``placements`` say, per mesh dimension, how the global tensor is laid over the
ranks: ``Replicate`` (every rank holds it all), ``Shard(d)`` (tensor dimension ``d`` split as
``torch.chunk`` splits it, the last ranks holding less or nothing when it does not divide),
``_StridedShard(d, split_factor=f)`` (FSDP2 over tensor parallelism on one dimension: ``d``
first cut in ``f`` pieces, each piece chunked, a rank taking its chunk of every piece) or
``Partial`` (each rank holds a summand, not a slice). Placements apply left to right, each to
what the previous ones left on the rank, so the global indices a rank holds are found by
applying them to the index ranges ``0..n-1`` of every dimension; the result is exact for uneven
and strided shards alike, where a (shape, offset) pair cannot describe a strided one.

Placements are read by what they answer (``is_replicate``, ``is_shard``, ``is_partial``,
``split_factor``), so this module needs no ``torch.distributed`` and runs on plain data: a mesh
shape, a rank's mesh coordinate and placement objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class LocalBox:
    """The global indices one rank holds, per tensor dimension, in the order of its local
    tensor: the local tensor is ``global[ix_(*indices)]``."""

    indices: tuple[torch.Tensor, ...]
    """One int64 vector per dimension of the global tensor."""

    @classmethod
    def whole(cls, shape: Sequence[int]) -> LocalBox:
        """Every element: a tensor that is not sharded."""
        return cls(tuple(torch.arange(n) for n in shape))

    @property
    def shape(self) -> tuple[int, ...]:
        """The local tensor's shape."""
        return tuple(len(ix) for ix in self.indices)

    def bounds(self) -> tuple[slice, ...]:
        """The smallest box of consecutive indices holding every local element, per dimension
        (``slice(0, 0)`` where the rank holds nothing): what to read from a file."""
        return tuple(
            slice(int(ix.min()), int(ix.max()) + 1) if len(ix) else slice(0, 0)
            for ix in self.indices
        )

    def take(self, block: torch.Tensor) -> torch.Tensor:
        """The local tensor out of ``block``, the global tensor's ``bounds()`` box: the box
        itself where every dimension's indices run consecutively (plain shards), otherwise the
        rows of each dimension picked in local order (strided shards)."""
        for dim, (ix, box) in enumerate(zip(self.indices, self.bounds(), strict=True)):
            relative = ix - (box.start or 0)
            if not torch.equal(relative, torch.arange(len(ix))):
                block = block.index_select(dim, relative)
        return block


def local_box(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Any],
) -> LocalBox:
    """The elements the rank at ``coordinate`` of a mesh of ``mesh_shape`` holds of a global
    tensor of ``shape`` laid out by ``placements`` (one per mesh dimension). A ``ValueError``
    for a ``Partial`` placement (its value is a sum over ranks: no slice of a checkpoint is
    what a rank holds), a placement of another kind, or placements that do not fit the
    shape or the mesh."""
    if not len(placements) == len(mesh_shape) == len(coordinate):
        raise ValueError(
            f"{len(placements)} placements for a mesh of shape {tuple(mesh_shape)} "
            f"(coordinate {tuple(coordinate)})"
        )
    cuts: list[Cut] = []
    for mesh_dim, placement in enumerate(placements):
        if placement.is_partial():
            raise ValueError(
                f"placement {placement} on mesh dimension {mesh_dim} is partial: each rank "
                "holds a summand, not a slice; redistribute it to Replicate or Shard first"
            )
        if placement.is_replicate():
            cuts.append(None)
            continue
        dim = getattr(placement, "dim", None)
        if not isinstance(dim, int) or not 0 <= dim < len(shape):
            raise ValueError(f"placement {placement} does not fit a tensor of shape {tuple(shape)}")
        if hasattr(placement, "split_factor"):
            cuts.append((dim, int(placement.split_factor)))
        elif placement.is_shard():
            cuts.append((dim, 1))
        else:
            raise ValueError(f"placement {placement} is neither a shard, a replica nor partial")
    return local_indices(shape, mesh_shape, coordinate, cuts)


Cut = tuple[int, int] | None
"""One mesh dimension's placement as plain data: ``None`` for a replica, ``(dim, f)`` for a
shard of tensor dimension ``dim`` (``f`` = 1) or a strided one of split factor ``f``."""


def local_indices(
    shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], cuts: Sequence[Cut]
) -> LocalBox:
    """The chunk rule, the project's only one: ``cuts`` applied left to right to the index
    ranges of ``shape`` (a strided cut: the dimension in ``f`` pieces, this rank's chunk of
    each). The caller has checked that every cut's dimension is one of ``shape``'s."""
    indices = [torch.arange(n) for n in shape]
    for cut, count, rank in zip(cuts, mesh_shape, coordinate, strict=True):
        if cut is None:
            continue
        dim, factor = cut
        if factor == 1:
            indices[dim] = _chunk(indices[dim], count, rank)
        else:
            pieces = _chunks(indices[dim], factor)
            indices[dim] = torch.cat([_chunk(piece, count, rank) for piece in pieces])
    return LocalBox(tuple(indices))


def _chunks(ix: torch.Tensor, count: int) -> list[torch.Tensor]:
    """``ix`` cut as ``torch.chunk`` cuts it (pieces of ``ceil(n / count)``), with the empty
    pieces ``torch.chunk`` leaves out put back, so there are always ``count``."""
    size = -(-len(ix) // count)
    return [ix[i * size : (i + 1) * size] for i in range(count)]


def _chunk(ix: torch.Tensor, count: int, rank: int) -> torch.Tensor:
    return _chunks(ix, count)[rank]

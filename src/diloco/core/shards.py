"""Where each piece of a sharded parameter lives (docs/design/groups.md, "Sharded groups").

A DTensor parameter of global shape S lies on a device mesh of shape M; along each mesh dim its
placement is ``Shard(d)`` (cut tensor dim d into M[i] chunks), ``_StridedShard(d, f)`` (FSDP2
over tensor parallelism on one dim: d first cut in f pieces, the rank taking its chunk of each)
or ``Replicate()`` (every coordinate along that mesh dim holds the same values). Which global
indices a coordinate holds is ``core/local_box.py``'s chunk rule (``local_indices``), the one
``diloco.load_into`` uses too; this module turns them into a ``Box`` and adds what a group needs
on top: ownership, tiling, and placement codes for the wire.

A ``Box`` is the block of the global tensor a coordinate holds, ``global[ix_(*indices)]``: per
dim a run of consecutive indices (an offset and an extent: read and written as a slice, a
view) or, where a strided shard leaves gaps, the indices themselves (read with
``index_select``, written with ``index_copy_``). An empty extent sits at the dim's global end,
as DTensor puts it.

Along a ``Replicate`` mesh dim several coordinates hold the same box; only the one at 0 along
every such dim *owns* it, so that each element is owned exactly once and a pseudo-gradient
gathered from the owners covers the parameter once.

Placements are given as codes: ``"S<d>"`` for ``Shard(d)``, ``"S<d>/<f>"`` for
``_StridedShard(d, split_factor=f)``, ``"R"`` for ``Replicate()`` (``placement_code`` turns
DTensor's objects into them and refuses every other kind).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from diloco.core.local_box import Cut, LocalBox, local_indices

REPLICATE = "R"


@dataclass(frozen=True)
class Box:
    """A block of a global tensor: where it starts along each dim and its extent, and, for the
    dims a strided shard leaves gaps in, the global indices themselves in local order (``picks``:
    empty when every dim is a run; else per dim None for a run, the indices for the others)."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    picks: tuple[tuple[int, ...] | None, ...] = ()

    @classmethod
    def of(cls, shape: Sequence[int], held: LocalBox) -> Box:
        """The box of ``held`` (global indices per dim) in a tensor of ``shape``."""
        offset, picks = [], []
        for size, ix in zip(shape, held.indices, strict=True):
            first = int(ix[0]) if len(ix) else size
            run = torch.equal(ix, torch.arange(first, first + len(ix)))
            offset.append(first if run else int(ix.min()))
            picks.append(None if run else tuple(ix.tolist()))
        return cls(tuple(offset), held.shape, tuple(picks) if any(picks) else ())

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def strided(self) -> bool:
        """Whether some dim is not a run of consecutive indices (no slice can index it)."""
        return bool(self.picks)

    def slices(self) -> tuple[slice, ...]:
        """Index a global tensor with these to get the box's view (a box with runs only)."""
        if self.strided:
            raise ValueError(f"a strided box {self} is no slice: use read and write")
        return tuple(slice(o, o + n) for o, n in zip(self.offset, self.shape, strict=True))

    def indices(self, dim: int) -> Sequence[int]:
        """The global indices the box holds along ``dim``, in local order."""
        pick = self.picks[dim] if self.picks else None
        return range(self.offset[dim], self.offset[dim] + self.shape[dim]) if pick is None else pick

    def read(self, whole: torch.Tensor) -> torch.Tensor:
        """The box's values out of ``whole``, a global-shaped tensor: a view for runs, a copy
        picked with ``index_select`` along strided dims."""
        if not self.strided:
            return whole[self.slices()]
        out = whole
        for dim, pick in enumerate(self.picks):
            if pick is None:
                out = out.narrow(dim, self.offset[dim], self.shape[dim])
            else:
                out = out.index_select(dim, torch.tensor(pick, device=whole.device))
        return out

    def write(self, whole: torch.Tensor, values: torch.Tensor) -> None:
        """Put ``values`` (the box's shape) into ``whole`` where the box lies."""
        if not self.strided:
            whole[self.slices()].copy_(values)
            return
        target = whole
        for dim, pick in enumerate(self.picks):  # the runs narrowed: a view of ``whole``
            if pick is None:
                target = target.narrow(dim, self.offset[dim], self.shape[dim])
        strided = [(d, torch.tensor(p, device=whole.device)) for d, p in enumerate(self.picks) if p]
        if len(strided) == 1:
            target.index_copy_(strided[0][0], strided[0][1], values.to(target.dtype))
            return
        grid = [  # several strided dims: every dim's indices, broadcast against each other
            torch.arange(n, device=whole.device) if p is None else torch.tensor(p)
            for n, p in zip(self.shape, self.picks, strict=True)
        ]
        target.index_put_(torch.meshgrid(*grid, indexing="ij"), values.to(target.dtype))

    def flat_range(self, shape: Sequence[int]) -> tuple[int, int] | None:
        """Where the box lies in the row-major flat view of a tensor of ``shape``, as (start,
        elements), when it is one run there: extent 1 along the dims before the first dim it
        spans more than one index of, and whole along every dim after it (``Shard(0)`` rows
        are; columns are not). None for a box that is no run (or is strided)."""
        if self.strided:
            return None
        if self.numel == 0:
            return (0, 0)
        first = next((d for d, n in enumerate(self.shape) if n != 1), len(self.shape))
        if any(
            n != size for n, size in zip(self.shape[first + 1 :], shape[first + 1 :], strict=True)
        ):
            return None
        start = 0
        for o, size in zip(self.offset, shape, strict=True):
            start = start * size + o
        return start, self.numel

    def overlaps(self, other: Box) -> bool:
        if self.numel == 0 or other.numel == 0:
            return False
        return all(_meet(self.indices(d), other.indices(d)) for d in range(len(self.shape)))


def _meet(a: Sequence[int], b: Sequence[int]) -> bool:
    """Whether two dims' index lists share an index (runs compared as intervals)."""
    if isinstance(a, range) and isinstance(b, range):
        return a.start < b.stop and b.start < a.stop
    return not set(a).isdisjoint(b)


def _inside(ix: Sequence[int], size: int) -> bool:
    """Whether an index list is distinct indices of a dim of ``size``."""
    if isinstance(ix, range):
        return 0 <= ix.start and ix.stop <= size
    return len(set(ix)) == len(ix) and all(0 <= i < size for i in ix)


def placement_code(name: str, placement: object) -> str:
    """``"S<d>"``, ``"S<d>/<f>"`` or ``"R"`` for a DTensor placement; a ValueError naming the
    parameter and the placement for any other kind (``Partial``: values still to be reduced)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if type(placement) is Shard:
        return f"S{placement.dim}"
    if type(placement) is _StridedShard:
        return f"S{placement.dim}/{placement.split_factor}"
    if type(placement) is Replicate:
        return REPLICATE
    raise ValueError(
        f"parameter {name!r} has placement {placement!r}: a worker group syncs only Shard(d) "
        "and Replicate() placements (and FSDP2's strided shards)"
    )


def cut(code: str) -> Cut:
    """A placement code as ``local_box``'s cut: None for ``Replicate``, else (dim, factor)."""
    if code == REPLICATE:
        return None
    dim, slash, factor = code[1:].partition("/")
    factor = factor if slash else "1"
    if not code.startswith("S") or not dim.isdigit() or not factor.isdigit():
        raise ValueError(f"unknown placement code {code!r}")
    if int(factor) < 1:
        raise ValueError(f"placement code {code!r}: a split factor is at least 1")
    return int(dim), int(factor)


def local_box(
    shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[str], coord: Sequence[int]
) -> Box:
    """The box the mesh coordinate ``coord`` holds of a tensor of global ``shape``."""
    if not len(mesh_shape) == len(placements) == len(coord):
        raise ValueError(
            f"mesh {tuple(mesh_shape)}, placements {tuple(placements)} and coordinate "
            f"{tuple(coord)} differ in length"
        )
    cuts = [cut(code) for code in placements]
    for code, c in zip(placements, cuts, strict=True):
        if c is not None and c[0] >= len(shape):
            raise ValueError(f"placement {code} of a {len(shape)}-d tensor")
    return Box.of(shape, local_indices(shape, mesh_shape, coord, cuts))


def owns(placements: Sequence[str], coord: Sequence[int]) -> bool:
    """Whether ``coord`` owns its box: at 0 along every ``Replicate`` mesh dim."""
    return all(c == 0 for code, c in zip(placements, coord, strict=True) if code == REPLICATE)


def coordinates(mesh_shape: Sequence[int]) -> Iterable[tuple[int, ...]]:
    """Every coordinate of the mesh, in row-major order (the order of ``DeviceMesh.mesh``)."""
    if not mesh_shape:
        yield ()
        return
    for c in range(mesh_shape[0]):
        for rest in coordinates(mesh_shape[1:]):
            yield (c, *rest)


def all_boxes(
    shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[str]
) -> dict[tuple[int, ...], tuple[Box, bool]]:
    """Every coordinate's box and whether it owns it."""
    return {
        c: (local_box(shape, mesh_shape, placements, c), owns(placements, c))
        for c in coordinates(mesh_shape)
    }


def tiles_once(shape: Sequence[int], boxes: Iterable[Box]) -> bool:
    """True if ``boxes`` cover a tensor of ``shape`` with every element exactly once."""
    boxes = [b for b in boxes if b.numel]
    total = 1
    for d in shape:
        total *= d
    if sum(b.numel for b in boxes) != total:
        return False
    inside = all(_inside(b.indices(d), s) for b in boxes for d, s in enumerate(shape))
    return inside and not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])

"""Where each piece of a sharded parameter lives (docs/design/groups.md, "Sharded groups").

A DTensor parameter of global shape S lies on a device mesh of shape M; along each mesh dim its
placement is ``Shard(d)`` (cut tensor dim d into M[i] chunks) or ``Replicate()`` (every
coordinate along that mesh dim holds the same values). The maths here is DTensor's own
(``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``): mesh dims are
applied left to right, each cutting the current local extent of its tensor dim as
``torch.chunk`` does, so the last chunks may be short or empty (5 rows over 2 ranks: 3 + 2;
1 row over 2 ranks: 1 + 0, the empty one's offset the dim's global size).

A coordinate's ``Box`` is the block of the global tensor it holds. Along a ``Replicate`` mesh
dim several coordinates hold the same box; only the one at 0 along every such dim *owns* it, so
that each element is owned exactly once and a pseudo-gradient gathered from the owners covers
the parameter once.

Placements are given as codes: ``"S<d>"`` for ``Shard(d)``, ``"R"`` for ``Replicate()``
(``placement_code`` turns DTensor's objects into them and refuses every other kind).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

REPLICATE = "R"


@dataclass(frozen=True)
class Box:
    """A block of a global tensor: where it starts along each dim and its extent."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def slices(self) -> tuple[slice, ...]:
        """Index a global tensor with these to get the box's view."""
        return tuple(slice(o, o + n) for o, n in zip(self.offset, self.shape, strict=True))

    def overlaps(self, other: Box) -> bool:
        if self.numel == 0 or other.numel == 0:
            return False
        return all(
            a < b + m and b < a + n
            for a, n, b, m in zip(self.offset, self.shape, other.offset, other.shape, strict=True)
        )


def placement_code(name: str, placement: object) -> str:
    """``"S<d>"`` or ``"R"`` for a DTensor placement; a ValueError naming the parameter and the
    placement for any other kind (``Partial``: values still to be reduced; strided shards)."""
    from torch.distributed.tensor import Replicate, Shard

    if type(placement) is Shard:
        return f"S{placement.dim}"
    if type(placement) is Replicate:
        return REPLICATE
    raise ValueError(
        f"parameter {name!r} has placement {placement!r}: a worker group syncs only Shard(d) "
        "and Replicate() placements"
    )


def shard_dim(code: str) -> int | None:
    """The tensor dim a placement code cuts; None for ``Replicate``."""
    if code == REPLICATE:
        return None
    if not code.startswith("S") or not code[1:].isdigit():
        raise ValueError(f"unknown placement code {code!r}")
    return int(code[1:])


def chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of chunk ``index`` when ``size`` elements are cut into ``parts`` as
    ``torch.chunk`` cuts them (every chunk ``ceil(size / parts)`` long but the last ones, which
    may be short or empty; an empty chunk starts at ``size``)."""
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"chunk {index} of {parts}")
    full = -(-size // parts)
    start = min(size, full * index)
    return start, max(0, min(size, start + full) - start)


def local_box(
    shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[str], coord: Sequence[int]
) -> Box:
    """The box the mesh coordinate ``coord`` holds of a tensor of global ``shape``."""
    if not len(mesh_shape) == len(placements) == len(coord):
        raise ValueError(
            f"mesh {tuple(mesh_shape)}, placements {tuple(placements)} and coordinate "
            f"{tuple(coord)} differ in length"
        )
    offset = [0] * len(shape)
    extent = list(shape)
    for size, code, c in zip(mesh_shape, placements, coord, strict=True):
        dim = shard_dim(code)
        if dim is None:
            continue
        if dim >= len(shape):
            raise ValueError(f"placement {code} of a {len(shape)}-d tensor")
        start, length = chunk(extent[dim], size, c)
        # DTensor puts an empty shard at the dim's global end, whatever cut it.
        offset[dim] = offset[dim] + start if length else shape[dim]
        extent[dim] = length
    return Box(tuple(offset), tuple(extent))


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
    inside = all(
        0 <= o and o + n <= s
        for b in boxes
        for o, n, s in zip(b.offset, b.shape, shape, strict=True)
    )
    return inside and not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])


def box_of(t: torch.Tensor, box: Box) -> torch.Tensor:
    """The view of a global-shaped tensor ``t`` that ``box`` covers."""
    return t[box.slices()]

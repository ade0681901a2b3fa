"""``core.local_box``: the elements a rank of a DTensor holds, from shapes, a mesh coordinate and
placements alone, checked against torch's own splitting (the one ``distribute_tensor`` applies,
mesh dimension by mesh dimension) for uneven, strided and multi-dimensional layouts."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from diloco.core.local_box import LocalBox, local_box


def torch_local(
    full: torch.Tensor, mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Any
) -> torch.Tensor:
    """What a rank holds of ``full`` as torch lays it out: each placement's ``_split_tensor``
    (``torch.chunk`` semantics, strided pieces) applied left to right."""
    local = full
    for placement, count, rank in zip(placements, mesh_shape, coordinate, strict=True):
        if not placement.is_replicate():
            local = placement._split_tensor(local, count, with_padding=False)[0][rank]
    return local


def via_box(full: torch.Tensor, box: LocalBox) -> torch.Tensor:
    """What ``load_into`` reads: the bounds of the box from the file, then ``take``."""
    return box.take(full[box.bounds()])


def every_rank(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(n) for n in mesh_shape)))


@pytest.mark.parametrize(
    ("shape", "mesh_shape", "placements", "rows"),
    [
        # 5 rows over 2 ranks: torch.chunk gives 3 and 2.
        ((5, 4), (2,), [Shard(0)], {(0,): [0, 1, 2], (1,): [3, 4]}),
        # 3 rows over 4 ranks: the last rank holds nothing.
        ((3, 2), (4,), [Shard(0)], {(0,): [0], (1,): [1], (2,): [2], (3,): []}),
        # FSDP2 over tensor parallelism on one dimension (dp=2, tp=2): rank (dp, tp) holds the
        # dp-th chunk of the tp-th half, so (0, 1) holds rows 4-5, not 2-3.
        (
            (8, 3),
            (2, 2),
            [_StridedShard(0, split_factor=2), Shard(0)],
            {(0, 0): [0, 1], (0, 1): [4, 5], (1, 0): [2, 3], (1, 1): [6, 7]},
        ),
    ],
)
def test_rows_by_rank(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    placements: list[Any],
    rows: dict[tuple[int, ...], list[int]],
) -> None:
    full = torch.arange(torch.Size(shape).numel()).view(shape)
    for coordinate, expected in rows.items():
        box = local_box(shape, mesh_shape, coordinate, placements)
        assert box.indices[0].tolist() == expected, coordinate
        assert torch.equal(via_box(full, box), full[expected]), coordinate


def test_a_shard_on_each_dimension_is_a_box_and_a_replica_is_everything() -> None:
    # Tensor parallel row-wise (dim 1 on tp) under FSDP2 (dim 0 on dp): a 2-D box per rank.
    box = local_box((5, 6), (2, 2), (1, 0), [Shard(0), Shard(1)])
    assert box.shape == (2, 3)
    assert box.bounds() == (slice(3, 5), slice(0, 3))
    assert local_box((5,), (2, 2), (1, 1), [Shard(0), Replicate()]).indices[0].tolist() == [3, 4]
    assert local_box((), (2,), (1,), [Replicate()]).shape == ()


def test_the_bounds_of_a_strided_shard_are_read_then_picked() -> None:
    # 6 rows, strided then sharded: rank (1, 0) holds row 2 and rank (0, 1) rows 3-4.
    box = local_box((6, 2), (2, 2), (1, 0), [_StridedShard(0, split_factor=2), Shard(0)])
    assert box.indices[0].tolist() == [2]
    strided = local_box((8, 2), (2, 1), (1, 0), [_StridedShard(0, split_factor=2), Replicate()])
    assert strided.indices[0].tolist() == [2, 3, 6, 7]
    assert strided.bounds()[0] == slice(2, 8)
    full = torch.arange(16).view(8, 2)
    assert torch.equal(via_box(full, strided), full[[2, 3, 6, 7]])


@settings(max_examples=150, deadline=None)
@given(
    shape=st.lists(st.integers(0, 9), min_size=1, max_size=3),
    mesh_shape=st.lists(st.integers(1, 3), min_size=1, max_size=2),
    data=st.data(),
)
def test_every_layout_matches_torch(
    shape: list[int], mesh_shape: list[int], data: st.DataObject
) -> None:
    dims = st.integers(0, len(shape) - 1)
    placement = st.one_of(
        st.just(Replicate()),
        dims.map(Shard),
        st.tuples(dims, st.integers(1, 3)).map(lambda d: _StridedShard(d[0], split_factor=d[1])),
    )
    placements = data.draw(st.lists(placement, min_size=len(mesh_shape), max_size=len(mesh_shape)))
    full = torch.arange(torch.Size(shape).numel()).view(shape)
    for coordinate in every_rank(mesh_shape):
        box = local_box(shape, mesh_shape, coordinate, placements)
        expected = torch_local(full, mesh_shape, coordinate, placements)
        assert box.shape == tuple(expected.shape), (coordinate, placements)
        assert torch.equal(via_box(full, box), expected), (coordinate, placements)


def test_partial_and_misfit_placements_are_refused() -> None:
    with pytest.raises(ValueError, match="partial: each rank holds a summand"):
        local_box((4,), (2,), (0,), [Partial()])
    with pytest.raises(ValueError, match="does not fit a tensor of shape"):
        local_box((4,), (2,), (0,), [Shard(1)])
    with pytest.raises(ValueError, match="1 placements for a mesh of shape"):
        local_box((4,), (2, 2), (0, 0), [Shard(0)])


def test_whole_is_every_element() -> None:
    full = torch.randn(3, 4)
    box = LocalBox.whole(full.shape)
    assert box.shape == (3, 4) and box.bounds() == (slice(0, 3), slice(0, 4))
    assert torch.equal(box.take(full[box.bounds()]), full)

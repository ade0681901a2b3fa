"""``core/shards.py``: the boxes a sharded parameter's mesh coordinates hold, against
hand-computed references and DTensor's own maths."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from diloco.core.shards import (
    Box,
    all_boxes,
    cut,
    local_box,
    owns,
    placement_code,
    tiles_once,
)


def test_five_rows_over_two_ranks_are_three_and_two() -> None:
    assert local_box((5, 4), (2,), ("S0",), (0,)) == Box((0, 0), (3, 4))
    assert local_box((5, 4), (2,), ("S0",), (1,)) == Box((3, 0), (2, 4))


def test_one_row_over_two_ranks_leaves_an_empty_shard_at_the_end() -> None:
    assert local_box((1, 4), (2,), ("S0",), (0,)) == Box((0, 0), (1, 4))
    assert local_box((1, 4), (2,), ("S0",), (1,)) == Box((1, 0), (0, 4))
    assert local_box((1,), (2,), ("S0",), (1,)).numel == 0


def test_shard_on_dim_1() -> None:
    assert local_box((2, 5), (2,), ("S1",), (0,)) == Box((0, 0), (2, 3))
    assert local_box((2, 5), (2,), ("S1",), (1,)) == Box((0, 3), (2, 2))


def test_two_d_mesh_shard_0_and_shard_1() -> None:
    # A 4x6 tensor on a 2x3 mesh: rows in halves, columns in thirds.
    boxes = {c: b for c, (b, _) in all_boxes((4, 6), (2, 3), ("S0", "S1")).items()}
    assert boxes[(0, 0)] == Box((0, 0), (2, 2))
    assert boxes[(1, 2)] == Box((2, 4), (2, 2))
    assert boxes[(0, 1)] == Box((0, 2), (2, 2))
    assert tiles_once((4, 6), boxes.values())


def test_the_same_dim_cut_twice_cuts_the_local_part() -> None:
    # 5 rows: mesh dim 0 cuts 3 + 2, mesh dim 1 cuts each again (2 + 1, 1 + 1).
    boxes = {c: b for c, (b, _) in all_boxes((5,), (2, 2), ("S0", "S0")).items()}
    assert [boxes[c] for c in [(0, 0), (0, 1), (1, 0), (1, 1)]] == [
        Box((0,), (2,)),
        Box((2,), (1,)),
        Box((3,), (1,)),
        Box((4,), (1,)),
    ]


def test_replicate_is_owned_only_at_coordinate_0_of_its_dim() -> None:
    table = all_boxes((4, 3), (2, 2), ("R", "S0"))
    assert table[(0, 0)] == (Box((0, 0), (2, 3)), True)
    assert table[(0, 1)] == (Box((2, 0), (2, 3)), True)
    assert table[(1, 0)] == (Box((0, 0), (2, 3)), False)  # the same rows as (0, 0)
    assert table[(1, 1)] == (Box((2, 0), (2, 3)), False)
    assert tiles_once((4, 3), [b for b, own in table.values() if own])
    assert not tiles_once((4, 3), [b for b, _ in table.values()])  # replicas count twice
    assert owns(("R", "R"), (0, 0)) and not owns(("R", "R"), (0, 1))


def test_one_mesh_dim_follows_torch_chunk() -> None:
    for size, parts in itertools.product(range(0, 9), range(1, 5)):
        pieces = torch.arange(size).chunk(parts) if size else ()
        for i in range(parts):
            box = local_box((size,), (parts,), ("S0",), (i,))
            expected = pieces[i].tolist() if i < len(pieces) else []
            assert list(box.indices(0)) == expected, (size, parts, i)


@pytest.mark.parametrize(
    ("shape", "mesh", "placements"),
    [
        ((5, 4), (2,), (Shard(0),)),
        ((1,), (2,), (Shard(0),)),
        ((3, 7), (2,), (Shard(1),)),
        ((7, 5), (2, 3), (Shard(0), Shard(1))),
        ((7, 5), (2, 3), (Replicate(), Shard(0))),
        ((9, 2), (2, 3), (Shard(0), Shard(0))),
        ((2, 2), (4, 2), (Shard(0), Shard(0))),
        ((8, 3), (2, 2), (_StridedShard(0, split_factor=2), Shard(0))),
        ((7, 3), (2, 2), (_StridedShard(0, split_factor=2), Shard(0))),
        ((6, 5), (2, 2), (_StridedShard(1, split_factor=2), Shard(1))),
    ],
)
def test_boxes_match_dtensor(
    shape: tuple[int, ...], mesh: tuple[int, ...], placements: tuple[object, ...]
) -> None:
    codes = [placement_code("w", p) for p in placements]
    for coord, (box, _) in all_boxes(shape, mesh, codes).items():
        local, offset = _compute_local_shape_and_global_offset(
            shape,
            mesh,
            list(coord),
            placements,  # type: ignore[arg-type]
        )
        assert box == Box(tuple(offset), tuple(local)), coord


def test_placements_other_than_shard_and_replicate_are_refused() -> None:
    assert placement_code("w", Shard(1)) == "S1" and placement_code("w", Replicate()) == "R"
    with pytest.raises(ValueError, match=r"parameter '0.weight' has placement Partial"):
        placement_code("0.weight", Partial())


def test_strided_codes_round_trip_and_bad_codes_are_refused() -> None:
    assert placement_code("w", _StridedShard(0, split_factor=2)) == "S0/2"
    assert cut("S0/2") == (0, 2) and cut("S1") == (1, 1) and cut("R") is None
    for bad in ("S", "S0/", "S0/0", "Sx", "X1", "S1/2/3"):
        with pytest.raises(ValueError, match="placement code"):
            cut(bad)


def test_fsdp_over_tp_boxes_are_runs_and_match_dtensor() -> None:
    # FSDP2 (dp) over tensor parallelism (tp) on dim 0 of 8 rows: (dp, tp) holds the dp-th
    # chunk of the tp-th half; every box a run, so the group slices as for plain shards.
    codes = ("S0/2", "S0")
    boxes = {c: b for c, (b, _) in all_boxes((8, 3), (2, 2), codes).items()}
    assert boxes[(0, 1)] == Box((4, 0), (2, 3)) and boxes[(1, 0)] == Box((2, 0), (2, 3))
    assert not any(b.strided for b in boxes.values())
    assert tiles_once((8, 3), boxes.values())


def test_a_strided_box_has_gaps_and_is_read_and_written_by_index() -> None:
    # A strided shard alone (split factor 2 over 2 ranks): rank 0 holds rows 0-1 and 4-5.
    table = all_boxes((8, 3), (2,), ("S0/2",))
    box = table[(0,)][0]
    assert box.strided and box.shape == (4, 3) and list(box.indices(0)) == [0, 1, 4, 5]
    assert tiles_once((8, 3), [b for b, _ in table.values()])
    whole = torch.arange(24.0).view(8, 3)
    assert torch.equal(box.read(whole), whole[[0, 1, 4, 5]])
    out = torch.zeros(8, 3)
    for b, _ in table.values():  # the parts put back together are the tensor
        b.write(out, b.read(whole))
    assert torch.equal(out, whole)
    with pytest.raises(ValueError, match="no slice"):
        box.slices()


def test_several_strided_dims_are_written_by_index() -> None:
    box = local_box((4, 6), (2, 2), ("S0/2", "S1/3"), (1, 0))
    assert list(box.indices(0)) == [1, 3] and list(box.indices(1)) == [0, 2, 4]
    whole = torch.arange(24.0).view(4, 6)
    got = box.read(whole)
    assert torch.equal(got, whole[[1, 3]][:, [0, 2, 4]])
    out = torch.zeros(4, 6)
    box.write(out, got)
    assert torch.equal(out[[1, 3]][:, [0, 2, 4]], got) and out.sum() == got.sum()


def test_tiling_finds_gaps_and_overlaps() -> None:
    assert tiles_once((4,), [Box((0,), (2,)), Box((2,), (2,))])
    assert not tiles_once((4,), [Box((0,), (2,)), Box((1,), (2,))])  # overlap, one missing
    assert not tiles_once((4,), [Box((0,), (3,)), Box((2,), (2,))])
    strided = Box((0,), (2,), ((0, 2),))
    assert tiles_once((4,), [strided, Box((1,), (1,)), Box((3,), (1,))])
    assert not tiles_once((4,), [strided, Box((1,), (2,))])  # 2 twice, 3 missing
    assert not tiles_once((4,), [Box((0,), (2,), ((0, 0),)), Box((2,), (2,))])  # 0 twice


@pytest.mark.parametrize(
    ("offset", "box", "expected"),
    [
        ((2, 0), (3, 4), (8, 12)),  # whole rows: one run
        ((0, 1), (3, 2), None),  # columns: a run per row, not one
        ((1, 1), (1, 2), (5, 2)),  # part of one row
        ((0, 0, 0), (2, 3, 4), (0, 24)),  # the whole tensor
        ((1, 1, 0), (1, 2, 4), (16, 8)),  # rows of one matrix of a stack
        ((0, 1, 0), (2, 2, 4), None),  # the same rows of two matrices
        ((3, 0), (0, 4), (0, 0)),  # an empty box
    ],
)
def test_flat_range_is_the_box_as_one_run_of_the_flat_tensor(
    offset: tuple[int, ...], box: tuple[int, ...], expected: tuple[int, int] | None
) -> None:
    shape = (4, 4) if len(box) == 2 else (2, 3, 4)
    b = Box(offset, box)
    assert b.flat_range(shape) == expected
    if expected is not None and b.numel:  # the run holds exactly the box's elements, in order
        whole = torch.arange(math.prod(shape)).reshape(shape)
        start, n = expected
        assert torch.equal(whole.reshape(-1)[start : start + n], b.read(whole).reshape(-1))


def test_a_strided_box_is_no_flat_range() -> None:
    assert Box((0, 0), (2, 4), ((0, 2), None)).flat_range((4, 4)) is None

"""Which of a shard's elements a fragment piece covers (``worker/groups/sharded_pieces.py``),
and the piece moves applied there equal the moves applied to the whole tensor's piece."""

from __future__ import annotations

import pytest
import torch

from diloco.core.outer import OuterSGD, apply_outer_step
from diloco.core.piece_moves import ADD, MERGE, REBASE, mix_span, move_piece, step_span
from diloco.core.shards import Box
from diloco.worker.groups.sharded_pieces import span_in

SHAPE = (5, 6)
BOXES = [
    Box((0, 0), (3, 6)),  # Shard(0): whole rows
    Box((3, 0), (2, 6)),
    Box((0, 2), (5, 2)),  # Shard(1): a column block
    Box((1, 3), (2, 3)),  # a 2-D block
    Box((5, 0), (0, 6)),  # empty (an uneven shard's last rank)
    Box((0, 0), (3, 6), ((0, 1, 4), None)),  # a strided shard: rows 0, 1 and 4
    Box((0, 1), (5, 3), (None, (1, 2, 5))),  # strided columns
]
SPANS = [(0, 30), (0, 7), (7, 19), (17, 18), (25, 30), (12, 12)]


def _positions(box: Box, start: int, stop: int) -> list[int]:
    """By brute force: positions (box flat order) whose global flat index is in the span."""
    index = box.read(torch.arange(30).view(SHAPE)).reshape(-1)
    return [i for i, g in enumerate(index.tolist()) if start <= g < stop]


@pytest.mark.parametrize("box", BOXES)
@pytest.mark.parametrize(("start", "stop"), SPANS)
def testspan_in_a_box_is_the_brute_force_one(box: Box, start: int, stop: int) -> None:
    span = span_in(box, SHAPE, start, stop)
    got = list(range(box.numel))[span] if isinstance(span, slice) else span.nonzero().view(-1)
    assert list(got if isinstance(got, list) else got.tolist()) == _positions(box, start, stop)
    if box.shape[1:] == SHAPE[1:] and not box.strided:
        assert isinstance(span, slice)  # whole rows: a view, no copy


def testspan_in_a_scalar() -> None:
    assert span_in(Box((), ()), (), 0, 1) == slice(0, 1)


@pytest.mark.parametrize("op", [MERGE, REBASE, ADD])
@pytest.mark.parametrize("box", BOXES[:4] + BOXES[5:])
def test_a_move_on_each_box_equals_the_move_on_the_whole(op: str, box: Box) -> None:
    """Every box moved with the scattered values of the piece, on its own elements only,
    equals the whole tensor's piece moved: untouched outside the piece."""
    g = torch.Generator().manual_seed(7)
    local, snap, values = (torch.randn(SHAPE, generator=g) for _ in range(3))
    start, stop = 7, 19
    want_local, want_snap = local.clone(), snap.clone()
    move_piece(
        op,
        want_local.view(-1)[start:stop],
        want_snap.view(-1)[start:stop],
        values.view(-1)[start:stop],
        0.25,
    )
    mine = box.read(local).clone().reshape(-1)
    ours = box.read(snap).clone().reshape(-1)
    got = box.read(values).reshape(-1)
    span = span_in(box, SHAPE, start, stop)
    if isinstance(span, slice):
        move_piece(op, mine[span], ours[span], got[span], 0.25)
    else:
        a, b = mine[span], ours[span]
        move_piece(op, a, b, got[span], 0.25)
        mine[span], ours[span] = a, b
    assert torch.equal(mine.view(box.shape), box.read(want_local))
    assert torch.equal(ours.view(box.shape), box.read(want_snap))


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("box", BOXES)
def test_an_outer_step_on_each_box_equals_the_step_on_the_whole_piece(
    box: Box, nesterov: bool
) -> None:
    """All-reduce streaming in a sharded group: every holder steps its elements of the piece
    (the averaged values scattered from rank 0) and they equal, bit for bit, a plain member's
    ``OuterSGD`` over the piece's view (twice: the momentum carried); nothing outside it
    moves."""
    g = torch.Generator().manual_seed(11)
    snap, avg = torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)
    mom = torch.randn(SHAPE, generator=g)
    start, stop = 7, 19
    want_snap, want_mom = snap.clone(), mom.clone()
    view = torch.nn.Parameter(want_snap.view(-1)[start:stop], requires_grad=False)
    outer = OuterSGD([view], lr=0.7, momentum=0.9, nesterov=nesterov)
    outer.state[view]["momentum_buffer"] = want_mom.view(-1)[start:stop]
    mine, buf = box.read(snap).clone().reshape(-1), box.read(mom).clone().reshape(-1)
    got = box.read(avg).reshape(-1)
    span = span_in(box, SHAPE, start, stop)
    for _ in range(2):
        apply_outer_step(outer, [view], [avg.view(-1)[start:stop].clone()])
        step_span(mine, buf, got[span], span, 0.7, 0.9, nesterov)
    assert torch.equal(mine.view(box.shape), box.read(want_snap))
    assert torch.equal(buf.view(box.shape), box.read(want_mom))


@pytest.mark.parametrize("alpha", [0.0, 0.25])
@pytest.mark.parametrize("box", BOXES)
def test_a_mix_on_each_box_equals_the_merge_of_the_whole_piece(box: Box, alpha: float) -> None:
    """The merge from each holder's own new snapshot equals a plain member's merge of the
    piece (``alpha * local + (1 - alpha) * snapshot``), the snapshot unchanged."""
    g = torch.Generator().manual_seed(13)
    local, snap = torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)
    start, stop = 7, 19
    want = local.clone()
    move_piece(
        MERGE,
        want.view(-1)[start:stop],
        snap.clone().view(-1)[start:stop],
        snap.view(-1)[start:stop],
        alpha,
    )
    mine, ours = box.read(local).clone().reshape(-1), box.read(snap).clone().reshape(-1)
    mix_span(mine, ours, span_in(box, SHAPE, start, stop), alpha)
    assert torch.equal(mine.view(box.shape), box.read(want))
    assert torch.equal(ours.view(box.shape), box.read(snap))

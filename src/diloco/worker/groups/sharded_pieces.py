"""Streaming fragments in a sharded worker group: one fragment piece (elements ``[start,
stop)`` of a flattened parameter, ``core/fragments.py``) to and from the ranks' shards
(docs/design/groups.md, "Streaming fragments").

- **fill** (due step): the piece's pseudo-gradient is cut from its parameter's ``grad``
  gather (``worker/groups/sharded.py``): one parameter put together on rank 0 at a time, in
  the staging that ``produce`` uses, never the model;
- **move** (merge step): rank 0 stages the piece's values at their place in one parameter's
  fp32 staging buffer and scatters each rank its box (``piece`` command); every holder
  (replicas included) applies the move (``core/piece_moves.py``: merge with ``merge_alpha``,
  rebase, or the lost upload's pseudo-gradient given back) to those elements of its box that
  lie in the piece, element-wise on its own shard and snapshot.

A box is a block of the global tensor, the piece a range of its flat (row-major) indices, so a
box's elements in the piece are those whose global flat index is in ``[start, stop)``: a range
of the box's own flat order for a ``Shard(0)`` box (views, no copy), a mask otherwise. A plain
parameter is rank 0's alone, moved there and broadcast by the group's ``share``.
"""

from __future__ import annotations

from typing import Any

import torch

from diloco.core.fragments import Piece
from diloco.core.piece_moves import move_piece
from diloco.core.shards import Box
from diloco.worker.groups.shard_table import ShardPlan
from diloco.worker.groups.sharded import ShardState

_COMM = {torch.float32: "F32", torch.bfloat16: "BF16"}


class PieceShards:
    """Every rank's side of the ``piece`` command, and rank 0's fill and move of a piece."""

    def __init__(self, state: ShardState) -> None:
        self._st = state
        state.handlers["piece"] = self._piece

    # --- rank 0 -----------------------------------------------------------------------------

    def fill(self, piece: Piece, out: torch.Tensor) -> None:
        """Rank 0: the piece's ``snapshot - local`` (fp32 subtraction, then ``out``'s dtype)."""
        got = self._st.command({"cmd": "grad", "name": piece.param, "dtype": _COMM[out.dtype]})
        assert got is not None
        out.copy_(got.reshape(-1)[piece.start : piece.stop])

    def move(self, piece: Piece, op: str, values: torch.Tensor, alpha: float) -> None:
        """Rank 0: ``op`` with the piece's ``values`` on every holder's elements of it."""
        st = self._st
        plan = st.plans[piece.param]
        if plan.plain:  # rank 0's alone: the group's share sends the result
            local = st.local(piece.param).view(-1)[piece.start : piece.stop]
            snap = st.snapshot[piece.param].view(-1)[piece.start : piece.stop]
            move_piece(op, local, snap, values, alpha)
            return
        st.staged(plan).view(-1)[piece.start : piece.stop].copy_(values)
        st.command(
            {
                "cmd": "piece",
                "name": piece.param,
                "op": op,
                "start": piece.start,
                "stop": piece.stop,
                "alpha": alpha,
            }
        )

    # --- every rank -------------------------------------------------------------------------

    @torch.no_grad()
    def _piece(self, cmd: dict[str, Any]) -> None:
        st = self._st
        plan = st.plans[cmd["name"]]
        # Each rank's box of rank 0's staged parameter (only the piece is set there).
        whole = st.staged(plan) if st.rank == 0 else None
        st.scatter(plan, whole, lambda name, values, owns: self._move(plan, cmd, values))

    def _move(self, plan: ShardPlan, cmd: dict[str, Any], values: torch.Tensor) -> None:
        st = self._st
        held = plan.boxes[st.rank]
        assert held is not None
        box = held[0]
        local = st.local(plan.name).view(-1)  # a view: the moves write into the shard
        snap = st.snapshot[plan.name].view(-1)
        span = span_in(box, plan.shape, cmd["start"], cmd["stop"])
        if isinstance(span, slice):
            if span.start < span.stop:
                move_piece(cmd["op"], local[span], snap[span], values[span], cmd["alpha"])
        else:  # copies of the selected elements, written back
            on_local = span.to(local.device)
            mine, ours = local[on_local], snap[span]
            move_piece(cmd["op"], mine, ours, values[span.to(values.device)], cmd["alpha"])
            local[on_local] = mine
            snap[span] = ours
        if st.device.type == "cuda":
            torch.cuda.synchronize(st.device)


def span_in(box: Box, shape: tuple[int, ...], start: int, stop: int) -> slice | torch.Tensor:
    """The positions, in the box's flat order, of its elements whose global flat index is in
    ``[start, stop)``: a slice when the box is whole rows of the tensor (its global indices
    one range), else a boolean mask (strided boxes too: their indices in local order)."""
    if not shape:  # a scalar: one element
        return slice(min(start, 1), max(min(start, 1), min(stop, 1)))
    inner = 1
    for d in shape[1:]:
        inner *= d
    whole_rows = tuple(box.shape[1:]) == tuple(shape[1:]) and all(o == 0 for o in box.offset[1:])
    if whole_rows and not box.strided:
        first = box.offset[0] * inner
        lo = min(max(start - first, 0), box.numel)
        hi = min(max(stop - first, 0), box.numel)
        return slice(lo, max(lo, hi))
    index = torch.zeros((), dtype=torch.int64)
    stride = 1
    for dim in reversed(range(len(shape))):
        along = torch.tensor(list(box.indices(dim)), dtype=torch.int64)  # strided too
        index = index + (along * stride).view((-1,) + (1,) * (len(shape) - 1 - dim))
        stride *= shape[dim]
    flat = index.expand(box.shape).reshape(-1)
    return (flat >= start) & (flat < stop)

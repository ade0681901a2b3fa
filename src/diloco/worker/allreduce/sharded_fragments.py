"""Streaming fragments in all-reduce mode for a sharded worker group's rank 0 (docs/design/
groups.md, "Sharded groups in all-reduce mode"): ``FragmentRounds`` whose state lives on the
group's shards.

A fragment's pseudo-gradient is rank 0's, as in any streaming worker: one fragment's buffer
(about 1/P of the model), filled piece by piece from its parameters gathered from the owners
(``LocalModel.fill_piece``); so the quorum averages exactly the bytes a plain streaming member
sends, and both kinds meet in one quorum (the layout check says "whole model": this payload
never exchanges shard with shard). What moves the state goes to the shards as commands
(``groups/sharded_outer.py``, ``q_piece``): the outer step scatters each piece's average to its
holders, which step their own elements of the snapshot and momentum (element-wise, so the same
values as a plain member's); the merge mixes each holder's elements of the model with its own
new snapshot. The resync and the state hash are ``StreamedState``'s.

Only ``overlap_steps == 0``: the round and its merge run at the due step, while the group's
other ranks serve rank 0's commands. With ``tau > 0`` the round would run on rank 0's thread
while the other ranks train, and could not reach their shards (refused by ``worker/choose.py``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from diloco.core.fragments import Piece
from diloco.core.outer import OuterSGD
from diloco.wire.messages import Assignment
from diloco.worker.allreduce.fragment_rounds import FragmentRounds
from diloco.worker.allreduce.sharded_whole import StreamedState
from diloco.worker.allreduce.shared_state import SharedState
from diloco.worker.session import Session

SHARDED_OVERLAP = (
    "streaming fragments of a sharded (DTensor) worker group in all-reduce mode need "
    "overlap_steps=0: the round reaches the other ranks' shards, which train while a round "
    "overlaps; set overlap_steps=0 or run a parameter server"
)


class PieceSteps(Protocol):
    """Rank 0's way to a fragment piece's state on the shards
    (``groups/sharded_outer.OuterShards``)."""

    def step_piece(
        self, piece: Piece, values: torch.Tensor, lr: float, momentum: float, nesterov: bool
    ) -> None:
        """The outer step on ``piece`` with its averaged ``values``, on every holder."""

    def mix_piece(self, piece: Piece, alpha: float) -> None:
        """``local = alpha * local + (1 - alpha) * snapshot`` on every holder's elements."""


class ShardedFragmentRounds(FragmentRounds):
    """``FragmentRounds`` over a sharded group's shards (``overlap_steps`` 0)."""

    def __init__(self, session: Session, state: StreamedState, steps: PieceSteps) -> None:
        if session.settings.overlap_steps > 0:
            raise ValueError(SHARDED_OVERLAP)
        self._steps = steps
        self._rules = state.rules
        self._scratch = torch.empty(0)
        super().__init__(session, state)
        state.carry_fragments([p for pieces in self._plan for p in pieces])

    def _build_outers(self, state: SharedState) -> None:
        # Stand-ins: the optimizers' param groups for the checkpoint's layout; the momentum is
        # on the shards (``StreamedState.save`` writes it piece by piece).
        rules = self._rules
        for pieces in self._plan:
            views = [torch.nn.Parameter(torch.empty(0), requires_grad=False) for _ in pieces]
            self._views.append(views)
            self._outers.append(
                OuterSGD(views, lr=rules.lr, momentum=rules.momentum, nesterov=rules.nesterov)
            )

    def _fill_piece(self, piece: Piece, out: torch.Tensor) -> None:
        self._s.local.fill_piece(piece, out, self._scratch)

    def _merge(self, k: int, alpha: float) -> None:
        for piece in self._plan[k]:
            self._steps.mix_piece(piece, alpha)

    def step(self, q: Assignment) -> None:
        k = q.round % len(self._plan)
        rules, offset = self._rules, 0
        for piece in self._plan[k]:
            values = self._acc[offset : offset + piece.numel]
            self._steps.step_piece(piece, values, rules.lr, rules.momentum, rules.nesterov)
            offset += piece.numel

"""All-reduce mode for a sharded worker group's rank 0 (docs/design/groups.md, "Sharded groups
in all-reduce mode"): the run's state (snapshot, momentum) lives on the group's shards, each
rank holding its boxes, and the quorum loop (``QuorumSync``, unchanged) reaches it through
``streamed.Parts`` one parameter at a time.

``StreamedState`` is the ``SharedState`` whose hash, broadcast and checked average are the
streamed ones (``streamed.py``: the same collectives and bytes as a plain member's, so both
kinds meet in one quorum); ``ShardedWhole`` is ``WholeModel`` whose contribution stays on the
shards (the average is stored there as each rank's ``acc``) and whose step runs on every rank's
boxes. Only ``num_fragments == 1``.

Rank 0's checkpoint (``q.save``) is the plain member's layout, written one parameter at a
time as it is gathered from the shards (``persistence.lazy_tensors``).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from diloco.core.fragments import SEQUENTIAL, Piece
from diloco.core.outer import OuterSGD
from diloco.persistence.lazy_tensors import LazyTensors
from diloco.wire.messages import Assignment
from diloco.worker.allreduce.average_checks import Averaged
from diloco.worker.allreduce.collective import QuorumCollective
from diloco.worker.allreduce.shard_exchange import (
    WHOLE_MODEL,
    Positions,
    QuorumPosition,
    exchange_average,
    join_command,
    layout_free_hash,
    raise_any,
    same_layout,
)
from diloco.worker.allreduce.shared_state import RunRules, SharedState
from diloco.worker.allreduce.streamed import (
    Entry,
    Parts,
    broadcast,
    checked_average,
)
from diloco.worker.allreduce.whole_model import WholeModel
from diloco.worker.session import Session

log = logging.getLogger(__name__)


class StreamedState(SharedState):
    """The run's state on a sharded group's shards, seen from rank 0 through ``parts``."""

    def __init__(
        self, session: Session, rules: RunRules, parts: Parts, positions: Positions
    ) -> None:
        # Not SharedState's: nothing of the state is held here.
        self._s = session
        self.rules = rules
        self.parts = parts
        self.positions = positions
        #: The quorum in progress averages shard with shard (``shard_exchange``).
        self.by_position = False
        #: The whole model is averaged through the shards (not a fragment's buffer).
        self.streamed = True
        self.momentum_pieces: list[Piece] | None = None
        self.globals = []
        self.momentum = []
        parts.own()  # every rank's snapshot from its own shards (as ``own_snapshot``)
        table = session.local.table()
        snaps: list[Entry] = [("snap", n, shape) for n, shape in table.items()]
        moms: list[Entry] = [("mom", n, shape) for n, shape in table.items()]
        #: The state in a plain member's order (``tensors``): parameters, then momentum.
        self.entries = snaps + (moms if rules.momentum > 0 else [])
        self.grads: list[Entry] = [("grad", n, shape) for n, shape in table.items()]

    def tensors(self) -> list[torch.Tensor]:
        raise AssertionError("a sharded group's state is reached one parameter at a time")

    def hash(self) -> str:
        return layout_free_hash(self.positions, self.parts.load, self.entries)

    def carry_fragments(self, pieces: list[Piece]) -> None:
        """Streaming fragments (``sharded_fragments.py``): the payload's buffer is averaged as
        a plain member's, and the checkpoint's momentum is cut into ``pieces``."""
        self.momentum_pieces = pieces
        self.streamed = False

    def meet(self, quorum: QuorumCollective, worker_id: str, path: str) -> None:
        """Shard with shard when every member is a group of this layout: every rank joins its
        position (``part`` leaves, even if joining failed on some rank). A fragment's round
        averages rank 0's buffer, a plain member's bytes."""
        if self.momentum_pieces is not None:
            same_layout(quorum, WHOLE_MODEL)
        elif same_layout(quorum, self.positions.mark()):
            self.by_position = True
            cmd = join_command(quorum, worker_id, path)
            raise_any(quorum, self.positions.open(QuorumPosition(quorum), cmd), "join")

    def part(self) -> None:
        if self.by_position:
            self.by_position = False
            self.positions.close()

    def broadcast(self, quorum: QuorumCollective, src: int) -> None:
        if self.by_position:
            kinds = sorted({kind for kind, _, _ in self.entries})
            raise_any(quorum, self.positions.broadcast(src, kinds), "resync")
        else:
            broadcast(quorum, self.parts, self.entries, src)

    def streamed_average(
        self, quorum: QuorumCollective, weight: float, comm: torch.dtype, sample: int
    ) -> tuple[Averaged, list[torch.Tensor], int]:
        numel = sum(math.prod(shape) for _, _, shape in self.grads)
        if self.by_position:
            averaged, samples = exchange_average(
                quorum,
                self.positions,
                self.parts.measure(),
                weight,
                comm,
                norm_bound=self.rules.norm_bound,
                sample=sample,
            )
            return averaged, samples, numel
        averaged, samples = checked_average(
            quorum,
            self.parts,
            self.grads,
            weight,
            comm,
            norm_bound=self.rules.norm_bound,
            sample=sample,
        )
        return averaged, samples, numel

    def save(
        self,
        quorum_id: str,
        state: dict[str, Any],
        layout: dict[str, Any],
        *,
        params: LazyTensors | None = None,
        momentum: LazyTensors | None = None,
    ) -> None:
        """``SharedState.save`` with the snapshot and the momentum gathered from the shards one
        parameter at a time as the files are written (``state``: the optimizer's param
        groups, no tensors)."""
        table = self._s.local.table()
        names = list(table)
        fp32 = torch.float32
        params = LazyTensors(
            {n: (fp32, shape) for n, shape in table.items()}, lambda n: self.parts.load("snap", n)
        )
        if self.rules.momentum > 0 and self.momentum_pieces is not None:
            pieces = self.momentum_pieces
            momentum = LazyTensors(
                {f"{i}/momentum_buffer": (fp32, p.shape) for i, p in enumerate(pieces)},
                lambda key: self._piece_of("mom", pieces[int(key.split("/")[0])]),
            )
        elif self.rules.momentum > 0:
            momentum = LazyTensors(
                {f"{i}/momentum_buffer": (fp32, table[n]) for i, n in enumerate(names)},
                lambda key: self.parts.load("mom", names[int(key.split("/")[0])]),
            )
        super().save(quorum_id, state, layout, params=params, momentum=momentum)

    def _piece_of(self, kind: str, piece: Piece) -> torch.Tensor:
        whole = self.parts.load(kind, piece.param).reshape(-1)
        return whole[piece.start : piece.stop].view(piece.shape)


class ShardedWhole(WholeModel):
    """``WholeModel`` on a sharded group: the pseudo-gradient is read from the shards during
    the average, which leaves its result on them (``acc``), and the outer step runs there."""

    def __init__(self, session: Session, state: StreamedState) -> None:
        self._s = session
        self._state = state
        self._parts = state.parts
        self._grads = len(state.grads)

    def contribution(self, q: Assignment, weighted: bool) -> tuple[list[torch.Tensor], float]:
        return [], self._weight() if weighted else 0.0

    def step(self, q: Assignment) -> None:
        rules = self._state.rules
        self._parts.step(rules.lr, rules.momentum, rules.nesterov)
        self._s.local.adopt_all()

    def checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``WholeModel``'s: an outer optimizer's param groups over the parameters (its tensors,
        the momentum, are written from the shards by ``StreamedState.save``)."""
        rules, n = self._state.rules, self._grads
        stand_ins = [torch.nn.Parameter(torch.empty(0), requires_grad=False) for _ in range(n)]
        outer = OuterSGD(stand_ins, lr=rules.lr, momentum=rules.momentum, nesterov=rules.nesterov)
        state = outer.state_dict()
        return state, {
            "fragments": [1, SEQUENTIAL],
            "unit_rounds": [self._s.base_round],
            "optimizer_units": [[n, len(state["param_groups"])]],
        }

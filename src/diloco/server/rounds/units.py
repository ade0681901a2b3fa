"""The parts of the model the server synchronises independently.

Plain DiLoCo has one unit, the whole model, whose pieces are the parameters themselves. Streaming
DiLoCo has one unit per fragment, whose pieces are flat element ranges of parameters
(``core.fragments``). Each unit has its own aggregator (server/rounds/aggregator.py: its round or
version), running sum and outer optimizer, so fragments advance independently. Its parameters are views
into the store's payload, so an outer step on a fragment changes exactly the bytes that fragment's
downloads stream.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from diloco.core import WeightedSum
from diloco.core.fragments import Piece, plan
from diloco.server.params.store import F32_BYTES, ParamStore
from diloco.server.rounds.aggregator import Aggregator
from diloco.wire import TensorSpec, build_layout

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def plan_pieces(store: ParamStore, num_fragments: int, pattern: str) -> list[list[Piece]]:
    """Pieces of each unit of ``store``'s parameters (``core.fragments.plan``, the planner the
    workers use too)."""
    return plan(store.table, num_fragments, pattern)


class Unit:
    """One independently synchronised part of the model and its server-side state."""

    #: How its submissions become updates: set once, right after construction, by whoever
    #: plans the units (server/rounds/synced_model.py), since the aggregator itself needs the unit.
    aggregator: Aggregator

    def __init__(
        self,
        index: int,
        pieces: list[Piece],
        store: ParamStore,
        factory: OptimizerFactory,
        *,
        round: int,
    ) -> None:
        self.index = index
        self.pieces = pieces
        self.table: dict[str, tuple[int, ...]] = {p.wire_name: p.shape for p in pieces}
        self.names = [p.wire_name for p in pieces]
        self._store = store
        self.params = [torch.nn.Parameter(self._view(p), requires_grad=False) for p in pieces]
        self.optimizer = factory(self.params)
        self.sum = WeightedSum([p.shape for p in pieces])
        #: The round whose result the store's bytes hold (moves when a result is published;
        #: the barrier's round moves after, and downloads wait on this one).
        self.published_round = round
        self.nbytes = sum(p.numel for p in pieces) * F32_BYTES
        self.ranges = [self._byte_range(p) for p in pieces]

    def _view(self, piece: Piece) -> torch.Tensor:
        param = self._store.params[piece.index].data
        if piece.start == 0 and piece.stop == param.numel() and piece.shape == tuple(param.shape):
            return param
        return param.view(-1)[piece.start : piece.stop]

    def _byte_range(self, piece: Piece) -> tuple[int, int]:
        begin, _ = self._store.layout.offsets[piece.index]
        return begin + piece.start * F32_BYTES, begin + piece.stop * F32_BYTES

    def repoint(self) -> None:
        """The store moved its parameters to a fresh buffer (copy-on-write): follow them."""
        for p, piece in zip(self.params, self.pieces, strict=True):
            p.data = self._view(piece)

    @property
    def round(self) -> int:
        """The round (sync) or version (async) submissions must name."""
        return self.aggregator.round

    def header(self, instance: str) -> bytes:
        """Header of this unit's download at its published round."""
        specs = [TensorSpec(p.wire_name, "F32", p.shape) for p in self.pieces]
        meta = {
            "round": str(self.published_round),
            "fragment": str(self.index),
            "instance": instance,
            "kind": "global_params",
        }
        return build_layout(specs, meta).header

"""Rank 0's ``LocalModel`` in a sharded worker group (docs/design/groups.md, "Sharded groups").

The sync path (``PlainSync``, the encoder, the client, ``LocalModel.refresh``) runs on rank 0
unchanged; what it asks of the model goes to every rank as a command (``worker/groups/
sharded.py``): a parameter's pseudo-gradient is gathered from its shards as the upload reaches
it, a download lands one parameter at a time in a staging buffer and is scattered to the ranks'
snapshots as soon as its last byte is in, and the moves between local and global (``adopt_``,
``rebase_``, ``to_progress_``) run on every rank's shards. Rank 0 never holds more of the model
than one parameter at a time.

Adoption after a download is one pass on every rank (not streamed as the bytes land), and a
compressed downlink's updates are not taken: a sharded group always downloads full parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from diloco.core.fragments import Piece
from diloco.wire import Layout, TensorSpec, WireError, byte_view, check_against
from diloco.worker.groups.sharded import MOVES, ShardState
from diloco.worker.groups.sharded_outer import OuterShards
from diloco.worker.groups.sharded_pieces import PieceShards
from diloco.worker.state.local_model import LocalModel
from diloco.worker.state.update_buffer import is_update

_NAMES = {fn: name for name, fn in MOVES.items()}
_GAP_BYTES = 1 << 16


class ShardedModel(LocalModel):
    """A ``LocalModel`` whose snapshot and moves live on every rank's shards."""

    takes_updates = False

    state: ShardState
    #: All-reduce mode's way to the state on the shards (``allreduce.streamed.Parts``).
    outer: OuterShards
    #: Streaming fragments' way to the shards (``sharded_pieces.py``).
    pieces: PieceShards

    @classmethod
    def of(
        cls, local: LocalModel, state: ShardState, outer: OuterShards, pieces: PieceShards
    ) -> ShardedModel:
        """Rank 0's ``local`` (already built from the model) as a sharded group's model."""
        model = cls.__new__(cls)
        model.__dict__.update(local.__dict__)
        model.state = state
        model.outer = outer
        model.pieces = pieces
        return model

    # --- pseudo-gradients -------------------------------------------------------------------

    def produce(self, spec: TensorSpec) -> Iterator[torch.Tensor]:
        """``snapshot - local`` of one parameter, gathered from its owners when the upload
        reaches it (a retry asks again: the shards do not change during a sync)."""
        got = self.state.command({"cmd": "grad", "name": spec.name, "dtype": spec.dtype})
        assert got is not None
        yield got

    def detached(self) -> Mapping[str, torch.Tensor]:
        """The parameters as they are, each gathered when it is read."""
        return _Gathered(self.state)

    def slices(self, piece: Piece) -> tuple[torch.Tensor, torch.Tensor]:
        raise AssertionError(
            "a sharded group's pieces are on its shards: fill_piece and move_piece reach them"
        )

    def fill_piece(self, piece: Piece, out: torch.Tensor, scratch: torch.Tensor) -> None:
        """The piece's pseudo-gradient, cut from its parameter gathered from the owners."""
        self.pieces.fill(piece, out)

    def move_piece(self, piece: Piece, op: str, values: torch.Tensor, alpha: float) -> None:
        """The piece's values scattered from rank 0; every holder moves its own elements."""
        self.pieces.move(piece, op, values, alpha)

    def own_snapshot(self) -> None:
        raise AssertionError(
            "a sharded group's snapshot is on its shards: all-reduce mode makes it through "
            "OuterShards (allreduce/sharded_whole.py's StreamedState)"
        )

    # --- receiving --------------------------------------------------------------------------

    def receiver(self, adopt: bool) -> Any:
        self.adopted = False  # adoption is one pass on every rank once the download is in
        return _ShardReceiver(self)

    def apply_update(self) -> bool:
        raise AssertionError("a sharded worker group never asks for an update body")

    # --- moves between local and global -----------------------------------------------------

    def each_param(self, fn: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        self.state.command({"cmd": "each", "fn": _NAMES[fn]})

    def settle_copies(self) -> None:
        pass  # every rank waits for its own copies at the end of each command


class _Gathered(Mapping[str, torch.Tensor]):
    """The model's parameters, each gathered whole on rank 0 when read (a staging buffer,
    valid until the next read)."""

    def __init__(self, state: ShardState) -> None:
        self._state = state

    def __getitem__(self, name: str) -> torch.Tensor:
        got = self._state.command({"cmd": "full", "name": name})
        assert got is not None
        return got

    def __iter__(self) -> Iterator[str]:
        return iter(self._state.plans)

    def __len__(self) -> int:
        return len(self._state.plans)


class _ShardReceiver:
    """One full download into the ranks' snapshots: the client's ``into``, ``on_progress``
    and ``landed`` (the ``SnapshotReceiver`` interface)."""

    def __init__(self, model: ShardedModel) -> None:
        self._model = model
        self._window: _Window | None = None
        self.update = False

    def into(self, layout: Layout) -> Any:
        if is_update(layout):
            raise WireError("bad_update", "a sharded worker group takes full parameters only")
        check_against(layout, self._model.table(), ("F32",))
        self._model.snapshot_dirty = True
        self._window = _Window(layout, self._model.state)  # a retry starts from its first byte
        return self._window

    def progress(self, received: int) -> None:
        pass

    def landed(self) -> None:
        assert self._window is not None
        self._window.finish()
        self._model.adopted = False
        self._model.snapshot_dirty = False


class _Window:
    """A download's payload as the client writes it (``len`` and slices that return the memory
    to read into), backed by one parameter's staging buffer: a slice is cut at the end of the
    parameter it starts in, and a parameter is scattered to the ranks once the client asks for
    memory past its last byte (the client's reads come in order and may be short)."""

    def __init__(self, layout: Layout, state: ShardState) -> None:
        self._state = state
        self._specs = layout.specs
        self._offsets = layout.offsets
        self._size = layout.payload_size
        self._next = 0  # the first parameter not yet scattered
        self._gap: memoryview | None = None

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index: slice) -> memoryview:
        start, stop = index.start or 0, min(index.stop or self._size, self._size)
        self._scatter_before(start)
        if self._next < len(self._specs):
            begin, end = self._offsets[self._next]
            if begin <= start:
                plan = self._state.plans[self._specs[self._next].name]
                view = byte_view(self._state.staged(plan))
                return view[start - begin : min(stop, end) - begin]
            stop = min(stop, begin)
        if self._gap is None:  # bytes between tensors (none in this project's bodies)
            self._gap = byte_view(torch.empty(_GAP_BYTES, dtype=torch.uint8))
        return self._gap[: min(stop - start, _GAP_BYTES)]

    def finish(self) -> None:
        """The last byte is in: scatter what is left."""
        self._scatter_before(self._size)

    def _scatter_before(self, pos: int) -> None:
        while self._next < len(self._specs) and self._offsets[self._next][1] <= pos:
            self._state.command({"cmd": "put", "name": self._specs[self._next].name})
            self._next += 1

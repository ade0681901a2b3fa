"""The worker's model and its fp32 snapshot of the global parameters (docs/design/
durability.md, "Worker state and rebasing").

The snapshot is laid out exactly like a full download's body, so new parameters are received
straight into it. Between syncs the model holds parameters; while a refresh is under way it may
hold progress (``local - snapshot``) or counted progress (values a round will replace whole).
The flags below say which, and every move between the states is a method here, so a sync
strategy never handles the flags itself.

Nothing here talks to the server: a refresh is given the download to run (``fetch``), which
receives into ``receiver(adopt)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch

from diloco.core import adopt_, pseudo_gradient_pieces, rebase_, to_progress_
from diloco.core.fragments import Piece
from diloco.core.names import wire_names
from diloco.core.piece_moves import move_piece
from diloco.core.pseudo_gradient import PIECE
from diloco.wire import (
    Layout,
    TensorSpec,
    WireError,
    build_layout,
    byte_view,
    check_against,
    tensor_views,
)
from diloco.wire.messages import Table
from diloco.worker.state.adoption import StreamedAdoption
from diloco.worker.state.update_buffer import UpdateBuffer, is_update
from diloco.worker.transport.client import SYNC_FAILURES

Fetch = Callable[[bool], bool]
"""``fetch(adopt)``: download global parameters into ``receiver(adopt)``; False if the wait gave
up with the snapshot intact; a network error may leave it half-written (``snapshot_dirty``)."""


class LocalModel:
    """A model's parameters, its snapshot of the global parameters and the state between them."""

    #: Whether a compressed downlink's update bodies may be asked for (a sharded worker group's
    #: rank 0, ``worker/groups/sharded_model.py``, takes full parameters only).
    takes_updates = True

    def __init__(self, model: torch.nn.Module, comm_dtype: str, metrics: dict[str, float]) -> None:
        # Keyed by wire name (wrapper prefixes out): the server, the snapshot and every upload
        # know these names; the values are the model's own parameters.
        self.params: dict[str, torch.nn.Parameter] = wire_names(model.named_parameters())
        if not self.params:
            raise ValueError("the model has no parameters to synchronise")
        self.comm_dtype = comm_dtype  # "BF16" or "F32": the dtype pseudo-gradients travel in
        self.device = next(iter(self.params.values())).device
        self._metrics = metrics  # the worker's: "rebases" is counted here
        self._payload: torch.Tensor | None = None
        self.snapshot: dict[str, torch.Tensor] = {}
        self._layout: Layout | None = None
        # The model's values are not parameters until a refresh ends: they are its progress
        # (local - snapshot), or, when that progress was counted by the server (its upload was
        # accepted), values that will be replaced whole and must never be added back.
        self.holds_progress = False
        self.progress_counted = False
        self._as_progress = False  # the model holds local - snapshot (to_progress_ was applied)
        self.snapshot_dirty = False  # a download broke off inside the snapshot's payload
        self.adopted = False  # the last download was adopted into the model as it landed
        self._scratch32: torch.Tensor | None = None
        self._scratch_comm: torch.Tensor | None = None
        #: Told about streamed adoptions (a worker group's rank 0 passes each parameter on to
        #: the other ranks as soon as it is adopted): ``body()`` when a download body starts
        #: (a retry starts again from its first byte), ``adopted(names)`` with the parameters
        #: adopted in full so far.
        self.listener: AdoptionListener | None = None
        self._updates = UpdateBuffer()  # where a compressed downlink's update bodies land

    # --- shapes -------------------------------------------------------------------------------

    def table(self) -> dict[str, tuple[int, ...]]:
        """Each parameter's name and shape, in the model's order."""
        return {n: tuple(p.shape) for n, p in self.params.items()}

    def check_server_table(self, entries: Table | list[Any]) -> None:
        """Raise ValueError unless the server's table (``[[name, shape], ...]``) is this
        model's."""
        server = {str(n): tuple(int(d) for d in shape) for n, shape in entries}
        own = self.table()
        if server != own:
            missing = sorted(set(own) - set(server))[:3]
            extra = sorted(set(server) - set(own))[:3]
            shapes = [n for n in own if n in server and own[n] != server[n]][:3]
            raise ValueError(
                "the model does not match the server's parameters: "
                f"not on server {missing}, not in model {extra}, different shapes {shapes}"
            )

    def detached(self) -> Mapping[str, torch.Tensor]:
        """The parameters as they are (the initial upload of a run that has none yet)."""
        return {n: p.detach() for n, p in self.params.items()}

    # --- pseudo-gradients ---------------------------------------------------------------------

    def specs(self) -> list[TensorSpec]:
        """The tensors of a whole-model upload."""
        return [TensorSpec(n, self.comm_dtype, tuple(p.shape)) for n, p in self.params.items()]

    def produce(self, spec: TensorSpec) -> Iterator[torch.Tensor]:
        """``snapshot - local`` of one parameter in pieces, as an upload streams it."""
        if self._scratch32 is None:  # small buffers reused for every tensor and every sync
            self._scratch32 = torch.empty(PIECE, dtype=torch.float32)
            self._scratch_comm = torch.empty(PIECE, dtype=torch.bfloat16)
        comm = self._scratch_comm if spec.dtype == "BF16" else None
        return pseudo_gradient_pieces(
            self.snapshot[spec.name], self.params[spec.name].data, self._scratch32, comm
        )

    def slices(self, piece: Piece) -> tuple[torch.Tensor, torch.Tensor]:
        """The piece's elements in the model and in the snapshot (views, no copies)."""
        local = self.params[piece.param].data.view(-1)[piece.start : piece.stop]
        snapshot = self.snapshot[piece.param].view(-1)[piece.start : piece.stop]
        return local, snapshot

    def fill_piece(self, piece: Piece, out: torch.Tensor, scratch: torch.Tensor) -> None:
        """The piece's pseudo-gradient ``snapshot - local`` into ``out`` (rounded after the
        fp32 subtraction; ``scratch``: fp32, reused)."""
        local, snapshot = self.slices(piece)
        offset = 0
        for chunk in pseudo_gradient_pieces(snapshot, local, scratch, None):
            out[offset : offset + chunk.numel()].copy_(chunk)
            offset += chunk.numel()

    def move_piece(self, piece: Piece, op: str, values: torch.Tensor, alpha: float) -> None:
        """``core.piece_moves.move_piece`` on the piece's elements (a sharded group's model:
        on every rank's shard of them)."""
        local, snapshot = self.slices(piece)
        move_piece(op, local, snapshot, values, alpha)

    # --- receiving ----------------------------------------------------------------------------

    def receiver(self, adopt: bool) -> SnapshotReceiver:
        """Where one full download lands. With ``adopt``, the model takes each parameter's new
        values as its bytes land (``adopted`` says, once it ends, whether all of them did)."""
        self.adopted = False
        return SnapshotReceiver(self, adopt)

    def _into_snapshot(self, layout: Layout) -> memoryview:
        """Check a download's layout against the model, then hand out the snapshot's memory."""
        check_against(layout, self.table(), ("F32",))
        if self._layout is None or (self._layout.offsets, self._layout.specs) != (
            layout.offsets,
            layout.specs,
        ):
            payload = torch.empty(layout.payload_size, dtype=torch.uint8)
            if self.device.type == "cuda":
                payload = payload.pin_memory()  # lets the copies to the GPU run asynchronously
            self._payload = payload
            self.snapshot = tensor_views(layout, payload)
            self._layout = layout
        self.snapshot_dirty = True
        assert self._payload is not None
        return byte_view(self._payload)

    def _into_update(self, layout: Layout) -> memoryview:
        """Check an update body's layout against the model, then hand out its own buffer
        (the snapshot is not touched until the whole body is in)."""
        if self._payload is None:
            raise WireError("bad_update", "an update body arrived before any full parameters")
        return self._updates.into(layout, self.table())

    def apply_update(self) -> bool:
        """Add the landed update to the snapshot and check the round's checksum. False on a
        mismatch: the snapshot is then dirty, and only a full download may follow. A malformed
        sparse update is a ``WireError`` (``bad_update``) before anything changes."""
        assert self._payload is not None
        self._updates.check(self.table())
        self.snapshot_dirty = True
        if not self._updates.apply(self.snapshot, self._payload):
            return False
        self.snapshot_dirty = False
        return True

    def own_snapshot(self) -> None:
        """Make the snapshot from the model's own parameters (fp32, laid out as a full download
        would be): the all-reduce mode's start, where no server holds parameters."""
        specs = [TensorSpec(n, "F32", tuple(p.shape)) for n, p in self.params.items()]
        self._into_snapshot(build_layout(specs))
        with torch.no_grad():
            for name, p in self.params.items():
                self.snapshot[name].copy_(p.detach())
        self.snapshot_dirty = False

    # --- moves between local and global -------------------------------------------------------

    def adopt_all(self) -> None:
        """The model takes the snapshot's values (the first download of a join)."""
        self.each_param(adopt_)

    def refresh(self, fetch: Fetch, *, counted: bool) -> bool:
        """Fetch global parameters into the snapshot. If ``counted``, the local progress is in
        them and is dropped; otherwise it is kept on top of them (a rebase).

        False (or a network error) with the snapshot intact leaves the model with its local
        values, counted progress included: the round that holds it never arrived, and the server
        may have lost it with a crash. The caller hands that upload in again."""
        if self.holds_progress and self.progress_counted:
            counted = True  # a download broke off inside the model: only adoption is left
        if not counted and not self._as_progress:
            self.each_param(to_progress_)
            self._as_progress = True
        # Counted: the model is overwritten by the adoption, so it need not become progress
        # first (a pass over the model fewer per round). The server sends no byte of a round
        # before it is durable (with --save-every 1), so a download that breaks off inside the
        # model leaves progress the server holds.
        self.holds_progress = True
        self.progress_counted = counted
        self.adopted = False
        try:
            if not fetch(counted):
                self.back_to_local()  # gave up waiting; the old snapshot is intact
                return False
        except SYNC_FAILURES:
            if not self.snapshot_dirty:
                self.back_to_local()
            raise
        if counted and self.adopted:
            self.settle_copies()  # adopted as the bytes landed
        else:
            self.each_param(adopt_ if counted else rebase_)
        self.holds_progress = self._as_progress = False
        if not counted:
            self._metrics["rebases"] += 1
        return True

    def back_to_local(self) -> None:
        """The snapshot is intact: the model takes back its local values, progress on top of
        the snapshot, counted or not (only a round that holds it may replace counted progress)."""
        if self._as_progress:
            self.each_param(rebase_)
            self._as_progress = False
        self.holds_progress = False

    def each_param(self, fn: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """``fn(parameter, its snapshot)`` for every parameter (``adopt_``, ``rebase_``,
        ``to_progress_``), then wait for the copies to the GPU."""
        with torch.no_grad():
            for name, p in self.params.items():
                fn(p.data, self.snapshot[name])
        self.settle_copies()

    def settle_copies(self) -> None:
        """Wait for the asynchronous copies to the GPU (a pinned snapshot's)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class AdoptionListener(Protocol):
    def body(self) -> None: ...

    def adopted(self, names: list[str]) -> None: ...


class SnapshotReceiver:
    """One full download into a ``LocalModel``'s snapshot: the client's ``into`` and
    ``on_progress`` callbacks, and ``landed()`` once the last byte is in."""

    def __init__(self, model: LocalModel, adopt: bool) -> None:
        self._model = model
        self._adopt = adopt
        self._adoption: StreamedAdoption | None = None
        #: The body that landed last was a compressed downlink's update (``apply_update``
        #: takes it into the snapshot), not full parameters.
        self.update = False

    def into(self, layout: Layout) -> memoryview:
        self.update = is_update(layout)
        if self.update:
            self._adoption = None
            return self._model._into_update(layout)
        view = self._model._into_snapshot(layout)
        if self._adopt:  # every body (a retry too) starts a fresh adoption from its first byte
            params = {name: p.data for name, p in self._model.params.items()}
            self._adoption = StreamedAdoption(layout, self._model.snapshot, params)
            if self._model.listener is not None:
                self._model.listener.body()
        return view

    def progress(self, received: int) -> None:
        if self._adoption is not None:
            self._adoption.upto(received)
            if self._model.listener is not None:
                self._model.listener.adopted(self._adoption.done)

    def landed(self) -> None:
        """The last byte of a full download is in."""
        self._model.adopted = self._adoption is not None and self._adoption.complete
        self._model.snapshot_dirty = False

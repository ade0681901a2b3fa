"""A lossy download codec, server side: each round published as a compressed update that every
replica applies bit for bit (``diloco server --download-codec int8``; docs/design/codecs.md,
"Downlink").

The server keeps two copies of the parameters (the maths: ``core/codecs/downlink.py``):

- *true*: what the outer optimizer and its finite guard step, exactly as without compression
  (``ParamStore.keep_true`` moves the optimizer's parameters there);
- *published*: the ``ParamStore`` payload, which full downloads stream and every worker holds.

After each round's outer step, still in the step's thread and under the tensor lock,
``encode`` writes ``encode_update(codec, true, published)`` for every parameter in payload order:
the update's parts go into one payload buffer and exactly what they decode to is added to the
published payload. The result is kept as a ready-to-stream safetensors body (``UpdateBody``):

- tensors: for each parameter its parts ``codec.parts(shape)``, named ``name + part.suffix``
  (``fc.weight``, ``fc.weight@scale``), laid out by ``wire.build_layout`` (wider dtypes first:
  every scale, then every code; so each tensor is aligned and a receiver can view it in place,
  and one that applies as bytes land holds the scales, 1/32 byte per element, and applies each
  parameter's codes as they arrive);
- ``__metadata__``: ``kind: "update"``, ``round`` (the new round), ``base_round`` (the round a
  replica must hold, ``round - 1``), ``instance``, ``checksum`` (``wire.checksum`` of the new
  published payload, the bytes of every parameter in payload order) and ``codec_metadata(codec)``
  (``codec``, ``codec_block``).

Only the latest round's update is kept. A worker asks for it with ``GET /global_params?
min_round=R+1&have_round=R`` (``open_update``); anything else gets full parameters.

Memory: the true copy (one more model) and the update body (about a quarter of the model for
int8, half for bf16); ``encode_update`` works a chunk at a time, so no other full-size buffer.
The body's buffer is reused next round unless a download still streams it (then a fresh one
is made and the old one goes when that download ends).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from diloco.core.codecs import BlockCodec, Workspace, check_name, codec_metadata
from diloco.core.codecs.downlink import encode_update
from diloco.server.params.publication import PayloadBuffer
from diloco.server.params.store import ParamStore, Snapshot
from diloco.wire import CODE_OF_DTYPE, TensorSpec, build_layout, byte_view, tensor_views
from diloco.wire.checksum import checksum_behind

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UpdateBody:
    """One round's update, ready to stream: ``header`` then ``buffer``'s payload."""

    round: int
    base_round: int
    header: bytes
    buffer: PayloadBuffer


async def open_kept(
    store: ParamStore, kept: Callable[[], UpdateBody | None], have_round: int
) -> Snapshot | None:
    """The kept update (``kept()``, read after the store settled) pinned for a replica holding
    ``have_round``, when it takes that replica to the published round; None otherwise. Both
    downlinks (quantized, sparse) serve their kept body through it."""
    await store.settled()
    body = kept()  # no await from here to the pin: one round's body
    if body is None or body.base_round != have_round or body.round != store.round:
        return None
    body.buffer.readers += 1
    return Snapshot(body.round, body.header, byte_view(body.buffer.payload), body.buffer)


class Downlink:
    """The true copy's partner: encodes each round's update and serves it."""

    def __init__(
        self,
        codec: BlockCodec,
        store: ParamStore,
        true: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """``true``: a checkpoint's true copy (None: equal to the published parameters, as at
        the start of a run or from a checkpoint written without one)."""
        for spec in store.specs:
            check_name(spec.name)  # ``name@scale`` must never be another parameter's name
        self.codec = codec
        self.store = store
        if true is not None or not store.has_true:
            store.keep_true(true)
        # Replicas compare the checksum; it is computed with every update, so a full download
        # waits for it only before the first round (initial or restored parameters).
        store.checksum_required = True
        self._specs = [
            TensorSpec(spec.name + part.suffix, CODE_OF_DTYPE[part.dtype], part.shape)
            for spec in store.specs
            for part in codec.parts(spec.shape)
        ]
        self._layout = build_layout(self._specs)  # offsets; the header changes every round
        #: The latest round's update; None before the first round after a start.
        self.current: UpdateBody | None = None
        self._work = Workspace()  # ``encode`` runs under the tensor lock: one call at a time

    @property
    def nbytes(self) -> int:
        """Payload bytes of one update."""
        return self._layout.payload_size

    def encode(self, new_round: int) -> None:
        """Blocking, in the outer step's thread once the step has written the true copy (the
        caller holds the tensor lock and ``ParamStore.update`` has cleared the store's idle
        flag, so no download can pin the kept body meanwhile): publish ``new_round`` as an
        update of the published payload, which it changes in place, and keep its body."""
        store, codec = self.store, self.codec
        old, self.current = self.current, None
        # No download pins a body while a step runs (``open_update`` waits for ``settled``), so
        # a count read as 0 here stays 0; one read as above 0 may only fall.
        if old is not None and old.buffer.readers == 0:
            buffer = old.buffer
        else:
            buffer = PayloadBuffer(torch.empty(self._layout.payload_size, dtype=torch.uint8))
        views = tensor_views(self._layout, buffer.payload)
        true, published = store.named(), store.published()
        base = store.payload.data_ptr()

        def encoded() -> Iterator[int]:  # payload order: the checksum follows behind
            for spec in sorted(store.specs, key=lambda s: published[s.name].data_ptr()):
                parts = [views[spec.name + p.suffix].view(-1) for p in codec.parts(spec.shape)]
                t = published[spec.name]
                encode_update(codec, true[spec.name], t, parts, self._work)
                yield t.data_ptr() - base + t.numel() * t.element_size()

        value = checksum_behind(byte_view(store.payload), encoded())
        store.note_checksum(value)
        meta = {
            "kind": "update",
            "round": str(new_round),
            "base_round": str(new_round - 1),
            "instance": store.instance,
            "checksum": value,
            **codec_metadata(codec),
        }
        header = build_layout(self._specs, meta).header
        self.current = UpdateBody(new_round, new_round - 1, header, buffer)

    async def open_update(self, have_round: int) -> Snapshot | None:
        """Pin the kept update when it takes a replica holding round ``have_round`` to the
        published round; None otherwise (the caller then serves full parameters)."""
        return await open_kept(self.store, lambda: self.current, have_round)

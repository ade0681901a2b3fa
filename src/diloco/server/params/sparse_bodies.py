"""The sparse downlink, server side (``diloco server --download-codec sparse``; docs/design/
codecs.md, "The sparse update"; the maths ``core/codecs/sparse_update.py``, the worker's side
``worker/state/update_buffer.py``).

Under plain averaged descent over sparse uploads a round changes the parameters only where the
round's sum has a bit set. After each round's outer step, still in the step's thread and under
the tensor lock, ``encode`` builds the round's update from the unit's sum and the parameters the
step wrote: per parameter its ``sparse_update.parts`` (counts per span, positions, new values),
named ``name + suffix`` and laid out by ``wire.build_layout`` (wider dtypes first), with
``__metadata__`` ``kind: "update"``, ``codec: "sparse"``, ``codec_index_bits``, ``round``, ``base_round`` (``round -
1``), ``instance`` and ``checksum`` (``wire.checksum`` of the new payload, which full downloads
then carry too). No true copy: the published parameters are the step's, and the update carries
them exactly.

A worker asks with ``GET /global_params?min_round=R+1&have_round=R`` (``open_update``, the same
as the compressed downlink's ``Downlink``); anything else (a joiner, a re-joiner, a worker more
than one round behind) gets full parameters. When the update would not be smaller than the full
payload (dense uploads, many workers with disjoint supports) none is kept and every worker
downloads full parameters that round.

Memory: only the latest round's update is kept, as for the compressed downlink (a download
still streaming the previous one keeps that buffer alive until it ends): 5.5 bytes per changed
element and 2 per 4096 elements, and never more than the full payload. Building it holds, per
parameter, its positions (int64) and values besides the body, a few times the body at most.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from diloco.core.codecs import check_name
from diloco.core.codecs.sparse_update import encode_changes, metadata, parts
from diloco.server.params.publication import PayloadBuffer
from diloco.server.params.store import ParamStore, Snapshot
from diloco.server.params.update_bodies import UpdateBody, open_kept
from diloco.wire import CODE_OF_DTYPE, TensorSpec, build_layout, byte_view, tensor_views
from diloco.wire.checksum import checksum

log = logging.getLogger(__name__)


class SparseDownlink:
    """Builds each round's sparse update and serves it."""

    def __init__(self, store: ParamStore) -> None:
        for spec in store.specs:
            check_name(spec.name)  # ``name@idx`` must never be another parameter's name
        self.store = store
        # Replicas compare the checksum; it is computed with every update, so a full download
        # waits for it only before the first round (initial or restored parameters).
        store.checksum_required = True
        #: The latest round's update; None before the first round after a start, or when the
        #: round's update would not have been smaller than full parameters.
        self.current: UpdateBody | None = None
        #: Payload bytes of the latest round's update (0 when none was kept), for measurements.
        self.last_nbytes = 0

    def encode(self, new_round: int, names: Sequence[str], sums: Sequence[torch.Tensor]) -> None:
        """Blocking, in the outer step's thread once the step has written the parameters (the
        caller holds the tensor lock; ``names`` and ``sums``: the whole model's unit, the sum
        the step used): publish ``new_round`` as a sparse update of round ``new_round - 1``."""
        store = self.store
        self.current = None  # a download pinning the old body keeps its buffer alive
        published = store.published()
        encoded = {
            name: encode_changes(s, published[name]) for name, s in zip(names, sums, strict=True)
        }
        value = checksum([byte_view(store.payload)])
        store.note_checksum(value)
        specs = [
            TensorSpec(name + part.suffix, CODE_OF_DTYPE[part.dtype], part.shape)
            for name in names
            for part in parts(published[name].numel(), encoded[name][2].numel())
        ]
        meta = {
            "kind": "update",
            **metadata(),
            "round": str(new_round),
            "base_round": str(new_round - 1),
            "instance": store.instance,
            "checksum": value,
        }
        layout = build_layout(specs, meta)
        self.last_nbytes = 0
        if layout.payload_size >= store.payload.numel():
            log.info("round %d: the sparse update is no smaller than the parameters", new_round)
            return
        buffer = PayloadBuffer(torch.empty(layout.payload_size, dtype=torch.uint8))
        views = tensor_views(layout, buffer.payload)
        suffixes = [part.suffix for part in parts(1, 0)]  # the same for every parameter
        for name in names:
            for suffix, t in zip(suffixes, encoded[name], strict=True):
                views[name + suffix].view(-1).copy_(t)
        self.last_nbytes = layout.payload_size
        self.current = UpdateBody(new_round, new_round - 1, layout.header, buffer)

    async def open_update(self, have_round: int) -> Snapshot | None:
        """Pin the kept update when it takes a replica holding round ``have_round`` to the
        published round; None otherwise (the caller then serves full parameters)."""
        return await open_kept(self.store, lambda: self.current, have_round)

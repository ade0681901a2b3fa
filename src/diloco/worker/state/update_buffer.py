"""A worker's side of a compressed downlink (``diloco server --download-codec int8``;
docs/design/codecs.md, "Downlink"; the server's side is ``server/params/update_bodies.py``, the maths
``core/codecs/downlink.py``).

A worker whose snapshot holds the published parameters of round R asks for round R+1 with
``have_round=R``. The server answers with the round's update (metadata ``kind: "update"``) when
it has one from R, otherwise with full parameters. An update body is small (a quarter of the
full body for int8) and lands in a buffer of its own, never in the snapshot, so a download that
breaks off leaves the snapshot intact. Once it has landed, each parameter's parts are added to
the snapshot with ``apply_update`` (the server's arithmetic, on the CPU, in fp32) and the
snapshot's bytes are checked against the checksum the round carries. A mismatch (a round this
worker missed, a server restored from an older checkpoint) leaves the snapshot dirty; the caller
then downloads full parameters, which overwrite it, and counts the mismatch.

A sparse update (``diloco server --download-codec sparse``, metadata ``codec: "sparse"``;
``core/codecs/sparse_update.py``) carries, per parameter, the positions the round changed and
their new values: ``check`` refuses a malformed one (out-of-range, repeated or unordered
positions, counts that do not add up, non-finite values) before anything is applied, and
``apply`` copies the values into the snapshot by index, no arithmetic, before the same checksum.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import torch

from diloco.core.codecs import BlockCodec, CodecError, Workspace, codec_from_metadata
from diloco.core.codecs.downlink import apply_update, check_download_codec
from diloco.core.codecs.sparse_update import (
    COUNT,
    INDEX,
    SPARSE_UPDATE,
    apply_changes,
    check_update,
    index_bytes,
    metadata,
    spans,
)
from diloco.wire import CODE_OF_DTYPE, Layout, TensorSpec, WireError, byte_view, tensor_views
from diloco.wire.checksum import checksum_behind

UPDATE_KIND = "update"
"""``__metadata__["kind"]`` of an update body (a full download's is ``global_params``)."""


def is_update(layout: Layout) -> bool:
    return layout.metadata.get("kind") == UPDATE_KIND


def lossy_downlink(metadata: Mapping[str, str]) -> bool:
    """A full download's metadata says its server publishes rounds as updates."""
    return metadata.get("download_codec", "fp32") != "fp32"


class UpdateBuffer:
    """Where update bodies land (one buffer, reused while bodies keep their size), and how one
    is applied to a snapshot."""

    def __init__(self) -> None:
        self._payload: torch.Tensor | None = None
        self._layout: Layout | None = None
        self._codec: BlockCodec | None = None  # the held update's codec; None: sparse
        self._work = Workspace()  # apply runs in the sync thread only

    def into(self, layout: Layout, table: Mapping[str, tuple[int, ...]]) -> memoryview:
        """Check an update's header against the model's parameter table (every parameter's
        parts, nothing else), then hand out memory for its payload. A ``WireError`` for a body
        that does not fit: nothing is received."""
        if layout.metadata.get("codec") == SPARSE_UPDATE:
            _check_sparse_header(layout, table)
            return self._hold(layout, None)
        try:
            codec = check_download_codec(codec_from_metadata(layout.metadata))
        except (CodecError, ValueError) as exc:
            raise WireError("bad_update", f"update body: {exc}") from None
        expected = {
            name + part.suffix: (CODE_OF_DTYPE[part.dtype], part.shape)
            for name, shape in table.items()
            for part in codec.parts(shape)
        }
        got = {spec.name: (spec.dtype, spec.shape) for spec in layout.specs}
        if got != expected:
            wrong = sorted(n for n in set(got) | set(expected) if got.get(n) != expected.get(n))
            raise WireError(
                "bad_update",
                f"update body does not fit the model's parameters for codec {codec.name}: "
                f"{wrong[:3]}",
            )
        return self._hold(layout, codec)

    def _hold(self, layout: Layout, codec: BlockCodec | None) -> memoryview:
        size = layout.payload_size
        if self._payload is None or self._payload.numel() < size:
            self._payload = torch.empty(size, dtype=torch.uint8)
        self._layout, self._codec = layout, codec
        return byte_view(self._payload[:size])

    def check(self, table: Mapping[str, tuple[int, ...]]) -> None:
        """Once the body has landed, before ``apply``: a ``WireError`` (``bad_update``) for a
        sparse update whose values do not describe distinct positions of each parameter
        (``sparse_update.check_update``), so a malformed one changes nothing. A quantized
        update's header was all there was to check."""
        layout = self._layout
        assert layout is not None and self._payload is not None
        if self._codec is not None:
            return
        views = tensor_views(layout, self._payload[: layout.payload_size])
        for name, shape in table.items():
            try:
                check_update(math.prod(shape), *(views[name + s] for s in _SUFFIXES))
            except CodecError as exc:
                raise WireError("bad_update", f"sparse update of {name!r}: {exc}") from None

    def apply(self, snapshot: Mapping[str, torch.Tensor], payload: torch.Tensor) -> bool:
        """Apply the landed update to ``snapshot`` (a quantized one added, a sparse one's values
        copied; flat-viewable fp32 CPU tensors, views into ``payload``, the snapshot's whole
        memory), then compare ``payload``'s checksum with the round's. False on a mismatch (the
        snapshot then holds neither round's parameters)."""
        layout, codec = self._layout, self._codec
        assert layout is not None and self._payload is not None
        views = tensor_views(layout, self._payload[: layout.payload_size])
        base = payload.data_ptr()

        def applied() -> Iterator[int]:  # in payload order: the checksum follows behind
            for name, t in sorted(snapshot.items(), key=lambda item: item[1].data_ptr()):
                if codec is None:  # sparse: the new values, copied by index (``check`` ran)
                    apply_changes(t, *(views[name + s] for s in _SUFFIXES))
                else:
                    parts = [views[name + p.suffix] for p in codec.parts(tuple(t.shape))]
                    apply_update(codec, t, parts, self._work)
                yield t.data_ptr() - base + t.numel() * t.element_size()

        expected = layout.metadata.get("checksum", "")
        return checksum_behind(byte_view(payload), applied()) == expected


_SUFFIXES = (COUNT, INDEX, "")
"""A sparse update's parts per parameter, in ``check_update``'s order."""


def _check_sparse_header(layout: Layout, table: Mapping[str, tuple[int, ...]]) -> None:
    """The format this worker reads, every parameter's three parts and nothing else
    (``WireError`` ``bad_update``)."""
    fmt = {k: layout.metadata.get(k) for k in metadata()}
    if fmt != metadata():
        raise WireError(
            "bad_update",
            f"sparse update body of another format ({fmt}; this worker reads {metadata()}): the "
            f"server runs another diloco version",
        )
    specs = {spec.name: spec for spec in layout.specs}
    wrong = sorted(set(specs) ^ {name + s for name in table for s in _SUFFIXES})
    if not wrong:
        wrong = [name for name, shape in table.items() if not _fits(specs, name, math.prod(shape))]
    if wrong:
        raise WireError(
            "bad_update", f"sparse update body does not fit the model's parameters: {wrong[:3]}"
        )


def _fits(specs: Mapping[str, TensorSpec], name: str, n: int) -> bool:
    """uint16 counts, one per span; fp32 values, at most the parameter's ``n`` elements, and
    their positions' packed bytes (uint8)."""
    count, idx, value = (specs[name + s] for s in _SUFFIXES)
    return (
        (count.dtype, count.shape) == ("U16", (spans(n),))
        and (idx.dtype, value.dtype) == ("U8", "F32")
        and len(value.shape) == 1
        and value.shape[0] <= n
        and idx.shape == (index_bytes(value.shape[0]),)
    )

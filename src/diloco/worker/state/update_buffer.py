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
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from diloco.core.codecs import BlockCodec, CodecError, Workspace, codec_from_metadata
from diloco.core.codecs.downlink import apply_update, check_download_codec
from diloco.wire import CODE_OF_DTYPE, Layout, WireError, byte_view, tensor_views
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
        self._codec: BlockCodec | None = None
        self._work = Workspace()  # apply runs in the sync thread only

    def into(self, layout: Layout, table: Mapping[str, tuple[int, ...]]) -> memoryview:
        """Check an update's header against the model's parameter table (every parameter's
        parts, nothing else), then hand out memory for its payload. A ``WireError`` for a body
        that does not fit: nothing is received."""
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
        size = layout.payload_size
        if self._payload is None or self._payload.numel() < size:
            self._payload = torch.empty(size, dtype=torch.uint8)
        self._layout, self._codec = layout, codec
        return byte_view(self._payload[:size])

    def apply(self, snapshot: Mapping[str, torch.Tensor], payload: torch.Tensor) -> bool:
        """Add the landed update to ``snapshot`` (flat-viewable fp32 CPU tensors, views into
        ``payload``, the snapshot's whole memory), then compare ``payload``'s checksum with the
        round's. False on a mismatch (the snapshot then holds neither round's parameters)."""
        layout, codec = self._layout, self._codec
        assert layout is not None and codec is not None and self._payload is not None
        views = tensor_views(layout, self._payload[: layout.payload_size])
        base = payload.data_ptr()

        def applied() -> Iterator[int]:  # in payload order: the checksum follows behind
            for name, t in sorted(snapshot.items(), key=lambda item: item[1].data_ptr()):
                parts = [views[name + p.suffix] for p in codec.parts(tuple(t.shape))]
                apply_update(codec, t, parts, self._work)
                yield t.data_ptr() - base + t.numel() * t.element_size()

        expected = layout.metadata.get("checksum", "")
        return checksum_behind(byte_view(payload), applied()) == expected

"""Streaming encoder: the header, then each tensor's own memory, chunk by chunk, never copied."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from diloco.wire.layout import Layout, TensorSpec, WireError, build_layout, spec_of

CHUNK_BYTES = 4 * 1024 * 1024


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous CPU tensor's memory (bf16 included; no copy)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    array: Any = flat.view(torch.uint8).numpy()  # numpy arrays export the buffer protocol
    return memoryview(array).cast("B")


def chunks(view: memoryview, chunk_bytes: int = CHUNK_BYTES) -> Iterator[memoryview]:
    for start in range(0, len(view), chunk_bytes):
        yield view[start : start + chunk_bytes]


def iter_body(
    layout: Layout,
    produce: Callable[[TensorSpec], torch.Tensor | Iterable[torch.Tensor]],
    chunk_bytes: int = CHUNK_BYTES,
) -> Iterator[memoryview | bytes]:
    """Yield a whole body. ``produce(spec)`` returns that tensor when it is about to be sent, so
    a caller can compute each tensor (a pseudo-gradient, a bf16 cast) just in time and hold only
    one of them at once."""
    yield layout.header
    for spec in layout.specs:
        produced = produce(spec)
        if isinstance(produced, torch.Tensor):
            if spec_of(spec.name, produced) != spec:
                raise WireError("internal", f"tensor {spec.name!r} does not match its header entry")
            yield from chunks(byte_view(produced.contiguous()), chunk_bytes)
            continue
        # Pieces: the tensor's flat bytes in order. The next piece is asked for only after the
        # previous one's chunks were taken, so a producer may reuse one scratch buffer.
        sent = 0
        for piece in produced:
            if piece.dtype != spec.torch_dtype:
                raise WireError(
                    "internal", f"a piece of {spec.name!r} is {piece.dtype}, not {spec.dtype}"
                )
            view = byte_view(piece.contiguous())
            sent += len(view)
            yield from chunks(view, chunk_bytes)
        if sent != spec.nbytes:
            raise WireError(
                "internal",
                f"pieces of {spec.name!r} hold {sent} bytes, the header says {spec.nbytes}",
            )


def encode(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """Whole body as bytes. For small messages and tests; large ones use iter_body."""
    layout = build_layout([spec_of(n, t) for n, t in tensors.items()], metadata)
    return b"".join(bytes(c) for c in iter_body(layout, lambda s: tensors[s.name].detach().cpu()))

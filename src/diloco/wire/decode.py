"""Streaming decoder: a bounded header read, then payload bytes copied into preallocated memory.

Readers are duck-typed so the same checks serve the server (aiohttp's StreamReader) and the
client (a urllib3 response). The caller validates the layout against its own table between
``read_layout`` and reading the payload, so no payload byte is accepted for a bad header.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

import torch

from diloco.wire.encode import byte_view
from diloco.wire.layout import (
    MAX_HEADER_BYTES,
    PREFIX,
    Layout,
    WireError,
    header_length,
    parse_header,
)

CHUNK_BYTES = 4 * 1024 * 1024
PROGRESS_BYTES = 2 * 1024 * 1024
"""Slice of a download between progress reports: small enough that what a report lets the
caller copy is still in the CPU's cache, large enough that the reports cost nothing."""


def tensor_views(layout: Layout, payload: torch.Tensor) -> dict[str, torch.Tensor]:
    """Typed views into a flat uint8 payload tensor, one per header entry (no copy)."""
    out: dict[str, torch.Tensor] = {}
    for spec, (begin, end) in zip(layout.specs, layout.offsets, strict=True):
        raw = payload[begin:end]
        if begin % spec.itemsize:  # a foreign writer packed it unaligned: copy this one tensor
            raw = raw.clone()
        out[spec.name] = raw.view(spec.torch_dtype).view(spec.shape)
    return out


# --- blocking readers (worker side) -----------------------------------------------------------


def read_exact(read: Callable[[int], bytes], n: int) -> bytes:
    parts: list[bytes] = []
    remaining = n
    while remaining:
        part = read(remaining)
        if not part:
            raise WireError("truncated", f"body ended {remaining} bytes early")
        parts.append(part)
        remaining -= len(part)
    return b"".join(parts)


def read_layout(read: Callable[[int], bytes], max_header: int = MAX_HEADER_BYTES) -> Layout:
    n = header_length(read_exact(read, PREFIX.size), max_header)
    return parse_header(read_exact(read, n))


def read_payload(
    read: Callable[[int], bytes], dest: memoryview, chunk_bytes: int = CHUNK_BYTES
) -> None:
    """Fill ``dest`` exactly, then insist the body ends there."""
    pos, size = 0, len(dest)
    while pos < size:
        part = read(min(chunk_bytes, size - pos))
        if not part:
            raise WireError("truncated", f"body ended {size - pos} bytes early")
        dest[pos : pos + len(part)] = part
        pos += len(part)
    if read(1):
        raise WireError("trailing_bytes", "body continues past the last tensor")


def readinto_payload(
    readinto: Callable[[memoryview], int],
    read: Callable[[int], bytes],
    dest: memoryview,
    on_progress: Callable[[int], None] | None = None,
    progress_bytes: int | None = None,
) -> None:
    """As ``read_payload``, with the stream writing straight into ``dest`` (no bytes objects
    in between); ``read`` serves the final check that the body ends there.

    With ``on_progress``, reads go in slices of ``progress_bytes`` (default ``PROGRESS_BYTES``)
    and ``on_progress(n)`` is called each time the first ``n`` bytes of ``dest`` hold their
    final values (also for a short read just before the body breaks off)."""
    pos, size = 0, len(dest)
    step = size if on_progress is None else (progress_bytes or PROGRESS_BYTES)
    while pos < size:
        got = readinto(dest[pos : pos + step])
        if not got:
            raise WireError("truncated", f"body ended {size - pos} bytes early")
        pos += got
        if on_progress is not None:
            on_progress(pos)
    if read(1):
        raise WireError("trailing_bytes", "body continues past the last tensor")


# --- asyncio readers (server side) ------------------------------------------------------------


class AsyncStream(Protocol):
    async def read(self, n: int = -1) -> bytes: ...


async def aread_exact(stream: AsyncStream, n: int) -> bytes:
    parts: list[bytes] = []
    remaining = n
    while remaining:
        part = await stream.read(remaining)
        if not part:
            raise WireError("truncated", f"body ended {remaining} bytes early")
        parts.append(part)
        remaining -= len(part)
    return b"".join(parts)


async def aread_layout(stream: AsyncStream, max_header: int = MAX_HEADER_BYTES) -> Layout:
    n = header_length(await aread_exact(stream, PREFIX.size), max_header)
    return parse_header(await aread_exact(stream, n))


class PayloadReader:
    """Reads a body's payload stretch by stretch into memory the caller gives each time.

    A stream with ``readinto`` (server/web/socket_body.py) receives straight into that memory,
    ``chunk_bytes`` at most at a time; otherwise its chunks are copied in, and the part of a
    chunk past the stretch waits for the next one."""

    def __init__(self, stream: AsyncStream, chunk_bytes: int = CHUNK_BYTES) -> None:
        self._stream = stream
        self._chunk = chunk_bytes
        self._readinto = getattr(stream, "readinto", None)
        # aiohttp's readany() hands over a received chunk as it is; read(n) would slice and
        # copy it.
        self._readany = getattr(stream, "readany", None)
        self._left = memoryview(b"")

    async def fill(
        self, dest: memoryview, room: Callable[[int], Awaitable[None]] | None = None
    ) -> None:
        """Fill ``dest`` exactly. With ``room``, each write of ``dest[:end]`` first awaits
        ``room(end)`` (the memory may still be being read by others)."""
        pos, size = 0, len(dest)
        while pos < size:
            if self._left:
                part = self._left
            elif self._readinto is not None:  # the socket writes into dest itself
                want = min(self._chunk, size - pos)
                if room is not None:
                    await room(pos + want)
                n = await self._readinto(dest[pos : pos + want])
                if not n:
                    raise WireError("truncated", f"body ended {size - pos} bytes early")
                pos += n
                continue
            else:
                got = (
                    await self._readany()
                    if self._readany is not None
                    else await self._stream.read(min(self._chunk, size - pos))
                )
                if not got:
                    raise WireError("truncated", f"body ended {size - pos} bytes early")
                part = memoryview(got)
            take = min(len(part), size - pos)
            if room is not None:
                await room(pos + take)
            dest[pos : pos + take] = part[:take]
            self._left = part[take:]
            pos += take

    async def end(self) -> None:
        """Insist the body ends where the payload does."""
        if self._left or await self._stream.read(1):
            raise WireError("trailing_bytes", "body continues past the last tensor")


async def aread_payload(
    stream: AsyncStream,
    dest: memoryview,
    chunk_bytes: int = CHUNK_BYTES,
    room: Callable[[int], Awaitable[None]] | None = None,
) -> None:
    """Fill ``dest`` exactly, then insist the body ends there (``PayloadReader``)."""
    reader = PayloadReader(stream, chunk_bytes)
    await reader.fill(dest, room)
    await reader.end()


def decode(
    data: bytes, max_header: int = MAX_HEADER_BYTES
) -> tuple[Layout, dict[str, torch.Tensor]]:
    """Decode a whole in-memory body (small messages and tests). Returns owned tensors."""
    view = memoryview(data)
    pos = 0

    def read(n: int) -> bytes:
        nonlocal pos
        part = bytes(view[pos : pos + n])
        pos += len(part)
        return part

    layout = read_layout(read, max_header)
    if layout.payload_size > len(view) - pos:  # allocate only what the body really holds
        raise WireError(
            "truncated", f"body ended {layout.payload_size - (len(view) - pos)} bytes early"
        )
    payload = torch.empty(layout.payload_size, dtype=torch.uint8)
    read_payload(read, byte_view(payload))
    return layout, tensor_views(layout, payload)

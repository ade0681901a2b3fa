"""A fingerprint of parameters' bytes: how a replica proves it holds the server's parameters.

With a compressed downlink (``core/codecs/downlink.py``) every worker rebuilds each round's
parameters from an update; the checksum that travels with the round tells it whether it got the
server's bits exactly. It detects a replica that diverged (a missed round, another device's
arithmetic), not an attacker: CRC-32, a single flipped bit always changes it, and two different
models share it with probability 2**-32. It runs at several GB/s on one core
(``benchmarks/codecs/speed.py``), where SHA-256 would add about 0.2 s per 100M parameters to every
round on each side.
"""

from __future__ import annotations

import queue
import threading
import zlib
from collections.abc import Iterable, Iterator

import torch

from diloco.wire.encode import byte_view


def checksum(buffers: Iterable[memoryview | bytes | bytearray]) -> str:
    """CRC-32 of the buffers' bytes in order, as eight hex digits (the split does not matter)."""
    value = 0
    for buf in buffers:
        value = zlib.crc32(buf, value)
    return f"{value:08x}"


def checksum_behind(buffer: memoryview, ends: Iterator[int]) -> str:
    """``checksum([buffer])``, computed beside the work that finishes the buffer: iterating
    ``ends`` does that work (applying or encoding an update parameter by parameter) and yields
    rising offsets below which ``buffer``'s bytes are final; a helper thread checksums each
    finished stretch while the next is worked on (zlib and torch both release the GIL, so on
    two cores the checksum leaves the round's critical path). Same value as ``checksum``.
    Whatever ``ends`` raises propagates, once the helper has stopped."""
    todo: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    result: list[int] = []

    def run() -> None:
        value, start = 0, 0
        while (end := todo.get()) is not None:
            value, start = zlib.crc32(buffer[start:end], value), end
        result.append(value)

    helper = threading.Thread(target=run, name="checksum", daemon=True)
    helper.start()
    try:
        last = 0
        for end in ends:
            if not last <= end <= len(buffer):
                raise ValueError(f"checksum_behind: offset {end} after {last}, of {len(buffer)}")
            todo.put(end)
            last = end
        todo.put(len(buffer))
    finally:
        todo.put(None)
        helper.join()
    return f"{result[0]:08x}"


def tensor_checksum(tensors: Iterable[torch.Tensor]) -> str:
    """``checksum`` of CPU tensors' bytes, in order (each made contiguous first)."""
    return checksum(byte_view(t.detach().contiguous()) for t in tensors)

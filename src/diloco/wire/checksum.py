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

import zlib
from collections.abc import Iterable

import torch

from diloco.wire.encode import byte_view


def checksum(buffers: Iterable[memoryview | bytes | bytearray]) -> str:
    """CRC-32 of the buffers' bytes in order, as eight hex digits (the split does not matter)."""
    value = 0
    for buf in buffers:
        value = zlib.crc32(buf, value)
    return f"{value:08x}"


def tensor_checksum(tensors: Iterable[torch.Tensor]) -> str:
    """``checksum`` of CPU tensors' bytes, in order (each made contiguous first)."""
    return checksum(byte_view(t.detach().contiguous()) for t in tensors)

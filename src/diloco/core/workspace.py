"""Scratch buffers a caller reuses from call to call (``Workspace``), for the codecs' chunked
passes and the running sum's decode-adds.

A codec's chunk of scratch (about 9 MB for int8 and int4: two fp32 and one int8 buffer of
``CHUNK`` elements) freshly allocated at every call is freshly page-faulted as well: the
allocator hands blocks that large back to the system when they are freed, so each call pays
about 2,300 page faults before its first pass. A worker's lossy round makes about a hundred
such calls each way and a server one per parameter per upload; reused, the buffers stay mapped
and warm in cache (docs/benchmarks.md, "Lossy rounds: where the time goes").
"""

from __future__ import annotations

import torch


class Workspace:
    """Scratch buffers reused from call to call by one caller: a codec's chunk of scratch
    (about 9 MB for int8 and int4) freshly allocated is freshly page-faulted as well, since
    the allocator hands blocks that large back to the system when freed; a worker's round makes
    about a hundred such calls each way (benchmarks/codecs/round_cost.py). Not thread-safe:
    each thread, or each owner whose calls never overlap, keeps its own. Grown, never shrunk:
    its size is one call's scratch (a ``CHUNK`` of a few dtypes)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, tag: str, dtype: torch.dtype, n: int, device: torch.device) -> torch.Tensor:
        """A flat uninitialised buffer of ``n`` elements, the same memory at every call with
        ``tag`` (a caller uses one tag per buffer it needs at once)."""
        key = (tag, dtype, torch.device(device))
        t = self._buffers.get(key)
        if t is None or t.numel() < n:
            t = torch.empty(n, dtype=dtype, device=device)
            self._buffers[key] = t
        return t[:n]


def scratch(
    work: Workspace | None, tag: str, dtype: torch.dtype, n: int, device: torch.device
) -> torch.Tensor:
    """``work.get(...)``, or a fresh buffer without a workspace."""
    if work is None:
        return torch.empty(n, dtype=dtype, device=device)
    return work.get(tag, dtype, n, device)

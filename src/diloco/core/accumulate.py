"""A running weighted sum of pseudo-gradients: server memory does not grow with the workers."""

from __future__ import annotations

from collections.abc import Sequence

import torch

CHUNK = 1 << 20  # elements converted at a time when a contribution is not fp32


class WeightedSum:
    """fp32 running sum ``sum_i w_i * g_i`` and ``sum_i w_i`` over one round's contributions.

    ``reset`` only forgets the count: the first contribution of the next round overwrites the
    sums (``w * g``, bit for bit what adding it to zeros gives), which saves zeroing the whole
    model between rounds. So ``sums`` are meaningful only while ``count > 0``."""

    def __init__(self, shapes: Sequence[torch.Size | tuple[int, ...]]) -> None:
        self.sums = [torch.zeros(shape, dtype=torch.float32) for shape in shapes]
        self._scratch = torch.empty(CHUNK, dtype=torch.float32)
        self.total_weight = 0.0
        self.count = 0

    @torch.no_grad()
    def add(self, tensors: Sequence[torch.Tensor], weight: float) -> None:
        if not weight > 0:
            raise ValueError(f"contribution weight must be positive, got {weight}")
        if len(tensors) != len(self.sums):
            raise ValueError(f"expected {len(self.sums)} tensors, got {len(tensors)}")
        first = self.count == 0
        for acc, t in zip(self.sums, tensors, strict=True):
            if t.dtype == acc.dtype:
                _accumulate(acc, t, weight, first)
                continue
            # A mixed-dtype add_ would first make an fp32 copy of the whole tensor (one large
            # embedding: its full fp32 size); going through a small scratch keeps memory flat.
            flat_acc, flat_t = acc.view(-1), t.reshape(-1)
            for start in range(0, flat_t.numel(), CHUNK):
                piece = flat_t[start : start + CHUNK]
                scratch = self._scratch[: piece.numel()]
                scratch.copy_(piece)
                _accumulate(flat_acc[start : start + piece.numel()], scratch, weight, first)
        self.total_weight += weight
        self.count += 1

    @torch.no_grad()
    def mean_(self) -> list[torch.Tensor]:
        """Divide the sums by the total weight in place and return them."""
        if self.count == 0:
            raise ValueError("no contribution to average")
        for acc in self.sums:
            acc.div_(self.total_weight)
        return self.sums

    def reset(self) -> None:
        self.total_weight = 0.0
        self.count = 0


def _accumulate(acc: torch.Tensor, t: torch.Tensor, weight: float, first: bool) -> None:
    if not first:
        acc.add_(t, alpha=weight)
    elif weight == 1:
        acc.copy_(t)
    else:
        torch.mul(t, weight, out=acc)

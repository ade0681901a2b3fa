"""A running weighted sum of pseudo-gradients: server memory does not grow with the workers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from diloco.core.workspace import Workspace

CHUNK = 1 << 20  # elements added at a time (bf16 ones go through an fp32 scratch of this size)


class AddsInto(Protocol):
    """A contribution that is not a plain tensor: an encoded one (``core.codecs.Encoded``) adds
    itself into an fp32 accumulator chunk by chunk, with no full-size decoded copy."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def add_into(
        self,
        acc: torch.Tensor,
        weight: float = 1.0,
        *,
        first: bool = False,
        work: Workspace | None = None,
    ) -> None:
        """``acc += weight * value`` (``acc = weight * value`` when ``first``), with ``work``'s
        scratch (reused from one contribution to the next)."""
        ...


Entry = torch.Tensor | AddsInto


class WeightedSum:
    """fp32 running sum ``sum_i w_i * g_i`` and ``sum_i w_i`` over one round's contributions.

    ``reset`` only forgets the count: the first contribution of the next round overwrites the
    sums (``w * g``, bit for bit what adding it to zeros gives), which saves zeroing the whole
    model between rounds. So ``sums`` are meaningful only while ``count > 0``."""

    def __init__(self, shapes: Sequence[torch.Size | tuple[int, ...]]) -> None:
        self.sums = [torch.zeros(shape, dtype=torch.float32) for shape in shapes]
        self._scratch = torch.empty(CHUNK, dtype=torch.float32)
        self._work = Workspace()  # encoded entries' decode scratch: adds never overlap
        self.total_weight = 0.0
        self.count = 0

    @torch.no_grad()
    def add(
        self,
        tensors: Sequence[Entry],
        weight: float,
        *,
        order: Sequence[int] | None = None,
        on_piece: Callable[[int, int], None] | None = None,
    ) -> None:
        """Add ``weight * tensors[i]`` to ``sums[i]`` for every i.

        The work goes in pieces of ``CHUNK`` elements, tensor by tensor in ``order`` (default:
        index order). After each piece ``on_piece(i, end)`` says that the first ``end`` flat
        elements of ``tensors[i]`` (and every tensor before it in ``order``) are no longer read,
        so a caller can reuse that memory while the rest is still being added.

        An entry may be encoded (``AddsInto``): it adds itself (decoding a chunk at a time, the
        same ``first`` semantics), and ``on_piece(i, numel)`` follows once it is done."""
        if not weight > 0:
            raise ValueError(f"contribution weight must be positive, got {weight}")
        if len(tensors) != len(self.sums):
            raise ValueError(f"expected {len(self.sums)} tensors, got {len(tensors)}")
        indices = range(len(self.sums)) if order is None else order
        if sorted(indices) != list(range(len(self.sums))):
            raise ValueError("order must name every tensor index exactly once")
        for i, t in enumerate(tensors):
            if t.shape != self.sums[i].shape:
                raise ValueError(
                    f"tensor {i} has shape {tuple(t.shape)}, expected {tuple(self.sums[i].shape)}"
                )
        first = self.count == 0
        for i in indices:
            entry = tensors[i]
            if not isinstance(entry, torch.Tensor):
                entry.add_into(self.sums[i], weight, first=first, work=self._work)
                if on_piece is not None:
                    on_piece(i, self.sums[i].numel())
                continue
            flat_t = entry.reshape(-1)
            done = None if on_piece is None else lambda end, i=i: on_piece(i, end)
            self._write(i, 0, flat_t, weight, first, done)
            if on_piece is not None and flat_t.numel() == 0:
                on_piece(i, 0)
        self.total_weight += weight
        self.count += 1

    @torch.no_grad()
    def write_first(self, i: int, start: int, piece: torch.Tensor, weight: float) -> None:
        """Write ``weight * piece`` over the flat elements ``[start, start + n)`` of ``sums[i]``:
        part of a first contribution that arrives in pieces, the same bits ``add`` would give.

        Only while no contribution counts: the sums then hold nothing meaningful, so one given
        up midway changes nothing. It counts once ``commit_first`` is called, after every
        element of every tensor has been written."""
        if self.count:
            raise ValueError("write_first is for the first contribution of a round")
        if not weight > 0:
            raise ValueError(f"contribution weight must be positive, got {weight}")
        flat_acc = self.sums[i].view(-1)
        flat = piece.reshape(-1)
        if start < 0 or start + flat.numel() > flat_acc.numel():
            raise ValueError(
                f"elements [{start}, {start + flat.numel()}) are outside tensor {i} "
                f"({flat_acc.numel()} elements)"
            )
        self._write(i, start, flat, weight, True, None)

    def _write(
        self,
        i: int,
        start: int,
        flat: torch.Tensor,
        weight: float,
        first: bool,
        done: Callable[[int], None] | None,
    ) -> None:
        """Add (or, for the first contribution, write) ``weight * flat`` into the flat elements
        of ``sums[i]`` from ``start`` on, ``CHUNK`` elements at a time; ``done(end)`` after each
        piece says that ``flat[:end]`` is no longer read."""
        flat_acc = self.sums[i].view(-1)
        for at in range(0, flat.numel(), CHUNK):
            piece = flat[at : at + CHUNK]
            n = piece.numel()
            if piece.dtype != flat_acc.dtype:
                # A mixed-dtype add_ would first make an fp32 copy of its input (for one large
                # embedding: its full fp32 size); a small reused scratch keeps memory flat.
                scratch = self._scratch[:n]
                scratch.copy_(piece)
                piece = scratch
            accumulate_(flat_acc[start + at : start + at + n], piece, weight, first)
            if done is not None:
                done(at + n)

    def commit_first(self, weight: float) -> None:
        """The contribution written by ``write_first`` counts, with ``weight``."""
        if self.count:
            raise ValueError("a first contribution already counts")
        if not weight > 0:
            raise ValueError(f"contribution weight must be positive, got {weight}")
        self.total_weight = weight
        self.count = 1

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


def accumulate_(acc: torch.Tensor, t: torch.Tensor, weight: float, first: bool) -> None:
    """``acc += weight * t``, or ``acc = weight * t`` when ``first``: one ``add_`` with
    ``alpha`` (``copy_`` for weight 1). Every contribution lands in a sum through this, a plain
    one here and a decoded one in the codecs (``core/codecs/``), so both give the same bits."""
    if not first:
        acc.add_(t, alpha=weight)
    elif weight == 1:
        acc.copy_(t)
    else:
        torch.mul(t, weight, out=acc)

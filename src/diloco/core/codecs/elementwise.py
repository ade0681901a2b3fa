"""Codecs that encode each element (or each block of elements) on its own, and so can encode and
accumulate a tensor piece by piece: the plain casts (the lossless fp32 and today's bf16), and the
base class of the quantizers.

A *piece* is a flat range ``[start, stop)`` of a tensor's elements whose ``start`` is a multiple
of the codec's ``align`` and whose ``stop`` is too, or is the end of the tensor. The worker computes
its pseudo-gradient in pieces of ``pseudo_gradient.PIECE`` (2**20) elements, a multiple of every
``align`` here, and the parts of a tensor are exactly the concatenation of the parts of its pieces,
so a piece can be encoded, sent, checked and accumulated without the rest of the tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diloco.core.accumulate import accumulate_
from diloco.core.codecs.base import CHUNK, Codec, CodecError, Part, numel_of
from diloco.core.finite import max_abs
from diloco.core.workspace import Workspace, scratch


class BlockCodec(Codec):
    """A codec whose parts split into per-piece ranges (see the module docstring)."""

    align: int = 1
    """Piece boundaries are multiples of this many elements (a power of two dividing 2**20)."""
    shaped_codes: bool = True
    """Whether the part named like the parameter holds one code per element, and so takes the
    parameter's shape (a captured body then reads naturally); packed codes stay flat."""
    sparse: bool = False
    """Whether it keeps a subset of the elements (``topk``): not a download codec (its rounds go
    down as ``--download-codec sparse``, ``sparse_update.py``)."""

    def flat_parts(self, n: int) -> list[Part]:
        """``parts`` of a flat tensor of ``n`` elements (each part flat as well)."""
        raise NotImplementedError

    def parts(self, shape: Sequence[int]) -> list[Part]:
        flat = self.flat_parts(numel_of(shape))
        if not self.shaped_codes:
            return flat
        return [
            Part(p.suffix, p.dtype, tuple(int(d) for d in shape)) if p.suffix == "" else p
            for p in flat
        ]

    def piece_ranges(self, numel: int, start: int, stop: int) -> list[tuple[int, int]]:
        """For elements ``[start, stop)`` of a tensor of ``numel`` elements: the flat range of
        each part (in ``parts`` order) that encodes them. A ``ValueError`` for a range that is
        not a piece."""
        if not 0 <= start <= stop <= numel:
            raise ValueError(f"piece [{start}, {stop}) is outside a tensor of {numel} elements")
        if start % self.align or (stop != numel and stop % self.align):
            raise ValueError(
                f"piece [{start}, {stop}) of codec {self.name} must start, and end unless it ends "
                f"the tensor, at a multiple of {self.align} elements"
            )
        before = self.flat_parts(start)
        inside = self.flat_parts(stop - start)
        return [(b.numel, b.numel + p.numel) for b, p in zip(before, inside, strict=True)]

    def encode_piece(
        self,
        piece: torch.Tensor,
        out: Sequence[torch.Tensor] | None = None,
        work: Workspace | None = None,
    ) -> list[torch.Tensor]:
        """The flat parts of a flat fp32 piece (see ``piece_ranges``), written into ``out`` when
        given (flat tensors matching ``flat_parts(piece.numel())``: a worker reuses them).
        ``work``: the caller's reused scratch (None: allocated for this call)."""
        raise NotImplementedError

    def add_piece_into(
        self,
        acc: torch.Tensor,
        parts: Sequence[torch.Tensor],
        weight: float,
        first: bool,
        work: Workspace | None = None,
    ) -> None:
        """``add_into`` on a flat piece: ``acc`` is the piece's flat fp32 accumulator, ``parts``
        the flat part ranges ``piece_ranges`` names; ``work`` as in ``encode_piece``."""
        raise NotImplementedError

    def empty_parts(self, n: int, device: torch.device) -> list[torch.Tensor]:
        """Uninitialised flat parts for ``n`` elements: the ``out`` of ``encode_piece``."""
        return [torch.empty(p.shape, dtype=p.dtype, device=device) for p in self.flat_parts(n)]

    @torch.no_grad()
    def encode(self, t: torch.Tensor, name: str = "") -> list[torch.Tensor]:
        flat = self.encode_piece(t.detach().reshape(-1))
        return [f.view(p.shape) for f, p in zip(flat, self.parts(t.shape), strict=True)]

    @torch.no_grad()
    def add_into(
        self,
        acc: torch.Tensor,
        parts: Sequence[torch.Tensor],
        weight: float = 1.0,
        *,
        first: bool = False,
        work: Workspace | None = None,
    ) -> None:
        self.add_piece_into(acc.view(-1), [p.reshape(-1) for p in parts], weight, first, work)

    @torch.no_grad()
    def decode_piece(self, parts: Sequence[torch.Tensor], n: int) -> torch.Tensor:
        """The flat fp32 piece of ``n`` elements that flat ``parts`` stand for."""
        out = torch.empty(n, dtype=torch.float32, device=parts[0].device)
        self.add_piece_into(out, parts, 1.0, True)
        return out


class CastCodec(BlockCodec):
    """A codec whose one part is the tensor cast to ``dtype``, element for element."""

    dtype: torch.dtype
    """The wire dtype of the part."""

    def flat_parts(self, n: int) -> list[Part]:
        return [Part("", self.dtype, (n,))]

    @torch.no_grad()
    def encode_piece(
        self,
        piece: torch.Tensor,
        out: Sequence[torch.Tensor] | None = None,
        work: Workspace | None = None,
    ) -> list[torch.Tensor]:
        (dst,) = self.empty_parts(piece.numel(), piece.device) if out is None else out
        return [dst.copy_(piece)]

    def check_part(self, shape: Sequence[int], index: int, t: torch.Tensor) -> None:
        _check_finite(t)


class Fp32Codec(CastCodec):
    """Lossless: the fp32 tensor itself."""

    name = "fp32"
    lossy = False
    dtype = torch.float32

    @torch.no_grad()
    def add_piece_into(
        self,
        acc: torch.Tensor,
        parts: Sequence[torch.Tensor],
        weight: float,
        first: bool,
        work: Workspace | None = None,
    ) -> None:
        accumulate_(acc, parts[0], weight, first)  # fp32 needs no scratch: no full temporary


class Bf16Codec(CastCodec):
    """Today's uplink: a plain round-to-nearest cast to bf16 (2 bytes per element). Lossy in the
    strict sense (8 significant bits), so a worker may keep error feedback for it; without it,
    it is what every release before the codecs sent."""

    name = "bf16"
    lossy = True
    dtype = torch.bfloat16

    @torch.no_grad()
    def add_piece_into(
        self,
        acc: torch.Tensor,
        parts: Sequence[torch.Tensor],
        weight: float,
        first: bool,
        work: Workspace | None = None,
    ) -> None:
        codes = parts[0]
        # A mixed-dtype add_ would make a full fp32 copy of its input; a chunk of scratch does not.
        buf = scratch(work, "bf16", torch.float32, min(CHUNK, acc.numel()), acc.device)
        for at in range(0, acc.numel(), CHUNK):
            piece = codes[at : at + CHUNK]
            s = buf[: piece.numel()]
            s.copy_(piece)
            accumulate_(acc[at : at + piece.numel()], s, weight, first)


def _check_finite(t: torch.Tensor) -> None:
    # One aminmax pass, no boolean temporary (core.finite.max_abs).
    if max_abs([t]) == float("inf"):
        raise CodecError("non_finite", "the tensor holds NaN or an infinity")

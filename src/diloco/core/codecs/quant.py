"""Blockwise absmax quantization, and the int8 codec built on it.

Each block of ``block`` consecutive elements (of the flattened tensor; the last block of a tensor
may be shorter) gets one scale ``s = absmax(block) / top``, stored as bf16 rounded *up*, and each
element the integer code ``k = round(x / s)`` (round half to even: deterministic, and unbiased
enough once error feedback carries each round's rounding into the next, so stochastic rounding
buys nothing). Decoding is ``k * s``.

Why these choices (figures in docs/design/codecs.md, "Choices, with their measurements"):

- bf16 scales: no measurable error difference from fp32 scales, half their bytes; and ``k * s``
  is then *exact* in fp32 (at most 7 + 8 significant bits), so a decoded value has the same bits
  on every device, whatever its arithmetic: what a compressed downlink needs.
- rounded up, so that ``|x / s| <= top`` holds after rounding and no code needs clamping.
- block 64 for int8: 1.03 bytes per element, relative error 0.6% on pseudo-gradients (block 128:
  0.7%, block 32: 1.06 bytes and 0.55%).

The work goes ``CHUNK`` elements at a time through a few reused scratch buffers, so each chunk's
passes (abs, block max, scale, round, convert) run in cache and memory is crossed about once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from diloco.core.accumulate import accumulate_
from diloco.core.codecs.base import CHUNK, CodecError, Part
from diloco.core.codecs.elementwise import BlockCodec
from diloco.core.workspace import Workspace, scratch

SCALE = "@scale"
FP32_MAX = float(torch.finfo(torch.float32).max)
_BF16_MAX_BITS = 0x7FC00000  # canonical NaN: every fp32 bit pattern above it is a NaN as well


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _Scratch:
    """Reused buffers of one call, sized for one chunk."""

    f1: torch.Tensor  # encode: |x|, then x / s; decode: spare room (as int8)
    f2: torch.Tensor  # encode: spare room for the fp4 companding; decode: the values
    i8: torch.Tensor  # codes as int8 before packing / after unpacking
    per_block: torch.Tensor  # block max, then 1 / s (or s when decoding)
    bits: torch.Tensor  # int32 bits of the scales while rounding them to bf16

    @classmethod
    def make(cls, n: int, block: int, device: torch.device, work: Workspace | None) -> _Scratch:
        m = min(n, CHUNK)
        nb = _ceil_div(m, block)
        f32 = torch.float32
        return cls(
            f1=scratch(work, "q.f1", f32, m, device),
            f2=scratch(work, "q.f2", f32, m, device),
            i8=scratch(work, "q.i8", torch.int8, m, device),
            per_block=scratch(work, "q.block", f32, nb, device),
            bits=scratch(work, "q.bits", torch.int32, nb, device),
        )


def round_up_bf16(x: torch.Tensor, out: torch.Tensor, bits: torch.Tensor) -> None:
    """``out`` = the smallest bf16 >= ``x`` (non-negative fp32; NaN stays NaN, inf stays inf),
    through the bits: adding 0xFFFF carries into the kept half unless the dropped half is zero."""
    torch.clamp_max(x.view(torch.int32), _BF16_MAX_BITS, out=bits)  # no NaN payload overflows
    bits.add_(0xFFFF).bitwise_right_shift_(16)
    out.view(torch.int16).copy_(bits)


def mul_blocks(src: torch.Tensor, per_block: torch.Tensor, out: torch.Tensor, block: int) -> None:
    """``out[i] = src[i] * per_block[i // block]`` (``out`` may be ``src``)."""
    n = src.numel()
    full = n // block
    body = full * block
    if full:
        torch.mul(
            src[:body].view(full, block), per_block[:full, None], out=out[:body].view(full, block)
        )
    if body < n:
        torch.mul(src[body:], per_block[full], out=out[body:])


class AbsmaxQuantizer(BlockCodec):
    """Blockwise absmax quantization to integer code indices; subclasses say how codes are
    stored (``_store``/``_load``) and, for non-uniform grids, how values map to indices
    (``_index_``/``_value_``). Parts: ``name@scale`` (bf16, one per block), then ``name`` (codes)."""

    lossy = True
    top: ClassVar[float]
    """What a block's absmax maps to: the largest code value."""
    code_dtype: ClassVar[torch.dtype]
    default_block: ClassVar[int] = 64
    group: ClassVar[int] = 1
    """Elements whose codes are packed together (pieces must not split a group)."""

    def __init__(self, block: int | None = None) -> None:
        block = self.default_block if block is None else int(block)
        if block < 2 or block > 4096 or block & (block - 1):
            raise ValueError(f"block must be a power of two from 2 to 4096, got {block}")
        self.block = block
        self.align = max(block, self.group)

    def options(self) -> dict[str, str]:
        return {"block": str(self.block)}

    def code_numel(self, n: int) -> int:
        """Code elements (on the wire) for ``n`` values."""
        return n

    def flat_parts(self, n: int) -> list[Part]:
        return [
            Part(SCALE, torch.bfloat16, (_ceil_div(n, self.block),)),
            Part("", self.code_dtype, (self.code_numel(n),)),
        ]

    # --- hooks -------------------------------------------------------------------------------

    def _index_(self, y: torch.Tensor, spare: torch.Tensor) -> None:
        """Turn ``x / s`` (in ``[-top, top]``) into the real-valued code index, in place."""

    value_factor: ClassVar[float] = 1.0
    """``_load`` gives ``value / (s * value_factor)``: the factor is applied to the (few) scales
    instead of every value. A power of two, so decoded values stay exact."""

    def _store(self, y: torch.Tensor, codes: torch.Tensor, w: _Scratch) -> None:
        """Write the integer-valued floats ``y`` as codes (``w.i8`` is free)."""
        codes.copy_(y)

    def _load(self, codes: torch.Tensor, y: torch.Tensor, w: _Scratch) -> None:
        """Write ``value / (s * value_factor)`` of each code into ``y`` (``w.i8`` and ``w.f1``
        are free)."""
        y.copy_(codes)

    # --- encode / accumulate -----------------------------------------------------------------

    def _chunks(self, n: int) -> list[tuple[int, int, tuple[int, int], tuple[int, int]]]:
        """Per chunk: its element range, and its ranges in the scales and in the codes."""
        out = []
        for a in range(0, n, CHUNK):
            b = min(a + CHUNK, n)
            scales, codes = self.piece_ranges(n, a, b)
            out.append((a, b, scales, codes))
        return out

    @torch.no_grad()
    def encode_piece(
        self,
        piece: torch.Tensor,
        out: Sequence[torch.Tensor] | None = None,
        work: Workspace | None = None,
    ) -> list[torch.Tensor]:
        if piece.dtype != torch.float32:
            piece = piece.float()  # the bit tricks below read fp32 bits
        n = piece.numel()
        scales, codes = self.empty_parts(n, piece.device) if out is None else out
        w = _Scratch.make(n, self.block, piece.device, work)
        for a, b, (sa, sb), (ca, cb) in self._chunks(n):
            self._encode_chunk(piece[a:b], scales[sa:sb], codes[ca:cb], w)
        return [scales, codes]

    def _encode_chunk(
        self, x: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor, w: _Scratch
    ) -> None:
        m, nb = x.numel(), scales.numel()
        full = m // self.block
        # |x| and its block maxima on the int32 bits: clearing the sign bit is |x|, and the order
        # of non-negative floats is that of their bits (NaN's bits above all), so an int32 max,
        # 2.4x faster on one core than the float max with its NaN checks, gives the same value.
        absx = torch.bitwise_and(x.view(torch.int32), 0x7FFFFFFF, out=w.f1[:m].view(torch.int32))
        amax = w.per_block[:nb]
        amax_bits = amax.view(torch.int32)
        if full:
            torch.amax(absx[: full * self.block].view(full, self.block), 1, out=amax_bits[:full])
        if full < nb:
            torch.amax(absx[full * self.block :], 0, keepdim=True, out=amax_bits[full:])
        amax.div_(self.top)
        round_up_bf16(amax, scales, w.bits[:nb])
        inv = amax.copy_(scales).reciprocal_()
        inv.nan_to_num_(nan=0.0, posinf=0.0)  # an all-zero block: scale 0, codes 0
        y = w.f1[:m]  # over |x|, no longer needed: one buffer less to keep in cache
        mul_blocks(x, inv, y, self.block)
        self._index_(y, w.f2[:m])
        y.round_()
        self._store(y, codes, w)

    @torch.no_grad()
    def add_piece_into(
        self,
        acc: torch.Tensor,
        parts: Sequence[torch.Tensor],
        weight: float,
        first: bool,
        work: Workspace | None = None,
    ) -> None:
        scales, codes = parts
        n = acc.numel()
        w = _Scratch.make(n, self.block, acc.device, work)
        for a, b, (sa, sb), (ca, cb) in self._chunks(n):
            m = b - a
            y = w.f2[:m]
            self._load(codes[ca:cb], y, w)
            s = w.per_block[: sb - sa].copy_(scales[sa:sb])
            if self.value_factor != 1.0:
                s.mul_(self.value_factor)
            mul_blocks(y, s, y, self.block)  # exact: few-bit code times bf16 scale
            accumulate_(acc[a:b], y, weight, first)

    # --- checks ------------------------------------------------------------------------------

    def check_part(self, shape: Sequence[int], index: int, t: torch.Tensor) -> None:
        if index != 0 or t.numel() == 0:
            return  # every code pattern decodes to a finite multiple of its scale
        low, high = (float(v) for v in torch.aminmax(t.float()))
        if not (math.isfinite(low) and math.isfinite(high)):
            raise CodecError("non_finite", f"a {self.name} scale is NaN or infinite")
        if low < 0:
            raise CodecError("bad_scale", f"a {self.name} scale is negative ({low})")
        # The largest value any stored pattern decodes to (int8's -128 included) must be finite.
        if high * self.max_code_value() > FP32_MAX:
            raise CodecError(
                "non_finite", f"a {self.name} scale of {high} decodes to values beyond fp32"
            )

    def max_code_value(self) -> float:
        """Largest ``|value / s|`` any code pattern decodes to."""
        return 128.0


class Int8Codec(AbsmaxQuantizer):
    """int8 codes ``round(x / s)`` in ``[-127, 127]`` with the parameter's shape, and one bf16
    scale per block of 64 elements by default: 1.03 bytes per element."""

    name = "int8"
    top = 127.0
    code_dtype = torch.int8

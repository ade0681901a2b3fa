"""4-bit codecs: uniform int4 and an E2M1 (FP4) grid, both blockwise absmax with bf16 scales,
two codes per byte.

Codes are signed indices ``k`` in ``[-7, 7]`` stored as two's-complement nibbles. Packing: within
each group of ``GROUP`` consecutive elements (the last group of a tensor may be shorter, ``r``
elements), byte ``j`` holds code ``j`` in its low nibble and code ``j + ceil(r / 2)`` in its high
nibble (0 where that is past the end). This is GGML's Q4_0 layout (code ``j`` with ``j + 16``)
with a long group: packing and unpacking are then a few byte operations over contiguous runs of
2048 bytes, where pairing neighbours (``2j`` with ``2j + 1``), or codes ``j`` and ``j + 32`` of a
64-element block, makes strided passes over short rows, several times slower on one core.

- ``int4``: ``x ~ k * s`` with ``s = absmax / 7``: 15 evenly spaced levels.
- ``fp4``: ``x ~ sign(k) * E2M1[|k|] * s`` with ``s = absmax / 6`` and
  ``E2M1 = (0, 0.5, 1, 1.5, 2, 3, 4, 6)``, the values of the OCP E2M1 format (sign, 2 exponent
  bits, 1 mantissa bit; stored here as the signed index rather than sign-magnitude bits). Finer
  steps near zero, coarser ones near the block's maximum: less error on heavy-tailed blocks.

Round to nearest, ties to even (for fp4: the even index, which is the even mantissa). The E2M1
grid is reached without a table: ``f(y) = y/2 + clamp(y, +-2) + clamp(y, +-4)/2`` is piecewise
linear and maps each grid value to its index and each midpoint between neighbours to a half
integer, so ``k = round(f(x / s))`` (four fp32 passes); decoding computes ``2 E2M1[k] = 4k -
clamp(k, +-4) - 2 clamp(k, +-6)`` in int8 (four byte passes). Table lookups (``index_select``) and
``bucketize`` measured 2x and 60x slower on one core.
"""

from __future__ import annotations

import torch

from diloco.core.codecs.quant import AbsmaxQuantizer, _Scratch

GROUP = 4096
"""Elements per packing group (a power of two dividing the 2**20 pieces of the worker)."""


def pack_nibbles(codes: torch.Tensor, out: torch.Tensor) -> None:
    """Pack int8 ``codes`` (values in [-8, 7]; overwritten) into ``out`` (uint8,
    ``ceil(n / 2)`` bytes) in the layout of the module docstring."""
    n = codes.numel()
    o = out.view(torch.int8)
    groups, half = n // GROUP, GROUP // 2
    if groups:
        v = codes[: groups * GROUP].view(groups, 2, half)
        ov = o[: groups * half].view(groups, half)
        torch.bitwise_left_shift(v[:, 1], 4, out=ov)
        ov.bitwise_or_(v[:, 0].bitwise_and_(15))
    rest = n - groups * GROUP
    if rest:
        t = codes[groups * GROUP :]
        ot = o[groups * half :]
        low = (rest + 1) // 2
        ot.copy_(t[:low]).bitwise_and_(15)
        ot[: rest - low].bitwise_or_(torch.bitwise_left_shift(t[low:], 4))


def unpack_nibbles(packed: torch.Tensor, codes: torch.Tensor) -> None:
    """The inverse of ``pack_nibbles``: ``codes`` (int8, n elements) from ``packed`` bytes.
    Arithmetic right shifts of int8 sign-extend each nibble."""
    n = codes.numel()
    b = packed.view(torch.int8)
    groups, half = n // GROUP, GROUP // 2
    if groups:
        bv = b[: groups * half].view(groups, half)
        v = codes[: groups * GROUP].view(groups, 2, half)
        torch.bitwise_right_shift(bv, 4, out=v[:, 1])
        torch.bitwise_left_shift(bv, 4, out=v[:, 0])
        v[:, 0].bitwise_right_shift_(4)
    rest = n - groups * GROUP
    if rest:
        bt = b[groups * half :]
        t = codes[groups * GROUP :]
        low = (rest + 1) // 2
        torch.bitwise_left_shift(bt, 4, out=t[:low])
        t[:low].bitwise_right_shift_(4)
        torch.bitwise_right_shift(bt[: rest - low], 4, out=t[low:])


class Int4Codec(AbsmaxQuantizer):
    """Uniform 4-bit: ``round(x / s)`` in ``[-7, 7]``, ``s = absmax / 7`` per block, packed two
    per byte. Parts: ``name@scale`` (bf16, one per block), ``name`` (uint8, ``ceil(n/2)``)."""

    name = "int4"
    top = 7.0
    code_dtype = torch.uint8
    group = GROUP
    shaped_codes = False

    def code_numel(self, n: int) -> int:
        return (n + 1) // 2

    def _store(self, y: torch.Tensor, codes: torch.Tensor, w: _Scratch) -> None:
        k = w.i8[: y.numel()]
        k.copy_(y)
        pack_nibbles(k, codes)

    def _load(self, codes: torch.Tensor, y: torch.Tensor, w: _Scratch) -> None:
        k = w.i8[: y.numel()]
        unpack_nibbles(codes, k)
        self._value_(k, w.f1.view(torch.int8)[: y.numel()])
        y.copy_(k)

    def _value_(self, k: torch.Tensor, spare: torch.Tensor) -> None:
        """Turn int8 code indices into ``value / (s * value_factor)`` in place."""

    def max_code_value(self) -> float:
        return 8.0  # nibble -8, never written, still decodes


class Fp4Codec(Int4Codec):
    """E2M1 grid: ``k = round(f(x / s))``, ``s = absmax / 6``; value ``sign(k) E2M1[|k|] s``.
    Same parts and packing as ``int4``."""

    name = "fp4"
    top = 6.0

    def _index_(self, y: torch.Tensor, spare: torch.Tensor) -> None:
        c = torch.clamp(y, -4.0, 4.0, out=spare)
        y.add_(c)  # y + c4
        c.clamp_(-2.0, 2.0)  # c2
        torch.add(c, y, alpha=0.5, out=y)  # c2 + (y + c4) / 2

    value_factor = 0.5

    def _value_(self, k: torch.Tensor, spare: torch.Tensor) -> None:
        # 2 * E2M1[k] = 4k - clamp(k, +-4) - 2 clamp(k, +-6): integers in [-12, 12], computed on
        # int8 (a quarter of the bytes of the same passes in fp32).
        c = torch.clamp(k, -6, 6, out=spare)
        k.bitwise_left_shift_(2).sub_(c, alpha=2)
        k.sub_(c.clamp_(-4, 4))

    def max_code_value(self) -> float:
        return 8.0  # |2 * -8 - (-2) - (-6)|: nibble -8, never written, still decodes

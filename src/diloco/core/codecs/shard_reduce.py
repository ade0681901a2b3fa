"""The arithmetic of a quantized all-reduce (docs/design/allreduce.md, "Quantized all-reduce"):
how a flat vector is cut into shards, how a shard's encoded parts sit in a byte slot, and the
three steps every rank computes the same way:

1. ``quantize_feedback_``: a member's contribution ``c`` (its weighted pseudo-gradient plus the
   residual it owes) into one slot per shard, ``c`` left holding what the codes dropped
   (``c - decode(codes)``, the member's next residual);
2. ``reduce_slots``: the sum of every member's decoded slot of one shard, in fp32, in rank order
   (the bits depend on the slots alone, never on which arrived first);
3. ``quantize_feedback_`` again on that sum (the requantization): its codes are what every rank
   decodes (``decode_slot``), so every replica ends with the same bits.

A slot holds the shard's parts in order (``BlockCodec.flat_parts``: an absmax quantizer's bf16
scales, then its codes; ``topk``'s one part of chunk records), each starting at a multiple of
``SLOT_ALIGN`` bytes; every slot of one call has the size of the largest shard's, so that one
all-to-all or all-gather of equal pieces moves them. ``topk`` is not requantized: its members'
slots are all-gathered whole and every rank sums them (``reduce_slots``). Shards start at multiples of the codec's
``align`` (its block, or int4's packing group), so a shard's codes are exactly the whole vector's
codes over its range: cutting changes no bit.

Pure tensor maths, no I/O; ``tests/unit/test_shard_reduce.py`` checks it against hand-computed
references.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diloco.core.codecs.elementwise import BlockCodec
from diloco.core.codecs.quant import AbsmaxQuantizer
from diloco.core.codecs.topk import TopKCodec

SLOT_ALIGN = 8
"""Slots start at multiples of this many bytes: the bf16 scales and the codes are read in place
(``Tensor.view`` needs the bf16 part aligned)."""


def shard_bounds(n: int, size: int, align: int) -> list[tuple[int, int]]:
    """``size`` consecutive ranges covering ``[0, n)``, each starting at a multiple of ``align``
    and as even as that allows (the last ones may be shorter, or empty)."""
    if size < 1 or align < 1 or n < 0:
        raise ValueError(f"shard_bounds needs n >= 0, size >= 1, align >= 1: {n}, {size}, {align}")
    step = -(-max(n, 1) // size)
    step = -(-step // align) * align
    return [(min(n, r * step), min(n, (r + 1) * step)) for r in range(size)]


def _layout(codec: BlockCodec, m: int) -> list[tuple[int, int, torch.dtype]]:
    """(offset, bytes, dtype) of each part of an ``m``-element shard within its slot."""
    out, offset = [], 0
    for part in codec.flat_parts(m):
        size = part.numel * part.dtype.itemsize
        out.append((offset, size, part.dtype))
        offset = -(-(offset + size) // SLOT_ALIGN) * SLOT_ALIGN
    return out


def slot_bytes(codec: BlockCodec, m: int) -> int:
    """Bytes of the slot of an ``m``-element shard: its parts, each padded."""
    offset, size, _ = _layout(codec, m)[-1]
    return -(-(offset + size) // SLOT_ALIGN) * SLOT_ALIGN


def slot_parts(codec: BlockCodec, slot: torch.Tensor, m: int) -> list[torch.Tensor]:
    """The parts of an ``m``-element shard, as views of ``slot`` (uint8)."""
    return [slot[a : a + n].view(dtype) for a, n, dtype in _layout(codec, m)]


def payload_bytes(codec: BlockCodec, m: int) -> int:
    """The bytes that carry an ``m``-element shard (its parts, without padding)."""
    return sum(n for _, n, _ in _layout(codec, m))


def quantize_feedback_(codec: BlockCodec, c: torch.Tensor, slot: torch.Tensor) -> None:
    """Encode the fp32 vector ``c`` into ``slot`` and leave in ``c`` what the codes dropped,
    ``c - decode(codes)`` (error feedback's residual; exact subtraction of an exact decode)."""
    m = c.numel()
    if m == 0:
        return
    parts = slot_parts(codec, slot, m)
    codec.encode_piece(c, parts)
    codec.add_piece_into(c, parts, -1.0, False)


def decode_slot(
    codec: BlockCodec, slot: torch.Tensor, out: torch.Tensor, *, first: bool = True
) -> None:
    """``out = decode(slot)`` (``first``) or ``out += decode(slot)``, in fp32."""
    if out.numel():
        codec.add_piece_into(out, slot_parts(codec, slot, out.numel()), 1.0, first)


def reduce_slots(codec: BlockCodec, slots: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """``out = sum_r decode(slots[r])`` in fp32, added in the order of ``slots`` (rank order)."""
    for r, slot in enumerate(slots):
        decode_slot(codec, slot, out, first=r == 0)
    if not slots:
        out.zero_()


def relative_error(codec: BlockCodec) -> float:
    """A bound on ``||decode(encode(x)) - x_kept|| / ||x||`` for any x (``x_kept``: x itself for
    a quantizer, the kept elements for ``topk``). Quantizers: each element is off by at most
    half its block's step ``s``, and ``s`` is at most ``absmax / top`` rounded up to bf16 (a
    factor ``1 + 2**-7``): a block's ``sqrt(block)`` errors of ``s / 2`` against its absmax,
    which is at most its norm. ``topk``: each kept value is off by at most ``s`` (its levels
    are the odd multiples of ``s``), ``sqrt(k)`` of them per chunk. So ``||decode(encode(x))||
    <= (1 + relative_error) ||x||``."""
    if isinstance(codec, TopKCodec):
        return codec.kept(codec.chunk) ** 0.5 / codec.top * (1 + 2**-7)
    if isinstance(codec, AbsmaxQuantizer):
        return codec.block**0.5 / (2 * codec.top) * (1 + 2**-7)
    raise ValueError(f"no quantized all-reduce for the {codec.name} codec")

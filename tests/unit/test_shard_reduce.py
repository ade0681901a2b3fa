"""The quantized all-reduce's arithmetic (``core.codecs.shard_reduce``) against hand-computed
references: shards, slots, quantize with error feedback, the fp32 sum in rank order, the
requantization, and the residuals over two rounds. Values are chosen so that every scale is a
power of two or 3/256 (exact in bf16), so each code and residual can be worked out on paper."""

from __future__ import annotations

import pytest
import torch

from diloco.core.codecs import Int4Codec, Int8Codec, TopKCodec
from diloco.core.codecs.shard_reduce import (
    decode_slot,
    payload_bytes,
    quantize_feedback_,
    reduce_slots,
    relative_error,
    shard_bounds,
    slot_bytes,
)


def test_shards_start_at_the_codecs_alignment_and_cover_the_vector() -> None:
    assert shard_bounds(10, 2, 2) == [(0, 6), (6, 10)]
    assert shard_bounds(10, 3, 4) == [(0, 4), (4, 8), (8, 10)]
    assert shard_bounds(3, 4, 2) == [(0, 2), (2, 3), (3, 3), (3, 3)]  # the last ones empty
    assert shard_bounds(9000, 2, 4096) == [(0, 8192), (8192, 9000)]  # int4's packing group
    with pytest.raises(ValueError):
        shard_bounds(4, 0, 2)


def test_a_slot_holds_the_scales_then_the_codes_padded_to_8_bytes() -> None:
    # int8, block 64, 100 elements: 2 bf16 scales (4 bytes, padded to 8), then 100 codes.
    assert payload_bytes(Int8Codec(), 100) == 104
    assert slot_bytes(Int8Codec(), 100) == 8 + 104
    # int4: 2 scales, 50 bytes of nibbles.
    assert payload_bytes(Int4Codec(), 100) == 54 and slot_bytes(Int4Codec(), 100) == 64


def quantize(c: list[float], codec: Int8Codec) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot, residual) of ``c``."""
    x = torch.tensor(c)
    slot = torch.zeros(slot_bytes(codec, x.numel()), dtype=torch.uint8)
    quantize_feedback_(codec, x, slot)
    return slot, x


def decoded(slot: torch.Tensor, n: int, codec: Int8Codec) -> list[float]:
    out = torch.empty(n)
    decode_slot(codec, slot, out)
    return out.tolist()


def test_quantize_with_feedback_leaves_what_the_codes_dropped() -> None:
    codec = Int8Codec(block=2)
    # absmax 127/128: s = 1/128; 0.501953125 * 128 = 64.25 -> 64; -0.25390625 * 128 = -32.5 ->
    # -32 (half to even).
    slot, e = quantize([0.9921875, 0.501953125, 0.9921875, -0.25390625], codec)
    assert decoded(slot, 4, codec) == [0.9921875, 0.5, 0.9921875, -0.25]
    assert e.tolist() == [0.0, 0.001953125, 0.0, -0.00390625]


def test_two_members_quantize_reduce_requantize_by_hand() -> None:
    """Two members, shards [0, 2) (rank 0) and [2, 4) (rank 1), int8 with blocks of 2."""
    codec = Int8Codec(block=2)
    c0 = [0.9921875, 0.501953125, 0.9921875, -0.25390625]
    c1 = [-0.9921875, 0.494140625, 0.49609375, 0.0]
    bounds = shard_bounds(4, 2, codec.align)
    assert bounds == [(0, 2), (2, 4)]
    slots, residuals = [], []
    for c in (c0, c1):
        x = torch.tensor(c)
        per_shard = []
        for lo, hi in bounds:
            slot = torch.zeros(slot_bytes(codec, 2), dtype=torch.uint8)
            quantize_feedback_(codec, x[lo:hi], slot)
            per_shard.append(slot)
        slots.append(per_shard)
        residuals.append(x)
    # c1 block 0: s = 1/128, 0.494140625 * 128 = 63.25 -> 63; block 1: absmax 0.49609375 =
    # 127/256, s = 1/256, codes 127 and 0 (exact).
    assert residuals[1].tolist() == [0.0, 0.001953125, 0.0, 0.0]
    average = torch.empty(4)
    for rank, (lo, hi) in enumerate(bounds):
        total = torch.empty(hi - lo)
        reduce_slots(codec, [slots[0][rank], slots[1][rank]], total)
        requant = torch.zeros(slot_bytes(codec, hi - lo), dtype=torch.uint8)
        quantize_feedback_(codec, total, requant)
        residuals[rank][lo:hi] += total  # the shard owner repays the requantization's loss
        decode_slot(codec, requant, average[lo:hi])
    # Shard 0: 0.9921875 - 0.9921875 = 0, 0.5 + 0.4921875 = 0.9921875: s = 1/128, exact.
    # Shard 1: 0.9921875 + 0.49609375 = 1.48828125 = 381/256, s = 3/256 (exact in bf16),
    # codes 127 and round(-0.25 * 256 / 3) = -21: -0.24609375.
    assert average.tolist() == [0.0, 0.9921875, 1.48828125, -0.24609375]
    assert residuals[0].tolist() == [0.0, 0.001953125, 0.0, -0.00390625]
    assert residuals[1].tolist() == [0.0, 0.001953125, 0.0, -0.00390625]
    # Nothing lost, only owed: the average plus the residuals is the exact sum.
    total = torch.tensor(c0) + torch.tensor(c1)
    assert torch.equal(average + residuals[0] + residuals[1], total)


def test_the_residuals_over_two_rounds_repay_what_the_first_dropped() -> None:
    """Round 2 adds each member's residual to its contribution: the two averages plus the last
    residuals equal the two rounds' exact sums (dyadic values: no fp32 rounding)."""
    codec = Int8Codec(block=2)
    rounds = [
        [
            [0.9921875, 0.501953125, 0.9921875, -0.25390625],
            [-0.9921875, 0.494140625, 0.49609375, 0],
        ],
        [[0.9921875, 0.25, 0.5, 0.125], [0.125, 0.25, 0.9921875, -0.126953125]],
    ]
    bounds = shard_bounds(4, 2, codec.align)
    owed = [torch.zeros(4), torch.zeros(4)]
    applied = torch.zeros(4)
    for contributions in rounds:
        slots, new = [], []
        for member, g in enumerate(contributions):
            c = torch.tensor(g) + owed[member]
            per = [torch.zeros(slot_bytes(codec, 2), dtype=torch.uint8) for _ in bounds]
            for (lo, hi), slot in zip(bounds, per, strict=True):
                quantize_feedback_(codec, c[lo:hi], slot)
            slots.append(per)
            new.append(c)
        for rank, (lo, hi) in enumerate(bounds):
            total = torch.empty(hi - lo)
            reduce_slots(codec, [slots[0][rank], slots[1][rank]], total)
            requant = torch.zeros(slot_bytes(codec, 2), dtype=torch.uint8)
            quantize_feedback_(codec, total, requant)
            new[rank][lo:hi] += total
            out = torch.empty(hi - lo)
            decode_slot(codec, requant, out)
            applied[lo:hi] += out
        owed = new
    exact = sum(torch.tensor(g) for r in rounds for g in r)
    assert isinstance(exact, torch.Tensor)
    assert torch.equal(applied + owed[0] + owed[1], exact)


def test_the_sum_is_taken_in_rank_order_whatever_the_values() -> None:
    """fp32 addition is not associative: the order of the slots sets the bits, so every rank
    sums in rank order. 127/128 (ulp 2**-24) plus 127 * 2**-32 (0.496 ulp) twice stays put;
    the two small ones first (0.99 ulp) move it up one ulp."""
    codec = Int8Codec(block=2)
    a, _ = quantize([0.9921875, 0.0], codec)
    b, _ = quantize([127 * 2.0**-32, 0.0], codec)
    forward, backward = torch.empty(2), torch.empty(2)
    reduce_slots(codec, [a, b, b], forward)
    reduce_slots(codec, [b, b, a], backward)
    assert forward[0].item() == 0.9921875
    assert backward[0].item() == 0.9921875 + 2.0**-24


def test_the_relative_error_bound_holds_for_int8_and_int4() -> None:
    gen = torch.Generator().manual_seed(3)
    for codec in (Int8Codec(), Int4Codec()):
        x = torch.randn(8192, generator=gen) * torch.rand(8192, generator=gen) ** 4
        c = x.clone()
        quantize_feedback_(codec, c, torch.zeros(slot_bytes(codec, 8192), dtype=torch.uint8))
        ratio = float(c.norm() / x.norm())
        assert 0 < ratio <= relative_error(codec), codec.name


def test_topk_slots_hold_one_record_and_sum_in_rank_order_by_hand() -> None:
    """topk with chunks of 4 keeping 2 at 2 bits (levels -3s, -s, s, 3s): the slot holds the
    chunk's one record, and two members' decoded parts sum as they are (no requantization:
    every rank decodes every member's slot)."""
    codec = TopKCodec(density=0.5, chunk=4, bits=2)
    # A record of 2 bytes of scale, two 2-bit positions in 1 byte, two 2-bit codes in 1 byte,
    # padded to 8.
    assert payload_bytes(codec, 4) == 4 and slot_bytes(codec, 4) == 8
    # Member 0 keeps 3.0 and 0.875: s = 1; (0.875 / 1 + 3) / 2 = 1.9375 -> code 2 -> 1.0.
    slot0, e0 = quantize_topk([0.875, -0.125, 0.25, 3.0], codec)
    assert e0.tolist() == [-0.125, -0.125, 0.25, 0.0]
    # Member 1 keeps 1.5 and 0.5: s = 0.5, exact.
    slot1, e1 = quantize_topk([0.5, 1.5, 0.0, 0.0], codec)
    assert e1.tolist() == [0.0, 0.0, 0.0, 0.0]
    total = torch.empty(4)
    reduce_slots(codec, [slot0, slot1], total)
    assert total.tolist() == [1.5, 1.5, 0.0, 3.0]
    assert relative_error(codec) == pytest.approx(2**0.5 / 3 * (1 + 2**-7))


def quantize_topk(c: list[float], codec: TopKCodec) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.tensor(c)
    slot = torch.zeros(slot_bytes(codec, x.numel()), dtype=torch.uint8)
    quantize_feedback_(codec, x, slot)
    return slot, x

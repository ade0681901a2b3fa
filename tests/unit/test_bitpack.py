"""Packed positions (core/codecs/bitpack.py): by hand at 12 and 3 bits, against a bit-by-bit
reference at every width from 1 to 16 and many row lengths, the padding check, and widths."""

from __future__ import annotations

import random

import pytest
import torch

from diloco.core.codecs.bitpack import (
    pack_rows,
    packed_bytes,
    padding_clear,
    unpack_rows,
    width_of,
)


def packed(values: list[list[int]], width: int) -> list[list[int]]:
    k = len(values[0])
    out = torch.full((len(values), packed_bytes(k, width)), 0xAA, dtype=torch.uint8)
    pack_rows(torch.tensor(values), width, out)
    return out.tolist()


def reference(row: list[int], width: int) -> list[int]:
    """One row, bit by bit: value t at bits [t * width, (t + 1) * width), little-endian."""
    stream = 0
    for t, v in enumerate(row):
        stream |= v << (t * width)
    return list(stream.to_bytes(packed_bytes(len(row), width), "little"))


def test_twelve_bits_by_hand() -> None:
    # 0xABC, 0x123 -> bits 0xABC | 0x123 << 12 = 0x123ABC: bytes BC 3A 12; a third value
    # 0xFFF fills 36 bits: 5 bytes, the last byte's top 4 bits zero.
    assert packed([[0xABC, 0x123]], 12) == [[0xBC, 0x3A, 0x12]]
    assert packed([[0xABC, 0x123, 0xFFF]], 12) == [[0xBC, 0x3A, 0x12, 0xFF, 0x0F]]


def test_three_bits_by_hand_rows_apart() -> None:
    # Row 0: 5, 2, 7 -> 5 | 2 << 3 | 7 << 6 = 0x1D5: bytes D5 01. Row 1 starts on its own byte.
    assert packed([[5, 2, 7], [1, 0, 0]], 3) == [[0xD5, 0x01], [0x01, 0x00]]


@pytest.mark.parametrize("width", range(1, 17))
def test_every_width_matches_the_bit_by_bit_reference(width: int) -> None:
    rng = random.Random(width)
    for k in (1, 2, 3, 7, 8, 9, 16, 17, 63, 64):
        rows = [[rng.randrange(1 << width) for _ in range(k)] for _ in range(3)]
        got = packed(rows, width)
        assert got == [reference(r, width) for r in rows], k
        data = torch.tensor(got, dtype=torch.uint8)
        assert unpack_rows(data, k, width).tolist() == rows
        assert padding_clear(data, k, width)


def test_into_strided_views_of_records() -> None:
    # Each row's packed bytes sit inside a wider record (as topk's do): nothing around them moves.
    records = torch.full((4, 7), 0x55, dtype=torch.uint8)
    values = torch.tensor([[1, 2], [3, 4], [4095, 0], [7, 4000]])
    pack_rows(values, 12, records[:, 2:5])
    assert torch.equal(unpack_rows(records[:, 2:5], 2, 12), values)
    assert bool((records[:, :2] == 0x55).all()) and bool((records[:, 5:] == 0x55).all())


def test_a_set_padding_bit_is_seen() -> None:
    data = torch.tensor(packed([[5, 2, 7], [1, 0, 0]], 3), dtype=torch.uint8)
    assert padding_clear(data, 3, 3)
    data[1, 1] |= 0x02  # bit 9 of a row of 9 bits
    assert not padding_clear(data, 3, 3)
    assert padding_clear(torch.zeros(2, 3, dtype=torch.uint8), 2, 12)  # 24 bits: no padding


def test_widths() -> None:
    assert [width_of(n) for n in (1, 2, 1024, 4096, 65536)] == [1, 1, 10, 12, 16]
    for bad in (0, 3, 1 << 17):
        with pytest.raises(ValueError, match="power of two"):
            width_of(bad)

"""``core.crc.crc32_combine`` against ``zlib.crc32`` of the concatenated bytes."""

from __future__ import annotations

import random
import zlib

import pytest

from diloco.core.crc import crc32_combine


@pytest.mark.parametrize("sizes", [(0, 0), (5, 0), (0, 7), (1, 1), (13, 4096), (100000, 3)])
def test_two_pieces_combine_to_the_crc_of_both(sizes: tuple[int, int]) -> None:
    rng = random.Random(sum(sizes))
    a = bytes(rng.getrandbits(8) for _ in range(sizes[0]))
    b = bytes(rng.getrandbits(8) for _ in range(sizes[1]))
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_many_pieces_fold_left_to_the_crc_of_the_whole() -> None:
    rng = random.Random(7)
    data = bytes(rng.getrandbits(8) for _ in range(20011))
    cuts = sorted(rng.sample(range(1, len(data)), 9))
    crc = zlib.crc32(b"header;")
    for lo, hi in zip([0, *cuts], [*cuts, len(data)], strict=True):
        crc = crc32_combine(crc, zlib.crc32(data[lo:hi]), hi - lo)
    assert crc == zlib.crc32(data, zlib.crc32(b"header;"))


def test_lengths_beyond_32_bits_combine_associatively() -> None:
    # No buffer of 2**33 bytes here: the CRC of zeros that long is built by doubling, and the
    # two ways of appending it twice must agree (exercises the powers table past 2**32).
    zeros, length = zlib.crc32(bytes(1 << 20)), 1 << 20
    while length < 1 << 33:
        zeros, length = crc32_combine(zeros, zeros, length), 2 * length
    head = zlib.crc32(b"x")
    step_by_step = crc32_combine(crc32_combine(head, zeros, length), zeros, length)
    at_once = crc32_combine(head, crc32_combine(zeros, zeros, length), 2 * length)
    assert step_by_step == at_once
    assert step_by_step != crc32_combine(head, zeros, length)


def test_a_negative_length_is_refused() -> None:
    with pytest.raises(ValueError, match="not negative"):
        crc32_combine(1, 2, -1)

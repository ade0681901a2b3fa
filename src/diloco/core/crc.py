"""Putting a CRC-32 together from the CRCs of its pieces (``crc32_combine``): the state hash of
a tensor whose bytes lie on several ranks (docs/design/groups.md, "Sharded groups in all-reduce
mode"), where each rank checksums its own run of the flat tensor and rank 0 joins the values,
so the hash equals ``wire.checksum`` of the whole tensor without the tensor ever being whole.

The maths is zlib's (1.2.12 and later, ``crc32_combine``): CRC-32 is linear over GF(2), and the
CRC of ``a + b`` is the CRC of ``a`` times ``x**(8 * len(b))`` modulo the CRC polynomial, plus
the CRC of ``b``. Polynomials are in the reflected bit order zlib uses (bit 31 is ``x**0``).
Python's ``zlib`` module does not expose the combination; it costs about 32 multiplications
of 32 bits per piece here, microseconds.
"""

from __future__ import annotations

POLY = 0xEDB88320
"""CRC-32's polynomial (IEEE 802.3, reflected): the one ``zlib.crc32`` uses."""

ONE = 1 << 31
"""The polynomial 1 (``x**0``) in the reflected order."""


def _times(a: int, b: int) -> int:
    """``a * b`` modulo ``POLY`` (both reflected polynomials of degree below 32)."""
    product = 0
    mask = ONE
    while a:
        if a & mask:
            product ^= b
            a ^= mask
        mask >>= 1
        b = (b >> 1) ^ POLY if b & 1 else b >> 1
    return product


def _powers() -> tuple[int, ...]:
    """``x**(2**k)`` modulo ``POLY`` for k in [0, 64)."""
    out = []
    p = ONE >> 1  # x**1
    for _ in range(64):
        out.append(p)
        p = _times(p, p)
    return tuple(out)


_X_2K = _powers()


def _x_to_8n(n: int) -> int:
    """``x**(8 * n)`` modulo ``POLY``: the shift a CRC undergoes as ``n`` bytes follow it."""
    if n < 0:
        raise ValueError(f"a length is not negative, got {n}")
    p = ONE
    k = 3  # 8 * n = n * 2**3
    while n:
        if n & 1:
            p = _times(_X_2K[k % 64], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``a + b`` from ``crc1 = crc32(a)``, ``crc2 = crc32(b)`` and ``len(b)``
    (the length of ``a`` does not matter)."""
    return _times(_x_to_8n(len2), crc1) ^ crc2 if len2 else crc1

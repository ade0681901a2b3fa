"""Small unsigned integers packed ``width`` bits each, row by row: the sparse codecs' positions
(``topk``'s index within a chunk of ``2**width`` elements, the sparse downlink's within a span).

Layout: the values of a row form one little-endian bit stream, value ``t`` at bits
``[t * width, (t + 1) * width)``, and the row ends on a whole byte (``packed_bytes``), its unused
high bits zero. Rows are independent, so a chunk-aligned range of a tensor owns whole bytes.

Vectorized with no per-row or per-value Python loop: values are taken ``g`` at a time, the
fewest whose bits fill whole bytes (``8 / gcd(width, 8)``: 2 values in 3 bytes at 12 bits, 8 in
``width`` bytes at odd widths), and combined into int64 words, a low one (bits 0-63) and, for a
group wider than 64 bits (odd widths above 8), a high one; the words' little-endian bytes are
the packed bytes. The Python loop runs over the ``g`` slots of a group only. int64 shifts wrap
(two's complement), which is what the low word wants; unpacking masks what an arithmetic right
shift drags in.
"""

from __future__ import annotations

import math

import torch

MAX_WIDTH = 16
"""Widest value (positions within a chunk or span of at most 65536 elements)."""


def width_of(length: int) -> int:
    """Bits that a position within ``length`` (a power of two) needs: ``log2(length)``, at least 1."""
    if length < 1 or length & (length - 1) or length > 1 << MAX_WIDTH:
        raise ValueError(f"length must be a power of two from 1 to {1 << MAX_WIDTH}, got {length}")
    return max(1, length.bit_length() - 1)


def packed_bytes(k: int, width: int) -> int:
    """Bytes of one row of ``k`` values of ``width`` bits."""
    return -(-k * width // 8)


def _group(width: int) -> tuple[int, int]:
    """Values per group and int64 words per group."""
    g = 8 // math.gcd(width, 8)
    return g, 1 if g * width <= 64 else 2


def pack_rows(values: torch.Tensor, width: int, out: torch.Tensor) -> None:
    """Pack ``values`` (rows x k, any integer dtype, each in ``[0, 2**width)``) into ``out``
    (uint8, rows x ``packed_bytes(k, width)``, may be a strided view)."""
    rows, k = values.shape
    if k == 0:
        return
    g, nw = _group(width)
    groups = -(-k // g)
    v = torch.zeros(rows, groups * g, dtype=torch.int64, device=values.device)
    v[:, :k] = values
    v = v.view(rows, groups, g)
    words = torch.zeros(rows, groups, nw, dtype=torch.int64, device=values.device)
    lo, hi = words[:, :, 0], words[:, :, nw - 1]
    for t in range(g):
        at, x = t * width, v[:, :, t]
        if at < 64:
            lo.bitwise_or_(x.bitwise_left_shift(at))  # wraps past bit 63: the high word's part
        if at + width > 64:
            if at >= 64:
                hi.bitwise_or_(x.bitwise_left_shift(at - 64))
            else:
                hi.bitwise_or_(x.bitwise_right_shift(64 - at))
    nb = g * width // 8
    data = words.view(torch.uint8).view(rows, groups, 8 * nw)[:, :, :nb]
    out.copy_(data.reshape(rows, groups * nb)[:, : out.shape[1]])


def unpack_rows(data: torch.Tensor, k: int, width: int) -> torch.Tensor:
    """The inverse of ``pack_rows``: ``data`` (uint8, rows x ``packed_bytes(k, width)``) to
    int64 values, rows x ``k``. Padding bits are ignored (``padding_clear`` checks them)."""
    rows = data.shape[0]
    if k == 0:
        return torch.zeros(rows, 0, dtype=torch.int64, device=data.device)
    g, nw = _group(width)
    groups, nb = -(-k // g), g * width // 8
    raw = torch.zeros(rows, groups, 8 * nw, dtype=torch.uint8, device=data.device)
    flat = raw[:, :, :nb]
    if data.shape[1] == groups * nb:
        flat.copy_(data.reshape(rows, groups, nb))
    else:  # the last group is short: pad it with zeros
        tmp = torch.zeros(rows, groups * nb, dtype=torch.uint8, device=data.device)
        tmp[:, : data.shape[1]] = data
        flat.copy_(tmp.view(rows, groups, nb))
    words = raw.view(torch.int64)  # rows x groups x nw
    lo, hi = words[:, :, 0], words[:, :, nw - 1]
    mask = (1 << width) - 1
    out = torch.empty(rows, groups, g, dtype=torch.int64, device=data.device)
    for t in range(g):
        at, x = t * width, out[:, :, t]
        if at + width <= 64:
            torch.bitwise_right_shift(lo, at, out=x)
        elif at >= 64:
            torch.bitwise_right_shift(hi, at - 64, out=x)
        else:  # straddles: low bits from lo's top, high bits from hi's bottom
            torch.bitwise_right_shift(lo, at, out=x)
            x.bitwise_and_((1 << (64 - at)) - 1)
            x.bitwise_or_(hi.bitwise_left_shift(64 - at))
        x.bitwise_and_(mask)
    return out.view(rows, groups * g)[:, :k]


def padding_clear(data: torch.Tensor, k: int, width: int) -> bool:
    """Whether every row's bits past its ``k * width`` are zero (``data`` as in
    ``unpack_rows``): a packer writes zeros there, so a set bit means a forged or garbled row."""
    used = k * width % 8
    if used == 0 or data.numel() == 0:
        return True
    return int(data[:, -1].bitwise_right_shift(used).amax()) == 0

"""A sparse downlink: a round of plain averaged descent over sparse uploads, published as the
positions that changed and their new values (issue 30 item 3; docs/design/codecs.md,
"The sparse update").

Under plain averaged descent (``--outer-rule sparseloco``, or outer momentum 0) the outer step
is ``p += (-lr) * (S / W)`` per element, ``S`` the round's fp32 sum of decoded uploads. Where
``S`` is ``+0`` the step adds ``-0`` and ``p`` keeps its bits, whatever ``p`` (``-0 + -0`` is
``-0``); where ``S`` is ``-0`` a ``p`` of ``-0`` would become ``+0``. So the *support* is every
position whose sum has any bit set (``S.view(int32) != 0``): a superset of where ``p`` changed,
and outside it ``p`` is bitwise unchanged. With ``topk`` uploads it is the union of the round's
kept positions (or less, where uploads cancel to ``+0``).

The update carries, per flat ``SPAN`` of a parameter, how many positions it holds, the
positions within the span (strictly ascending, packed ``INDEX_BITS`` = 12 bits each: one bit
stream per parameter, ``bitpack.py``) and the *new* fp32 values the server's step wrote there,
not differences: a replica copies them into its snapshot by index, with no
arithmetic, so it is bit-identical by construction on any device (no summation order, no fused
multiply-add to agree on), and nothing is dropped, so the server keeps no true copy. The round's
checksum still guards the whole (a position the support missed, a replica that missed a round).

Per parameter of ``n`` elements, with ``m`` changed positions, the parts (``Part``s, in a body
named ``name + suffix``):

- ``name@count``: uint16 ``[ceil(n / SPAN)]``, positions per span;
- ``name@idx``: uint8 ``[ceil(12 m / 8)]``, each span's positions within it, spans in order, as
  one stream of 12-bit fields (the last byte's unused high bits zero);
- ``name``: fp32 ``[m]``, the new values.

That is 5.5 bytes per changed element (6 with uint16 positions) and 2 per ``SPAN`` elements:
below the dense 4 bytes per element while fewer than about 70% of the elements changed (the
server serves full parameters otherwise). The body's metadata names ``codec_index_bits``: a
worker refuses an update without it (``bad_update``, from an older server) and, like an older
worker refusing this layout, downloads full parameters instead. Pure: no I/O; ``check_update``
refuses a malformed update before ``apply_changes`` touches anything.
"""

from __future__ import annotations

import math

import torch

from diloco.core.codecs.base import CHUNK, CodecError, Part
from diloco.core.codecs.bitpack import pack_rows, packed_bytes, padding_clear, unpack_rows

SPARSE_UPDATE = "sparse"
"""The download codec's name (``diloco server --download-codec sparse``), and ``codec`` in an
update body's ``__metadata__``."""

COUNT = "@count"
INDEX = "@idx"
INDEX_BITS = 12
SPAN = 1 << INDEX_BITS
"""Elements per span: positions within it fit 12 bits exactly (0 to 4095), so a span needs no
range check of its own and only a parameter's last, shorter span can hold an index too large."""
PACK = CHUNK
"""Positions packed or unpacked at a time (a multiple of 8: a piece starts on a whole byte)."""


def spans(n: int) -> int:
    """Spans of a parameter of ``n`` elements (the length of its ``@count`` part)."""
    return -(-n // SPAN)


def index_bytes(m: int) -> int:
    """Bytes of ``m`` packed positions (the length of an ``@idx`` part)."""
    return packed_bytes(m, INDEX_BITS)


def parts(n: int, m: int) -> list[Part]:
    """The parts of a parameter of ``n`` elements with ``m`` changed positions, in body order."""
    return [
        Part(COUNT, torch.uint16, (spans(n),)),
        Part(INDEX, torch.uint8, (index_bytes(m),)),
        Part("", torch.float32, (m,)),
    ]


def update_bytes(n: int, m: int) -> int:
    """Payload bytes of one parameter's update (alignment padding aside)."""
    return 2 * spans(n) + index_bytes(m) + 4 * m


def metadata() -> dict[str, str]:
    """What an update body's ``__metadata__`` says of its format (beside ``kind``, ``round``)."""
    return {"codec": SPARSE_UPDATE, "codec_index_bits": str(INDEX_BITS)}


def pack_positions(within: torch.Tensor) -> torch.Tensor:
    """Positions within their spans (any integer dtype, each below ``SPAN``) as the ``@idx``
    part, ``PACK`` at a time."""
    m = within.numel()
    out = torch.empty(packed_bytes(m, INDEX_BITS), dtype=torch.uint8)
    step = PACK * INDEX_BITS // 8
    for a in range(0, m, PACK):
        piece = within[a : a + PACK]
        at = a // PACK * step
        dst = out[at : at + packed_bytes(piece.numel(), INDEX_BITS)]
        pack_rows(piece.view(1, -1), INDEX_BITS, dst.view(1, -1))
    return out


def unpack_positions(idx: torch.Tensor, m: int) -> torch.Tensor:
    """The inverse of ``pack_positions``: int64 positions within their spans."""
    out = torch.empty(m, dtype=torch.int64)
    step = PACK * INDEX_BITS // 8
    for a in range(0, m, PACK):
        k = min(PACK, m - a)
        at = a // PACK * step
        data = idx[at : at + packed_bytes(k, INDEX_BITS)].view(1, -1)
        out[a : a + k] = unpack_rows(data, k, INDEX_BITS)[0]
    return out


@torch.no_grad()
def encode_changes(
    sums: torch.Tensor, new: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The update of one parameter: ``(counts, idx, values)`` for every position where the
    round's sum ``sums`` (fp32) has a bit set, with ``new``'s values there (the parameter after
    the step, same shape). Works ``CHUNK`` elements at a time (a multiple of ``SPAN``), so the
    scratch is one chunk's mask and positions."""
    s = sums.reshape(-1)
    v = new.reshape(-1)
    n = s.numel()
    if v.numel() != n or s.dtype != torch.float32 or v.dtype != torch.float32:
        raise ValueError(f"sums and new values must be fp32 of {n} elements each")
    bits = s.view(torch.int32)
    positions, values = [], []
    for a in range(0, n, CHUNK):
        pos = torch.nonzero(bits[a : a + CHUNK]).view(-1)
        positions.append(pos.add_(a))
        values.append(v[a : a + CHUNK].index_select(0, pos - a))
    pos = torch.cat(positions) if positions else torch.empty(0, dtype=torch.int64)
    counts = torch.bincount(pos // SPAN, minlength=spans(n)).to(torch.uint16)
    idx = pack_positions(pos % SPAN)
    out = torch.cat(values) if values else torch.empty(0, dtype=torch.float32)
    return counts, idx, out


def check_update(n: int, counts: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> None:
    """Refuse (``CodecError``) an update that does not describe distinct positions of a parameter
    of ``n`` elements with finite values: wrong dtypes or lengths (``bad_shape``: counts that
    exceed their span or do not add up to the positions sent, as a truncated body's would not,
    packed positions of another length than the values'), positions outside the parameter,
    repeated or out of order within their span, or the packed stream's padding bits set
    (``bad_index``), a NaN or infinite value (``non_finite``; a server never publishes one)."""
    if counts.dtype != torch.uint16 or idx.dtype != torch.uint8 or values.dtype != torch.float32:
        raise CodecError(
            "bad_dtype",
            f"a sparse update is uint16 counts, uint8 packed indices, fp32 values; got "
            f"{counts.dtype}, {idx.dtype}, {values.dtype}",
        )
    if counts.dim() != 1 or counts.numel() != spans(n):
        raise CodecError(
            "bad_shape",
            f"a sparse update of {n} elements has {spans(n)} counts, got {tuple(counts.shape)}",
        )
    m = values.numel()
    if idx.dim() != 1 or values.dim() != 1 or idx.numel() != index_bytes(m):
        raise CodecError(
            "bad_shape",
            f"sparse update: {tuple(idx.shape)} bytes of {INDEX_BITS}-bit indices for "
            f"{tuple(values.shape)} values",
        )
    c = counts.to(torch.int64)
    if spans(n) and int(c.max()) > SPAN:
        raise CodecError("bad_shape", "a sparse update's count exceeds its span")
    total = int(c.sum())
    if total != m:
        raise CodecError(
            "bad_shape", f"a sparse update's counts add up to {total}, but {m} indices came"
        )
    if m == 0:
        return
    if not padding_clear(idx.view(1, -1), m, INDEX_BITS):
        raise CodecError("bad_index", "a sparse update's packed indices have padding bits set")
    pos = _positions(c, idx, m)
    if int(pos[-1]) >= n or (m > 1 and int(pos.diff().min()) <= 0):
        why = "outside its parameter" if int(pos.max()) >= n else "repeated or out of order"
        raise CodecError(
            "bad_index", f"a sparse update's index is {why} (a parameter of {n} elements)"
        )
    low, high = (float(x) for x in torch.aminmax(values))
    if not (math.isfinite(low) and math.isfinite(high)):
        raise CodecError("non_finite", "a sparse update's value is NaN or infinite")


def _positions(counts: torch.Tensor, idx: torch.Tensor, m: int) -> torch.Tensor:
    """Flat int64 positions: each index plus its span's start (``counts`` int64, already
    checked to add up to ``m``, the values' count)."""
    starts = torch.arange(counts.numel(), dtype=torch.int64) * SPAN
    return unpack_positions(idx, m).add_(torch.repeat_interleave(starts, counts))


@torch.no_grad()
def apply_changes(
    published: torch.Tensor, counts: torch.Tensor, idx: torch.Tensor, values: torch.Tensor
) -> None:
    """Write ``values`` into ``published`` (flat-viewable fp32) at the update's positions: a
    copy, no arithmetic. Call ``check_update`` first: this one trusts its input."""
    if values.numel() == 0:
        return
    pos = _positions(counts.to(torch.int64), idx, values.numel())
    published.view(-1).index_copy_(0, pos, values.view(-1))

"""Chunked top-k sparsification with few-bit values: SparseLoCo's upload (arXiv 2508.15706).

A tensor is flattened and cut into chunks of ``chunk`` elements (the last may be shorter, ``r``
elements). Each chunk keeps its ``k = max(1, round(density * length))`` largest-magnitude
elements: a count fixed by the chunk's length, so ``parts(shape)`` depends on the shape and the
options alone and a server checks a body's header before its payload, as for every codec.

One part, named like the parameter: uint8, one fixed-size *record* per chunk (the last chunk's
shorter), so a chunk-aligned piece owns whole bytes and a body's header carries one entry per
parameter (at the quality suite's 137k parameters, three entries per tensor made the header
weigh more than the payload: docs/benchmarks.md, "Sparse top-k codec"). A record:

- 2 bytes: the chunk's bf16 scale ``s = absmax(kept) / top`` rounded *up* (as the quantizers
  do: ``|x / s| <= top`` then holds, no code needs clamping), little-endian;
- ``ceil(k * w / 8)`` bytes: the kept positions within the chunk, strictly ascending, packed
  ``w = log2(chunk)`` bits each (at least 1; ``bitpack.py``; 12 at 4096), unused high bits zero;
- ``ceil(k / (8 / bits))`` bytes: the ``bits``-bit codes, ``8 / bits`` per byte.

``w`` travels as the option ``index_bits`` (``codec_index_bits`` in a body's metadata): a peer
from before the packing refuses the option by name (400 ``bad_option``), and this one refuses a
topk codec that does not name it (``required_options``), so the two formats never meet.

Values: a code ``j`` in ``[0, 2**bits - 1]`` stands for ``(2j - top) * s`` with
``top = 2**bits - 1``: the odd integers from ``-top`` to ``top``, symmetric and without zero
(a kept element is among its chunk's largest, so a zero level would waste one of 2-bit's four
codes); ``j = round((x / s + top) / 2)``, ties to even. ``(2j - top) * s`` is an integer of at
most 8 significant bits times a bf16 scale: exact in fp32, the same bits on every device.

Decoding scatters: ``add_into`` works ``CHUNK`` elements at a time, gathers the sum's elements at
the kept positions, adds with ``accumulate_`` (the arithmetic every contribution goes through)
and writes them back, so the scratch is the kept elements of one ``CHUNK`` (about 1.5% of it at
SparseLoCo's density) and no full-size temporary exists. Pieces (``BlockCodec``) are ranges
aligned to ``chunk``, a power of two so that it divides the worker's ``PIECE`` of 2**20.

Elsewhere: the SparseLoCo outer rule (``core/outer_rules.py``), the sparse downlink
(``sparse_update.py``; ``sparse`` keeps this codec itself out of ``check_download_codec``), and
the all-reduce mode, which all-gathers members' encoded buckets (``core/codecs/shard_reduce.py``,
``worker/allreduce/quantized.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from diloco.core.accumulate import accumulate_
from diloco.core.codecs.base import CHUNK, CodecError, Part
from diloco.core.codecs.bitpack import pack_rows, packed_bytes, padding_clear, unpack_rows, width_of
from diloco.core.codecs.elementwise import BlockCodec
from diloco.core.codecs.quant import FP32_MAX, round_up_bf16
from diloco.core.workspace import Workspace, scratch

BITS = (2, 4, 8)
MAX_CHUNK = 1 << 16
"""Positions within a chunk are packed in at most 16 bits."""
DEFAULT_DENSITY = 0.0156
DEFAULT_CHUNK = 4096
DEFAULT_BITS = 2
SCALE_BYTES = 2
"""A record's bf16 scale."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def group_size(length: int, k: int) -> int:
    """Elements per group for ``top_positions`` on rows of ``length``: the power of two ``g``
    nearest ``sqrt(length / k)`` from below (so ``length / g`` group maxima and ``k * g``
    candidates are each at most ``length / g``), 1 where grouping buys nothing."""
    g = 1
    while (2 * g) ** 2 * k <= length and length % (2 * g) == 0:
        g *= 2
    return g


def top_positions(mag: torch.Tensor, k: int) -> torch.Tensor:
    """The positions of ``k`` largest values of each row of ``mag`` (rows x length, the int32
    magnitude bits), in no particular order.

    In two ``torch.topk`` calls on short rows instead of one on the whole row (whose CPU
    kernel costs about 3.5 ns per element, most of a topk round's CPU): each row is cut into
    groups of ``g`` (``group_size``), the ``k`` groups with the largest maxima are kept, and the
    ``k`` largest of their ``k * g`` elements are taken. Exact: an element among its row's
    ``k`` largest lies in a group whose maximum is at least its value, and at most ``k`` groups
    hold such elements, so those groups are among the ``k`` kept (with ties at the ``k``-th
    value, the result is still ``k`` elements none smaller than any left out, possibly other
    tied ones than a single ``topk`` picks: ties are not ordered by either). Deterministic."""
    rows, length = mag.shape
    g = group_size(length, k)
    if g == 1:
        return torch.topk(mag, k, dim=1, sorted=False).indices
    groups = mag.view(rows, length // g, g)
    best = torch.topk(groups.amax(2), k, dim=1, sorted=False).indices
    cand = groups.gather(1, best[:, :, None].expand(rows, k, g)).reshape(rows, k * g)
    sel = torch.topk(cand, k, dim=1, sorted=False).indices
    shift = g.bit_length() - 1
    within = sel.bitwise_and(g - 1)
    return best.gather(1, sel.bitwise_right_shift_(shift)).bitwise_left_shift_(shift).add_(within)


class TopKCodec(BlockCodec):
    """Chunked top-k, values at ``bits`` bits with one bf16 scale per chunk and positions packed
    in ``index_bits`` bits (module docstring). One part: ``name``, uint8 records."""

    name = "topk"
    lossy = True
    shaped_codes = False
    sparse = True
    required_options = ("index_bits",)

    def __init__(
        self,
        density: float = DEFAULT_DENSITY,
        chunk: int = DEFAULT_CHUNK,
        bits: int = DEFAULT_BITS,
        index_bits: int | None = None,
    ) -> None:
        density, chunk, bits = float(density), int(chunk), int(bits)
        if not 0.0 < density <= 1.0:  # NaN fails this too
            raise ValueError(f"density must be in (0, 1], got {density}")
        if not 1 <= chunk <= MAX_CHUNK or chunk & (chunk - 1):
            raise ValueError(f"chunk must be a power of two from 1 to {MAX_CHUNK}, got {chunk}")
        if bits not in BITS:
            raise ValueError(f"bits must be one of {', '.join(map(str, BITS))}, got {bits}")
        width = width_of(chunk)
        if index_bits is not None and int(index_bits) != width:
            # One packing per chunk size: a peer naming another is another format.
            raise ValueError(
                f"index_bits must be {width} (log2 of chunk {chunk}, at least 1), got {index_bits}"
            )
        self.density, self.chunk, self.bits, self.index_bits = density, chunk, bits, width
        self.align = chunk
        self.top = float((1 << bits) - 1)
        self.per_byte = 8 // bits

    def options(self) -> dict[str, str]:
        return {
            "density": repr(self.density),
            "chunk": str(self.chunk),
            "bits": str(self.bits),
            "index_bits": str(self.index_bits),
        }

    # --- layout ------------------------------------------------------------------------------

    def kept(self, length: int) -> int:
        """Elements a chunk of ``length`` keeps (0 for an empty one)."""
        return max(1, round(self.density * length)) if length else 0

    def code_bytes(self, k: int) -> int:
        """Bytes of one chunk's ``k`` codes."""
        return _ceil_div(k, self.per_byte)

    def index_bytes(self, k: int) -> int:
        """Bytes of one chunk's ``k`` packed positions."""
        return packed_bytes(k, self.index_bits)

    def record(self, length: int) -> int:
        """Bytes of the record of a chunk of ``length`` elements (0 for an empty one)."""
        k = self.kept(length)
        return SCALE_BYTES + self.index_bytes(k) + self.code_bytes(k) if length else 0

    def flat_parts(self, n: int) -> list[Part]:
        full, rest = divmod(n, self.chunk)
        return [Part("", torch.uint8, (full * self.record(self.chunk) + self.record(rest),))]

    def _spans(self, n: int) -> list[tuple[int, int, int, int]]:
        """Runs of equal chunks, each at most ``CHUNK`` elements: ``(start, rows, length, byte)``,
        ``byte`` where the run's first record begins."""
        full, rest = divmod(n, self.chunk)
        size = self.record(self.chunk)
        step = max(1, CHUNK // self.chunk)
        out = [
            (c * self.chunk, min(step, full - c), self.chunk, c * size)
            for c in range(0, full, step)
        ]
        if rest:
            out.append((full * self.chunk, 1, rest, full * size))
        return out

    def _fields(
        self, data: torch.Tensor, at: int, rows: int, length: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """The ``rows`` records of chunks of ``length`` from byte ``at`` of ``data``, as strided
        views: scale bytes (rows x 2), packed positions, codes; and their ``k``."""
        k, size = self.kept(length), self.record(length)
        rec = data[at : at + rows * size].view(rows, size)
        ib = SCALE_BYTES + self.index_bytes(k)
        return rec[:, :SCALE_BYTES], rec[:, SCALE_BYTES:ib], rec[:, ib:], k

    # --- encode ------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_piece(
        self,
        piece: torch.Tensor,
        out: Sequence[torch.Tensor] | None = None,
        work: Workspace | None = None,
    ) -> list[torch.Tensor]:
        piece = piece.reshape(-1)
        if piece.dtype != torch.float32:
            piece = piece.float()  # round_up_bf16 reads fp32 bits
        n = piece.numel()
        (data,) = self.empty_parts(n, piece.device) if out is None else out
        for start, rows, length, at in self._spans(n):
            scale, index, codes, k = self._fields(data, at, rows, length)
            x = piece[start : start + rows * length].view(rows, length)
            mag = scratch(work, "topk.mag", torch.int32, x.numel(), x.device).view(x.shape)
            self._encode_rows(x, mag, k, scale, index, codes)
        return [data]

    def _encode_rows(
        self,
        x: torch.Tensor,
        mag: torch.Tensor,
        k: int,
        scale: torch.Tensor,
        index: torch.Tensor,
        codes: torch.Tensor,
    ) -> None:
        """Each row of ``x`` is one chunk: its ``k`` kept positions, scale and codes into its
        record's fields (``mag``: scratch of ``x``'s shape)."""
        # |x| on the int32 bits (the sign bit cleared): non-negative floats order as their bits
        # (NaN above all), and torch.topk on int32 ran 12% faster than on fp32 on one core.
        torch.bitwise_and(x.view(torch.int32), 0x7FFFFFFF, out=mag)
        pos = top_positions(mag, k).sort(dim=1).values  # ascending: the order a receiver checks
        values = x.gather(1, pos)
        amax = mag.gather(1, pos).amax(1).view(torch.float32).div_(self.top)
        scales = torch.empty(amax.shape, dtype=torch.bfloat16, device=x.device)
        round_up_bf16(amax, scales, torch.empty(amax.shape, dtype=torch.int32, device=x.device))
        scale.copy_(scales.view(torch.uint8).view(scale.shape))
        inv = amax.copy_(scales).reciprocal_()
        inv.nan_to_num_(nan=0.0, posinf=0.0)  # an all-zero chunk: scale 0, every value 0
        # j = round((x / s + top) / 2): |x / s| <= top, so j is in [0, top]; the clamp only
        # absorbs the last bit of 1 / s.
        q = values.mul_(inv[:, None]).add_(self.top).mul_(0.5).round_().clamp_(0.0, self.top)
        pack_rows(pos, self.index_bits, index)
        self._pack(q.to(torch.uint8), codes)

    def _pack(self, j: torch.Tensor, codes: torch.Tensor) -> None:
        """Codes ``j`` (uint8, rows x k) into ``codes`` (rows x ceil(k / per_byte)): byte ``m``
        of a row holds its codes ``m * per_byte + t`` at bit ``t * bits``."""
        rows, k = j.shape
        if self.per_byte == 1:
            codes.copy_(j)
            return
        padded = torch.zeros(
            rows, codes.shape[1] * self.per_byte, dtype=torch.uint8, device=j.device
        )
        padded[:, :k] = j
        grouped = padded.view(rows, -1, self.per_byte)
        codes.copy_(grouped[:, :, 0])
        for t in range(1, self.per_byte):
            codes.bitwise_or_(grouped[:, :, t].bitwise_left_shift(t * self.bits))

    def _unpack(self, codes: torch.Tensor, k: int) -> torch.Tensor:
        """The inverse of ``_pack``: uint8 codes, rows x k."""
        if self.per_byte == 1:
            return codes
        mask = (1 << self.bits) - 1
        shifts = torch.arange(0, 8, self.bits, dtype=torch.uint8, device=codes.device)
        j = codes[:, :, None].bitwise_right_shift(shifts).bitwise_and_(mask)
        return j.view(codes.shape[0], -1)[:, :k]

    # --- decode / accumulate -----------------------------------------------------------------

    @torch.no_grad()
    def add_piece_into(
        self,
        acc: torch.Tensor,
        parts: Sequence[torch.Tensor],
        weight: float,
        first: bool,
        work: Workspace | None = None,
    ) -> None:
        (data,) = parts
        for start, rows, length, at in self._spans(acc.numel()):
            scale, index, codes, k = self._fields(data, at, rows, length)
            part = acc[start : start + rows * length]
            j = self._unpack(codes, k)
            # (2j - top) * s: exact (a small odd integer times a bf16 scale).
            values = j.to(torch.float32).mul_(2.0).sub_(self.top)
            values.mul_(_scales(scale).to(torch.float32)[:, None])
            pos = unpack_rows(index, k, self.index_bits)
            pos.add_(torch.arange(0, rows * length, length, device=pos.device)[:, None])
            flat = pos.reshape(-1)
            if first:
                part.zero_()  # what accumulate_ writes where the decoded tensor is zero
            kept = part.index_select(0, flat)
            accumulate_(kept, values.reshape(-1), weight, first)
            part.index_copy_(0, flat, kept)

    # --- checks ------------------------------------------------------------------------------

    def check_part(self, shape: Sequence[int], index: int, t: torch.Tensor) -> None:
        """Every record of the one part: its scale (``non_finite``, ``bad_scale``), then its
        positions (``bad_index``: outside the chunk, repeated or not ascending, padding bits
        set). Codes need no check (each decodes to a finite multiple of a checked scale)."""
        data = t.reshape(-1)
        n = math.prod(int(d) for d in shape)
        spans = self._spans(n)
        for _, rows, length, at in spans:
            self._check_scales(_scales(self._fields(data, at, rows, length)[0]))
        for start, rows, length, at in spans:
            _, packed, _, k = self._fields(data, at, rows, length)
            self._check_index(packed, k, start, length)

    def _check_scales(self, t: torch.Tensor) -> None:
        low, high = (float(v) for v in torch.aminmax(t.float()))
        if not (math.isfinite(low) and math.isfinite(high)):
            raise CodecError("non_finite", "a topk scale is NaN or infinite")
        if low < 0:
            raise CodecError("bad_scale", f"a topk scale is negative ({low})")
        if high * self.top > FP32_MAX:
            raise CodecError("non_finite", f"a topk scale of {high} decodes to values beyond fp32")

    def _check_index(self, packed: torch.Tensor, k: int, start: int, length: int) -> None:
        """Each row: the packed kept positions of the chunk that starts at element ``start``."""
        where = f"(the chunks from element {start})"
        if not padding_clear(packed, k, self.index_bits):
            raise CodecError("bad_index", f"a topk record's index padding bits are set {where}")
        pos = unpack_rows(packed, k, self.index_bits)
        if int(pos.amax()) >= length:
            raise CodecError(
                "bad_index", f"a topk index is outside its chunk of {length} elements {where}"
            )
        if k > 1 and int(pos.diff(dim=1).amin()) <= 0:
            raise CodecError(
                "bad_index",
                f"topk indices within a chunk must be strictly ascending {where}: one is "
                f"repeated or out of order",
            )


def _scales(raw: torch.Tensor) -> torch.Tensor:
    """The bf16 scales of records (rows x 2 bytes, strided), as a flat tensor."""
    # A fresh copy: a view of records has an odd stride or offset, which a bf16 view refuses.
    out = torch.empty(raw.shape, dtype=torch.uint8, device=raw.device)
    return out.copy_(raw).view(torch.bfloat16).view(-1)

"""Chunked top-k sparsification with few-bit values: SparseLoCo's upload (arXiv 2508.15706).

A tensor is flattened and cut into chunks of ``chunk`` elements (the last may be shorter, ``r``
elements). Each chunk keeps its ``k = max(1, round(density * length))`` largest-magnitude
elements: a count fixed by the chunk's length, so ``parts(shape)`` depends on the shape and the
options alone and a server checks a body's header before its payload, as for every codec. Parts,
in body order:

- ``name@scale``: bf16, one per chunk, ``s = absmax(kept) / top`` rounded *up* to bf16 (as the
  quantizers do: ``|x / s| <= top`` then holds, no code needs clamping);
- ``name@idx``: uint16, the kept elements' positions within their chunk, strictly ascending
  per chunk (``chunk <= 65536``): ``k`` per full chunk, then the last chunk's;
- ``name``: uint8, the kept values' ``bits``-bit codes, ``8 / bits`` per byte, each chunk's
  codes padded to whole bytes (so a chunk-aligned piece owns whole bytes of every part).

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
from diloco.core.codecs.elementwise import BlockCodec
from diloco.core.codecs.quant import FP32_MAX, SCALE, round_up_bf16

INDEX = "@idx"
BITS = (2, 4, 8)
MAX_CHUNK = 1 << 16
"""Indices within a chunk travel as uint16."""
DEFAULT_DENSITY = 0.0156
DEFAULT_CHUNK = 4096
DEFAULT_BITS = 2


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class TopKCodec(BlockCodec):
    """Chunked top-k, values at ``bits`` bits with one bf16 scale per chunk (module docstring).
    Parts: ``name@scale`` (bf16, one per chunk), ``name@idx`` (uint16), ``name`` (uint8)."""

    name = "topk"
    lossy = True
    shaped_codes = False
    sparse = True

    def __init__(
        self, density: float = DEFAULT_DENSITY, chunk: int = DEFAULT_CHUNK, bits: int = DEFAULT_BITS
    ) -> None:
        density, chunk, bits = float(density), int(chunk), int(bits)
        if not 0.0 < density <= 1.0:  # NaN fails this too
            raise ValueError(f"density must be in (0, 1], got {density}")
        if not 1 <= chunk <= MAX_CHUNK or chunk & (chunk - 1):
            raise ValueError(f"chunk must be a power of two from 1 to {MAX_CHUNK}, got {chunk}")
        if bits not in BITS:
            raise ValueError(f"bits must be one of {', '.join(map(str, BITS))}, got {bits}")
        self.density, self.chunk, self.bits = density, chunk, bits
        self.align = chunk
        self.top = float((1 << bits) - 1)
        self.per_byte = 8 // bits

    def options(self) -> dict[str, str]:
        return {"density": repr(self.density), "chunk": str(self.chunk), "bits": str(self.bits)}

    # --- layout ------------------------------------------------------------------------------

    def kept(self, length: int) -> int:
        """Elements a chunk of ``length`` keeps (0 for an empty one)."""
        return max(1, round(self.density * length)) if length else 0

    def code_bytes(self, k: int) -> int:
        """Bytes of one chunk's ``k`` codes."""
        return _ceil_div(k, self.per_byte)

    def flat_parts(self, n: int) -> list[Part]:
        full, rest = divmod(n, self.chunk)
        k, k_last = self.kept(self.chunk), self.kept(rest)
        return [
            Part(SCALE, torch.bfloat16, (_ceil_div(n, self.chunk),)),
            Part(INDEX, torch.uint16, (full * k + k_last,)),
            Part("", torch.uint8, (full * self.code_bytes(k) + self.code_bytes(k_last),)),
        ]

    def _spans(self, n: int) -> list[tuple[int, int, int, int, int, int]]:
        """Runs of equal chunks, each at most ``CHUNK`` elements: ``(start, rows, length, chunk
        index, kept index, code byte)`` where the run's rows begin in each part."""
        full, rest = divmod(n, self.chunk)
        k, kb = self.kept(self.chunk), self.code_bytes(self.kept(self.chunk))
        step = max(1, CHUNK // self.chunk)
        out = [
            (c * self.chunk, min(step, full - c), self.chunk, c, c * k, c * kb)
            for c in range(0, full, step)
        ]
        if rest:
            out.append((full * self.chunk, 1, rest, full, full * k, full * kb))
        return out

    # --- encode ------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_piece(
        self, piece: torch.Tensor, out: Sequence[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        piece = piece.reshape(-1)
        if piece.dtype != torch.float32:
            piece = piece.float()  # round_up_bf16 reads fp32 bits
        n = piece.numel()
        scales, index, codes = self.empty_parts(n, piece.device) if out is None else out
        for start, rows, length, c, i, b in self._spans(n):
            k, kb = self.kept(length), self.code_bytes(self.kept(length))
            x = piece[start : start + rows * length].view(rows, length)
            self._encode_rows(
                x,
                k,
                scales[c : c + rows],
                index[i : i + rows * k].view(rows, k),
                codes[b : b + rows * kb].view(rows, kb),
            )
        return [scales, index, codes]

    def _encode_rows(
        self,
        x: torch.Tensor,
        k: int,
        scales: torch.Tensor,
        index: torch.Tensor,
        codes: torch.Tensor,
    ) -> None:
        """Each row of ``x`` is one chunk: its ``k`` kept positions, scale and codes."""
        # |x| on the int32 bits (the sign bit cleared): non-negative floats order as their bits
        # (NaN above all), and torch.topk on int32 ran 12% faster than on fp32 on one core.
        mag = torch.bitwise_and(x.view(torch.int32), 0x7FFFFFFF)
        pos = torch.topk(mag, k, dim=1, sorted=False).indices
        pos = pos.sort(dim=1).values  # ascending: the order a receiver checks
        values = x.gather(1, pos)
        amax = mag.gather(1, pos).amax(1).view(torch.float32).div_(self.top)
        round_up_bf16(amax, scales, torch.empty(amax.shape, dtype=torch.int32, device=x.device))
        inv = amax.copy_(scales).reciprocal_()
        inv.nan_to_num_(nan=0.0, posinf=0.0)  # an all-zero chunk: scale 0, every value 0
        # j = round((x / s + top) / 2): |x / s| <= top, so j is in [0, top]; the clamp only
        # absorbs the last bit of 1 / s.
        q = values.mul_(inv[:, None]).add_(self.top).mul_(0.5).round_().clamp_(0.0, self.top)
        index.copy_(pos)
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
        self, acc: torch.Tensor, parts: Sequence[torch.Tensor], weight: float, first: bool
    ) -> None:
        scales, index, codes = parts
        for start, rows, length, c, i, b in self._spans(acc.numel()):
            k, kb = self.kept(length), self.code_bytes(self.kept(length))
            part = acc[start : start + rows * length]
            j = self._unpack(codes[b : b + rows * kb].view(rows, kb), k)
            # (2j - top) * s: exact (a small odd integer times a bf16 scale).
            values = j.to(torch.float32).mul_(2.0).sub_(self.top)
            values.mul_(scales[c : c + rows].to(torch.float32)[:, None])
            pos = index[i : i + rows * k].view(rows, k).to(torch.int64)
            pos.add_(torch.arange(0, rows * length, length, device=pos.device)[:, None])
            flat = pos.view(-1)
            if first:
                part.zero_()  # what accumulate_ writes where the decoded tensor is zero
            kept = part.index_select(0, flat)
            accumulate_(kept, values.view(-1), weight, first)
            part.index_copy_(0, flat, kept)

    # --- checks ------------------------------------------------------------------------------

    def check_part(self, shape: Sequence[int], index: int, t: torch.Tensor) -> None:
        if t.numel() == 0 or index == 2:
            return  # every code decodes to a finite multiple of its checked scale
        if index == 0:
            self._check_scales(t.reshape(-1))
        else:
            n = math.prod(int(d) for d in shape)
            for start, rows, length, _, i, _ in self._spans(n):
                k = self.kept(length)
                self._check_index(t.reshape(-1)[i : i + rows * k].view(rows, k), start, length)

    def _check_scales(self, t: torch.Tensor) -> None:
        low, high = (float(v) for v in torch.aminmax(t.float()))
        if not (math.isfinite(low) and math.isfinite(high)):
            raise CodecError("non_finite", "a topk scale is NaN or infinite")
        if low < 0:
            raise CodecError("bad_scale", f"a topk scale is negative ({low})")
        if high * self.top > FP32_MAX:
            raise CodecError("non_finite", f"a topk scale of {high} decodes to values beyond fp32")

    def _check_index(self, rows: torch.Tensor, start: int, length: int) -> None:
        """Each row: the kept positions of the chunk that starts at element ``start``."""
        pos = rows.to(torch.int32)
        if int(pos.amax()) >= length:
            raise CodecError(
                "bad_index",
                f"a topk index is outside its chunk of {length} elements (the chunks from "
                f"element {start})",
            )
        if pos.shape[1] > 1 and int(pos.diff(dim=1).amin()) <= 0:
            raise CodecError(
                "bad_index",
                f"topk indices within a chunk must be strictly ascending (the chunks from "
                f"element {start}): one is repeated or out of order",
            )

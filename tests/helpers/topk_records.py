"""A topk part (one uint8 record per chunk, core/codecs/topk.py) read into its fields and
written back, so a test can forge one field of one chunk: a scale, a position, a padding bit."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diloco.core.codecs import TopKCodec
from diloco.core.codecs.bitpack import pack_rows, unpack_rows


@dataclass
class Record:
    """One chunk's record: its scale, its kept positions, its packed position bytes (for padding
    forgeries) and its code bytes."""

    scale: float
    positions: list[int]
    packed: list[int]
    codes: list[int]


def _lengths(codec: TopKCodec, n: int) -> list[int]:
    full, rest = divmod(n, codec.chunk)
    return [codec.chunk] * full + ([rest] if rest else [])


def read(codec: TopKCodec, part: torch.Tensor, n: int) -> list[Record]:
    """The records of a tensor of ``n`` elements, chunk by chunk."""
    data, out, at = part.reshape(-1), [], 0
    for length in _lengths(codec, n):
        k = codec.kept(length)
        ib, size = codec.index_bytes(k), codec.record(length)
        rec = data[at : at + size]
        packed = rec[2 : 2 + ib].view(1, ib)
        positions = unpack_rows(packed, k, codec.index_bits)[0].tolist()
        scale = float(rec[:2].clone().view(torch.bfloat16))
        out.append(Record(scale, positions, packed[0].tolist(), rec[2 + ib :].tolist()))
        at += size
    return out


def write(codec: TopKCodec, records: list[Record], *, repack: bool = True) -> torch.Tensor:
    """The part of ``records``; ``repack``: positions packed again (False: ``packed`` as is)."""
    chunks = []
    for r in records:
        scale = torch.tensor([r.scale], dtype=torch.bfloat16).view(torch.uint8)
        packed = torch.tensor([r.packed], dtype=torch.uint8)
        if repack:
            pack_rows(torch.tensor([r.positions]), codec.index_bits, packed)
        chunks += [scale, packed[0], torch.tensor(r.codes, dtype=torch.uint8)]
    return torch.cat(chunks)

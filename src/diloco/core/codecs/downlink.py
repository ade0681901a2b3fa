"""A compressed downlink: the server publishes each round as a quantized update of the global
parameters, with its own error feedback, and every replica stays bit-identical to the server.

The server keeps two copies of the parameters:

- ``true``: what the outer optimizer steps, exactly as without compression;
- ``published``: what ``GET /global_params`` serves and every worker holds.

Closing a round, after the outer step has written the new ``true``, the server encodes the
update ``u = true - published`` and adds exactly what it encoded to ``published``:

    parts = encode(true - published);   published += decode(parts)

``true - published`` is this round's step plus whatever earlier rounds' updates dropped, so the
difference between the copies never grows beyond one round's quantization error (error feedback,
with the residual ``true - published`` held implicitly: no third buffer). A worker that holds
the previous ``published`` applies the same parts with the same function (``apply_update``), on
the CPU, in fp32: the decoded values are exact (a code times a bf16 scale) and one IEEE addition
per element has one answer, so the result has the same bits as the server's, whatever the chunk
boundaries or the SIMD path. A checksum of the new parameters (``wire.checksum``) travels with the round so
that a replica that missed a round, or computed elsewhere, notices and downloads full parameters
once.

Only element-wise (``BlockCodec``) codecs qualify: a low-rank product's summation order differs
between devices and libraries. ``fp32`` as a download codec means today's full parameters, not
an update (``published + (true - published)`` need not round back to ``true``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diloco.core.codecs.base import CHUNK
from diloco.core.codecs.elementwise import BlockCodec, Fp32Codec
from diloco.core.workspace import Workspace, scratch


def check_download_codec(codec: object) -> BlockCodec:
    """``codec`` itself if it can carry published updates; a ``ValueError`` otherwise."""
    if not isinstance(codec, BlockCodec) or isinstance(codec, Fp32Codec) or codec.sparse:
        name = getattr(codec, "name", type(codec).__name__)
        raise ValueError(
            f"codec {name!r} cannot carry a published update: a download codec must be an "
            "element-wise lossy codec (bf16, int8, int4); fp32 downloads are full parameters"
        )
    return codec


@torch.no_grad()
def encode_update(
    codec: BlockCodec,
    true: torch.Tensor,
    published: torch.Tensor,
    out: Sequence[torch.Tensor] | None = None,
    work: Workspace | None = None,
) -> list[torch.Tensor]:
    """Encode ``true - published`` (flat fp32 pieces of the same range, see
    ``BlockCodec.piece_ranges``; CPU) and add what was encoded to ``published`` in place.

    Returns the flat parts (written into ``out`` when given). Works a chunk at a time with one
    chunk of scratch (``work``'s, reused, when given), so the update never exists at full size.
    ``true`` is not modified."""
    true = true.reshape(-1)
    published = published.reshape(-1)
    n = true.numel()
    if published.numel() != n:
        raise ValueError(f"true has {n} elements, published {published.numel()}")
    parts = codec.empty_parts(n, true.device) if out is None else list(out)
    buf = scratch(work, "downlink", torch.float32, min(n, CHUNK), true.device)
    for a in range(0, n, CHUNK):
        b = min(n, a + CHUNK)
        u = buf[: b - a]
        torch.sub(true[a:b], published[a:b], out=u)
        sub = [p[s:t] for p, (s, t) in zip(parts, codec.piece_ranges(n, a, b), strict=True)]
        codec.encode_piece(u, sub, work)
        codec.add_piece_into(published[a:b], sub, 1.0, False, work)
    return parts


@torch.no_grad()
def apply_update(
    codec: BlockCodec,
    published: torch.Tensor,
    parts: Sequence[torch.Tensor],
    work: Workspace | None = None,
) -> None:
    """``published += decode(parts)`` in place: a replica's side of ``encode_update``, with the
    same arithmetic (a flat fp32 CPU tensor, or a piece of one, and its flat parts; ``work``:
    reused scratch)."""
    codec.add_piece_into(published.reshape(-1), [p.reshape(-1) for p in parts], 1.0, False, work)

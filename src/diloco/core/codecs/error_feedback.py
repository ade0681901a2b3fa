"""Error feedback (Seide et al. 2014; Karimireddy et al. 2019): what a lossy codec dropped from
one round's pseudo-gradient is added to the next one's, so nothing is lost, only delayed.

For each tensor, round ``t`` sends ``encode(c_t)`` with ``c_t = g_t + e_{t-1}`` and keeps
``e_t = c_t - decode(encode(c_t))``. Summed over rounds, what the server received plus the last
residual is the sum of the true pseudo-gradients: ``sum_t sent_t + e_T = sum_t g_t``, exactly but
for the fp32 rounding of each ``c_t``. (That is also why round-to-nearest suffices: a rounding
bias of one round is repaid by the next, which is what stochastic rounding would buy.)

Memory: one fp32 residual per tensor, on the tensor's device, the only buffer the method needs:
``c`` is built in the residual itself, encoded, and the decoded value subtracted in place through
the codec's ``add_into`` with weight -1, which needs no full-size temporary.

With a decay ``beta`` (SparseLoCo's, arXiv 2508.15706) the residual is scaled before it is
added, ``c_t = g_t + beta * e_{t-1}``: the residual then acts as a local momentum of the dropped
part, and the invariant above no longer holds (what is dropped decays away). ``beta = 1``
(``DECAY``, the default) is the plain rule, with the same bits as before the decay existed.

A worker keeps one ``ErrorFeedback`` across rounds and saves ``state_dict`` with its state: a
rejoin restores it, and a rebase (local progress kept on top of new global parameters) leaves it
as it is, since the dropped part of an earlier pseudo-gradient is still owed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from diloco.core.codecs.base import CHUNK, Codec
from diloco.core.codecs.elementwise import BlockCodec

DECAY = 1.0
"""The residual's default decay: none, plain error feedback."""


class ErrorFeedback:
    """The residuals of one worker, keyed by parameter name. Not thread-safe. ``decay``: the
    factor in ``[0, 1]`` the residual is scaled by before each compensation (module docstring)."""

    def __init__(self, decay: float = DECAY) -> None:
        decay = float(decay)
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"error feedback decay must be in [0, 1], got {decay}")
        self.decay = decay
        self.residuals: dict[str, torch.Tensor] = {}

    def _decay_(self, e: torch.Tensor) -> torch.Tensor:
        """``e *= decay`` in place (nothing at 1, so the plain rule keeps its bits)."""
        return e if self.decay == 1.0 else e.mul_(self.decay)

    def _residual(self, name: str, shape: Sequence[int], device: torch.device) -> torch.Tensor:
        e = self.residuals.get(name)
        if e is None or tuple(e.shape) != tuple(shape) or e.device != device:
            e = torch.zeros(tuple(shape), dtype=torch.float32, device=device)
            self.residuals[name] = e
        return e

    @torch.no_grad()
    def encode(self, codec: Codec, name: str, g: torch.Tensor) -> list[torch.Tensor]:
        """``codec.encode(g + decay * e)`` for tensor ``name``, keeping ``e <- c - decode(...)``.
        ``g`` (the pseudo-gradient, any float dtype) is not modified."""
        if isinstance(codec, BlockCodec):
            flat = self.encode_piece(codec, name, g.shape, 0, g.reshape(-1))
            return [f.view(p.shape) for f, p in zip(flat, codec.parts(g.shape), strict=True)]
        e = self._residual(name, g.shape, g.device)
        self._decay_(e).add_(g)  # c = g + decay * e, built in place
        parts = codec.encode(e, name)
        codec.add_into(e, parts, -1.0)  # e = c - sent
        return parts

    @torch.no_grad()
    def commit(
        self, codec: Codec, name: str, g: torch.Tensor, parts: Sequence[torch.Tensor]
    ) -> None:
        """``e <- g + decay * e - decode(parts)``: what ``encode`` keeps, for ``parts`` that were
        encoded earlier from the same ``c`` (a worker sends a body first and moves its residual
        only once the server has counted it). Same bits as ``encode``'s update."""
        e = self._residual(name, g.shape, g.device)
        self._decay_(e).add_(g)
        codec.add_into(e, parts, -1.0)

    @torch.no_grad()
    def encode_piece(
        self,
        codec: BlockCodec,
        name: str,
        shape: Sequence[int],
        start: int,
        piece: torch.Tensor,
        out: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """``encode`` for the flat piece of tensor ``name`` (of ``shape``) that starts at element
        ``start`` (see ``BlockCodec.piece_ranges``); ``out`` as in ``BlockCodec.encode_piece``.
        Pieces of one round must not overlap (each updates its range of the residual)."""
        e = self._residual(name, shape, piece.device).view(-1)
        n = piece.numel()
        codec.piece_ranges(e.numel(), start, start + n)  # refuses a misaligned piece
        parts = codec.empty_parts(n, piece.device) if out is None else list(out)
        flat = piece.reshape(-1)
        # A chunk at a time, so that c stays in cache from the compensation through the encoding
        # to the subtraction of what was sent: the residual crosses memory once, not three times.
        for a in range(0, n, CHUNK):
            b = min(n, a + CHUNK)
            c = self._decay_(e[start + a : start + b])
            c.add_(flat[a:b])
            sub = [p[s:t] for p, (s, t) in zip(parts, codec.piece_ranges(n, a, b), strict=True)]
            codec.encode_piece(c, sub)
            codec.add_piece_into(c, sub, -1.0, False)
        return parts

    def norm(self) -> float:
        """``||e||`` over every residual (fp32), for the worker's metrics."""
        total = 0.0
        for e in self.residuals.values():
            total += float(torch.linalg.vector_norm(e)) ** 2
        return total**0.5

    def forget(self, name: str | None = None) -> None:
        """Drop the residual of ``name`` (every residual when None): after the worker hands the
        owed amount in by other means, or when its run is over."""
        if name is None:
            self.residuals.clear()
        else:
            self.residuals.pop(name, None)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The residuals by name: plain tensors, ready for ``safetensors.torch.save_file``."""
        return dict(self.residuals)

    def load_state_dict(
        self, state: Mapping[str, torch.Tensor], device: torch.device | str | None = None
    ) -> None:
        """Restore ``state_dict`` (copies, as fp32, on ``device`` or where they are)."""
        self.residuals = {
            name: e.detach().to(device=device, dtype=torch.float32, copy=True)
            for name, e in state.items()
        }

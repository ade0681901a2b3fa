"""Low-rank pseudo-gradients: PowerSGD (Vogels et al., NeurIPS 2019, arXiv 1905.13727).

A tensor of shape ``(n, ...)`` is viewed as the matrix ``M`` of ``n`` rows and ``m`` = the rest
(a linear weight as it is, a conv weight as ``(out, in * kh * kw)``) and sent as two factors:

    P = orthonormal(M Q_prev)        (n x r)
    Q = M^T P                        (m x r)        decoded: P Q^T

one power iteration per round, ``Q_prev`` being the ``Q`` this codec sent for the same tensor the
round before (the paper's warm start: over the rounds the iteration converges to the top-r
subspace of the slowly changing pseudo-gradients; error feedback carries what it missed). The
first round starts from a Gaussian ``Q`` drawn from a generator seeded by ``(seed, name)``.

Tensors with fewer than two dimensions, and those where ``r (n + m) >= n m`` (the factors would
not be smaller), go through the ``fallback`` codec instead, and ``parts`` says which by shape, so
the server knows before any payload arrives.

State: the warm-start ``Q`` of every tensor encoded so far (``m x r`` each), kept in the codec
instance and keyed by name. A worker that rejoins must save and restore it (``state_dict``)
beside its error-feedback residuals; losing it costs a round or two of convergence, not
correctness. The server keeps no state for this codec.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from diloco.core.accumulate import accumulate_
from diloco.core.codecs.base import CHUNK, Codec, CodecError, Part, numel_of
from diloco.core.codecs.elementwise import BlockCodec
from diloco.core.finite import FP32_MAX, max_abs
from diloco.core.workspace import Workspace

Q_SUFFIX = "@q"


def name_seed(seed: int, name: str) -> int:
    """A 63-bit seed from ``seed`` and ``name``, the same in every process (FNV-1a: Python's own
    ``hash`` of a string changes from one process to the next)."""
    h = 0xCBF29CE484222325 ^ (seed & 0xFFFFFFFFFFFFFFFF)
    for byte in name.encode("utf-8"):
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h >> 1


class LowRankCodec(Codec):
    """Rank-``rank`` factors ``P`` (the part named like the parameter, fp32 ``n x r``) and ``Q``
    (``name@q``, fp32 ``m x r``); ``fallback`` (a piecewise codec, default int8) for the rest."""

    name = "lowrank"
    lossy = True

    def __init__(self, rank: int = 4, fallback: BlockCodec | None = None, seed: int = 0) -> None:
        if int(rank) < 1:
            raise ValueError(f"rank must be at least 1, got {rank}")
        if fallback is None:
            from diloco.core.codecs.quant import Int8Codec

            fallback = Int8Codec()
        if not isinstance(fallback, BlockCodec):
            raise ValueError(f"the fallback must be a piecewise codec, got {fallback!r}")
        self.rank = int(rank)
        self.fallback = fallback
        self.seed = int(seed)
        self._q: dict[str, torch.Tensor] = {}

    def options(self) -> dict[str, str]:
        opts = {"rank": str(self.rank), "fallback": self.fallback.name}
        opts.update({f"fallback_{k}": v for k, v in self.fallback.options().items()})
        if self.seed:
            opts["seed"] = str(self.seed)
        return opts

    def matrix_shape(self, shape: Sequence[int]) -> tuple[int, int] | None:
        """``(n, m)`` of the matrix a tensor of ``shape`` is sent as; None when it goes through
        the fallback."""
        if len(shape) < 2 or numel_of(shape) == 0:
            return None
        n = int(shape[0])
        m = numel_of(shape) // n
        return (n, m) if self.rank * (n + m) < n * m else None

    def parts(self, shape: Sequence[int]) -> list[Part]:
        mat = self.matrix_shape(shape)
        if mat is None:
            return self.fallback.parts(shape)
        n, m = mat
        return [
            Part("", torch.float32, (n, self.rank)),
            Part(Q_SUFFIX, torch.float32, (m, self.rank)),
        ]

    def _warm_q(self, name: str, m: int, device: torch.device) -> torch.Tensor:
        q = self._q.get(name)
        if q is not None and q.shape == (m, self.rank):
            return q.to(device)
        g = torch.Generator().manual_seed(name_seed(self.seed, name))
        return torch.randn(m, self.rank, generator=g).to(device)

    @torch.no_grad()
    def encode(self, t: torch.Tensor, name: str = "") -> list[torch.Tensor]:
        """One power iteration from the tensor's previous ``Q`` (see the module docstring);
        updates the warm-start state of ``name``."""
        mat = self.matrix_shape(t.shape)
        if mat is None:
            return self.fallback.encode(t, name)
        n, m = mat
        matrix = t.detach().reshape(n, m).float()
        # Both products as (r x n) @ (n x m) forms: BLAS ran ``M^T P`` 20x slower than
        # ``(P^T M)^T`` on one core (the transposed n x m operand with a narrow result).
        q_prev = self._warm_q(name, m, t.device)
        p = (q_prev.t() @ matrix.t()).t()
        # Householder QR: orthonormal columns even for a rank-deficient or zero P (Gram-Schmidt,
        # the paper's choice, divides by the norm of a column that may vanish).
        p = torch.linalg.qr(p, mode="reduced").Q.contiguous()
        q = (p.t() @ matrix).t().contiguous()
        self._q[name] = q.clone()
        return [p, q]

    @torch.no_grad()
    def add_into(
        self,
        acc: torch.Tensor,
        parts: Sequence[torch.Tensor],
        weight: float = 1.0,
        *,
        first: bool = False,
        work: Workspace | None = None,
    ) -> None:
        """``P Q^T`` a block of rows at a time (``CHUNK`` elements of scratch), each block one
        matrix product, so decoding and accumulating share their bits."""
        mat = self.matrix_shape(acc.shape)
        if mat is None:
            self.fallback.add_into(acc, parts, weight, first=first, work=work)
            return
        n, m = mat
        p, q = parts
        rows = max(1, CHUNK // m)
        matrix = acc.view(n, m)
        scratch = torch.empty(min(rows, n) * m, dtype=torch.float32, device=acc.device)
        qt = q.t()
        for a in range(0, n, rows):
            b = min(n, a + rows)
            block = torch.mm(p[a:b], qt, out=scratch[: (b - a) * m].view(b - a, m))
            accumulate_(matrix[a:b], block, weight, first)

    def check_part(self, shape: Sequence[int], index: int, t: torch.Tensor) -> None:
        if self.matrix_shape(shape) is None:
            self.fallback.check_part(shape, index, t)
            return
        bound = max_abs([t])
        if bound == float("inf"):
            raise CodecError("non_finite", "a low-rank factor holds NaN or an infinity")
        # A decoded element sums rank products of one entry of each factor: with both factors
        # below this bound it stays finite. (P is orthonormal, Q = M^T P: far below it.)
        if bound > (FP32_MAX / self.rank) ** 0.5:
            raise CodecError(
                "non_finite", f"a low-rank factor entry of {bound} may decode beyond fp32"
            )

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The warm-start ``Q`` of each tensor, keyed by its name."""
        return dict(self._q)

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        for name, q in state.items():
            if q.dim() != 2 or q.shape[1] != self.rank:
                raise ValueError(
                    f"warm-start Q of {name!r} has shape {tuple(q.shape)}, expected (m, {self.rank})"
                )
        self._q = {name: q.float().clone() for name, q in state.items()}

"""Robust aggregation of one sync round's pseudo-gradients: per-worker norm clipping relative to
the median of the round's norms, and a coordinate-wise trimmed mean (server mode); and which
members of an all-reduce quorum are left out of a round, judged from the scalars they exchange
(``judge``).

Both need every upload of the round at once (the median of the norms is known only when the last
upload has arrived; the trimmed mean sorts each coordinate over the workers), so with either one
on the server keeps the round's uploads instead of adding them to a running sum: N copies of the
model (or fragment) in fp32 instead of one. The time is a norm pass per upload (clipping) and a
sort of N values per coordinate (trimmed mean), done in chunks so that scratch memory stays small.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

CHUNK = 1 << 16  # coordinates sorted at a time: N x CHUNK values and their int64 indices


def global_norm(tensors: Sequence[torch.Tensor]) -> float:
    """The L2 norm of all tensors together, combined in float64. A tensor whose norm overflows
    fp32 gives ``inf``: such an upload counts as infinitely large."""
    total = 0.0
    for t in tensors:
        if t.numel():
            n = float(torch.linalg.vector_norm(t.float() if t.dtype != torch.float32 else t))
            total += n * n
    return math.sqrt(total)


def clip_scales(norms: Sequence[float], factor: float) -> list[float]:
    """Per upload, the scale that clips it to ``factor`` times the median of ``norms``:
    ``min(1, factor * median / norm)``. A single outlier cannot move the median, so it cannot
    raise its own limit; a majority can (no clipping rule survives that)."""
    if not factor > 0:
        raise ValueError(f"clip factor must be positive, got {factor}")
    if not norms:
        return []
    ordered = sorted(norms)
    mid = len(ordered) // 2  # the median: the middle one, or the mean of the middle two
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    limit = factor * median
    return [1.0 if n <= limit else limit / n for n in norms]


@dataclass(frozen=True)
class Verdict:
    """Which members of a quorum contribute to its average, by rank (``judge``)."""

    reasons: tuple[str, ...]
    """Per rank: "" for a member admitted, else why it is left out."""
    weights: tuple[float, ...]
    """Per rank: its weight in the average (0 when left out)."""
    total: float
    """The admitted weights' sum (0: no step is taken)."""
    bound: float
    """``sum(w_i / total * norm_i)`` over the admitted: by the triangle inequality, the largest
    norm their weighted average can have (0 when ``total`` is 0)."""

    @property
    def excluded(self) -> tuple[int, ...]:
        """The ranks left out."""
        return tuple(i for i, why in enumerate(self.reasons) if why)


def judge(
    finite: Sequence[bool],
    norms: Sequence[float],
    weights: Sequence[float],
    factor: float,
    max_weight: float,
) -> Verdict:
    """Per member (by rank) whether its pseudo-gradient enters the quorum's average. Every member
    calls this with the same numbers (exchanged before the tensor all-reduce), so every member
    reaches the same verdict without another message.

    A member is left out if its pseudo-gradient is not finite (``finite`` False, or its norm not
    finite), if its weight is not finite or outside ``[0, max_weight]``, or if its norm is above
    ``factor`` times the median norm of the members admitted with a positive weight. The median
    of an even count is the lower middle value: with two members, the smaller norm sets the
    limit, so one huge member cannot raise its own limit (the mean of the two would). Members of
    weight 0 (a join) add nothing: they are neither judged by their norm nor counted in the
    median."""
    n = len(finite)
    if len(norms) != n or len(weights) != n:
        raise ValueError(
            f"need one flag, norm and weight per member, got {n}, {len(norms)}, {len(weights)}"
        )
    if not factor > 0:
        raise ValueError(f"norm bound factor must be positive, got {factor}")
    reasons = []
    for ok, norm, weight in zip(finite, norms, weights, strict=True):
        if not (ok and math.isfinite(norm)):
            reasons.append("non-finite pseudo-gradient")
        elif not (math.isfinite(weight) and 0 <= weight <= max_weight):
            reasons.append(f"weight {weight:g} outside [0, {max_weight:g}]")
        else:
            reasons.append("")
    judged = [i for i in range(n) if not reasons[i] and weights[i] > 0]
    if judged:
        ordered = sorted(norms[i] for i in judged)
        median = ordered[(len(ordered) - 1) // 2]
        for i in judged:
            if norms[i] > factor * median:
                times = f"{norms[i] / median:.3g} x" if median > 0 else "above"
                reasons[i] = f"norm {norms[i]:.3g}, {times} the median {median:.3g}"
    kept = tuple(0.0 if why else float(w) for why, w in zip(reasons, weights, strict=True))
    total = sum(kept)
    bound = sum(w / total * norms[i] for i, w in enumerate(kept) if w > 0) if total > 0 else 0.0
    return Verdict(tuple(reasons), kept, total, bound)


def trim_count(n: int, fraction: float) -> int:
    """Uploads dropped at each end of every coordinate: ``floor(fraction * n)``, at most enough
    to keep one. With fewer than ``1 / fraction`` uploads nothing is trimmed."""
    if not 0 <= fraction < 0.5:
        raise ValueError(f"trim fraction must be in [0, 0.5), got {fraction}")
    return min(math.floor(fraction * n), (n - 1) // 2)


@dataclass(frozen=True)
class RobustResult:
    """What ``robust_mean`` did: per upload its norm and scale, and the uploads trimmed at each
    end of every coordinate."""

    norms: list[float]
    scales: list[float]
    trimmed: int


@torch.no_grad()
def robust_mean(
    uploads: Sequence[Sequence[torch.Tensor]],
    weights: Sequence[float],
    out: Sequence[torch.Tensor],
    *,
    clip_factor: float | None = None,
    trim_fraction: float = 0.0,
) -> RobustResult:
    """Write the robust mean of ``uploads`` (each a list of tensors shaped like ``out``) into
    ``out``.

    Each upload is first scaled by its ``clip_scales`` factor (when ``clip_factor`` is set). Then
    with ``trim_count(n, trim_fraction) = k > 0``, every coordinate is the mean of its n - 2k
    middle values (unweighted: one worker, one vote, as a trimmed mean must be, or a heavy
    weight would buy its way past the trim); else the weighted mean ``sum w_i x_i / sum w_i``."""
    n = len(uploads)
    if n == 0 or len(weights) != n:
        raise ValueError(f"need one weight per upload and at least one upload, got {n}")
    if any(len(u) != len(out) for u in uploads):
        raise ValueError(f"every upload must hold {len(out)} tensors")
    norms = [global_norm(u) for u in uploads] if clip_factor is not None else [math.nan] * n
    scales = clip_scales(norms, clip_factor) if clip_factor is not None else [1.0] * n
    k = trim_count(n, trim_fraction)
    total = float(sum(weights))
    for i, acc in enumerate(out):
        flat_out = acc.view(-1)
        pieces = [u[i].reshape(-1) for u in uploads]
        if k == 0:
            flat_out.zero_()
            for piece, w, s in zip(pieces, weights, scales, strict=True):
                flat_out.add_(piece, alpha=w * s / total)
            continue
        for at in range(0, flat_out.numel(), CHUNK):
            stacked = torch.stack([p[at : at + CHUNK].float() for p in pieces])
            if clip_factor is not None:
                stacked.mul_(torch.tensor(scales, dtype=torch.float32).unsqueeze(1))
            middle = stacked.sort(dim=0).values[k : n - k]
            torch.mean(middle, dim=0, out=flat_out[at : at + CHUNK])
    return RobustResult(norms, scales, k)

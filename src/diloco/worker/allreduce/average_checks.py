"""The checks that keep a faulty member's pseudo-gradient out of a quorum's average
(docs/design/allreduce.md, "Checks"): ``checked_average``, the quorum loop's average, and
``name_excluded``, the members it left out as the outcome and the logs name them.

Cost: one pass over the member's pseudo-gradient for its norm and finiteness, one tiny
all-reduce of three scalars per member, and the average's norm taken from each bucket while it is
in cache; the tensor all-reduce itself is ``collective.reduce_scaled``'s, one per bucket, as
``average``'s.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from diloco.core.codecs.shard_reduce import relative_error
from diloco.core.robust import Verdict, global_norm, judge
from diloco.wire.messages import Assignment
from diloco.wire.messages.uploads import MAX_WEIGHT
from diloco.worker.allreduce.collective import (
    BUCKET_BYTES,
    QuorumCollective,
    allreduce_work,
    check_tables,
    flat_views,
    reduce_scaled,
    table_of,
)
from diloco.worker.allreduce.quantized import Moved, Quantized, quantized_reduce

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Averaged:
    """What ``checked_average`` did: the members' verdict (``core.robust.Verdict``: who was
    left out and why, the admitted weights' sum) and the result's check."""

    verdict: Verdict
    norm: float
    """The L2 norm of the average (0 when no member was admitted)."""
    sound: bool
    """The average is finite and its norm within the bound the admitted members' stated norms
    allow (``verdict.bound``, with ``slack``); True when no member was admitted."""
    moved: Moved | None = None
    """A quantized all-reduce's norm and bytes (None for the dense one)."""

    @property
    def total(self) -> float:
        return self.verdict.total


def checked_average(
    quorum: QuorumCollective,
    tensors: Sequence[torch.Tensor],
    weight: float,
    dtype: torch.dtype = torch.float32,
    *,
    norm_bound: float,
    bucket_bytes: int = BUCKET_BYTES,
    quantized: Quantized | None = None,
) -> Averaged:
    """``average`` that no faulty member can spoil (docs/design/allreduce.md, "Checks"). A
    collective: every member calls it with its own tensors and ``weight``.

    Before the tensor all-reduce the members exchange three scalars each in one tiny all-reduce
    (its pseudo-gradient is finite, its L2 norm, its weight); every member then reaches the same
    verdict (``core.robust.judge`` with ``norm_bound``, weights bounded by ``MAX_WEIGHT``): a
    member left out contributes zeros (it still takes part, so the collective's shape is the
    same on every rank), the others ``w_i / total``. If no member is admitted, or the admitted
    weights sum to 0, the tensors are zeroed on every rank. After the all-reduce the result is
    checked: finite, and its norm at most ``verdict.bound`` (plus ``slack``). The
    check's outcome is returned (``sound``), not acted on: the caller folds it into the commit
    point, so that a failed check discards the round on every member.

    Raises ``ValueError`` on every rank together if the members' tables, ``dtype`` or
    ``bucket_bytes`` differ. On ``QuorumFailed`` the tensors hold a mix of averaged and own
    values, as with ``average``.

    ``quantized``: the average travels as the quorum's int8 or int4 codes with this member's
    error feedback, if it keeps any (``quantized.quantized_reduce``; ``dtype`` is then unused);
    an admitted member adds the residual it owes (times ``quantized.decay``), and the result's
    bound adds the residuals' norms (one more tiny all-reduce) and the two quantizations'
    relative error."""
    if quantized is not None:
        return _checked_quantized(quorum, tensors, weight, norm_bound, bucket_bytes, quantized)
    if not dtype.is_floating_point:
        raise ValueError(f"the communication dtype must be floating point, not {dtype}")
    flats = flat_views(tensors)
    check_tables(quorum, f"checked {dtype} {bucket_bytes};" + table_of(tensors))
    finite, norm = measure(quorum, flats)
    verdict = judge(*exchange(quorum, finite, norm, weight), norm_bound, MAX_WEIGHT)
    total = verdict.total
    got = reduce_scaled(
        quorum,
        flats,
        verdict.weights[quorum.rank] / total if total else 0.0,
        total,
        dtype,
        bucket_bytes,
        norm=True,
    )
    if total == 0:
        return Averaged(verdict, 0.0, True)
    # The result's norm was taken bucket by bucket during the all-reduce (no further pass).
    return Averaged(verdict, got, got <= verdict.bound * (1 + slack(dtype, quorum.size)) + TINY)


def _checked_quantized(
    quorum: QuorumCollective,
    tensors: Sequence[torch.Tensor],
    weight: float,
    norm_bound: float,
    bucket_bytes: int,
    q: Quantized,
) -> Averaged:
    flats = flat_views(tensors)
    codec = q.codec
    check_tables(
        quorum,
        f"checked {codec.name} {sorted(codec.options().items())} {bucket_bytes};"
        + table_of(tensors),
    )
    finite, norm = measure(quorum, flats)
    verdict = judge(*exchange(quorum, finite, norm, weight), norm_bound, MAX_WEIGHT)
    admitted = quorum.rank not in verdict.excluded
    mine = q.decay * global_norm(q.residual) if admitted and q.residual is not None else 0.0
    owed = _residual_sum(quorum, mine)  # every member calls it: the collective's shape
    total = verdict.total
    if total == 0:
        for flat in flats:
            flat.zero_()
        return Averaged(verdict, 0.0, True)
    moved = quantized_reduce(
        quorum,
        flats,
        verdict.weights[quorum.rank] / total if admitted else 0.0,
        codec,
        q.residual,
        q.pending,
        send_residual=admitted,
        bucket_bytes=bucket_bytes,
        decay=q.decay,
    )
    # Each member's decoded codes are within relative_error of its contribution, and the shard's
    # sum within it again after the requantization (the triangle inequality, twice; once for
    # topk, whose decoded parts are summed as they are).
    times = 1 if codec.sparse else 2
    bound = (verdict.bound + owed) * (1 + relative_error(codec)) ** times
    got = moved.norm
    return Averaged(verdict, got, got <= bound * 1.01 + TINY, moved)


def _residual_sum(quorum: QuorumCollective, mine: float) -> float:
    """The sum of the members' residual norms (each rank adds its own; one tiny all-reduce)."""
    t = torch.tensor([mine], dtype=torch.float64, device=quorum.device)
    quorum.collective("residual norms", allreduce_work(t, quorum.timeout))
    return float(t.item())


def slack(dtype: torch.dtype, size: int) -> float:
    """The relative amount by which an honest average's norm may exceed the triangle
    inequality's bound: each member's scaled tensor is rounded once into ``dtype``, and the sum
    of ``size`` of them in ``dtype`` rounds at each of its steps (bf16: 2**-8 each), plus 1% for
    the norms' own fp32 arithmetic. A liar's tensor is off by orders of magnitude."""
    return 0.01 + size * torch.finfo(dtype).eps


TINY = 1e-9
"""Absolute slack of the result's check: averages of (near) zero pseudo-gradients."""


def measure(quorum: QuorumCollective, flats: Sequence[torch.Tensor]) -> tuple[bool, float]:
    """This member's statement about its pseudo-gradient: whether it is finite, and its L2
    norm. One fp32 pass (``core.robust.global_norm``, combined in fp64); only when that norm is
    not finite (a NaN or inf, or values whose squares overflow fp32) a second, fp64 pass tells a
    non-finite tensor from a large one. ``quorum`` is the caller's (tests stand in a liar)."""
    norm = global_norm(flats)
    if math.isfinite(norm):
        return True, norm
    if not all(bool(torch.isfinite(f).all()) for f in flats):
        return False, math.inf
    wide = [float(torch.linalg.vector_norm(f, dtype=torch.float64)) for f in flats]
    return True, math.sqrt(sum(n * n for n in wide))


def exchange(
    quorum: QuorumCollective, finite: bool, norm: float, weight: float
) -> tuple[list[bool], list[float], list[float]]:
    """Every member's (finite, norm, weight), by rank: one SUM all-reduce of a ``[size, 3]``
    fp64 table in which each rank fills its own row (every other rank adds 0 there, so any
    value, NaN or 1e300 included, arrives as it was sent)."""
    table = torch.zeros(quorum.size, 3, dtype=torch.float64, device=quorum.device)
    table[quorum.rank] = torch.tensor([1.0 if finite else 0.0, norm, weight], dtype=torch.float64)
    quorum.collective("norm exchange", allreduce_work(table, quorum.timeout))
    rows = table.cpu().tolist()
    return [r[0] == 1.0 for r in rows], [r[1] for r in rows], [r[2] for r in rows]


def name_excluded(
    worker: str | None, q: Assignment, averaged: Averaged
) -> tuple[tuple[str, ...], bool]:
    """The members of quorum ``q`` the checks left out, by worker id (for its outcome), and
    whether this worker (``q.rank``) is one; logged: a warning naming them and why, and an error
    on the member left out."""
    verdict = averaged.verdict
    if not verdict.excluded:
        return (), False
    names = [q.members[r] if r < len(q.members) else f"rank {r}" for r in verdict.excluded]
    log.warning(
        "worker %s: quorum %s left out %s",
        worker,
        q.quorum_id,
        "; ".join(
            f"{n} ({verdict.reasons[r]})" for n, r in zip(names, verdict.excluded, strict=True)
        ),
    )
    mine = q.rank in verdict.excluded
    if mine:
        log.error(
            "worker %s: its contribution to quorum %s was dropped: %s",
            worker,
            q.quorum_id,
            verdict.reasons[q.rank],
        )
    return tuple(names), mine

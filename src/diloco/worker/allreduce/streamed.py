"""The quorum collectives of a member whose state is not in its memory as a whole (a sharded
worker group's rank 0: docs/design/groups.md, "Sharded groups in all-reduce mode"): the checked
average, the state's broadcast and its hash, each reaching the state one parameter at a time
through ``Parts`` (the group's commands), never holding the model.

On the wire they are exactly ``average_checks.checked_average``, ``collective.broadcast`` and
``collective.state_hash`` of the whole model: the same table check, the same buckets (cut by
``bucket_plan`` as ``collective._packed`` cuts them: consecutive tensors packed in order, a large
one split across buckets), the same bytes. So a sharded group and plain workers meet in one
quorum. What differs is where the values come from and go: a parameter is loaded (gathered from
its owners) when the bucket reaches its first element, and stored (scattered to its holders)
once the bucket holding its last element has been reduced. Rank 0 holds one bucket, the
parameter being read, and the results of the parameters whose elements are in the bucket.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from diloco.core.robust import judge
from diloco.wire.messages.uploads import MAX_WEIGHT
from diloco.worker.allreduce.average_checks import TINY, Averaged, exchange, slack
from diloco.worker.allreduce.collective import (
    BUCKET_BYTES,
    QuorumCollective,
    allreduce_work,
    check_tables,
    state_hash,
)

Entry = tuple[str, str, tuple[int, ...]]
"""One tensor of the state, in the order a plain member lists it: (kind, parameter name, shape);
kind ``snap`` (the snapshot), ``mom`` (the momentum) or ``grad`` (the pseudo-gradient)."""


class Parts(Protocol):
    """Rank 0's way to the state on its group's shards (``groups/sharded_outer.OuterShards``).
    Every tensor is fp32 and has the parameter's global shape."""

    def own(self) -> None:
        """The snapshot from the model's own parameters."""

    def measure(self) -> tuple[bool, float]:
        """Whether the pseudo-gradient (``snapshot - local``) is finite, and its L2 norm."""
        ...

    def load(self, kind: str, name: str) -> torch.Tensor:
        """A parameter's ``grad``, ``snap`` or ``mom``, valid until the next ``load``."""
        ...

    def store(self, kind: str, name: str, whole: torch.Tensor) -> None:
        """``whole`` into the parameter's ``acc``, ``snap`` or ``mom`` (not kept)."""

    def step(self, lr: float, momentum: float, nesterov: bool) -> None:
        """The outer step on the snapshot with ``acc`` and the momentum."""


def table(entries: Sequence[Entry]) -> str:
    """``collective.table_of`` of the fp32 tensors ``entries`` name."""
    return ";".join(f"{torch.float32}{tuple(shape)}" for _, _, shape in entries)


def bucket_plan(numels: Sequence[int], capacity: int) -> Iterator[list[tuple[int, int, int, int]]]:
    """``collective._packed``'s buckets over tensors of ``numels`` elements: per bucket, its
    pieces as (tensor index, start in the tensor, elements, start in the bucket)."""
    pieces: list[tuple[int, int, int, int]] = []
    used = 0
    for i, n in enumerate(numels):
        start = 0
        while start < n:
            take = min(capacity - used, n - start)
            pieces.append((i, start, take, used))
            used += take
            start += take
            if used == capacity:
                yield pieces
                pieces, used = [], 0
    if pieces:
        yield pieces


def checked_average(
    quorum: QuorumCollective,
    parts: Parts,
    entries: Sequence[Entry],
    weight: float,
    dtype: torch.dtype,
    *,
    norm_bound: float,
    sample: int,
    bucket_bytes: int = BUCKET_BYTES,
) -> tuple[Averaged, list[torch.Tensor]]:
    """``average_checks.checked_average`` of the ``grad`` entries, each result stored as
    ``acc``; also every ``sample``-th element of each result (the commit point's sample).
    The same contract: nothing but ``acc`` changes, and on ``QuorumFailed`` ``acc`` holds a mix."""
    if not dtype.is_floating_point:
        raise ValueError(f"the communication dtype must be floating point, not {dtype}")
    check_tables(quorum, f"checked {dtype} {bucket_bytes};" + table(entries))
    finite, norm = parts.measure()
    verdict = judge(*exchange(quorum, finite, norm, weight), norm_bound, MAX_WEIGHT)
    total = verdict.total
    numels = [math.prod(shape) for _, _, shape in entries]
    samples = [torch.zeros(n, dtype=torch.float32)[::sample] for n in numels]
    if total == 0:  # as ``reduce_scaled``: zeros, no collective (no step follows)
        return Averaged(verdict, 0.0, True), samples
    scale = verdict.weights[quorum.rank] / total
    capacity = max(1, bucket_bytes // dtype.itemsize)
    buffer = torch.empty(min(capacity, max(1, sum(numels))), dtype=dtype, device=quorum.device)
    results: dict[int, torch.Tensor] = {}
    reading: tuple[int, torch.Tensor] | None = None
    squares = 0.0
    for pieces in bucket_plan(numels, capacity):
        used = 0
        for i, start, take, at in pieces:
            part = buffer[at : at + take]
            used = at + take
            if scale == 0.0:
                part.zero_()  # a member left out sends zeros, not its tensor (0 * NaN is NaN)
                continue
            if reading is None or reading[0] != i:
                _, name, _ = entries[i]
                reading = (i, parts.load("grad", name).reshape(-1))
            own = reading[1][start : start + take]
            torch.mul(own.to(part.device), scale, out=part)  # rounded once into ``dtype``
        quorum.collective("all-reduce", allreduce_work(buffer[:used], quorum.timeout))
        for i, start, take, at in pieces:
            result = results.setdefault(i, torch.empty(numels[i], dtype=torch.float32))
            got = result[start : start + take]
            got.copy_(buffer[at : at + take])
            squares += float(torch.linalg.vector_norm(got, dtype=torch.float32)) ** 2
            if start + take == numels[i]:
                _, name, shape = entries[i]
                parts.store("acc", name, result.view(shape))
                samples[i] = result[::sample].clone()
                del results[i]
    got_norm = math.sqrt(squares)
    bound = verdict.bound * (1 + slack(dtype, quorum.size)) + TINY
    return Averaged(verdict, got_norm, got_norm <= bound), samples


def broadcast(
    quorum: QuorumCollective,
    parts: Parts,
    entries: Sequence[Entry],
    src: int,
    *,
    bucket_bytes: int = BUCKET_BYTES,
) -> None:
    """``collective.broadcast`` of the state ``entries`` name, from rank ``src``: loaded when
    this member sends, stored when it receives. The same contract."""
    if not 0 <= src < quorum.size:
        raise ValueError(f"src must be a rank in [0, {quorum.size}), got {src}")
    check_tables(quorum, f"broadcast {src} {bucket_bytes};" + table(entries))
    sizes = [math.prod(shape) * 4 for _, _, shape in entries]  # bytes: fp32
    sending = quorum.rank == src
    buffer = torch.empty(
        min(bucket_bytes, max(1, sum(sizes))), dtype=torch.uint8, device=quorum.device
    )
    results: dict[int, torch.Tensor] = {}
    reading: tuple[int, torch.Tensor] | None = None
    for pieces in bucket_plan(sizes, max(1, bucket_bytes)):
        used = pieces[-1][3] + pieces[-1][2]
        if sending:
            for i, start, take, at in pieces:
                if reading is None or reading[0] != i:
                    kind, name, _ = entries[i]
                    whole = parts.load(kind, name).contiguous()
                    reading = (i, whole.reshape(-1).view(torch.uint8))
                buffer[at : at + take].copy_(reading[1][start : start + take])
        quorum.collective("broadcast", _broadcast_work(buffer[:used], src, quorum.timeout))
        if sending:
            continue
        for i, start, take, at in pieces:
            result = results.setdefault(i, torch.empty(sizes[i], dtype=torch.uint8))
            result[start : start + take].copy_(buffer[at : at + take])
            if start + take == sizes[i]:
                kind, name, shape = entries[i]
                parts.store(kind, name, result.view(torch.float32).view(shape))
                del results[i]


def streamed_hash(parts: Parts, entries: Sequence[Entry]) -> str:
    """``collective.state_hash`` of the state ``entries`` name, one parameter loaded at a
    time (the checksum reads each before the next is loaded)."""
    return state_hash(parts.load(kind, name) for kind, name, _ in entries)


def _broadcast_work(tensor: torch.Tensor, src: int, timeout: float) -> Any:
    options = dist.BroadcastOptions()
    options.rootRank = src
    options.rootTensor = 0
    options.timeout = timedelta(seconds=timeout)
    return lambda backend: backend.broadcast([tensor], options)

"""The all-reduce mode's data plane: a process group for ONE quorum (``QuorumCollective``), and
the collectives a round needs on it (a weighted average of pseudo-gradients, a broadcast for a
joiner, a state hash).

A quorum is the set of live workers the server picked for a round (``server/allreduce/``).
Each member calls ``QuorumCollective.build`` with where the quorums meet (a ``connect.Meeting``:
the server's authenticated rendezvous, ``http_store.py``), the quorum's id, its rank and the
quorum's size; the backend (gloo on CPU, NCCL on CUDA) is constructed directly on that quorum's
store. ``torch.distributed.init_process_group`` is never called: a broken quorum cannot poison
the default group, the next round's group, or a worker group (``worker/groups/group.py``)
living in the same process.

Faults: every wait is bounded by the collective's ``timeout`` (connecting to the rendezvous, meeting
the other members, each collective). A peer killed outright fails the collective at once (its
sockets are reset: about 30 ms measured); a peer that stops answering without closing its
sockets (SIGSTOP, a frozen host) fails it when the timeout runs out. Either way, and on any
other error of a collective, the caller gets ``QuorumFailed`` and the collective is closed for good:
the round is discarded and a new quorum (a new id) repeats it.

The rendezvous is authenticated; gloo's and NCCL's peer connections are not (see
docs/design/security.md).
The NCCL path is written to the same contract but untested (no GPU in this project's tests).
A ``QuorumCollective`` is used by one thread at a time.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from diloco.wire.checksum import checksum
from diloco.wire.encode import byte_view
from diloco.wire.messages import quorum_prefix
from diloco.worker.allreduce.connect import Meeting, connect, shut

log = logging.getLogger(__name__)

BUCKET_BYTES = 32 << 20
"""Collectives move at most this many bytes at a time: extra memory stays one bucket, whatever
the model's size, and a large model still travels in few collectives."""


class QuorumFailed(RuntimeError):
    """A quorum could not form or one of its collectives failed (a peer died or stopped
    answering within the timeout, the rendezvous was unreachable). The cause is chained
    (``__cause__``). The collective is closed; results of the interrupted call must not be used."""

    def __init__(self, quorum_id: str, message: str, *, stage: str = "") -> None:
        super().__init__(f"quorum {quorum_id}: {message}")
        self.quorum_id = quorum_id
        #: Where the round broke off (``QuorumOutcome.stage``): set by the quorum loop where
        #: it is not known here.
        self.stage = stage


class QuorumCollective:
    """One member's handle on a quorum's process group. Made by ``build``; closed by ``close``
    (or a failed collective), after which every call raises ``QuorumFailed``."""

    def __init__(
        self,
        backend: Any,
        store: Any,
        *,
        quorum_id: str,
        rank: int,
        size: int,
        timeout: float,
        device: torch.device,
    ) -> None:
        self._backend: Any = backend
        self._store: Any = store  # the backend holds it too; kept so close() drops both
        self.quorum_id = quorum_id
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.device = device

    @classmethod
    def build(
        cls,
        meeting: Meeting,
        quorum_id: str,
        rank: int,
        size: int,
        timeout: float,
        device: torch.device | str = "cpu",
        *,
        interface: str | None = None,
    ) -> QuorumCollective:
        """Join quorum ``quorum_id`` as ``rank`` of ``size`` through ``meeting``'s rendezvous.
        Returns once every member has joined; takes at most twice ``timeout`` plus
        ``quorum_connect.BUILD_MARGIN_S`` seconds (connecting, then meeting the others), else raises
        ``QuorumFailed``.

        ``device``: CPU builds gloo, CUDA builds NCCL (untested here). ``interface``: the local
        address gloo listens on for its peers; by default the one this machine routes to the
        server from, which is on the network the peers share (gloo's own default, the
        hostname's address, is loopback on many hosts).
        """
        quorum_prefix(quorum_id)  # a ValueError for an id the protocol refuses
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, {size}), got {rank}")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"quorum collectives run on cpu (gloo) or cuda (NCCL), not {device}")
        try:
            backend, store = connect(meeting, quorum_id, rank, size, timeout, device, interface)
        except (RuntimeError, OSError) as err:  # torch's DistError family, gloo's, the deadline
            raise QuorumFailed(quorum_id, f"rank {rank} could not join: {err}") from err
        log.debug("joined quorum %s as rank %d of %d", quorum_id, rank, size)
        return cls(
            backend,
            store,
            quorum_id=quorum_id,
            rank=rank,
            size=size,
            timeout=timeout,
            device=device,
        )

    @property
    def closed(self) -> bool:
        return self._backend is None

    def collective(self, what: str, start: Callable[[Any], Any]) -> None:
        """Run one collective: ``start(backend)`` issues it and returns its ``Work``, which is
        waited for at most ``timeout``. On any failure the collective is closed and ``QuorumFailed``
        (naming ``what``) is raised; the tensors it touched hold unspecified values then."""
        backend = self._backend
        if backend is None:
            raise QuorumFailed(self.quorum_id, f"{what} on a closed collective")
        try:
            work = start(backend)
            # Bounded twice: the backend's per-operation timeout (gloo enforces it on every
            # receive) and this wait's own limit (NCCL blocks the CPU only when given one).
            if not work.wait(timedelta(seconds=self.timeout)):
                raise RuntimeError("the collective did not complete")
        except Exception as err:
            self.close()
            log.warning("quorum %s: %s failed on rank %d: %s", self.quorum_id, what, self.rank, err)
            raise QuorumFailed(self.quorum_id, f"{what} failed: {err}") from err

    def close(self) -> None:
        """Abort pending collectives and connections, shut the backend down, drop it and the
        store connection. Idempotent; the collective is never used again."""
        backend, self._backend, self._store = self._backend, None, None
        if backend is not None:
            shut(backend, self.quorum_id)

    def __enter__(self) -> QuorumCollective:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def average(
    quorum: QuorumCollective,
    tensors: Sequence[torch.Tensor],
    weight: float,
    dtype: torch.dtype = torch.float32,
    *,
    bucket_bytes: int = BUCKET_BYTES,
) -> float:
    """The quorum's weighted mean ``sum(w_i * t_i) / sum(w_i)``, in place in every member's
    ``tensors`` (contiguous, floating point, the same table on every rank); returns the sum of
    the weights. A collective: every member calls it with its own tensors and ``weight``.

    ``dtype`` is the communication dtype (bf16 halves the bytes); results are written back in
    the tensors' own dtype. Every member ends with bit-identical tensors: gloo's all-reduce
    hands every rank the same bytes (checked by tests/processes/test_quorum_group.py).
    If every weight is 0 the tensors are zeroed (the same on every rank) and 0.0 returned.
    Raises ``ValueError`` on every rank together if a weight is negative or not finite, or the
    members' tables, ``dtype`` or ``bucket_bytes`` differ: nothing mismatched is ever summed.
    On ``QuorumFailed`` the tensors hold a mix of averaged and own values: the caller
    recomputes its pseudo-gradient (``snapshot - local``) for the next quorum.
    """
    if not dtype.is_floating_point:
        raise ValueError(f"the communication dtype must be floating point, not {dtype}")
    flats = flat_views(tensors)
    check_tables(quorum, f"average {dtype} {bucket_bytes};" + table_of(tensors))
    total = _weight_sum(quorum, weight)
    reduce_scaled(quorum, flats, weight / total if total else 0.0, total, dtype, bucket_bytes)
    return total


def reduce_scaled(
    quorum: QuorumCollective,
    flats: list[torch.Tensor],
    scale: float,
    total: float,
    dtype: torch.dtype,
    bucket_bytes: int,
    *,
    norm: bool = False,
) -> float:
    """The sum over the quorum of each rank's ``scale * flats``, in place, bucket by bucket (one
    all-reduce each); all zeros on every rank when ``total`` is 0. With ``norm``, returns the
    result's L2 norm (of the values written back, combined in fp64; NaN or inf if any value is
    not), taken while each bucket is in cache rather than in another pass (else 0)."""
    if total == 0.0:
        for flat in flats:
            flat.zero_()
        return 0.0
    squares = 0.0
    # Each rank scales by w_i / sum(w) before the sum, not after: one pass fewer over the model,
    # and bf16 carries values of the result's size whatever the weights' magnitude.
    for bucket, pieces in _packed(flats, dtype, bucket_bytes, quorum.device):
        for own, part in pieces:
            if scale == 0.0:
                part.zero_()  # 0 * NaN is NaN: a member left out sends zeros, not its tensor
            else:
                _scaled_copy(part, own, scale)
        quorum.collective("all-reduce", allreduce_work(bucket, quorum.timeout))
        for own, part in pieces:
            own.copy_(part)
            if norm:
                # Of the fp32 values written back: a bf16 bucket's norm in fp32 copies it first
                # (190 ms against 14 ms per 100M parameters on one core).
                squares += float(torch.linalg.vector_norm(own, dtype=torch.float32)) ** 2
    return math.sqrt(squares)


def broadcast(
    quorum: QuorumCollective,
    tensors: Sequence[torch.Tensor],
    src: int,
    *,
    bucket_bytes: int = BUCKET_BYTES,
) -> None:
    """Rank ``src``'s ``tensors`` (contiguous, any dtype, the same table on every rank) into
    every member's, bit for bit: how a joiner catches up from a live member. A collective.
    Raises ``ValueError`` on every rank together if the tables differ. On ``QuorumFailed`` the
    receivers' tensors are partly overwritten and must be fetched again."""
    if not 0 <= src < quorum.size:
        raise ValueError(f"src must be a rank in [0, {quorum.size}), got {src}")
    # Bytes, not values: a bucket of one dtype carries any mix of dtypes without conversion.
    flats = [t.detach().reshape(-1).view(torch.uint8) for t in _contiguous(tensors)]
    check_tables(quorum, f"broadcast {src} {bucket_bytes};" + table_of(tensors))
    sending = quorum.rank == src
    for bucket, pieces in _packed(flats, torch.uint8, bucket_bytes, quorum.device):
        if sending:
            for own, part in pieces:
                part.copy_(own)
        quorum.collective("broadcast", _broadcast(bucket, src, quorum.timeout))
        if not sending:
            for own, part in pieces:
                own.copy_(part)


def compare(
    quorum: QuorumCollective, value: str, *, veto: bool, what: str = "hash check"
) -> tuple[bool, bool]:
    """Whether every member holds the same hex hash ``value`` (``state_hash``'s), and whether
    some member vetoed: one MAX all-reduce of ``[v, -v, veto]`` gives the largest and the
    smallest value held and any veto. Every member that completes the collective learns both,
    so a veto (a failed check of the average) fails the comparison on every member, never on
    some. A collective (``what`` names it in errors and logs)."""
    v = float(int(value, 16))  # 32 bits: exact in fp64
    t = torch.tensor([v, -v, 1.0 if veto else 0.0], dtype=torch.float64)
    quorum.collective(what, allreduce_work(t, quorum.timeout, dist.ReduceOp.MAX))
    return bool(t[0].item() == v and -t[1].item() == v), bool(t[2].item() > 0)


def state_hash(tensors: Iterable[torch.Tensor]) -> str:
    """A fingerprint of each tensor's dtype, shape and bytes, in order: parameters then outer
    optimizer state, compared across a quorum after every round.

    CRC-32 (``wire/checksum.py``), as the server mode's downlink checksum: this detects a
    replica that diverged (a missed round, another device's arithmetic), not an attacker, and
    it runs at several GB/s where a cryptographic hash would add about a second per round to
    a 100M-parameter model with its optimizer state. Two diverged states collide with
    probability 2**-32 per comparison."""

    def buffers() -> Iterator[memoryview | bytes]:
        for t in tensors:
            yield f"{t.dtype}{tuple(t.shape)};".encode()
            t = t.detach().to("cpu").contiguous()
            if t.dim() and t.stride(-1) != 1:  # a one-element view keeps its odd stride
                t = t.clone(memory_format=torch.contiguous_format)
            yield byte_view(t)

    return checksum(buffers())


def _contiguous(tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    for i, t in enumerate(tensors):
        if not t.is_contiguous():
            raise ValueError(f"tensor {i} is not contiguous: collectives work on flat views")
    return tensors


def flat_views(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    for i, t in enumerate(_contiguous(tensors)):
        if not t.is_floating_point():
            raise ValueError(f"tensor {i} is {t.dtype}: only floating point tensors are averaged")
    return [t.detach().view(-1) for t in tensors]


def table_of(tensors: Sequence[torch.Tensor]) -> str:
    return ";".join(f"{t.dtype}{tuple(t.shape)}" for t in tensors)


def check_tables(quorum: QuorumCollective, layout: str) -> None:
    """Every rank raises ValueError together unless all ranks describe the same ``layout``:
    one tiny all-reduce (MAX of the fingerprint and of its negation gives max and -min)."""
    mark = int(checksum([layout.encode()]), 16)
    pair = torch.tensor([mark, -mark], dtype=torch.int64, device=quorum.device)
    quorum.collective("table check", allreduce_work(pair, quorum.timeout, dist.ReduceOp.MAX))
    if int(pair[0]) != -int(pair[1]):
        raise ValueError(
            f"quorum {quorum.quorum_id}: the members' tensor tables (or call arguments) differ"
        )


def _weight_sum(quorum: QuorumCollective, weight: float) -> float:
    # A bad weight is reported through the sum, so every rank refuses together instead of one
    # rank raising while the others wait for it until the timeout.
    bad = not (math.isfinite(weight) and weight >= 0)
    pair = torch.tensor(
        [0.0 if bad else weight, 1.0 if bad else 0.0], dtype=torch.float64, device=quorum.device
    )
    quorum.collective("weight sum", allreduce_work(pair, quorum.timeout))
    if pair[1].item() > 0:
        raise ValueError(
            f"quorum {quorum.quorum_id}: {int(pair[1].item())} member(s) gave a negative or "
            f"non-finite weight (this rank's: {weight})"
        )
    return float(pair[0].item())


def _packed(
    flats: list[torch.Tensor], dtype: torch.dtype, bucket_bytes: int, device: torch.device
) -> Iterator[tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]]:
    """Yield (bucket, [(slice of a flat tensor, its place in the bucket)]) over all tensors in
    order: small tensors share a bucket, large ones are split across several. One buffer is
    reused, so the caller is done with a bucket before asking for the next."""
    capacity = max(1, bucket_bytes // dtype.itemsize)
    total = sum(f.numel() for f in flats)
    if total == 0:
        return
    buffer = torch.empty(min(capacity, total), dtype=dtype, device=device)
    for used, plan in bucket_plan(flats, capacity):
        yield (
            buffer[:used],
            [
                (flats[i][start : start + take], buffer[at : at + take])
                for i, start, take, at in plan
            ],
        )


def bucket_plan(
    flats: Sequence[torch.Tensor], capacity: int
) -> Iterator[tuple[int, list[tuple[int, int, int, int]]]]:
    """(elements, [(tensor index, start, count, offset in the bucket)]) over the flat tensors
    in order, at most ``capacity`` elements a bucket: small tensors share a bucket, large ones
    are split across several (the plain and the quantized collectives' one packing rule)."""
    pieces: list[tuple[int, int, int, int]] = []
    used = 0
    for i, flat in enumerate(flats):
        start = 0
        while start < flat.numel():
            take = min(capacity - used, flat.numel() - start)
            pieces.append((i, start, take, used))
            used += take
            start += take
            if used == capacity:
                yield used, pieces
                pieces, used = [], 0
    if pieces:
        yield used, pieces


def _scaled_copy(part: torch.Tensor, own: torch.Tensor, scale: float) -> None:
    if own.device == part.device:
        # Multiplied in the tensor's precision, rounded once into the communication dtype.
        torch.mul(own, scale, out=part)
    else:
        part.copy_(own.to(part.device).mul_(scale))


def allreduce_work(
    tensor: torch.Tensor, timeout: float, op: Any = dist.ReduceOp.SUM
) -> Callable[[Any], Any]:
    options = dist.AllreduceOptions()
    options.reduceOp = op
    options.timeout = timedelta(seconds=timeout)
    return lambda backend: backend.allreduce([tensor], options)


def _broadcast(tensor: torch.Tensor, src: int, timeout: float) -> Callable[[Any], Any]:
    options = dist.BroadcastOptions()
    options.rootRank = src
    options.rootTensor = 0
    options.timeout = timedelta(seconds=timeout)
    return lambda backend: backend.broadcast([tensor], options)

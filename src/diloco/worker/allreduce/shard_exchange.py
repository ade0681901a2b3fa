"""Shard with shard (the HSDP exchange): a quorum whose members are all sharded worker groups of
one layout averages position by position, rank r of each group with rank r of the others, so
no rank 0 funnels the model (docs/design/groups.md, "Sharded groups in all-reduce mode").

- ``same_layout``: every member's first step in a quorum (``SharedState.meet``): one tiny
  collective comparing the members' layout marks. A plain member's mark is ``WHOLE_MODEL``; a
  sharded group's is its ``Positions.mark`` (its size and every rank's boxes). Only when all
  marks are one sharded layout do the groups exchange shard with shard; any other quorum (a
  plain member, groups of other sizes or meshes) takes the streamed path (``streamed.py``),
  whose bytes are a plain member's.
- ``exchange_average``: the checked average as ``average_checks.checked_average`` does it on
  the quorum (the members' statements, the verdict, each member's scale, the result's norm
  against the bound), with the tensor all-reduce run on every position; the commit point's
  sample is each rank's CRC of its sample (the layout is the same everywhere, so are they).
- ``layout_free_hash``: ``collective.state_hash`` of the state without gathering it: each owner
  checksums its boxes that are runs of the flat parameter (``Shard(0)`` rows are), rank 0 joins
  the CRCs in order (``core.crc``); a parameter cut another way is gathered as before. The
  value is the whole model's, so a sharded group and a plain member agree on it.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from diloco.core.crc import crc32_combine
from diloco.core.robust import judge
from diloco.wire.checksum import checksum
from diloco.wire.encode import byte_view
from diloco.wire.messages import Rendezvous
from diloco.wire.messages.uploads import MAX_WEIGHT
from diloco.worker.allreduce.average_checks import TINY, Averaged, exchange, slack
from diloco.worker.allreduce.collective import (
    BUCKET_BYTES,
    QuorumCollective,
    QuorumFailed,
    broadcast,
    compare,
    reduce_scaled,
)
from diloco.worker.allreduce.http_store import HttpMeeting
from diloco.worker.transport.client import DiLoCoClient

WHOLE_MODEL = checksum([b"the whole model in one process"])
"""A plain member's layout mark."""

Entry = tuple[str, str, tuple[int, ...]]
"""One tensor of the state: (kind, parameter name, shape), as ``streamed.Entry``."""


class Positions(Protocol):
    """Rank 0's way to run the exchange on its group's ranks
    (``groups/sharded_positions.PositionShards``). Every call but ``mark`` is a command every
    rank runs; those that can fail on a rank return every rank's error (None: none)."""

    def mark(self) -> str:
        """The layout's fingerprint (8 hex digits, as ``wire.checksum``)."""
        ...

    def open(self, quorum: QuorumPosition, cmd: dict[str, Any]) -> list[str | None]:
        """Every rank joins its position of the quorum ``cmd`` describes (``join_command``);
        rank 0's is ``quorum``."""
        ...

    def close(self) -> None:
        """Every rank leaves its position."""

    def average(
        self, scale: float, total: float, dtype: torch.dtype, sample: int
    ) -> tuple[float, list[int], list[str | None]]:
        """The pseudo-gradient averaged on every position into ``acc``: the result's squared
        norm and each rank's CRC of its sample."""
        ...

    def broadcast(self, src: int, kinds: list[str]) -> list[str | None]:
        """Member ``src``'s state of ``kinds`` into every member's, position by position."""
        ...

    def runs(self, kind: str) -> dict[str, list[tuple[int, int, int]]]:
        """The owned boxes of ``kind`` that are runs of their flat parameter, by parameter:
        (start, elements, CRC-32 of their fp32 bytes)."""
        ...


class QuorumPosition:
    """A quorum's process group as one rank position (``groups/sharded_positions.Position``):
    the quorum's own for rank 0 of each group, one built through the rendezvous for rank r."""

    def __init__(self, quorum: QuorumCollective) -> None:
        self.quorum = quorum
        self.size = quorum.size

    def average(
        self, flats: list[torch.Tensor], scale: float, total: float, dtype: torch.dtype
    ) -> None:
        reduce_scaled(self.quorum, flats, scale, total, dtype, BUCKET_BYTES)

    def broadcast(self, tensors: list[torch.Tensor], src: int) -> None:
        broadcast(self.quorum, tensors, src)

    def close(self) -> None:
        self.quorum.close()


class HttpLink:
    """How rank r of a group joins position r: the quorum's rendezvous on the server, in the
    key space of position r, as its group's member (``groups/sharded_positions.Link``)."""

    def __init__(self, client: DiLoCoClient) -> None:
        self._client = client

    def join(self, cmd: dict[str, Any], position: int, device: torch.device) -> QuorumPosition:
        where = Rendezvous(path=cmd["path"])
        meeting = HttpMeeting(self._client, cmd["worker_id"], where, position=position)
        quorum = QuorumCollective.build(
            meeting, cmd["quorum_id"], cmd["rank"], cmd["size"], cmd["timeout"], device
        )
        return QuorumPosition(quorum)


def join_command(quorum: QuorumCollective, worker_id: str, path: str) -> dict[str, Any]:
    """What rank r needs to join position r of ``quorum`` (``x_join``'s fields)."""
    return {
        "worker_id": worker_id,
        "path": path,
        "quorum_id": quorum.quorum_id,
        "rank": quorum.rank,
        "size": quorum.size,
        "timeout": quorum.timeout,
        "cuda": quorum.device.type == "cuda",
    }


def raise_any(quorum: QuorumCollective, errors: Sequence[str | None], stage: str) -> None:
    """``QuorumFailed`` naming every rank's error, if one had any."""
    failed = [e for e in errors if e]
    if failed:
        raise QuorumFailed(quorum.quorum_id, "; ".join(failed), stage=stage)


def same_layout(quorum: QuorumCollective, mark: str) -> bool:
    """Whether every member gave the same ``mark``. A collective (a tiny all-reduce)."""
    same, _ = compare(quorum, mark, veto=False, what="layout check")
    return same


def exchange_average(
    quorum: QuorumCollective,
    positions: Positions,
    statement: tuple[bool, float],
    weight: float,
    dtype: torch.dtype,
    *,
    norm_bound: float,
    sample: int,
) -> tuple[Averaged, list[torch.Tensor]]:
    """``average_checks.checked_average`` of the group's pseudo-gradient, averaged position by
    position (``statement``: whether it is finite, and its norm). The same contract: every
    member reaches the same verdict, a member left out sends zeros, the result's check is
    returned for the commit point; only ``acc`` changes, and on ``QuorumFailed`` it holds a mix.
    Also the commit point's sample: each rank's CRC of its part of the result."""
    if not dtype.is_floating_point:
        raise ValueError(f"the communication dtype must be floating point, not {dtype}")
    verdict = judge(*exchange(quorum, *statement, weight), norm_bound, MAX_WEIGHT)
    total = verdict.total
    scale = verdict.weights[quorum.rank] / total if total else 0.0
    squares, crcs, errors = positions.average(scale, total, dtype, sample)
    raise_any(quorum, errors, "average")
    sample_of = [torch.tensor(crcs, dtype=torch.int64)]
    if total == 0:
        return Averaged(verdict, 0.0, True), sample_of
    norm = math.sqrt(squares)
    bound = verdict.bound * (1 + slack(dtype, quorum.size)) + TINY
    return Averaged(verdict, norm, norm <= bound), sample_of


def layout_free_hash(
    positions: Positions, load: Callable[[str, str], torch.Tensor], entries: Sequence[Entry]
) -> str:
    """``collective.state_hash`` of the fp32 tensors ``entries`` name: from the owners' CRCs
    where every owned box of a parameter is a run of it, else from the parameter gathered
    (``load(kind, name)``)."""
    runs = {kind: positions.runs(kind) for kind in dict.fromkeys(k for k, _, _ in entries)}
    crc = 0
    for kind, name, shape in entries:
        crc = zlib.crc32(f"{torch.float32}{tuple(shape)};".encode(), crc)
        pieces = sorted(runs[kind].get(name, []))
        if _tiles(pieces, math.prod(shape)):
            for _, n, piece_crc in pieces:
                crc = crc32_combine(crc, piece_crc, 4 * n)  # fp32: 4 bytes an element
        else:
            crc = zlib.crc32(byte_view(load(kind, name).contiguous()), crc)
    return f"{crc:08x}"


def _tiles(pieces: Sequence[tuple[int, int, int]], numel: int) -> bool:
    """Whether the runs, sorted, cover ``[0, numel)`` end to end."""
    at = 0
    for start, n, _ in pieces:
        if start != at:
            return False
        at += n
    return at == numel

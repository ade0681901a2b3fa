"""The quantized all-reduce of a quorum (``comm`` ``int8``, ``int4`` or ``topk``;
docs/design/allreduce.md, "Quantized all-reduce"), and the error-feedback residuals each member
keeps for it.

One bucket at a time (``BUCKET_BYTES`` of fp32, as the dense path): every member quantizes its
contribution ``scale * acc + e`` (``e``: the residual it owes) blockwise into one slot per shard;
one all-to-all hands each rank every member's slot of its shard (the reduce-scatter); the rank
sums them in fp32 in rank order and requantizes the sum (``core.codecs.shard_reduce``); one
all-gather hands every rank every requantized shard, and every rank decodes the same bytes, so
every replica ends bit-identical. gloo's all-to-all was measured beside its all-gather and
all-reduce (docs/design/allreduce.md). ``topk`` (sparse) is not reduce-scattered: each member's
encoded bucket is all-gathered whole, and every rank sums the N decoded slots in rank order.

Error feedback: what a member's codes dropped, plus what the requantization of the shard it
reduced dropped, is its next residual (``Residuals.pending``), adopted only once the round
passed its commit point (``commit``): a discarded round leaves the residual as it was, so the
repeat sends the same. With a decay ``beta`` (the worker's ``ef_decay``, or its outer rule's:
``core/outer_rules.py``) the residual is scaled before it is added, ``c = scale * acc + beta *
e``, as ``ErrorFeedback`` does in server mode. Rules for a member resynced, left out or
restarted are ``Residuals``'. Without error feedback (the worker's ``error_feedback`` False, as
in server mode) there is no residual: each round sends ``scale * acc`` quantized on its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from diloco.core.codecs import BlockCodec, Int4Codec, Int8Codec, TopKCodec
from diloco.core.codecs.shard_reduce import (
    decode_slot,
    quantize_feedback_,
    reduce_slots,
    shard_bounds,
    slot_bytes,
)
from diloco.worker.allreduce.collective import (
    BUCKET_BYTES,
    QuorumCollective,
    bucket_plan,
    table_of,
)
from diloco.worker.session import Session

QUANTIZED: dict[str, Callable[[], BlockCodec]] = {
    "int8": Int8Codec,
    "int4": Int4Codec,
    "topk": TopKCodec,
}
"""The quorum ``comm`` values that travel encoded, and their codecs (default options)."""


@dataclass(frozen=True)
class Quantized:
    """What a quantized average needs of the member: the codec, the residuals it owes for these
    tensors and the buffers for its new ones (``Residuals.for_round``)."""

    codec: BlockCodec
    residual: list[torch.Tensor] | None
    pending: list[torch.Tensor] | None
    """Both None without error feedback (``Residuals.feedback`` False): nothing sent, nothing
    kept."""
    decay: float = 1.0
    """The residual is scaled by this before it is added to the contribution (1: plain)."""


QUORUM_RESIDUAL = "quorum_residual/"
"""Key prefix of the residuals in a worker's checkpoint (``Residuals.state_dict``): then the
share and the tensor's index, ``quorum_residual/0/3``."""


@dataclass
class Residuals:
    """A member's error-feedback residuals for the quantized all-reduce, fp32 flat tensors keyed
    by the share of the model a round averages (the whole model, or one streaming fragment).

    Rules: a round's new residuals (``pending``) replace the old ones only at ``commit`` (the
    round passed its commit point and stepped); a discarded round, a quorum whose admitted
    weights sum to 0, a member left out by the checks (it sent none of it: still owed) and a
    dense round keep the old ones; a rebase keeps them (the residual is owed to the run,
    whatever the state the progress sits on); ``forget`` drops them where the member takes the run's
    state wholesale (a rejoin after exclusions, or a state made by a quorum whose commit point
    failed here, which may or may not hold this member's last contribution): at most one
    round's quantization error is lost. The decay scales only a residual that is sent: a member
    left out keeps its residual undecayed. A worker's checkpoint holds them (``state_dict``,
    through ``Session.saved_feedback``) and a resumed worker starts from them
    (``load_state_dict``), so a restart between rounds loses nothing.

    ``feedback`` False (the worker's ``error_feedback``): none of that; rounds get no residual
    (``for_round``), nothing is held or saved, and a checkpoint's residuals are dropped."""

    held: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    pending: tuple[str, list[torch.Tensor]] | None = None
    filling: bool = False
    """``pending`` belongs to the round in progress (``begin``), not to an earlier one that
    failed: only then may ``commit`` adopt it."""
    restored: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    """A checkpoint's residuals by share, not yet taken by a round (``of`` takes them)."""
    feedback: bool = True

    @classmethod
    def resumed(cls, session: Session, feedback: bool = True) -> Residuals:
        """A worker's residuals: a resumed worker's checkpoint's (``Session.resumed_feedback``;
        dropped without ``feedback``), and saved with its checkpoints from now on
        (``Session.saved_feedback``)."""
        residuals = cls(feedback=feedback)
        if feedback:
            residuals.load_state_dict(session.resumed_feedback)
        session.resumed_feedback = {}
        session.saved_feedback = residuals.state_dict
        return residuals

    def of(self, key: str, flats: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The residuals for ``flats`` under ``key``: a checkpoint's for its share when they fit
        (``load_state_dict``), else zeros the first time, or when the shapes changed."""
        held = self.held.get(key)
        sizes = [f.numel() for f in flats]
        if held is None or [h.numel() for h in held] != sizes:
            saved = self.restored.pop(key.split(";", 1)[0], None)
            if saved is not None and [e.numel() for e in saved] == sizes:
                held = [e.to(f.device) for e, f in zip(saved, flats, strict=True)]
            else:
                held = [torch.zeros_like(f, dtype=torch.float32) for f in flats]
            self.held[key] = held
        return held

    def begin(self, key: str, flats: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Buffers for this round's new residuals (reused between rounds)."""
        self.filling = True
        if self.pending is not None and self.pending[0] == key:
            buffers = self.pending[1]
            if [b.numel() for b in buffers] == [f.numel() for f in flats]:
                return buffers
        buffers = [torch.empty(f.numel(), dtype=torch.float32, device=f.device) for f in flats]
        self.pending = (key, buffers)
        return buffers

    def for_round(
        self, comm: str, share: int, tensors: Sequence[torch.Tensor], decay: float = 1.0
    ) -> Quantized | None:
        """A round starts averaging ``tensors``, share ``share`` of the model (a streaming
        fragment's index, else 0), in ``comm``: what its quantized average needs (residuals keyed
        by the share and the tensors' table: equal fragments' tables may coincide; ``decay``
        their decay; none without ``feedback``), or None for a dense ``comm``."""
        self.discard()
        make = QUANTIZED.get(comm)
        if make is None:
            return None
        if not self.feedback:
            return Quantized(make(), None, None, decay)
        flats = [t.view(-1) for t in tensors]
        key = f"{share};{table_of(tensors)}"
        return Quantized(make(), self.of(key, flats), self.begin(key, flats), decay)

    def discard(self) -> None:
        """A round starts: whatever ``pending`` holds is an earlier round's, never adopted (a
        dense round after a failed quantized one must not commit it)."""
        self.filling = False

    def commit(self) -> None:
        """The round that filled ``pending`` stepped on every member: its residuals are owed."""
        if self.pending is not None and self.filling:
            self.filling = False
            key, buffers = self.pending
            old = self.held.get(key)
            self.held[key] = buffers
            self.pending = None if old is None else (key, old)  # the old buffers are reused

    def forget(self) -> None:
        self.held.clear()
        self.restored.clear()
        self.pending = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """CPU copies of the residuals owed (``held``, and a checkpoint's not yet taken), keyed
        ``QUORUM_RESIDUAL`` + share + ``/`` + index: safetensors, no pickle. Between rounds (a
        streaming round in flight may replace ``held`` under it)."""
        out = {}
        shares = {**self.restored, **{k.split(";", 1)[0]: v for k, v in self.held.items()}}
        for share, residuals in shares.items():
            for i, e in enumerate(residuals):
                out[f"{QUORUM_RESIDUAL}{share}/{i}"] = e.detach().to("cpu", copy=True)
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Hold ``state_dict``'s residuals (keys without ``QUORUM_RESIDUAL`` are another
        owner's, skipped) until a round of their share takes them (``of``); residuals that do not
        fit that round's tensors are dropped there (zeros). A ``ValueError`` naming the key for
        one that is malformed (a key not share/index, indices not 0..n-1, not a finite 1-D
        float tensor), with nothing changed."""
        shares: dict[str, dict[int, torch.Tensor]] = {}
        for key, e in state.items():
            if not key.startswith(QUORUM_RESIDUAL):
                continue
            share, _, index = key[len(QUORUM_RESIDUAL) :].partition("/")
            if not (share.isdigit() and index.isdigit()):
                raise ValueError(f"checkpoint residual {key!r}: not {QUORUM_RESIDUAL}SHARE/INDEX")
            if e.dim() != 1 or not e.is_floating_point() or not bool(torch.isfinite(e).all()):
                raise ValueError(f"checkpoint residual {key!r}: not a finite 1-D float tensor")
            shares.setdefault(share, {})[int(index)] = e
        restored = {}
        for share, by_index in shares.items():
            if sorted(by_index) != list(range(len(by_index))):
                raise ValueError(f"checkpoint residuals of share {share}: indices not 0..n-1")
            restored[share] = [
                by_index[i].to(torch.float32, copy=True) for i in range(len(by_index))
            ]
        self.restored = restored

    def norm(self, key: str) -> float:
        return math.sqrt(
            sum(float(torch.linalg.vector_norm(e)) ** 2 for e in self.held.get(key, []))
        )


@dataclass(frozen=True)
class Moved:
    """What a quantized all-reduce did on this member."""

    norm: float
    """The L2 norm of the average written back (fp64 sum of fp32 norms)."""
    sent: int
    """Bytes this member sent to the others (slots of scales and codes, padding included)."""
    received: int
    payload: int
    """Bytes of the quantized contribution: every shard's slot, once."""


def quantized_reduce(
    quorum: QuorumCollective,
    flats: list[torch.Tensor],
    scale: float,
    codec: BlockCodec,
    residual: list[torch.Tensor] | None,
    pending: list[torch.Tensor] | None,
    *,
    send_residual: bool,
    bucket_bytes: int = BUCKET_BYTES,
    decay: float = 1.0,
) -> Moved:
    """The sum over the quorum of each rank's ``scale * flats + decay * residual`` (without the
    residual when not ``send_residual``: a member the checks left out sends zeros and keeps its
    residual as it was), quantized as the module docstring says, written back into ``flats``
    identically on every rank. ``pending`` receives this member's new residuals (``residual``
    itself is not written); both None: no error feedback, what the codes drop is dropped. A
    collective."""
    size, rank = quorum.size, quorum.rank
    squares, sent, received, payload = 0.0, 0, 0, 0
    capacity = max(codec.align, bucket_bytes // 4 // codec.align * codec.align)
    buf = torch.empty(min(capacity, sum(f.numel() for f in flats)), dtype=torch.float32)
    for n, pieces in bucket_plan(flats, capacity):
        b = buf[:n]
        for i, a, t, o in pieces:
            if scale == 0.0:
                b[o : o + t].zero_()  # 0 * NaN is NaN: a member left out sends zeros
            else:
                torch.mul(flats[i][a : a + t], scale, out=b[o : o + t])
            if send_residual and residual is not None:  # times 1 is exact: the plain rule's bits
                b[o : o + t].add_(residual[i][a : a + t], alpha=decay)
        if codec.sparse:
            slot = slot_bytes(codec, n)
            out = torch.empty(slot, dtype=torch.uint8)
            quantize_feedback_(codec, b, out)  # b keeps what the codes dropped
            _keep_residual(b, pieces, residual, pending, send_residual)
            got = torch.empty(size * slot, dtype=torch.uint8)
            quorum.collective("sparse all-gather", _all_gather(got, out, size, quorum.timeout))
            reduce_slots(codec, [got[r * slot : (r + 1) * slot] for r in range(size)], b)
            squares += _write_back(b, pieces, flats)
            sent += (size - 1) * slot
            received += (size - 1) * slot
            payload += size * slot
            continue
        bounds = shard_bounds(n, size, codec.align)
        slot = slot_bytes(codec, max(hi - lo for lo, hi in bounds))
        out = torch.empty(size * slot, dtype=torch.uint8)
        for j, (lo, hi) in enumerate(bounds):
            quantize_feedback_(codec, b[lo:hi], out[j * slot : (j + 1) * slot])
        got = torch.empty_like(out)
        quorum.collective("quantized reduce-scatter", _all_to_all(got, out, quorum.timeout))
        lo, hi = bounds[rank]
        total = torch.empty(hi - lo, dtype=torch.float32)
        reduce_slots(codec, [got[r * slot : (r + 1) * slot] for r in range(size)], total)
        mine = out[:slot]  # the own slots were sent: room for the requantized shard
        quantize_feedback_(codec, total, mine)
        b[lo:hi].add_(total)  # the requantization's residual is the shard owner's to repay
        _keep_residual(b, pieces, residual, pending, send_residual)
        quorum.collective("quantized all-gather", _all_gather(got, mine, size, quorum.timeout))
        for j, (lo, hi) in enumerate(bounds):
            decode_slot(codec, got[j * slot : (j + 1) * slot], b[lo:hi])
        squares += _write_back(b, pieces, flats)
        sent += 2 * (size - 1) * slot
        received += 2 * (size - 1) * slot
        payload += size * slot
    return Moved(math.sqrt(squares), sent, received, payload)


def count_bytes(
    metrics: dict[str, Any], size: int, total: float, moved: Moved | None, numel: int,
    comm: torch.dtype,
) -> None:  # fmt: skip
    """A round's bytes into the worker's ``sync_metrics``: ``collective_bytes``, the payload
    averaged (in ``comm``, or the quantized slots); ``collective_sent`` and
    ``collective_received``, this member's bytes to and from the others: a quantized average's
    slots as they were moved (scales, codes and padding, one all-to-all and one all-gather:
    ``(N-1)`` slots each way in each), a dense one's as a ring all-reduce moves them
    (``2 (N-1) / N`` of the payload each way). Nothing when the admitted weights summed to 0
    (``total``; a join's round): no tensor moved then. The HTTP bytes stay in ``bytes_up`` and
    ``bytes_down``."""
    if total == 0:
        return
    if moved is not None:
        metrics["collective_bytes"] += moved.payload
        metrics["collective_sent"] += moved.sent
        metrics["collective_received"] += moved.received
        return
    payload = numel * torch.empty((), dtype=comm).element_size()
    metrics["collective_bytes"] += payload
    ring = 2 * (size - 1) * payload // size
    metrics["collective_sent"] += ring
    metrics["collective_received"] += ring


def _keep_residual(
    b: torch.Tensor,
    pieces: list[tuple[int, int, int, int]],
    residual: list[torch.Tensor] | None,
    pending: list[torch.Tensor] | None,
    sent: bool,
) -> None:
    """``pending`` = what the bucket ``b`` holds now (what this member's codes dropped), plus
    the old residual where it was not sent (a member left out keeps owing it); nothing without
    error feedback (``pending`` None)."""
    if pending is None:
        return
    for i, a, t, o in pieces:
        if sent or residual is None:
            pending[i][a : a + t].copy_(b[o : o + t])
        else:
            torch.add(residual[i][a : a + t], b[o : o + t], out=pending[i][a : a + t])


def _write_back(
    b: torch.Tensor, pieces: list[tuple[int, int, int, int]], flats: list[torch.Tensor]
) -> float:
    """The averaged bucket into the tensors; the sum of squares of what was written."""
    squares = 0.0
    for i, a, t, o in pieces:
        own = flats[i][a : a + t]
        own.copy_(b[o : o + t])
        squares += float(torch.linalg.vector_norm(own, dtype=torch.float32)) ** 2
    return squares


def _all_to_all(out: torch.Tensor, inp: torch.Tensor, timeout: float) -> Callable[[Any], Any]:
    options = dist.AllToAllOptions()
    options.timeout = timedelta(seconds=timeout)
    return lambda backend: backend.alltoall_base(out, inp, [], [], options)


def _all_gather(
    out: torch.Tensor, mine: torch.Tensor, size: int, timeout: float
) -> Callable[[Any], Any]:
    options = dist.distributed_c10d.AllgatherOptions()
    options.timeout = timedelta(seconds=timeout)
    slot = mine.numel()
    outs = [out[j * slot : (j + 1) * slot] for j in range(size)]
    return lambda backend: backend.allgather([outs], [mine], options)

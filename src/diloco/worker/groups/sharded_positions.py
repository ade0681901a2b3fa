"""Shard with shard: a sharded worker group's side of the HSDP exchange in all-reduce mode
(docs/design/groups.md, "Sharded groups in all-reduce mode"). When every member of a quorum is
a sharded group with the same layout (the same group size, every rank holding the same boxes),
rank r of each group averages its own boxes with rank r of the others, on a process group per
rank position: nothing of the model passes through any rank 0.

Position 0 is the quorum's own process group (rank 0 of each group is its member). Position
r > 0 is built by rank r through the same authenticated rendezvous, in the quorum's key space
for position r (``wire/messages/rendezvous.py``), as its group's member (the group's worker id),
with the member's quorum rank: so positions line up rank for rank, and each is a copy of the
quorum's ring. A quorum of one builds nothing (its average is its own pseudo-gradient).

The commands, broadcast by rank 0 as JSON and run on every rank (``ShardState.handlers``):

- ``x_join``: join this rank's position; every rank's error (or none) comes back to rank 0;
- ``x_avg``: each holder writes its boxes' pseudo-gradient into ``acc`` and averages it in
  place on its position (``collective.reduce_scaled``, with the scale the quorum's checks gave
  this member); then one group all-reduce brings rank 0 the result's squared norm (owned boxes:
  each element once), a CRC of every ``sample``-th element of each rank's owned boxes (the
  commit point's sample) and which ranks failed;
- ``x_bcast``: the state (snapshot, and momentum when kept) from the source member's rank r to
  every member's rank r (``collective.broadcast``);
- ``x_runs``: each owner's CRC-32 of each owned box that is one run of the flat parameter
  (``core.shards.Box.flat_range``), for the layout-free state hash (``core.crc``);
- ``x_leave``: close the position (rank 0's is the quorum's, which the quorum loop closes).

A failure on one position (a peer died, a timeout) is reported, never raised on that rank
alone: every rank finishes the command's group collective, and rank 0 raises ``QuorumFailed``,
so the round is discarded everywhere (the quorum's commit point sees rank 0 leave).
"""

from __future__ import annotations

import json
import zlib
from collections import Counter
from typing import Any, Protocol

import torch
import torch.distributed as dist

from diloco.wire.checksum import checksum
from diloco.wire.encode import byte_view
from diloco.worker.groups.json_collectives import all_gather_json
from diloco.worker.groups.sharded import ShardState

DTYPES = {"torch.float32": torch.float32, "torch.bfloat16": torch.bfloat16}
"""Communication dtypes a command may name."""

Run = tuple[int, int, int]
"""An owned box as one run of the flat parameter: (start, elements, CRC-32 of its fp32 bytes)."""


class Position(Protocol):
    """One rank's process group with the same rank of the other members (all-reduce mode's
    ``allreduce/shard_exchange.QuorumPosition``). A failure raises ``RuntimeError`` (the
    position is closed then) or ``ValueError``; the rank reports it, never raises it."""

    size: int

    def average(
        self, flats: list[torch.Tensor], scale: float, total: float, dtype: torch.dtype
    ) -> None:
        """The sum over the position of each rank's ``scale * flats``, in place (zeros when
        ``total`` is 0)."""

    def broadcast(self, tensors: list[torch.Tensor], src: int) -> None:
        """Rank ``src``'s ``tensors`` into every rank's."""

    def close(self) -> None:
        """Leave the position's process group."""


class Link(Protocol):
    """How a rank r > 0 joins its position (``allreduce/shard_exchange.HttpLink``: the server's
    rendezvous, with this rank's own client)."""

    def join(self, cmd: dict[str, Any], position: int, device: torch.device) -> Position:
        """The position's process group as ``cmd`` describes the quorum (``x_join``'s fields);
        raises ``RuntimeError`` or ``ValueError`` if it cannot be joined."""
        ...


class Holder(Protocol):
    """A rank's all-reduce state beside its shards (``sharded_outer.OuterShards``)."""

    #: ``acc`` holds this round's pseudo-gradient already (its measure wrote it).
    fresh: bool

    def held(self, kind: str, name: str) -> torch.Tensor:
        """This rank's ``kind`` tensor (``snap``, ``mom``, ``acc``) of a box it holds."""
        ...


class PositionShards:
    """One rank's position in the quorums its group meets shard with shard, and rank 0's way
    to run the exchange on every rank (``allreduce.shard_exchange.Positions``)."""

    def __init__(self, state: ShardState, holder: Holder) -> None:
        self._st = state
        self._holder = holder
        self._held = holder.held
        #: How this rank joins its position (every rank of a group has a client of the
        #: server): set by the worker.
        self.link: Link | None = None
        self._position: Position | None = None
        self._quorum: Position | None = None  # rank 0: the quorum itself (its position)
        #: Commands run on this rank, by name (what the tests hold the exchange to).
        self.served: Counter[str] = Counter()
        state.handlers.update(
            {
                "x_join": self._join,
                "x_avg": self._average,
                "x_bcast": self._broadcast,
                "x_runs": self._runs,
                "x_leave": lambda cmd: self._leave(),
            }
        )

    # --- rank 0 -----------------------------------------------------------------------------

    def mark(self) -> str:
        """A fingerprint of the layout: the group's size and every rank's box of every
        parameter. Groups with the same mark can average position by position."""
        st = self._st
        layout = [
            [name, list(plan.shape), [_box_code(b) for b in plan.boxes]]
            for name, plan in st.plans.items()
        ]
        return checksum([json.dumps([st.size, layout]).encode()])

    def open(self, quorum: Position, cmd: dict[str, Any]) -> list[str | None]:
        """Every rank joins its position of the quorum ``cmd`` describes (``x_join``'s fields;
        rank 0's position is ``quorum`` itself): every rank's error, None where it joined
        (those that did leave again at ``close``)."""
        self._quorum = quorum
        return list(self._issue({**cmd, "cmd": "x_join"}))

    def close(self) -> None:
        self._issue({"cmd": "x_leave"})
        self._quorum = None

    def average(
        self, scale: float, total: float, dtype: torch.dtype, sample: int
    ) -> tuple[float, list[int], list[str | None]]:
        """Every holder's boxes of the pseudo-gradient averaged on its position into ``acc``
        (scaled by ``scale``; zeros if ``total`` is 0): the result's squared L2 norm, each
        rank's CRC of every ``sample``-th element of its owned boxes, every rank's error."""
        cmd = {"cmd": "x_avg", "scale": scale, "total": total, "dtype": str(dtype)}
        squares, crcs, errors = self._issue({**cmd, "sample": sample})
        return float(squares), crcs, errors

    def broadcast(self, src: int, kinds: list[str]) -> list[str | None]:
        """The source member's state of ``kinds`` (``snap``, ``mom``) into every member's:
        every rank's error."""
        return list(self._issue({"cmd": "x_bcast", "src": src, "kinds": kinds}))

    def runs(self, kind: str) -> dict[str, list[Run]]:
        """Every owned box of ``kind`` that is one run of its flat parameter, by parameter."""
        got: dict[str, list[Run]] = {}
        for reported in self._issue({"cmd": "x_runs", "kind": kind}):
            for name, run in reported.items():
                got.setdefault(name, []).append(tuple(run))
        return got

    def _issue(self, cmd: dict[str, Any]) -> Any:
        return self._st.command(cmd)

    # --- every rank -------------------------------------------------------------------------

    def _join(self, cmd: dict[str, Any]) -> list[str | None] | None:
        st = self._st
        self.served["x_join"] += 1
        self._leave()
        error = None
        if st.rank == 0:
            self._position = self._quorum
        elif cmd["size"] > 1:
            try:
                if self.link is None:
                    raise ValueError("this rank has no way to the server's rendezvous")
                device = st.device if cmd["cuda"] else torch.device("cpu")
                self._position = self.link.join(cmd, st.rank, device)
            except (RuntimeError, ValueError) as exc:
                error = f"rank {st.rank} could not join its position: {exc}"
        return self._gather(error)

    def _leave(self) -> None:
        position, self._position = self._position, None
        if position is not None and self._st.rank != 0:
            position.close()

    @torch.no_grad()
    def _average(self, cmd: dict[str, Any]) -> tuple[float, list[int], list[str | None]] | None:
        st = self._st
        self.served["x_avg"] += 1
        scale, total, dtype = cmd["scale"], cmd["total"], DTYPES[cmd["dtype"]]
        accs: list[torch.Tensor] = []
        for name, snap in st.snapshot.items():
            acc = self._held("acc", name)
            if not self._holder.fresh:  # else the measure just wrote it
                torch.sub(snap, st.local(name).detach().to("cpu", torch.float32), out=acc)
            accs.append(acc.view(-1))
        self._holder.fresh = False
        error = None
        try:
            if self._position is not None and self._position.size > 1:
                self._position.average(accs, scale, total, dtype)
            else:  # a quorum of one: its own pseudo-gradient, rounded as the wire would
                for acc in accs:
                    if total:
                        acc.copy_(torch.mul(acc, scale).to(dtype))
                    else:
                        acc.zero_()
        except (RuntimeError, ValueError) as exc:
            error = f"rank {st.rank}: {exc}"
        squares, crc = 0.0, 0
        for name, acc in zip(st.snapshot, accs, strict=True):
            held = st.plans[name].boxes[st.rank]
            if held is None or not held[1]:
                continue
            squares += float(torch.linalg.vector_norm(acc)) ** 2  # fp32, as reduce_scaled's
            # clone: ``contiguous`` keeps a one-element view's odd stride
            picked = acc[:: cmd["sample"]].clone(memory_format=torch.contiguous_format)
            crc = zlib.crc32(byte_view(picked), crc)
        summary = torch.zeros(1 + 2 * st.size, dtype=torch.float64, device=st.device)
        summary[0] = squares
        summary[1 + st.rank] = crc  # 32 bits: exact in fp64
        summary[1 + st.size + st.rank] = error is not None
        dist.all_reduce(summary, group=st.pg)
        errors = self._gather(error)
        if st.rank != 0:
            return None
        values = summary.cpu().tolist()
        assert errors is not None
        return values[0], [int(v) for v in values[1 : 1 + st.size]], errors

    def _broadcast(self, cmd: dict[str, Any]) -> list[str | None] | None:
        st = self._st
        self.served["x_bcast"] += 1
        tensors = [self._held(kind, name) for kind in cmd["kinds"] for name in st.snapshot]
        error = None
        if self._position is not None and self._position.size > 1:
            try:
                self._position.broadcast(tensors, cmd["src"])
            except (RuntimeError, ValueError) as exc:
                error = f"rank {st.rank}: {exc}"
        return self._gather(error)

    def _runs(self, cmd: dict[str, Any]) -> list[dict[str, Run]] | None:
        st = self._st
        self.served["x_runs"] += 1
        mine: dict[str, Run] = {}
        for name, plan in st.plans.items():
            held = plan.boxes[st.rank]
            if held is None or not held[1] or not held[0].numel:
                continue
            run = held[0].flat_range(plan.shape)
            if run is not None:
                tensor = self._held(cmd["kind"], name).contiguous()
                mine[name] = (run[0], run[1], zlib.crc32(byte_view(tensor)))
        got = all_gather_json(mine, st.pg, device=st.device)
        return got if st.rank == 0 else None

    def _gather(self, error: str | None) -> list[str | None] | None:
        got = all_gather_json(error, self._st.pg, device=self._st.device)
        return got if self._st.rank == 0 else None


def _box_code(held: Any) -> Any:
    if held is None:
        return None
    box, owned = held
    return [list(box.offset), list(box.shape), [list(p) if p else None for p in box.picks], owned]

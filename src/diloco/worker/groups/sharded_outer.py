"""A sharded worker group's side of all-reduce mode (docs/design/groups.md, "Sharded groups in
all-reduce mode"): the run's state (the snapshot and the outer momentum) lives on the ranks'
shards, and rank 0's quorum loop reaches it one parameter at a time through the commands here.

Every rank holding a box of a parameter (its owner, and the replicas along a ``Replicate`` mesh
dim) keeps three fp32 CPU tensors of the box's shape: the snapshot (``ShardState``'s), the
momentum and the averaging buffer (``acc``), both made at their first use. So a rank's
all-reduce memory is three times its shard, never the model. The commands, broadcast by rank 0
as JSON and run on every rank (``ShardState.handlers``):

- ``q_own``: the snapshot from the rank's own parameters (the start: no server holds them);
- ``q_measure``: this member's statement about its pseudo-gradient, whether it is finite and
  its L2 norm, summed over the owned boxes in one tiny all-reduce of the group;
- ``q_get KIND NAME``: the owners' boxes of the pseudo-gradient (``grad``: ``snapshot -
  local``), the snapshot (``snap``) or the momentum (``mom``) gathered onto rank 0, fp32, the
  parameter put together (a staging buffer, valid until the next ``q_get``);
- ``q_set KIND NAME``: a parameter rank 0 holds scattered into every holder's ``acc``,
  ``snap`` or ``mom`` (replicas included), rank 0 handing the tensor in-process;
- ``q_step``: the outer step (``core.outer.OuterSGD``, the run's rules in the command) on every
  held box with its ``acc``; element-wise, so each box steps as the whole model would;
- ``q_piece``: streaming fragments (``allreduce/sharded_fragments.py``): one fragment piece's
  averaged pseudo-gradient scattered from rank 0, and every holder's outer step on its elements
  of the piece (``step``); or every holder's merge of its elements of the piece with its own
  new snapshot (``mix``: ``local = alpha * local + (1 - alpha) * snapshot``).

Plain (non-DTensor) parameters are rank 0's alone (no broadcast), as in ``ShardState``.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from diloco.core.fragments import Piece
from diloco.core.outer import OuterSGD, apply_outer_step
from diloco.core.piece_moves import mix_span, step_span
from diloco.worker.groups.json_collectives import broadcast_json
from diloco.worker.groups.shard_table import ShardPlan
from diloco.worker.groups.sharded import ShardState
from diloco.worker.groups.sharded_pieces import span_in
from diloco.worker.groups.sharded_positions import PositionShards


class OuterShards:
    """One rank's all-reduce state beside its snapshot shards, and rank 0's way to it (the
    ``allreduce.streamed.Parts`` protocol: ``own``, ``measure``, ``load``, ``store``,
    ``step``)."""

    def __init__(self, state: ShardState) -> None:
        self._st = state
        self.acc: dict[str, torch.Tensor] = {}
        self.momentum: dict[str, torch.Tensor] = {}
        self._outer: tuple[tuple[float, float, bool], OuterSGD, list[Any]] | None = None
        #: ``acc`` holds this round's pseudo-gradient (``q_measure`` wrote it): the exchange
        #: shard with shard averages it in place without taking it again.
        self.fresh = False
        #: Parameters rank 0 put together, by kind (``grad``, ``snap``, ``mom``): what the
        #: tests hold the exchange shard with shard to (it gathers none of the pseudo-gradient).
        self.gathered: Counter[str] = Counter()
        #: The exchange shard with shard, when a quorum's members share this layout.
        self.positions = PositionShards(state, self)
        state.handlers.update(
            {
                "q_own": lambda cmd: self._own(),
                "q_measure": lambda cmd: self._measure(),
                "q_get": lambda cmd: self._get(cmd["kind"], self._st.plans[cmd["name"]]),
                "q_set": lambda cmd: self._set(cmd["kind"], self._st.plans[cmd["name"]], None),
                "q_step": lambda cmd: self._step(cmd["lr"], cmd["momentum"], cmd["nesterov"]),
                "q_piece": self._piece,
            }
        )

    # --- rank 0 -----------------------------------------------------------------------------

    def own(self) -> None:
        self._issue({"cmd": "q_own"})

    def measure(self) -> tuple[bool, float]:
        """Rank 0: whether the group's pseudo-gradient is finite, and its L2 norm."""
        got = self._issue({"cmd": "q_measure"})
        assert got is not None
        return got

    def load(self, kind: str, name: str) -> torch.Tensor:
        """Rank 0: parameter ``name``'s ``kind`` (``grad``, ``snap``, ``mom``) put together."""
        got = self._issue({"cmd": "q_get", "kind": kind, "name": name})
        assert got is not None
        return got

    def store(self, kind: str, name: str, whole: torch.Tensor) -> None:
        """Rank 0: ``whole`` (the parameter's shape, fp32) into every holder's ``kind``
        (``acc``, ``snap``, ``mom``)."""
        self._issue({"cmd": "q_set", "kind": kind, "name": name}, whole)

    def step(self, lr: float, momentum: float, nesterov: bool) -> None:
        self._issue({"cmd": "q_step", "lr": lr, "momentum": momentum, "nesterov": nesterov})

    def step_piece(
        self, piece: Piece, values: torch.Tensor, lr: float, momentum: float, nesterov: bool
    ) -> None:
        """Rank 0: the outer step on fragment piece ``piece`` with its averaged ``values``, on
        every holder's elements of it."""
        st = self._st
        plan = st.plans[piece.param]
        cmd = {"cmd": "q_piece", "op": "step", "name": piece.param, "start": piece.start}
        cmd.update(stop=piece.stop, lr=lr, momentum=momentum, nesterov=nesterov)
        if plan.plain:
            self._piece(cmd, values)
            return
        st.staged(plan).view(-1)[piece.start : piece.stop].copy_(values)
        st.command(cmd)

    def mix_piece(self, piece: Piece, alpha: float) -> None:
        """Rank 0: every holder's elements of ``piece`` mixed with its own snapshot's."""
        cmd = {"cmd": "q_piece", "op": "mix", "name": piece.param, "alpha": alpha}
        cmd.update(start=piece.start, stop=piece.stop)
        if self._st.plans[piece.param].plain:
            self._piece(cmd)
            return
        self._st.command(cmd)

    def _issue(self, cmd: dict[str, Any], whole: torch.Tensor | None = None) -> Any:
        st = self._st
        assert st.rank == 0
        plan = st.plans.get(cmd.get("name", ""))
        if plan is None or not plan.plain:
            broadcast_json(cmd, st.pg, src=True, device=st.device)
        if cmd["cmd"] == "q_set":
            assert plan is not None
            return self._set(cmd["kind"], plan, whole)
        return st.handlers[cmd["cmd"]](cmd)

    # --- every rank -------------------------------------------------------------------------

    def held(self, kind: str, name: str) -> torch.Tensor:
        """This rank's ``kind`` tensor (``snap``, ``mom``, ``acc``) of a box it holds."""
        return self._held(kind, name)

    def _held(self, kind: str, name: str) -> torch.Tensor:
        """This rank's ``kind`` tensor of a parameter it holds (momentum and acc made at their
        first use, zeros: the first step's ``0 * m + g`` is ``g``, as in ``SharedState``)."""
        if kind == "snap":
            return self._st.snapshot[name]
        table = self.acc if kind == "acc" else self.momentum
        if name not in table:
            table[name] = torch.zeros_like(self._st.snapshot[name])
        return table[name]

    @torch.no_grad()
    def _own(self) -> None:
        for name, snap in self._st.snapshot.items():
            snap.copy_(self._st.local(name))

    @torch.no_grad()
    def _measure(self) -> tuple[bool, float] | None:
        # Each held box's pseudo-gradient lands in its ``acc`` (the exchange shard with shard
        # averages it there, ``fresh``); the norm is the owned boxes' (they tile each parameter
        # once), fp32 per box combined in fp64 as a plain member's ``measure``, with an fp64
        # pass only when that overflows: a large finite value is not a non-finite one.
        st = self._st
        squares, bad = 0.0, 0.0
        for name, plan in st.plans.items():
            held = plan.boxes[st.rank]
            if held is None or not held[0].numel:
                continue
            diff = self._held("acc", name)
            torch.sub(st.snapshot[name], self._local32(name), out=diff)
            if not held[1]:
                continue
            norm = float(torch.linalg.vector_norm(diff))
            if not math.isfinite(norm):
                bad += float(not bool(torch.isfinite(diff).all()))
                norm = float(torch.linalg.vector_norm(diff, dtype=torch.float64))
            squares += norm * norm
        self.fresh = True
        t = torch.tensor([squares, bad], dtype=torch.float64, device=st.device)
        dist.all_reduce(t, group=st.pg)
        if st.rank != 0:
            return None
        if t[1].item() > 0:
            return False, math.inf
        return True, math.sqrt(float(t[0].item()))

    def _local32(self, name: str) -> torch.Tensor:
        return self._st.local(name).detach().to("cpu", torch.float32)

    def _grad(self, name: str) -> torch.Tensor:
        return self._st.snapshot[name] - self._local32(name)

    @torch.no_grad()
    def _get(self, kind: str, plan: ShardPlan) -> torch.Tensor | None:
        st = self._st
        held = plan.boxes[st.rank]
        staging = st.staging
        if plan.plain:
            return self._source(kind, plan.name).reshape(plan.shape)
        width = plan.width
        send = staging.get("q_send", width, torch.float32)
        if held is not None and held[1] and held[0].numel:
            send[: held[0].numel].copy_(self._source(kind, plan.name).reshape(-1))
        parts = None
        if st.rank == 0:
            parts = [staging.get(f"q_part{r}", width, torch.float32) for r in range(st.size)]
        dist.gather(send, parts, group_dst=0, group=st.pg)
        if parts is None:
            return None
        self.gathered[kind] += 1
        whole = staging.get("q_whole", math.prod(plan.shape), torch.float32, cpu=True)
        whole = whole.view(plan.shape)
        for part, got in zip(parts, plan.boxes, strict=True):
            if got is not None and got[1] and got[0].numel:
                box = got[0]
                box.write(whole, part[: box.numel].view(box.shape))
        return whole

    def _source(self, kind: str, name: str) -> torch.Tensor:
        return self._grad(name) if kind == "grad" else self._held(kind, name)

    @torch.no_grad()
    def _set(self, kind: str, plan: ShardPlan, whole: torch.Tensor | None) -> None:
        """Rank 0's ``whole`` into every holder's box (its staging keys are not ``q_get``'s
        ``q_whole``: a parameter being read stays valid while another one is stored)."""

        def store(name: str, values: torch.Tensor, owns: bool) -> None:
            self._held(kind, name).view(-1).copy_(values)

        shaped = None if whole is None else whole.reshape(plan.shape)
        self._st.scatter(plan, shaped, store, keys=("q_out", "q_recv"))

    def _step(self, lr: float, momentum: float, nesterov: bool) -> None:
        rules = (lr, momentum, nesterov)
        if self._outer is None or self._outer[0] != rules:
            names = list(self._st.snapshot)
            params = [torch.nn.Parameter(self._st.snapshot[n], requires_grad=False) for n in names]
            outer = OuterSGD(params, lr=lr, momentum=momentum, nesterov=nesterov)
            if momentum > 0:
                for p, n in zip(params, names, strict=True):
                    outer.state[p]["momentum_buffer"] = self._held("mom", n)
            self._outer = (rules, outer, params)
        _, outer, params = self._outer
        grads = [self._held("acc", n) for n in self._st.snapshot]
        apply_outer_step(outer, params, grads)

    @torch.no_grad()
    def _piece(self, cmd: dict[str, Any], values: torch.Tensor | None = None) -> None:
        """``q_piece`` on this rank's elements of the piece (a plain parameter: rank 0's whole,
        ``values`` handed in-process)."""
        st = self._st
        plan = st.plans[cmd["name"]]
        if cmd["op"] == "step" and not plan.plain:  # the averages, each holder its box
            whole = st.staged(plan) if st.rank == 0 else None
            st.scatter(plan, whole, lambda name, got, owns: self._piece_on(plan, cmd, got))
            return
        self._piece_on(plan, cmd, values)

    def _piece_on(self, plan: ShardPlan, cmd: dict[str, Any], values: torch.Tensor | None) -> None:
        st = self._st
        held = plan.boxes[st.rank]
        if held is None or not held[0].numel:
            return
        start, stop = cmd["start"], cmd["stop"]
        span = span_in(held[0], plan.shape, start, stop) if not plan.plain else slice(start, stop)
        snap = self._held("snap", plan.name).view(-1)
        if cmd["op"] == "step":
            assert values is not None
            grads = values.view(-1) if plan.plain else values.view(-1)[span]
            mom = self._held("mom", plan.name).view(-1) if cmd["momentum"] > 0 else None
            step_span(snap, mom, grads, span, cmd["lr"], cmd["momentum"], cmd["nesterov"])
        else:
            mix_span(st.local(plan.name).view(-1), snap, span, cmd["alpha"])
        if st.device.type == "cuda":
            torch.cuda.synchronize(st.device)

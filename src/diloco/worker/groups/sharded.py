"""Each rank's DiLoCo state in a sharded worker group, and the commands rank 0 runs on all of
them while it syncs (docs/design/groups.md, "Sharded groups").

Every rank keeps the snapshot of what it holds: one fp32 CPU tensor per parameter, the shape
of its box (pinned when the parameters are on CUDA). No rank holds the whole model. While rank
0 talks to the server, the other ranks sit in ``serve``: rank 0 broadcasts each command as JSON
(``worker/groups/json_collectives.py``) and every rank, rank 0 included, runs it:

- ``grad NAME``: each rank's owned box of ``snapshot - local`` in the communication dtype is
  gathered (padded to the largest box) onto rank 0, which puts the parameter together (with
  ``owed``: plus the owner's error-feedback residual, ``worker/groups/sharded_codec.py``);
- ``full NAME``: the same with the parameter's own values (the run's initial parameters);
- ``put NAME``: rank 0's staged download of one parameter is scattered, each rank its box, into
  the snapshots (replicas included);
- ``each FN``: every rank applies ``adopt_``, ``rebase_`` or ``to_progress_`` to its shards.

The sync's report (the verdict, no ``cmd`` key) ends ``serve``. Plain (non-DTensor) parameters
are rank 0's alone: no command, and the group's ``share`` broadcasts them after the verdict.

Rank 0's staging is reused from parameter to parameter and sized by the largest one, never the
model: the parameter put together (or downloaded), one padded part per rank, and its own send
buffer and fp32 scratch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from diloco.core import adopt_, rebase_, to_progress_
from diloco.worker.groups.json_collectives import all_gather_json, broadcast_json
from diloco.worker.groups.shard_table import ShardPlan, local_part

MOVES: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
    "adopt": adopt_,
    "rebase": rebase_,
    "to_progress": to_progress_,
}
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16}


class Staging:
    """Rank 0's reused buffers, by purpose; each grows to the largest request and is kept.
    None is ever larger than the largest parameter (fp32), so together they are bounded by a
    few parameters, never the model."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._bufs: dict[str, torch.Tensor] = {}

    def get(
        self, purpose: str, numel: int, dtype: torch.dtype, *, cpu: bool = False
    ) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        key = purpose + (":cpu" if cpu else "")
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(
                max(nbytes, 8), dtype=torch.uint8, device="cpu" if cpu else self._device
            )
            self._bufs[key] = buf
        return buf[:nbytes].view(dtype)

    def sizes(self) -> dict[str, int]:
        """Each buffer's bytes, by purpose (what the tests hold to one parameter's size)."""
        return {key: b.numel() for key, b in self._bufs.items()}


class ShardState:
    """One rank's snapshot shards and its side of every command."""

    def __init__(
        self,
        pg: Any,
        rank: int,
        params: Mapping[str, torch.nn.Parameter],
        plans: Mapping[str, ShardPlan],
        device: torch.device,
    ) -> None:
        self.pg = pg
        self.rank = rank
        self.size = dist.get_world_size(pg)
        self.plans = dict(plans)
        self._params = params
        self.device = device  # where the group's collectives run (gloo: CPU, NCCL: CUDA)
        pin = device.type == "cuda"
        #: This rank's snapshot: one fp32 CPU tensor per parameter it holds, its box's shape.
        self.snapshot: dict[str, torch.Tensor] = {}
        for name, plan in self.plans.items():
            held = plan.boxes[rank]
            if held is not None:
                self.snapshot[name] = torch.zeros(
                    held[0].shape, dtype=torch.float32, pin_memory=pin
                )
        #: A lossy codec's error-feedback residual of each box this rank owns (fp32, CPU, the
        #: box's shape; made at the first commit, ``sharded_codec.py``); replicas keep none.
        self.residual: dict[str, torch.Tensor] = {}
        self.staging = Staging(device)
        #: Further commands by name (all-reduce mode's, ``sharded_outer.OuterShards``).
        self.handlers: dict[str, Callable[[dict[str, Any]], Any]] = {}

    def first_error(self, error: str | None) -> str | None:
        """Every rank: the first rank's error of all of them (None if none had one), so a
        step that may fail on one rank (a checkpoint's file) fails the same on every rank."""
        errors = all_gather_json(error, self.pg, device=self.device)
        return next((e for e in errors if e is not None), None)

    def local(self, name: str) -> torch.Tensor:
        """This rank's part of the model's parameter (its shard, or the plain tensor)."""
        return local_part(self._params[name])

    # --- rank 0 -----------------------------------------------------------------------------

    def command(self, cmd: dict[str, Any]) -> torch.Tensor | None:
        """Rank 0: run ``cmd`` on every rank (a plain parameter's on rank 0 alone)."""
        assert self.rank == 0
        plan = self.plans.get(cmd.get("name", ""))
        if plan is None or not plan.plain:
            broadcast_json(cmd, self.pg, src=True, device=self.device)
        return self.run(cmd)

    # --- every rank -------------------------------------------------------------------------

    def serve(self) -> dict[str, Any]:
        """The ranks but 0, while rank 0 syncs: run its commands until its report comes."""
        assert self.rank != 0
        while True:
            msg = broadcast_json(None, self.pg, src=False, device=self.device)
            if "cmd" not in msg:
                return dict(msg)
            self.run(msg)

    def run(self, cmd: dict[str, Any]) -> torch.Tensor | None:
        op = cmd["cmd"]
        if op in self.handlers:
            return self.handlers[op](cmd)
        if op == "each":
            self.each(MOVES[cmd["fn"]])
            return None
        plan = self.plans[cmd["name"]]
        if op == "grad":
            owed = self.residual.get(plan.name) if cmd.get("owed") else None
            decay = float(cmd.get("decay", 1.0))
            return self._gather(plan, _DTYPES[cmd["dtype"]], grad=True, owed=owed, decay=decay)
        if op == "full":
            return self._gather(plan, getattr(torch, plan.dtype.removeprefix("torch.")), grad=False)
        if op == "put":
            self.scatter(plan, self.staged(plan) if self.rank == 0 else None, self._into_snapshot)
            return None
        raise ValueError(f"unknown worker group command {op!r}")

    @torch.no_grad()
    def each(self, fn: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        for name, snap in self.snapshot.items():
            fn(self.local(name), snap)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def _gather(
        self,
        plan: ShardPlan,
        dtype: torch.dtype,
        *,
        grad: bool,
        owed: torch.Tensor | None = None,
        decay: float = 1.0,
    ) -> torch.Tensor | None:
        """Every owner's box of ``snapshot - local`` (plus ``decay * owed``, its residual, if
        any; or of
        ``local``) in ``dtype``; rank 0 gets the parameter put together, on the CPU (a staging
        buffer, valid until the next command)."""
        held = plan.boxes[self.rank]
        if plan.plain:
            return self._own_whole(plan, dtype, grad, _decayed(owed, decay))
        width = plan.width
        send = self.staging.get("send", width, dtype)
        if held is not None and held[1]:
            self._own_box(plan.name, held[0].numel, send, grad, _decayed(owed, decay))
        parts = None
        if self.rank == 0:
            parts = [self.staging.get(f"part{r}", width, dtype) for r in range(self.size)]
        dist.gather(send, parts, group_dst=0, group=self.pg)
        if parts is None:
            return None
        whole = self.staging.get("whole", _numel(plan.shape), dtype, cpu=True).view(plan.shape)
        for part, got in zip(parts, plan.boxes, strict=True):
            if got is not None and got[1] and got[0].numel:
                box = got[0]
                box.write(whole, part[: box.numel].view(box.shape))
        return whole

    def _own_box(
        self, name: str, numel: int, out: torch.Tensor, grad: bool, owed: torch.Tensor | None
    ) -> None:
        local = self.local(name).reshape(-1)
        if not grad:
            out[:numel].copy_(local)
            return
        diff = self.staging.get("fp32", numel, torch.float32)
        snap = self.snapshot[name].reshape(-1)
        torch.sub(
            snap.to(diff.device, non_blocking=True), local.to(diff.device, torch.float32), out=diff
        )
        if owed is not None:  # c = g + e, as the plain encoder adds them (fp32, same bits)
            diff.add_(owed.reshape(-1).to(diff.device))
        out[:numel].copy_(diff)

    def _own_whole(
        self, plan: ShardPlan, dtype: torch.dtype, grad: bool, owed: torch.Tensor | None
    ) -> torch.Tensor:
        whole = self.staging.get("whole", _numel(plan.shape), dtype, cpu=True)
        if grad:
            diff = self.staging.get("fp32", _numel(plan.shape), torch.float32)
            local = self.local(plan.name).reshape(-1).to(diff.device, torch.float32)
            torch.sub(self.snapshot[plan.name].reshape(-1).to(diff.device), local, out=diff)
            if owed is not None:
                diff.add_(owed.reshape(-1).to(diff.device))
            whole.copy_(diff)
        else:
            whole.copy_(self.local(plan.name).reshape(-1))
        return whole.view(plan.shape)

    def staged(self, plan: ShardPlan) -> torch.Tensor:
        """Rank 0: where one parameter of a download lands before ``put`` (fp32, CPU)."""
        return self.staging.get("whole", _numel(plan.shape), torch.float32, cpu=True).view(
            plan.shape
        )

    @torch.no_grad()
    def scatter(
        self,
        plan: ShardPlan,
        whole: torch.Tensor | None,
        store: Callable[[str, torch.Tensor, bool], None],
        keys: tuple[str, str] = ("part", "send"),
    ) -> None:
        """Rank 0's fp32 ``whole`` parameter (None on the other ranks) cut into every rank's
        box; each rank that holds one calls ``store(name, its box's values, owns)`` (a view of
        a staging buffer, flat, valid until the next command). ``keys`` name the staging
        buffers (rank 0's parts, the received box): a caller whose other buffers must stay
        valid meanwhile passes its own."""
        held = plan.boxes[self.rank]
        if plan.plain:
            assert whole is not None
            store(plan.name, whole.reshape(-1), True)
            return
        width = plan.width
        parts = None
        if self.rank == 0:
            assert whole is not None
            parts = []
            for r, got in enumerate(plan.boxes):
                part = self.staging.get(f"{keys[0]}{r}", width, torch.float32)
                if got is not None and got[0].numel:
                    part[: got[0].numel].view(got[0].shape).copy_(got[0].read(whole))
                parts.append(part)
        recv = self.staging.get(keys[1], width, torch.float32)
        dist.scatter(recv, parts, group_src=0, group=self.pg)
        if held is not None and held[0].numel:
            store(plan.name, recv[: held[0].numel], held[1])

    def _into_snapshot(self, name: str, values: torch.Tensor, owns: bool) -> None:
        self.snapshot[name].view(-1).copy_(values)  # replicas too: every holder's snapshot


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _decayed(owed: torch.Tensor | None, decay: float) -> torch.Tensor | None:
    """``decay * owed`` rounded to fp32 (as ``UploadEncoder`` rounds the product before the
    sum); ``owed`` itself at 1, so plain feedback keeps its bits and makes no copy."""
    return owed if owed is None or decay == 1.0 else owed * decay

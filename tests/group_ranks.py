"""The ranks of worker-group tests: functions run in spawned processes (gloo on 127.0.0.1), and
the single-process references they are compared with."""

from __future__ import annotations

import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from diloco import DiLoCoClient, DiLoCoWorker
from diloco.worker.transport.client import Unreachable

SYNC_EVERY = 4
ROUNDS = 3
BATCH = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(fn: Any, args: tuple[Any, ...], nprocs: int = 2) -> Any:
    """Start ``fn(rank, port, *args)`` in ``nprocs`` processes; ``join`` the context it returns."""
    return mp.start_processes(
        fn, args=(free_port(), *args), nprocs=nprocs, join=False, start_method="spawn"
    )


def join(ctx: Any, timeout: float) -> None:
    """Wait for every rank; a rank still running at ``timeout`` is a hang: kill and fail."""
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise AssertionError(f"a rank hung (still running after {timeout:.0f} s)")


def _init(rank: int, port: int, world: int = 2) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )


def leave() -> None:
    """End a rank: destroy the group, then exit without the interpreter's teardown, where
    torch 2.13's gloo threads sometimes abort the process (SIGABRT, "terminate called without
    an active exception") after all work is done."""
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def make_deep_model() -> torch.nn.Module:
    torch.manual_seed(4321)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 3),
    )


def make_inner(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01)


def batches(stream: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + stream)
    out = []
    for _ in range(steps):
        x = torch.randn(BATCH, 6, generator=g)
        out.append((x, torch.sin(x[:, :3] * (stream + 1))))
    return out


def _worker(model: torch.nn.Module, opt: Any, server: str, **kw: Any) -> DiLoCoWorker:
    kw.setdefault("sync_every", SYNC_EVERY)
    return DiLoCoWorker(model, opt, server, bf16_comm=False, heartbeat_interval=0, **kw)


def _record(model: torch.nn.Module, worker: DiLoCoWorker) -> dict[str, Any]:
    m = worker.sync_metrics
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "outcome": worker.last_sync_outcome,
        "round": worker.base_round,
        "worker_id": worker.worker_id,
        "metrics": {
            k: m[k] for k in ("rounds", "rebases", "failed_syncs", "sync_every", "residual_norm")
        },
    }


# --- ranks -------------------------------------------------------------------------------------


def ddp_rank(
    rank: int, port: int, server: str, group: int, out: str, faults: bool, codec: str | None = None
) -> None:
    """One rank of a DDP group; records its state after every step."""
    _init(rank, port)
    model = make_model()
    ddp = DistributedDataParallel(model)
    opt = make_inner(ddp.parameters())
    client = FaultyClient(server) if faults and rank == 0 else None
    records = []
    steps = SYNC_EVERY * (5 if faults else ROUNDS)
    with _worker(ddp, opt, server, client=client, codec=codec) as worker:
        records.append(_record(model, worker))  # after the join
        for x, y in batches(2 * group + rank, steps):
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
            worker.report(samples=BATCH)
            records.append(_record(model, worker))
    torch.save(records, Path(out) / f"g{group}r{rank}.pt")
    leave()


class FaultyClient(DiLoCoClient):
    """Rank 0's client: the 2nd upload finds the server unreachable; before the 4th the server
    forgets this worker (a real 410, then a re-join and a rebase)."""

    def __init__(self, server: str) -> None:
        super().__init__(server, retries=1, backoff=0.01)
        self.uploads = 0

    def submit_pseudogradients(self, worker_id: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.uploads += 1
        if self.uploads == 2:
            raise Unreachable("scripted: the server is unreachable")
        if self.uploads == 4:
            self.deregister(worker_id)
        return super().submit_pseudogradients(worker_id, *args, **kwargs)


def pipeline_rank(rank: int, port: int, server: str, out: str) -> None:
    """Two pipeline stages: rank 0 owns layers 0-1, rank 1 layers 2-4 (names kept)."""
    _init(rank, port)
    model = make_deep_model()
    for i in range(len(model)):
        if (i < 2) != (rank == 0):
            model[i] = torch.nn.Identity()
    opt = make_inner(model.parameters())
    records = []
    with _worker(model, opt, server) as worker:
        for x, y in batches(0, SYNC_EVERY * ROUNDS):
            if rank == 0:
                h = model(x)
                dist.send(h.detach(), 1)
                grad = torch.empty_like(h)
                dist.recv(grad, 1)
                h.backward(grad)
            else:
                h = torch.empty(BATCH, 16)
                dist.recv(h, 0)
                h.requires_grad_()
                torch.nn.functional.mse_loss(model(h), y).backward()
                assert h.grad is not None
                dist.send(h.grad, 0)
            opt.step()
            opt.zero_grad()
            records.append(_record(model, worker))
    torch.save(records, Path(out) / f"pipe{rank}.pt")
    leave()


def disagreeing_rank(rank: int, port: int, server: str, out: str) -> None:
    """Ranks that cannot form one worker: every construction must fail on every rank."""
    _init(rank, port)
    errors: dict[str, str] = {}
    wide = torch.nn.Sequential(torch.nn.Linear(6, 17), torch.nn.Tanh(), torch.nn.Linear(17, 3))
    cases: dict[str, tuple[torch.nn.Module, dict[str, Any]]] = {
        "sync_every": (make_model(), {"sync_every": 4 + rank}),
        "shape": (make_model() if rank == 0 else wide, {}),
        "num_fragments": (make_model(), {"num_fragments": 1 + rank}),
        "streaming": (make_model(), {"num_fragments": 2}),
        "partitioned": (make_model(), {"partitioned": True}),
    }
    for case, (model, kw) in cases.items():
        try:
            _worker(model, make_inner(model.parameters()), server, **kw)
        except ValueError as exc:
            errors[case] = str(exc)
    torch.save(errors, Path(out) / f"bad{rank}.pt")
    leave()


# --- references --------------------------------------------------------------------------------


def reference_groups(num_groups: int) -> dict[str, torch.Tensor]:
    """Single-process DiLoCo where each group is one worker whose inner step uses the mean
    gradient of its two ranks' batches."""
    global_model = make_model()
    outer = torch.optim.SGD(global_model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    workers = [make_model() for _ in range(num_groups)]
    inners = [make_inner(m.parameters()) for m in workers]
    data = [
        list(zip(*(batches(2 * g + r, SYNC_EVERY * ROUNDS) for r in range(2)), strict=True))
        for g in range(num_groups)
    ]
    for r in range(ROUNDS):
        pseudo_grads = []
        for g, (model, inner) in enumerate(zip(workers, inners, strict=True)):
            model.load_state_dict(global_model.state_dict())
            for step in range(SYNC_EVERY):
                halves = data[g][r * SYNC_EVERY + step]
                loss = sum(torch.nn.functional.mse_loss(model(x), y) for x, y in halves) / 2
                assert isinstance(loss, torch.Tensor)
                loss.backward()
                inner.step()
                inner.zero_grad()
            pseudo_grads.append(
                [
                    gp.detach() - p.detach()
                    for gp, p in zip(global_model.parameters(), model.parameters(), strict=True)
                ]
            )
        with torch.no_grad():
            for j, p in enumerate(global_model.parameters()):
                p.grad = torch.stack([pg[j] for pg in pseudo_grads]).sum(0) / num_groups
        outer.step()
        outer.zero_grad()
    return {n: p.detach().clone() for n, p in global_model.named_parameters()}


def train_unsplit(server: str) -> None:
    """The pipeline's model in one process, one worker, through ``server``."""
    model = make_deep_model()
    opt = make_inner(model.parameters())
    with _worker(model, opt, server):
        for x, y in batches(0, SYNC_EVERY * ROUNDS):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()

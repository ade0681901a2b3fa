"""The ranks of worker-group tests: functions run in spawned processes (gloo on 127.0.0.1), and
the single-process references they are compared with."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from diloco import DiLoCoClient, DiLoCoWorker
from diloco.worker.transport.client import Unreachable
from tests.helpers.ranks import (
    BATCH,
    ROUNDS,
    SYNC_EVERY,
    batches,
    leave,
    make_deep_model,
    make_inner,
    make_model,
    pipeline_step,
)


def _init(rank: int, port: int, world: int = 2) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )












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
            pipeline_step(model, rank, x, y)
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




def train_unsplit(server: str) -> None:
    """The pipeline's model in one process, one worker, through ``server``."""
    model = make_deep_model()
    opt = make_inner(model.parameters())
    with _worker(model, opt, server):
        for x, y in batches(0, SYNC_EVERY * ROUNDS):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()

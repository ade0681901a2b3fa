"""Streaming fragments in worker groups: rank functions run in spawned processes (gloo on
127.0.0.1) and the single-process streaming references they are compared with."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel

from diloco import DiLoCoWorker
from tests.helpers.ranks import (
    BATCH,
    SYNC_EVERY,
    batches,
    leave,
    make_deep_model,
    make_inner,
    make_model,
    pipeline_step,
)
from tests.programs.group_ranks import FaultyClient
from tests.programs.shard_ranks import _sharded_model, _shards

STEPS = 3 * SYNC_EVERY


def _init(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )


def _worker(
    model: torch.nn.Module, opt: Any, server: str, fragments: int, tau: int, **kw: Any
) -> DiLoCoWorker:
    return DiLoCoWorker(
        model,
        opt,
        server,
        sync_every=SYNC_EVERY,
        num_fragments=fragments,
        overlap_steps=tau,
        bf16_comm=False,
        heartbeat_interval=0,
        **kw,
    )


def _record(model: torch.nn.Module, worker: DiLoCoWorker) -> dict[str, Any]:
    m = worker.sync_metrics
    keys = ("rounds", "rebases", "failed_syncs", "fragments_sent", "stalls", "reconnections")
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "outcome": worker.last_sync_outcome,
        "round": m["round"],
        "worker_id": worker.worker_id,
        "metrics": {k: m[k] for k in keys},
    }


def samples_of(group: int, rank: int) -> int:
    """What a rank reports per step: unequal across ranks and groups, so a group that weighed
    only rank 0's samples would move the average of two groups."""
    return BATCH * (1 + rank + 2 * group)


def ddp_rank(
    rank: int,
    port: int,
    server: str,
    out: str,
    fragments: int,
    tau: int,
    faults: bool,
    group: int = 0,
) -> None:
    """One rank of DDP group ``group`` that streams ``fragments`` fragments; records its state
    after the join and after every step in ``g{group}s{rank}.pt``. ``faults``: rank 0's
    scripted client (2nd upload unreachable, the server forgets the worker before the 4th)."""
    _init(rank, port)
    model = make_model()
    ddp = DistributedDataParallel(model)
    opt = make_inner(ddp.parameters())
    client = FaultyClient(server) if faults and rank == 0 else None
    records = []
    with _worker(ddp, opt, server, fragments, tau, client=client) as worker:
        records.append(_record(model, worker))
        for x, y in batches(2 * group + rank, STEPS):
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
            worker.report(samples=samples_of(group, rank))
            records.append(_record(model, worker))
    torch.save(records, Path(out) / f"g{group}s{rank}.pt")
    leave()


def pipeline_rank(rank: int, port: int, server: str, out: str, fragments: int, tau: int) -> None:
    """Two pipeline stages (rank 0 layers 0-1, rank 1 layers 2-4, names kept) streaming."""
    _init(rank, port)
    model = make_deep_model()
    assert isinstance(model, torch.nn.Sequential)
    for i in range(len(model)):
        if (i < 2) != (rank == 0):
            model[i] = torch.nn.Identity()
    opt = make_inner(model.parameters())
    records = []
    with _worker(model, opt, server, fragments, tau) as worker:
        for x, y in batches(0, STEPS):
            pipeline_step(model, rank, x, y)
            opt.step()
            opt.zero_grad()
            records.append(_record(model, worker))
    torch.save(records, Path(out) / f"pipe{rank}.pt")
    leave()


def fsdp_rank(
    rank: int,
    port: int,
    server: str,
    out: str,
    fragments: int,
    tau: int,
    faults: bool,
    save_dir: str | None = None,
) -> None:
    """One rank of an FSDP2 group (``shard_ranks._sharded_model``) streaming ``fragments``
    fragments on stream ``rank``; records its shards (and where each starts) and its largest
    staging buffer after the join and after every step in ``fsdp{rank}.pt``. ``faults``: rank
    0's scripted client, as ``ddp_rank``'s; ``save_dir``: the worker's (all-reduce mode)."""
    _init(rank, port)
    model = _sharded_model((2,))
    opt = make_inner(model.parameters())
    client = FaultyClient(server) if faults and rank == 0 else None
    records = []

    def record() -> None:
        records.append(_record(model, worker))
        records[-1]["params"] = _shards(model)
        shards = worker._group.shards  # type: ignore[union-attr]
        assert shards is not None
        records[-1]["staging"] = max(shards.staging.sizes().values(), default=0)

    with _worker(model, opt, server, fragments, tau, client=client, save_dir=save_dir) as worker:
        record()
        for x, y in batches(rank, STEPS):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            worker.report(samples=samples_of(0, rank))
            record()
    torch.save(records, Path(out) / f"fsdp{rank}.pt")
    leave()


def refused_rank(rank: int, port: int, servers: list[str], out: str) -> None:
    """Streaming groups that are still refused in all-reduce mode (``server`` runs in it), each
    rank's error recorded: a sharded group (DTensor weight) and a partitioned group, both
    overlapping their rounds (tau 1), both at
    their start, where the mode is learnt (each its own server: a run takes one model)."""
    _init(rank, port)
    errors: dict[str, str] = {}
    mesh = init_device_mesh("cpu", (2,))
    sharded = torch.nn.Linear(4, 4, bias=False)
    local = sharded.weight.detach().chunk(2, 0)[rank].clone()
    sharded.weight = torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)]))
    try:
        _worker(sharded, make_inner(sharded.parameters()), servers[0], 2, 1).start()
    except Exception as exc:
        errors["allreduce_sharded"] = f"{type(exc).__name__}: {exc}"
    stage = make_model()
    assert isinstance(stage, torch.nn.Sequential)
    stage[2 * rank] = torch.nn.Identity()  # rank 0 owns layer 2, rank 1 layer 0
    worker = _worker(stage, make_inner(stage.parameters()), servers[1], 2, 1)
    try:
        worker.start()
    except Exception as exc:
        errors["allreduce_partitioned"] = f"{type(exc).__name__}: {exc}"
    torch.save(errors, Path(out) / f"refused{rank}.pt")
    leave()


# --- references (single process, the test's own) -----------------------------------------------


COUNTED = ("rounds", "fragments_sent", "failed_syncs")
"""The metrics a group and its reference count alike at every step (stalls depend on timing)."""


def reference_ddp(
    server: str,
    fragments: int,
    tau: int,
    group: int = 0,
    model: torch.nn.Module | None = None,
    save_dir: str | None = None,
) -> list[dict[str, Any]]:
    """A single-process streaming worker standing for DDP group ``group``: its inner step uses
    the mean gradient of the two ranks' batches and it reports both ranks' samples; its
    parameters and counts (``COUNTED``) after every step. ``model``: built by the caller when
    several run in threads (``make_model`` seeds the process)."""
    model = model if model is not None else make_model()
    opt = make_inner(model.parameters())
    out = []
    halves = list(zip(*(batches(2 * group + r, STEPS) for r in range(2)), strict=True))
    samples = samples_of(group, 0) + samples_of(group, 1)
    with _worker(model, opt, server, fragments, tau, save_dir=save_dir) as worker:
        for pair in halves:
            loss = sum(torch.nn.functional.mse_loss(model(x), y) for x, y in pair) / 2
            assert isinstance(loss, torch.Tensor)
            loss.backward()
            opt.step()
            opt.zero_grad()
            worker.report(samples=samples)
            out.append(_counted(model, worker))
    return out


def reference_pipeline(server: str, fragments: int, tau: int) -> list[dict[str, Any]]:
    """The pipeline's model unsplit, one streaming worker; its parameters and counts after
    every step."""
    model = make_deep_model()
    opt = make_inner(model.parameters())
    out = []
    with _worker(model, opt, server, fragments, tau) as worker:
        for x, y in batches(0, STEPS):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            out.append(_counted(model, worker))
    return out


def _counted(model: torch.nn.Module, worker: DiLoCoWorker) -> dict[str, Any]:
    m = worker.sync_metrics
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "metrics": {k: m[k] for k in COUNTED},
    }

"""The ranks of sharded worker-group tests (FSDP2 / DTensor over gloo on 127.0.0.1): functions
run in spawned processes, compared with ``tests.helpers.ranks.reference_groups``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Shard

from diloco import DiLoCoClient, DiLoCoWorker
from tests.helpers.ranks import BATCH, ROUNDS, SYNC_EVERY, batches, leave, make_inner, make_model
from tests.programs.group_ranks import FaultyClient, _init


def _worker(model: torch.nn.Module, opt: Any, server: str, **kw: Any) -> DiLoCoWorker:
    kw.setdefault("sync_every", SYNC_EVERY)
    kw.setdefault("bf16_comm", False)
    kw.setdefault("heartbeat_interval", 0)
    return DiLoCoWorker(model, opt, server, **kw)


def _sharded_model(mesh_shape: tuple[int, ...]) -> torch.nn.Module:
    """``make_model`` wrapped with ``fully_shard`` per layer and at the root, the usual way.
    A 2-D mesh ``(2, 1)`` is HSDP: replicated along dim 0, sharded along dim 1."""
    model = make_model()
    names = ("replicate", "shard")[-len(mesh_shape) :]
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _shards(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, tuple[int, ...]]]:
    """Each parameter's local shard and where it starts in the global tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    for name, p in model.named_parameters():
        assert isinstance(p.data, DTensor)
        _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        out[name] = (p.to_local().detach().clone(), tuple(offset))
    return out


def fsdp_rank(
    rank: int,
    port: int,
    server: str,
    group: int,
    out: str,
    mesh: tuple[int, ...],
    comm: str,
    faults: bool = False,
) -> None:
    """One rank of an FSDP2 group training ``make_model`` on stream ``2 * group + rank``;
    records its shards after every sync, rank 0 also the server's parameters then and its
    staging's size. ``faults``: rank 0's client is ``group_ranks.FaultyClient`` (5 rounds)."""
    _init(rank, port)
    model = _sharded_model(mesh)
    opt = make_inner(model.parameters())
    records: list[dict[str, Any]] = []
    served: dict[int, dict[str, torch.Tensor]] = {}
    reader = DiLoCoClient(server)
    client = FaultyClient(server) if faults and rank == 0 else None
    steps = SYNC_EVERY * (5 if faults else ROUNDS)
    with _worker(model, opt, server, bf16_comm=comm == "bf16", client=client) as worker:
        for step, (x, y) in enumerate(batches(2 * group + rank, steps), start=1):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            worker.report(samples=BATCH)
            if step % SYNC_EVERY == 0:
                records.append({"round": worker.base_round, "shards": _shards(model)})
                records[-1]["outcome"] = worker.last_sync_outcome
                if rank == 0:  # the round the group adopted, as the server serves it
                    served[worker.base_round] = reader.get_global_params(
                        min_round=worker.base_round
                    )[1]
        shards = worker._group.shards  # type: ignore[union-attr]
        assert shards is not None
        facts = {
            "snapshot": {n: tuple(t.shape) for n, t in shards.snapshot.items()},
            "staging": shards.staging.sizes(),
            "worker_id": worker.worker_id,
        }
    reader.close()
    torch.save(
        {"records": records, "served": served, "facts": facts}, Path(out) / f"g{group}r{rank}.pt"
    )
    leave()


def plain_rank(rank: int, port: int, server: str, group: int) -> None:
    """A single-process worker that trains on the mean loss of streams ``2 * group`` and
    ``2 * group + 1`` (what a group of two ranks computes)."""
    torch.set_num_threads(1)
    model = make_model()
    opt = make_inner(model.parameters())
    data = zip(*(batches(2 * group + r, SYNC_EVERY * ROUNDS) for r in range(2)), strict=True)
    with _worker(model, opt, server) as worker:
        for halves in data:
            loss = sum(torch.nn.functional.mse_loss(model(x), y) for x, y in halves) / 2
            assert isinstance(loss, torch.Tensor)
            loss.backward()
            opt.step()
            opt.zero_grad()
            worker.report(samples=2 * BATCH)


def _hand_sharded(rank: int, placements: list[Any], mesh: Any) -> torch.nn.Module:
    """A one-layer model whose weight is a DTensor built from this rank's part by hand."""
    model = torch.nn.Linear(4, 4, bias=False)
    full = model.weight.detach()
    local = full if not isinstance(placements[0], Shard) else full.chunk(2, placements[0].dim)[rank]
    weight = DTensor.from_local(local.clone(), mesh, placements, run_check=False)
    model.weight = torch.nn.Parameter(weight)
    return model


def bad_shard_rank(rank: int, port: int, server: str, out: str) -> None:
    """Sharded groups that cannot form one worker: every construction fails on every rank."""
    _init(rank, port)
    mesh = init_device_mesh("cpu", (2,))
    alone = [dist.new_group([0]), dist.new_group([1])][rank]  # every rank makes both
    errors: dict[str, str] = {}
    cases: dict[str, tuple[torch.nn.Module, dict[str, Any]]] = {
        "disagree": (_hand_sharded(rank, [Shard(rank)], mesh), {}),
        "partial": (_hand_sharded(rank, [Partial()], mesh), {}),
        "mesh": (_hand_sharded(rank, [Shard(0)], mesh), {"process_group": alone}),
        "codec": (_hand_sharded(rank, [Shard(0)], mesh), {"codec": "int8", "num_fragments": 2}),
        "plain": (
            _hand_sharded(rank, [Shard(0)], mesh) if rank == 0 else torch.nn.Linear(4, 4, False),
            {},
        ),
    }
    for case, (model, kw) in cases.items():
        try:
            _worker(model, make_inner(model.parameters()), server, **kw)
        except ValueError as exc:
            errors[case] = str(exc)
    torch.save(errors, Path(out) / f"bad{rank}.pt")
    leave()

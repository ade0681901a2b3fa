"""The ranks of tensor-parallel worker-group tests (DTensor over gloo on 127.0.0.1): tensor
parallelism by ``parallelize_module`` on a 1-D mesh, and the same under FSDP2 on a 2-D
``(dp, tp)`` mesh, whose dim-0 shards FSDP2 makes strided. Compared with
``tests.helpers.ranks.reference_groups``: a tensor-parallel group's ranks all compute the same
step, so they all take the same batches (the two streams a two-rank reference group takes),
while the ranks along ``dp`` each take their own stream, as FSDP and DDP ranks do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from diloco import DiLoCoClient, DiLoCoWorker
from tests.helpers.ranks import BATCH, ROUNDS, SYNC_EVERY, batches, leave, make_inner, make_model
from tests.programs.group_ranks import _init


def _tp_model(mesh_shape: tuple[int, ...]) -> tuple[torch.nn.Module, int]:
    """``make_model`` with its first layer column-wise and its last row-wise parallel over the
    ``tp`` mesh dim; on a ``(dp, tp)`` mesh also ``fully_shard`` over ``dp``. Returns the model
    and this rank's coordinate along ``dp`` (0 on a 1-D mesh)."""
    model = make_model()
    names = ("dp", "tp")[-len(mesh_shape) :]
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    if len(mesh_shape) == 1:
        return model, 0
    assert isinstance(model, torch.nn.Sequential)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh.get_local_rank("dp")


def tp_rank(
    rank: int, port: int, server: str, out: str, mesh: tuple[int, ...], allreduce: bool = False
) -> None:
    """One rank of a tensor-parallel group (one group: the worker of streams 0 and 1). After
    every sync it records the outcome and every parameter put together by DTensor itself
    (``full_tensor``, a collective every rank calls); rank 0 also the server's parameters of
    that round (none in all-reduce mode: the server holds no parameters). Every rank records
    its placements and local shapes."""
    _init(rank, port, world=len(mesh) * 2)
    model, dp = _tp_model(mesh)
    opt = make_inner(model.parameters())
    streams = [dp] if len(mesh) == 2 else [0, 1]
    data = list(zip(*(batches(s, SYNC_EVERY * ROUNDS) for s in streams), strict=True))
    records: list[dict[str, Any]] = []
    served: dict[int, dict[str, torch.Tensor]] = {}
    reader = DiLoCoClient(server)
    with DiLoCoWorker(
        model, opt, server, sync_every=SYNC_EVERY, bf16_comm=False, heartbeat_interval=0
    ) as worker:
        for step, pieces in enumerate(data, start=1):
            loss = sum(torch.nn.functional.mse_loss(model(x), y) for x, y in pieces) / len(pieces)
            assert isinstance(loss, torch.Tensor)
            loss.backward()
            opt.step()
            opt.zero_grad()
            worker.report(samples=BATCH)
            if step % SYNC_EVERY == 0:
                full = {
                    n: p.data.full_tensor().detach().clone()  # type: ignore[attr-defined]
                    for n, p in model.named_parameters()
                }
                records.append(
                    {"round": worker.base_round, "outcome": worker.last_sync_outcome, "full": full}
                )
                if rank == 0 and not allreduce:
                    served[worker.base_round] = reader.get_global_params(
                        min_round=worker.base_round
                    )[1]
        layout = {}
        for n, p in model.named_parameters():
            assert isinstance(p.data, DTensor)
            layout[n] = ([str(pl) for pl in p.data.placements], tuple(p.data.to_local().shape))
    reader.close()
    torch.save({"records": records, "served": served, "layout": layout}, Path(out) / f"tp{rank}.pt")
    leave()


class _Strided(torch.nn.Module):
    """Two parameters: ``w`` (8 x 3) and ``b`` (4), initialised from a fixed seed."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(99)
        self.w = torch.nn.Parameter(torch.randn(8, 3))
        self.b = torch.nn.Parameter(torch.randn(4))


def _move_(t: torch.Tensor, pattern: torch.Tensor) -> None:
    """A step that depends on each element's place: what an inner step would do, without
    autograd through a strided DTensor."""
    t.mul_(0.9).add_(pattern, alpha=0.1)


STRIDED_STEPS = SYNC_EVERY * ROUNDS


def strided_rank(rank: int, port: int, server: str, out: str) -> None:
    """A group of 2 ranks holding ``w`` as ``_StridedShard(0, split_factor=2)`` on a 1-D mesh
    (rank 0 holds rows 0-1 and 4-5: a box with gaps) and ``b`` replicated, moving each shard by
    ``_move_``; after every sync it records whether its shard is torch's split of the server's
    ``w``. Then a checkpoint save, which strided boxes cannot be saved in yet: its error."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.placement_types import _StridedShard

    from diloco.worker import resume

    _init(rank, port)
    mesh = init_device_mesh("cpu", (2,))
    strided = _StridedShard(0, split_factor=2)
    model = _Strided()

    def split(full: torch.Tensor) -> torch.Tensor:  # torch's own layout of a strided shard
        return strided._split_tensor(full, 2, with_padding=False)[0][rank].contiguous()

    pattern = split(torch.arange(24.0).view(8, 3))
    local = split(model.w.detach())
    w = DTensor.from_local(
        local, mesh, [strided], run_check=False, shape=torch.Size((8, 3)), stride=(3, 1)
    )
    model.w = torch.nn.Parameter(w)
    b = DTensor.from_local(model.b.detach().clone(), mesh, [Replicate()], run_check=False)
    model.b = torch.nn.Parameter(b)
    reader = DiLoCoClient(server)
    matches: list[bool] = []
    error = ""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with DiLoCoWorker(
        model, opt, server, sync_every=SYNC_EVERY, bf16_comm=False, heartbeat_interval=0
    ) as worker:
        for step in range(1, STRIDED_STEPS + 1):
            with torch.no_grad():
                _move_(model.w.data.to_local(), pattern)  # type: ignore[attr-defined]
                _move_(model.b.data.to_local(), torch.arange(4.0))  # type: ignore[attr-defined]
            opt.step()  # no gradients: moves nothing, counts the step
            worker.report(samples=BATCH)
            if step % SYNC_EVERY == 0:
                got = reader.get_global_params(min_round=worker.base_round)[1]
                held = model.w.data.to_local()  # type: ignore[attr-defined]
                matches.append(torch.equal(held, split(got["w"])))
        try:
            resume.save(worker, str(Path(out) / "ckpt"))
        except ValueError as exc:
            error = str(exc)
    reader.close()
    torch.save({"matches": matches, "error": error}, Path(out) / f"strided{rank}.pt")
    leave()


def strided_plain(rank: int, port: int, server: str) -> None:
    """The same moves on the whole parameters, in one process."""
    torch.set_num_threads(1)
    model = _Strided()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with DiLoCoWorker(
        model, opt, server, sync_every=SYNC_EVERY, bf16_comm=False, heartbeat_interval=0
    ) as worker:
        for _ in range(STRIDED_STEPS):
            with torch.no_grad():
                _move_(model.w.data, torch.arange(24.0).view(8, 3))
                _move_(model.b.data, torch.arange(4.0))
            opt.step()
            worker.report(samples=BATCH)

"""The ranks of the sharded-loading tests (``tests/processes/test_sharded_load.py``): a model
sharded with FSDP2 on a 1-D mesh, or with tensor parallelism and FSDP2 on a 2-D one, loads the
files the test wrote into ``folder`` with ``diloco.load_into`` and writes what it holds back as
``folder/<kind><rank>.safetensors``; what happened (names, placements, errors, reports) travels
as JSON in that file's metadata."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from diloco import load_into
from tests.helpers.ranks import leave


class TiedNet(torch.nn.Module):
    """Uneven for two ranks everywhere: 7, 5 and 1 rows (the last rank of ``gate`` holds
    nothing); a head tied to the embedding, as GPT-2's; a buffer no checkpoint holds."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(7, 4)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 5), torch.nn.Linear(5, 4)])
        self.gate = torch.nn.Parameter(torch.randn(1, 4))
        self.head = torch.nn.Linear(4, 7, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(3))


def make_tp(seed: int) -> torch.nn.Sequential:
    """Column-parallel then row-parallel (6 and 5 rows: uneven over a 2 x 2 mesh)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 5))


def _init(rank: int, port: int, world: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )


def _error(call: Callable[[], Any]) -> str | None:
    try:
        call()
    except ValueError as exc:
        return str(exc)
    return None


def _params(model: torch.nn.Module) -> list[tuple[str, DTensor]]:
    out = [(n, cast(DTensor, p)) for n, p in model.named_parameters(remove_duplicate=False)]
    assert all(isinstance(p, DTensor) for _, p in out), [type(p) for _, p in out]
    return out


def _locals(model: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    # Cloned: tied names share one local tensor, and safetensors refuses shared storage.
    return {f"{prefix}.{n}": p.to_local().detach().clone() for n, p in _params(model)}


def _write(path: Path, tensors: dict[str, torch.Tensor], outcome: dict[str, Any]) -> None:
    save_file(tensors, str(path), metadata={"outcome": json.dumps(outcome)})


def _partial_module(mesh: DeviceMesh) -> torch.nn.Module:
    """A parameter whose placement is ``Partial``: a summand per rank, not a slice."""
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(DTensor.from_local(torch.zeros(4), mesh, [Partial()]))
    return module


def fsdp_rank(rank: int, port: int, folder: str) -> None:
    """FSDP2 the usual way (each layer, then the root) over two ranks; the error cases first,
    then the prefixed file, then the checkpoint, then rank 1 alone loads ``other``."""
    _init(rank, port, world=2)
    root = Path(folder)
    mesh = init_device_mesh("cpu", (2,))
    model = TiedNet(seed=1)
    outcome: dict[str, Any] = {"names_before": [n for n, _ in model.named_parameters()]}
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    outcome["names_after"] = [n for n, _ in model.named_parameters()]
    outcome["tied"] = model.head.weight is model.embed.weight
    fresh = _locals(model, "fresh")
    outcome["shape_error"] = _error(lambda: load_into(model, root / "wrong_shape.safetensors"))
    outcome["strict_error"] = _error(lambda: load_into(model, root / "misfit.safetensors"))
    outcome["partial_error"] = _error(
        lambda: load_into(_partial_module(mesh), root / "partial.safetensors")
    )
    after_errors = _locals(model, "after_errors")
    loose = load_into(model, root / "misfit.safetensors", strict=False)
    outcome["loose"] = asdict(loose)
    tensors = {**fresh, **after_errors, **_locals(model, "loose")}
    load_into(model, root / "prefixed.safetensors")
    tensors.update(_locals(model, "prefixed"))
    outcome["report"] = asdict(load_into(model, root / "ckpt"))  # a save dir: its newest
    tensors.update(_locals(model, "local"))
    tensors.update({f"full.{n}": p.full_tensor() for n, p in _params(model)})  # collectives
    if rank == 1:
        # Alone: a load that ran any collective would wait for rank 0, which never joins it.
        load_into(model, root / "other.safetensors")
        tensors.update(_locals(model, "alone"))
    _write(root / f"fsdp{rank}.safetensors", tensors, outcome)
    leave()


def tp_rank(rank: int, port: int, folder: str) -> None:
    """Tensor parallelism on the ``tp`` dimension of a 2 x 2 mesh, FSDP2 on ``dp`` (each
    layer, then the root): strided, 2-D and replicated placements. Each rank records its local
    tensors, the full tensors, and what ``distribute_tensor`` (torch's own split, without
    communication) gives that rank of the checkpoint's tensor."""
    _init(rank, port, world=4)
    root = Path(folder)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = make_tp(seed=1)
    names_before = [n for n, _ in model.named_parameters()]
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    report = load_into(model, root / "tp.safetensors")
    tensors = _locals(model, "local")
    tensors.update({f"full.{n}": p.full_tensor() for n, p in _params(model)})
    source = make_tp(seed=0)  # what the test saved
    for name, p in _params(model):
        value = source.get_parameter(name).detach()
        split = distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None)
        tensors[f"expected.{name}"] = split.to_local().clone()
    outcome = {
        "names_before": names_before,
        "names_after": [n for n, _ in model.named_parameters()],
        "placements": {n: str(p.placements) for n, p in _params(model)},
        "report": asdict(report),
    }
    _write(root / f"tp{rank}.safetensors", tensors, outcome)
    leave()

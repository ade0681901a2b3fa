"""Stage sync in swarm mode, in-process (issue 29, part D): each replica a ``DiLoCoWorker``
training its own stage module on seeded synthetic gradients (no pipeline: the sync is the
subject), registered for its stage against a real ``diloco server --swarm``; and the plain
single-process DiLoCo of one stage as the reference."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from diloco import DiLoCoClient, DiLoCoWorker
from diloco.wire.messages import RegisterInfo

EVERY = 4
"""Inner steps between a stage's syncs."""
INNER_LR = 0.05
OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
"""The server's default outer step (``ServerConfig``), which every replica applies."""
WIDTHS = ((12, 8), (8, 3))
"""Stage k is one linear layer ``WIDTHS[k]``: the stages' tables differ in shapes."""

_SEEDING = threading.Lock()  # torch's global generator: threads must not build modules at once

Hook = Callable[[int, DiLoCoWorker], None]
"""``hook(step, worker)`` after each optimizer step of a replica."""


def make_stage(stage: int, seed: int = 0) -> torch.nn.Module:
    """Stage ``stage``'s module (names as a split model's stage: ``"0.weight"``)."""
    with _SEEDING:
        torch.manual_seed(1000 * stage + seed)
        return torch.nn.Sequential(torch.nn.Linear(*WIDTHS[stage]))


def grads(stage: int, replica: int) -> torch.Generator:
    """The seeded source of a replica's synthetic gradients."""
    return torch.Generator().manual_seed(100 * (stage + 1) + replica)


def register_for(address: str, peer: str, stage: int) -> dict[str, Any]:
    """Register ``peer`` saying only ``stage`` fits it (as a swarm peer does before it builds
    its stage); the ``DiLoCoWorker`` that registers again under this id keeps the stage."""
    client = DiLoCoClient(address)
    try:
        reply = client.register(peer, info=RegisterInfo(stages=(stage,)))
    finally:
        client.close()
    assert reply["stage"] == stage, reply
    return reply


def train_replica(
    address: str,
    stage: int,
    replica: int,
    steps: int,
    *,
    seed: int = 0,
    after_step: Hook | None = None,
    **kw: Any,
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """One replica of ``stage`` (id ``s<stage>r<replica>``): registered for its stage, then
    ``steps`` SGD steps on its synthetic gradients inside a ``DiLoCoWorker`` syncing every
    ``EVERY``. Its final parameters and metrics."""
    peer = f"s{stage}r{replica}"
    register_for(address, peer, stage)
    module = make_stage(stage, seed)
    opt = torch.optim.SGD(module.parameters(), lr=INNER_LR)
    gen = grads(stage, replica)
    with DiLoCoWorker(
        module,
        opt,
        address,
        worker_id=peer,
        sync_every=EVERY,
        heartbeat_interval=0.2,
        bf16_comm=False,
        **kw,
    ) as w:
        for step in range(steps):
            for p in module.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
            w.report(samples=1)
            if after_step is not None:
                after_step(step, w)
        params = {k: v.detach().clone() for k, v in module.named_parameters()}
        metrics = dict(w.sync_metrics)
    return params, metrics


def reference_stage(stage: int, replicas: int, rounds: int) -> list[dict[str, torch.Tensor]]:
    """Plain DiLoCo of one stage in one process, as the paper's Algorithm 1: the global
    parameters after each round (index 0: the start)."""
    global_model = make_stage(stage)
    outer = torch.optim.SGD(global_model.parameters(), **OUTER)  # type: ignore[arg-type]
    gens = [grads(stage, r) for r in range(replicas)]
    out = [{k: v.detach().clone() for k, v in global_model.named_parameters()}]
    for _ in range(rounds):
        pseudo: list[list[torch.Tensor]] = []
        for r in range(replicas):
            local = [p.detach().clone() for p in global_model.parameters()]
            for _ in range(EVERY):
                for t in local:
                    t.sub_(torch.randn(t.shape, generator=gens[r]), alpha=INNER_LR)
            pseudo.append(
                [g.detach() - t for g, t in zip(global_model.parameters(), local, strict=True)]
            )
        with torch.no_grad():
            for j, p in enumerate(global_model.parameters()):
                p.grad = torch.stack([pg[j] for pg in pseudo]).sum(0) / replicas
        outer.step()
        outer.zero_grad()
        out.append({k: v.detach().clone() for k, v in global_model.named_parameters()})
    return out

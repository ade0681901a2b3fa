"""What the equivalence tests share: the model, its batches, the inner optimizer and one
training step of the single-process references, and the same training through a real server."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig
from tests.helpers.threads import in_threads


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def make_inner(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.01)


def batches(worker: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + worker)
    out = []
    for _ in range(steps):
        x = torch.randn(8, 6, generator=g)
        out.append((x, torch.sin(x[:, :3] * (worker + 1))))
    return out


def train_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]
) -> None:
    x, y = batch
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()


def reference_rounds(
    num_workers: int,
    sync_every: int,
    rounds: int,
    average: Callable[[list[list[torch.Tensor]]], list[torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """DiLoCo in one process, as plainly as the paper's Algorithm 1: every round each worker
    trains ``sync_every`` steps on its ``batches`` from the global parameters (its inner
    optimizer's state kept across rounds); ``average`` turns the workers' pseudo-gradients
    (one list per worker, in parameter order) into the outer gradient, and the server's
    default outer step (SGD, lr 0.7, Nesterov momentum 0.9) applies it. The final parameters."""
    global_model = make_model()
    outer = torch.optim.SGD(global_model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    workers = [make_model() for _ in range(num_workers)]
    inners = [make_inner(m) for m in workers]
    data = [batches(i, sync_every * rounds) for i in range(num_workers)]
    for r in range(rounds):
        pseudo_grads = []
        for i, (model, inner) in enumerate(zip(workers, inners, strict=True)):
            model.load_state_dict(global_model.state_dict())
            for step in range(sync_every):
                train_step(model, inner, data[i][r * sync_every + step])
            pseudo_grads.append(
                [
                    g.detach() - p.detach()
                    for g, p in zip(global_model.parameters(), model.parameters(), strict=True)
                ]
            )
        with torch.no_grad():
            for p, g in zip(global_model.parameters(), average(pseudo_grads), strict=True):
                p.grad = g
        outer.step()
        outer.zero_grad()
    return {n: p.detach().clone() for n, p in global_model.named_parameters()}


def through_server(
    num_workers: int, steps: int, mode: str = "sync", **worker_kw: Any
) -> tuple[dict[str, torch.Tensor], list[dict[str, float]], int]:
    """The same training through a real server: ``num_workers`` workers in threads, each
    ``steps`` steps on its own ``batches``; the server's parameters at the end, each worker's
    metrics, and the server's round. ``worker_kw``: ``DiLoCoWorker``'s (``sync_every`` at least)."""
    with DiLoCoServer(ServerConfig(port=0, num_workers=num_workers, mode=mode)) as server:
        # Built here, not in the threads: torch.manual_seed is process-global and would interleave.
        models = [make_model() for _ in range(num_workers)]

        def work(i: int) -> dict[str, float]:
            model = models[i]
            inner = make_inner(model)
            with DiLoCoWorker(
                model,
                inner,
                server.address,
                bf16_comm=False,
                worker_id=f"w{i}",
                heartbeat_interval=0,
                **worker_kw,
            ) as worker:
                for batch in batches(i, steps):
                    train_step(model, inner, batch)
            return worker.sync_metrics

        metrics = in_threads(num_workers, work, timeout=60)
        return server.global_params(), metrics, server.status()["round"]


def assert_same_params(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Every tensor of ``expected`` in ``got``, equal up to float rounding (named when not)."""
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], msg=lambda m, n=name: f"{n}: {m}")

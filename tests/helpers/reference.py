"""The single-process DiLoCo references that the equivalence tests hold the server and workers
to: the model, its batches, the inner optimizer and one training step."""

from __future__ import annotations

import torch


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

"""Workers in-process: a small model, a fake training step and a copy of its parameters."""

from __future__ import annotations

import torch


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2)


def fake_step(model: torch.nn.Module, opt: torch.optim.Optimizer, delta: float) -> None:
    """An optimizer step with a known effect: SGD lr 1 on a constant gradient ``-delta``."""
    for p in model.parameters():
        p.grad = torch.full_like(p, -delta)
    opt.step()
    opt.zero_grad()


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}

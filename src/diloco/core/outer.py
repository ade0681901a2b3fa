"""The outer optimizer: any torch.optim.Optimizer over the global parameters."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

DEFAULT_OUTER_LR = 0.7
DEFAULT_OUTER_MOMENTUM = 0.9


def default_outer_optimizer(
    params: Iterable[torch.nn.Parameter],
    lr: float = DEFAULT_OUTER_LR,
    momentum: float = DEFAULT_OUTER_MOMENTUM,
    nesterov: bool = True,
) -> torch.optim.Optimizer:
    """SGD with Nesterov momentum, the DiLoCo paper's outer optimizer.

    ``foreach=False``: the multi-tensor path materialises a temporary as large as the whole
    model; the per-tensor path needs only one tensor's worth, which keeps the server's peak
    memory flat."""
    return torch.optim.SGD(
        params, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0, foreach=False
    )


@torch.no_grad()
def apply_outer_step(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.nn.Parameter],
    pseudo_gradients: Sequence[torch.Tensor],
) -> None:
    """One outer step with the averaged pseudo-gradient used as the gradient.

    Parameters whose gradient is None are skipped by torch optimizers, so passing a subset keeps
    the others (and their momentum) untouched."""
    for p, g in zip(params, pseudo_gradients, strict=True):
        p.grad = g
    optimizer.step()
    for p in params:
        p.grad = None


def optimizer_hparams(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """lr and momentum of the first param group, for status pages."""
    group = optimizer.param_groups[0]
    out = {"lr": float(group["lr"])}
    if "momentum" in group:
        out["momentum"] = float(group["momentum"])
    return out


def set_optimizer_hparams(
    optimizer: torch.optim.Optimizer, lr: float | None = None, momentum: float | None = None
) -> None:
    for group in optimizer.param_groups:
        if lr is not None:
            group["lr"] = lr
        if momentum is not None:
            if "momentum" not in group:
                raise ValueError("the outer optimizer has no momentum to set")
            group["momentum"] = momentum

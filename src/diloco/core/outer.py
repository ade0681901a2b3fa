"""The outer optimizer: any torch.optim.Optimizer over the global parameters."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

DEFAULT_OUTER_LR = 0.7
DEFAULT_OUTER_MOMENTUM = 0.9


class OuterSGD(torch.optim.Optimizer):
    """SGD with (Nesterov) momentum, computed in place.

    The same update as ``torch.optim.SGD`` without dampening or weight decay:
    ``b = momentum * b + g``; ``p -= lr * (g + momentum * b)`` (Nesterov) or ``p -= lr * b``.
    torch's version builds ``g + momentum * b`` as a new tensor per parameter (or, with foreach,
    for the whole model at once); two in-place adds need no temporary, which keeps the server's
    peak memory at parameters + sum + momentum. The state is torch's (``momentum_buffer``)."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float = DEFAULT_OUTER_LR,
        momentum: float = DEFAULT_OUTER_MOMENTUM,
        nesterov: bool = True,
    ) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "nesterov": nesterov})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        assert closure is None, "OuterSGD takes no closure"
        for group in self.param_groups:
            lr, momentum, nesterov = group["lr"], group["momentum"], group["nesterov"]
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if momentum == 0:
                    p.add_(g, alpha=-lr)
                    continue
                state = self.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = state["momentum_buffer"] = g.detach().clone()
                else:
                    buf.mul_(momentum).add_(g)
                if nesterov:
                    p.add_(g, alpha=-lr)
                    p.add_(buf, alpha=-lr * momentum)
                else:
                    p.add_(buf, alpha=-lr)


def default_outer_optimizer(
    params: Iterable[torch.nn.Parameter],
    lr: float = DEFAULT_OUTER_LR,
    momentum: float = DEFAULT_OUTER_MOMENTUM,
    nesterov: bool = True,
) -> torch.optim.Optimizer:
    """SGD with Nesterov momentum, the DiLoCo paper's outer optimizer (lr 0.7, momentum 0.9)."""
    return OuterSGD(params, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0)


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

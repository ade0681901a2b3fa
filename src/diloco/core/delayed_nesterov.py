"""Delayed Nesterov (DN), the outer optimizer of asynchronous DiLoCo.

Algorithm 3 of Liu et al., "Asynchronous Local-SGD Training for Language Modeling"
(arXiv 2401.09135). Each ``step()`` consumes one arrival: the pseudo-gradient of one worker in
``p.grad``. With buffer size N, momentum decay beta, activation c in [0, 1/N], learning rate lr,
a momentum buffer m and a sum of arrivals D (both per parameter), arrival number t does:

    D += g
    if t % N == 0:                       # the N-th arrival: one momentum step from their average
        m = beta * m + D / N
        p -= lr * ((1 - c*N + c) * beta * m + g / N)
        D = 0
    else:
        p -= lr * (c * beta * m + g / N)

Every arrival applies g/N at once; momentum moves once per N arrivals. With c = 0 the momentum
term is applied only at the N-th arrival; with c > 0 a share of the old momentum is applied at
each arrival and the rest at the N-th, (N-1)*c + (1 - c*N + c) = 1 in total. With N = 1 and c = 0
this is exactly SGD with Nesterov momentum.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class DelayedNesterov(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float = 0.7,
        momentum: float = 0.9,
        buffer_size: int = 1,
        activation: float = 0.0,
    ) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
        if not 0 <= activation <= 1 / buffer_size:
            raise ValueError(
                f"activation c must be in [0, 1/N] = [0, {1 / buffer_size}], got {activation}"
            )
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "buffer_size": buffer_size,
            "activation": activation,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        assert closure is None, "DelayedNesterov takes no closure"
        for group in self.param_groups:
            lr, beta = group["lr"], group["momentum"]
            n, c = group["buffer_size"], group["activation"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if not state:
                    state["arrivals"] = torch.zeros((), dtype=torch.int64)
                    state["momentum_buffer"] = torch.zeros_like(p)
                    state["delta"] = torch.zeros_like(p)
                state["arrivals"] += 1
                m, delta = state["momentum_buffer"], state["delta"]
                delta.add_(g)
                if int(state["arrivals"]) % n == 0:
                    m.mul_(beta).add_(delta, alpha=1.0 / n)
                    p.add_(m, alpha=-lr * (1 - c * n + c) * beta)
                    delta.zero_()
                elif c > 0:
                    p.add_(m, alpha=-lr * c * beta)
                p.add_(g, alpha=-lr / n)

    def buffered(self) -> int:
        """Arrivals in the current buffer (0 to N-1), for status pages."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state:
                    return int(state["arrivals"]) % group["buffer_size"]
        return 0

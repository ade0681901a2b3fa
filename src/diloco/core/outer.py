"""The outer optimizer: any torch.optim.Optimizer over the global parameters."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from diloco.core.pseudo_gradient import PIECE

DEFAULT_OUTER_LR = 0.7
DEFAULT_OUTER_MOMENTUM = 0.9


PieceDone = Callable[[torch.Tensor, int], None]
"""``(parameter, n)``: the first ``n`` elements of the parameter hold their new values."""


class OuterSGD(torch.optim.Optimizer):
    """SGD with (Nesterov) momentum, computed in place.

    The same update as ``torch.optim.SGD`` without dampening or weight decay:
    ``b = momentum * b + g``; ``p -= lr * (g + momentum * b)`` (Nesterov) or ``p -= lr * b``.
    torch's version builds ``g + momentum * b`` as a new tensor per parameter (or, with foreach,
    for the whole model at once); in-place operations need no temporary, which keeps the server's
    peak memory at parameters + sum + momentum. The state is torch's (``momentum_buffer``).

    ``step(divisor=w)`` uses ``grad / w`` as the gradient without writing it anywhere: the
    server hands in a running sum of pseudo-gradients and their total weight."""

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
        self._scratch: torch.Tensor | None = None

    @torch.no_grad()
    def step(  # type: ignore[override]
        self,
        closure: Callable[[], Any] | None = None,
        *,
        divisor: float = 1.0,
        on_piece: PieceDone | None = None,
    ) -> None:
        """One update. ``on_piece(p, n)``, if given, is called each time the first ``n``
        elements of parameter ``p`` hold their final values (parameters go in group order)."""
        assert closure is None, "OuterSGD takes no closure"
        if not divisor > 0:
            raise ValueError(f"divisor must be positive, got {divisor}")
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(group, p, p.grad, divisor, on_piece)

    def _update(
        self,
        group: dict[str, Any],
        p: torch.Tensor,
        grad: torch.Tensor,
        divisor: float,
        on_piece: PieceDone | None,
    ) -> None:
        lr, momentum, nesterov = group["lr"], group["momentum"], group["nesterov"]
        state = self.state[p]
        if momentum and "momentum_buffer" not in state:
            # The first step: the buffer starts as the gradient itself.
            state["momentum_buffer"] = grad / divisor if divisor != 1 else grad.clone()
            first = True
        else:
            first = False
        buf = state.get("momentum_buffer")
        done = 0
        for p_, g, b in _pieces(p, grad, buf):
            if divisor != 1:
                g = torch.div(g, divisor, out=self._scratch_for(g))
            if not momentum:
                p_.add_(g, alpha=-lr)
            else:
                assert b is not None
                if not first:
                    b.mul_(momentum).add_(g)
                if nesterov:
                    p_.add_(g, alpha=-lr)
                    p_.add_(b, alpha=-lr * momentum)
                else:
                    p_.add_(b, alpha=-lr)
            done += p_.numel()
            if on_piece is not None:
                on_piece(p, done)

    def _scratch_for(self, piece: torch.Tensor) -> torch.Tensor:
        n = piece.numel()
        scratch = self._scratch
        if (
            scratch is None
            or scratch.numel() < n
            or scratch.dtype != piece.dtype
            or scratch.device != piece.device
        ):
            scratch = self._scratch = torch.empty(
                max(n, PIECE), dtype=piece.dtype, device=piece.device
            )
        return scratch[:n].view(piece.shape)


def _pieces(
    p: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor | None
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Matching flat pieces of a parameter, its gradient and its momentum buffer; the whole
    tensors at once when one of them is not contiguous (or they differ in shape)."""
    tensors = [t for t in (p, grad, buf) if t is not None]
    if not all(t.is_contiguous() and t.shape == p.shape for t in tensors):
        yield p, grad, buf
        return
    flat_p, flat_g = p.view(-1), grad.view(-1)
    flat_b = buf.view(-1) if buf is not None else None
    for start in range(0, flat_p.numel(), PIECE):
        end = start + PIECE
        yield (
            flat_p[start:end],
            flat_g[start:end],
            flat_b[start:end] if flat_b is not None else None,
        )


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
    divisor: float = 1.0,
    on_piece: PieceDone | None = None,
) -> None:
    """One outer step with ``pseudo_gradient / divisor`` used as the gradient (a running sum
    and its total weight give the weighted mean).

    OuterSGD divides on the fly and reports finished pieces to ``on_piece``; for any other
    optimizer the pseudo-gradients are divided in place first and nothing is reported (its
    parameters are final only when it returns). Parameters whose gradient is None are skipped
    by torch optimizers, so passing a subset keeps the others (and their momentum) untouched."""
    if not divisor > 0:
        raise ValueError(f"divisor must be positive, got {divisor}")
    for p, g in zip(params, pseudo_gradients, strict=True):
        p.grad = g
    try:
        if isinstance(optimizer, OuterSGD):
            optimizer.step(divisor=divisor, on_piece=on_piece)
        else:
            if divisor != 1:
                for g in pseudo_gradients:
                    g.div_(divisor)
            optimizer.step()
    finally:
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

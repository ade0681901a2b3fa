"""A finite outer step: one whose result would hold NaN or an infinity is refused, and the
parameters and the outer optimizer state stay as they were.

Every input is checked finite, yet finite fp32 values can still overflow: a sum of uploads near
the fp32 maximum, or a step that moves a parameter past it. Checking the new parameters after
the step is too late (downloads stream a round while it is written, and undoing an in-place step
needs a copy of the model), and copying the model before every step costs a copy per round.

So the guard keeps upper bounds of ``max|p|`` (parameters) and ``max|s|`` (optimizer state) and,
per step, measures ``max|g|`` of the averaged pseudo-gradient with one aminmax pass over the sum:
the only pass of the common case. If the bounds after the step stay below ``SAFE`` the step runs
in place, streamed as before, and cannot overflow. Only when they do not (inputs near the fp32
maximum, or bounds grown loose over many steps) does it measure the parameters and state (two
more passes, which tightens the bounds again), and, if that is not enough, copy them, step
without streaming, check, and restore the copy when the step overflowed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from diloco.core.delayed_nesterov import DelayedNesterov
from diloco.core.outer import OuterSGD, PieceDone, apply_outer_step

FP32_MAX = float(torch.finfo(torch.float32).max)
SAFE = FP32_MAX / 2
"""Bounds below this leave a margin for fp32 rounding: a step does a few operations, each off by
at most a relative 2**-24 from the exact value the bounds are computed for."""


def max_abs(tensors: Iterable[torch.Tensor]) -> float:
    """Largest ``|x|`` over the floating-point tensors; ``inf`` when one holds NaN or an infinity.
    aminmax reads each tensor once and builds no boolean tensor; NaN propagates into it."""
    out = 0.0
    for t in tensors:
        if not t.is_floating_point() or t.numel() == 0:
            continue
        low, high = (float(v) for v in torch.aminmax(t))
        if not (math.isfinite(low) and math.isfinite(high)):
            return math.inf
        out = max(out, -low, high)
    return out


def state_growth(optimizer: torch.optim.Optimizer) -> float | None:
    """``a`` in ``max|s'| <= a * max|s| + max|g|`` for the outer optimizers of this package; None
    for any other (its step is checked after the fact, on a copy).

    OuterSGD: ``b' = momentum * b + g``. DelayedNesterov: ``delta' = delta + g`` and
    ``m' = beta * m + delta' / N <= (beta + 1/N) * s + g``, so 2 covers both of its buffers."""
    if isinstance(optimizer, OuterSGD):
        return max(float(g["momentum"]) for g in optimizer.param_groups)
    if isinstance(optimizer, DelayedNesterov):
        return 2.0
    return None


def step_bounds(
    p_max: float, s_max: float, g_max: float, lr: float, growth: float
) -> tuple[float, float]:
    """Upper bounds of ``max|p|`` and ``max|s|`` after one step from parameters, state and
    gradient bounded by ``p_max``, ``s_max`` and ``g_max``.

    ``s' <= growth * s + g``. Both optimizers move a parameter by lr times at most one new-state
    term, one old-state term and the gradient, each with a coefficient <= 1 (OuterSGD Nesterov:
    ``g + momentum * b'``; DelayedNesterov: ``(1 - cN + c) beta m' + c beta m + g / N``), so
    ``p' <= p + lr * (s' + s + g)``."""
    s_next = growth * s_max + g_max
    return p_max + lr * (s_next + s_max + g_max), s_next


class FiniteGuard:
    """The outer steps of one set of parameters, refused when their result could be non-finite.

    Not thread-safe: one step at a time (the server's tensor lock)."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter]
    ) -> None:
        self.optimizer = optimizer
        self.params = list(params)
        #: Upper bounds of max|p| and max|state|; None until first measured (a restored
        #: checkpoint, an operator's change of state: measured at the next step).
        self.p_bound: float | None = None
        self.s_bound: float | None = None
        #: Steps that had to copy the parameters and state first (bounds too close to overflow).
        self.checked_steps = 0

    def forget(self) -> None:
        """The parameters or state changed outside ``step``: measure them at the next step."""
        self.p_bound = self.s_bound = None

    def _state_tensors(self) -> list[torch.Tensor]:
        state = self.optimizer.state
        return [
            v for p in self.params for v in state.get(p, {}).values() if isinstance(v, torch.Tensor)
        ]

    def _measure(self) -> None:
        self.p_bound = max_abs(self.params)
        self.s_bound = max_abs(self._state_tensors())

    def step(
        self,
        pseudo_gradients: Sequence[torch.Tensor],
        divisor: float = 1.0,
        on_piece: PieceDone | None = None,
    ) -> str | None:
        """``apply_outer_step`` unless its result could hold NaN or an infinity. Returns None when
        the step was applied, else why it was refused: the parameters and the optimizer state
        are then bit for bit what they were, and ``on_piece`` was never called."""
        g_max = max_abs(pseudo_gradients) / divisor
        if not g_max <= FP32_MAX:  # also NaN: an overflowed sum, or a divisor near zero
            return f"the averaged pseudo-gradient is not finite in fp32 (max |g| = {g_max:.3g})"
        lr = max(float(g["lr"]) for g in self.optimizer.param_groups)
        growth = state_growth(self.optimizer)
        if growth is not None:
            if self.p_bound is None or self.s_bound is None:
                self._measure()
            assert self.p_bound is not None and self.s_bound is not None
            bounds = step_bounds(self.p_bound, self.s_bound, g_max, lr, growth)
            if max(bounds) > SAFE:  # loose after many steps, or truly near the fp32 maximum
                self._measure()
                bounds = step_bounds(self.p_bound, self.s_bound, g_max, lr, growth)
            if max(bounds) <= SAFE:
                apply_outer_step(
                    self.optimizer,
                    self.params,
                    pseudo_gradients,
                    divisor=divisor,
                    on_piece=on_piece,
                )
                self.p_bound, self.s_bound = bounds
                return None
        return self._checked_step(pseudo_gradients, divisor)

    def _checked_step(self, pseudo_gradients: Sequence[torch.Tensor], divisor: float) -> str | None:
        """Step on the live tensors with a copy to go back to; nothing is streamed meanwhile."""
        self.checked_steps += 1
        params = [p.detach().clone() for p in self.params]
        state = {
            p: {k: _clone(v) for k, v in self.optimizer.state[p].items()}
            for p in self.params
            if p in self.optimizer.state
        }
        apply_outer_step(self.optimizer, self.params, pseudo_gradients, divisor=divisor)
        p_max, s_max = max_abs(self.params), max_abs(self._state_tensors())
        if math.isfinite(p_max) and math.isfinite(s_max):
            self.p_bound, self.s_bound = p_max, s_max
            return None
        with torch.no_grad():
            for p, saved in zip(self.params, params, strict=True):
                p.copy_(saved)
        for p in self.params:
            if p in state:
                self.optimizer.state[p] = state[p]
            else:
                self.optimizer.state.pop(p, None)
        return "the outer step overflowed fp32 (parameters or optimizer state)"


def _clone(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value

"""The optimizer a worker hooks, found under the wrappers trainers put around it."""

from __future__ import annotations

from typing import Any

import torch


def real_optimizer(optimizer: Any) -> Any:
    """The optimizer whose ``step`` runs the update, under wrappers that expose it as
    ``.optimizer`` (Accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``).
    A wrapper's own ``step`` may not fire the hooks (Accelerate's skips ``Optimizer.__init__``),
    and under AMP or gradient accumulation the inner step is the one that really happened."""
    seen = optimizer
    for _ in range(8):  # wrappers of wrappers, never a cycle
        inner = getattr(seen, "optimizer", None)
        hooks = callable(getattr(seen, "register_step_post_hook", None))
        if (
            inner is None
            or inner is seen
            or (hooks and not isinstance(inner, torch.optim.Optimizer))
        ):
            break
        seen = inner
    if not callable(getattr(seen, "register_step_post_hook", None)):
        wrapped = (
            "" if seen is optimizer else f" (unwrapped through .optimizer to {type(seen).__name__})"
        )
        raise ValueError(
            f"{type(optimizer).__name__}{wrapped} has no register_step_post_hook: the worker needs "
            "a torch.optim.Optimizer, or a wrapper that exposes one as .optimizer, to see each step"
        )
    return seen

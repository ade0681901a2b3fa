"""Pseudo-gradients and the in-place moves a worker makes between global and local parameters.

Notation of the paper: theta_g is the global snapshot a worker started from, theta_l its local
parameters after H inner steps. The pseudo-gradient is ``theta_g - theta_l``; the local progress
is its negation ``theta_l - theta_g``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

PIECE = 1 << 20
"""Elements of a tensor computed at a time, by the worker (its pseudo-gradient scratch: 4 MB of
fp32 whatever the model's size) and by OuterSGD (pieces of parameter, gradient and momentum stay
in cache across the update's in-place operations, so each tensor crosses memory about once per
step instead of once per operation. For a 100M model on two cores, run in an executor thread as
the server runs it: about 0.12 s -> 0.10 s (docs/design/data-path.md). Smaller pieces were slower there:
each operation's thread-pool hand-off then costs more than the cache saves)."""


def pseudo_gradient(
    global_param: torch.Tensor, local_param: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``global - local`` computed in fp32 (on the local tensor's device), returned on the CPU in
    ``dtype``. Rounding to bf16 happens once, after the subtraction, so small steps survive."""
    local32 = local_param.detach().to(torch.float32)
    diff = global_param.to(local32.device, non_blocking=True).to(torch.float32) - local32
    return diff.to(dtype).cpu()


@torch.no_grad()
def pseudo_gradient_pieces(
    global_param: torch.Tensor,
    local_param: torch.Tensor,
    scratch32: torch.Tensor,
    scratch_comm: torch.Tensor | None,
) -> Iterator[torch.Tensor]:
    """``global - local`` in consecutive flat pieces, written into reused scratch buffers.

    Each piece is valid until the next is requested. Memory is the scratch, whatever the tensor's
    size; rounding to the communication dtype (``scratch_comm``, None for fp32) happens after the
    fp32 subtraction."""
    flat_global = global_param.reshape(-1)
    flat_local = local_param.detach().reshape(-1)
    size = scratch32.numel()
    for start in range(0, flat_global.numel(), size):
        g = flat_global[start : start + size]
        n = g.numel()
        local = flat_local[start : start + n]
        if local.device != g.device:
            local = local.to(g.device)  # one piece of a GPU model comes to the CPU
        out = scratch32[:n]
        # Not torch.sub(..., out=bf16): same bits, but torch allocates an fp32 temporary for
        # every piece inside (no faster, and more resident memory; docs/benchmarks-log.md).
        torch.sub(g, local, out=out)
        if scratch_comm is None:
            yield out
        else:
            scratch_comm[:n].copy_(out)
            yield scratch_comm[:n]


@torch.no_grad()
def to_progress_(local_param: torch.Tensor, global_param: torch.Tensor) -> None:
    """Turn the local parameter into its progress ``local - global`` in place.

    The worker does this before it downloads new global parameters into its snapshot, so that
    the old snapshot is no longer needed and no second copy of the model is held."""
    local_param.sub_(global_param.to(local_param.device, non_blocking=True))


@torch.no_grad()
def rebase_(progress: torch.Tensor, new_global: torch.Tensor) -> None:
    """Keep local progress on top of new global parameters: ``progress + new_global`` in place."""
    progress.add_(new_global.to(progress.device, non_blocking=True))


@torch.no_grad()
def adopt_(local_param: torch.Tensor, new_global: torch.Tensor) -> None:
    """Replace the local parameter with the new global one (the progress was counted upstream)."""
    local_param.copy_(new_global, non_blocking=True)


@torch.no_grad()
def merge_(
    local_param: torch.Tensor, snapshot: torch.Tensor, new_global: torch.Tensor, alpha: float
) -> None:
    """Streaming DiLoCo's merge of a returned fragment (arXiv 2501.18512): the local parameters
    become ``alpha * local + (1 - alpha) * new_global`` and the snapshot becomes ``new_global``,
    in place. ``alpha = 0`` adopts the global values; a positive alpha keeps part of the steps
    the worker took while the fragment was in flight."""
    fresh = new_global.to(local_param.device, non_blocking=True)
    if alpha == 0:
        local_param.copy_(fresh)
    else:
        local_param.mul_(alpha).add_(fresh.to(local_param.dtype), alpha=1 - alpha)
    snapshot.copy_(new_global)

"""What a streaming merge does to one fragment piece's elements (arXiv 2501.18512), on any
holder of them: a single worker's whole parameter, or one rank's shard of it in a sharded group
(``worker/groups/sharded_pieces.py``), where each rank moves its own elements and gets the same
values a single worker would."""

from __future__ import annotations

import torch

from diloco.core.outer import OuterSGD, apply_outer_step
from diloco.core.pseudo_gradient import merge_, rebase_, to_progress_

MERGE, REBASE, ADD = "merge", "rebase", "add"


@torch.no_grad()
def move_piece(
    op: str, local: torch.Tensor, snapshot: torch.Tensor, values: torch.Tensor, alpha: float
) -> None:
    """``op`` on the same elements of ``local`` and ``snapshot`` with the piece's ``values``:

    - ``merge``: the fragment's new global values mixed in (``local = alpha*local +
      (1-alpha)*values``, ``snapshot = values``);
    - ``rebase``: the local progress kept on top of the new global values;
    - ``add``: a sent pseudo-gradient given back to ``local`` (its upload was lost)."""
    if op == MERGE:
        merge_(local, snapshot, values, alpha)
    elif op == REBASE:
        to_progress_(local, snapshot)
        snapshot.copy_(values)
        rebase_(local, snapshot)
    elif op == ADD:
        local.add_(values.to(local.device, local.dtype))
    else:
        raise ValueError(f"unknown piece move {op!r}")


Span = slice | torch.Tensor
"""A holder's elements of a piece, in its box's flat order: a slice (a view) or a mask."""


@torch.no_grad()
def step_span(
    snapshot: torch.Tensor,
    momentum: torch.Tensor | None,
    grads: torch.Tensor,
    span: Span,
    lr: float,
    beta: float,
    nesterov: bool,
) -> None:
    """The outer step (``OuterSGD``: ``b = beta * b + g``, then ``p -= lr * (g + beta * b)``
    with Nesterov, else ``p -= lr * b``) on the ``span`` elements of the flat ``snapshot`` and
    ``momentum`` (None: no momentum), ``grads`` the averaged pseudo-gradient of those elements.
    Element-wise, so a holder's elements step exactly as the whole tensor's would."""
    mine = snapshot[span]
    buf = None if momentum is None else momentum[span]
    param = torch.nn.Parameter(mine, requires_grad=False)
    outer = OuterSGD([param], lr=lr, momentum=beta, nesterov=nesterov)
    if buf is not None:
        outer.state[param]["momentum_buffer"] = buf
    apply_outer_step(outer, [param], [grads.contiguous()])
    if not isinstance(span, slice):  # a mask selects a copy: written back
        snapshot[span] = param.data
        if momentum is not None and buf is not None:
            momentum[span] = buf


@torch.no_grad()
def mix_span(local: torch.Tensor, snapshot: torch.Tensor, span: Span, alpha: float) -> None:
    """A streaming merge from the holder's own new snapshot on the ``span`` elements of the flat
    ``local`` (``alpha * local + (1 - alpha) * snapshot``; 0: adopt)."""
    on_local = span if isinstance(span, slice) else span.to(local.device)
    mine = local[on_local]
    new = snapshot[span]
    merge_(mine, new.clone(), new, alpha)
    if not isinstance(span, slice):
        local[on_local] = mine

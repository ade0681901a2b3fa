"""What a streaming merge does to one fragment piece's elements (arXiv 2501.18512), on any
holder of them: a single worker's whole parameter, or one rank's shard of it in a sharded group
(``worker/groups/sharded_pieces.py``), where each rank moves its own elements and gets the same
values a single worker would."""

from __future__ import annotations

import torch

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

"""All-reduce mode: rank 0 of a quorum writes the run's state (the workers hold it) as a
checkpoint of the server mode's layout (``diloco.persistence``: parameters, the outer
optimizer's state, the fields a server checks when it resumes), so ``diloco server --save-dir``
can go on from it and a run moves between the modes."""

from __future__ import annotations

import logging
from typing import Any

from diloco.persistence import save_checkpoint
from diloco.worker.session import Session

log = logging.getLogger(__name__)

KEEP_CHECKPOINTS = 3
"""Checkpoints rank 0 keeps in its ``save_dir`` (the server's ``--keep`` default)."""


def save_shared_state(
    s: Session, quorum_id: str, state: dict[str, Any], layout: dict[str, Any], outer: str
) -> None:
    """Write the snapshot and ``state`` (the outer optimizer's state dict) at ``s.base_round``
    into the worker's ``save_dir``; ``layout`` holds the fields that say how the state is cut
    (``fragments``, ``unit_rounds``, ``optimizer_units``), ``outer`` the optimizer's class name.
    Blocking; a failure (or no ``save_dir``) is logged, never raised into training."""
    folder = s.settings.save_dir
    if folder is None:
        log.warning(
            "worker %s: the server asked rank 0 to save round %d, but this worker has no "
            "save_dir (DILOCO_SAVE_DIR, diloco worker --save-dir)",
            s.worker_id,
            s.base_round,
        )
        return
    params = dict(s.local.snapshot)
    extra = {
        "param_order": list(params),
        "mode": "sync",
        **layout,
        "outer_optimizer": outer,
        "receipts": [],
        "worker_deaths": 0,
        "instance": quorum_id,
        "written_by": f"all-reduce rank 0 ({s.worker_id})",
    }
    try:
        path = save_checkpoint(folder, s.base_round, params, state, extra, KEEP_CHECKPOINTS)
    except OSError as exc:
        log.error("worker %s: checkpoint of round %d failed: %s", s.worker_id, s.base_round, exc)
        return
    log.info("worker %s saved round %d to %s", s.worker_id, s.base_round, path)

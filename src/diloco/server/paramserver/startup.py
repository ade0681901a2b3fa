"""Where a parameter server starts from: a checkpoint (the newest loadable one in ``save_dir``,
or the one named), else the initial parameters (given, or read from ``--init``), else nothing:
the first worker to register uploads them.
"""

from __future__ import annotations

import logging

import torch

from diloco.persistence import (
    Checkpoint,
    NoLoadableCheckpoint,
    load_checkpoint,
    remove_stale_temporaries,
    resume_checkpoint,
)
from diloco.server.config import ServerConfig
from diloco.server.params.initial import load_initial_params
from diloco.server.params.store import ParamStore
from diloco.server.paramserver.coordinator import Coordinator
from diloco.server.rounds.units import OptimizerFactory

log = logging.getLogger(__name__)


def start_coordinator(
    config: ServerConfig,
    initial_params: dict[str, torch.Tensor] | None,
    outer_optimizer_factory: OptimizerFactory | None,
) -> Coordinator:
    """The parameter server's front, resumed or fresh."""
    checkpoint = find_checkpoint(config)
    if checkpoint is None and initial_params is None and config.initial_params:
        initial_params = load_initial_params(config.initial_params)
    store = (
        ParamStore.from_tensors(initial_params)
        if initial_params is not None and checkpoint is None
        else None
    )
    coordinator = Coordinator(config, store, outer_optimizer_factory)
    if checkpoint is not None:
        coordinator.restore(checkpoint)
    return coordinator


def find_checkpoint(config: ServerConfig) -> Checkpoint | None:
    if config.save_dir:
        remove_stale_temporaries(config.save_dir)
    if config.from_checkpoint:
        return load_checkpoint(config.from_checkpoint)
    if config.save_dir:
        try:
            return resume_checkpoint(config.save_dir)
        except NoLoadableCheckpoint as exc:
            # Starting from scratch beside a run that only failed to load would throw that
            # run away unnoticed: only an explicit request does it.
            if not config.fresh_start:
                raise
            log.warning("%s; starting fresh as asked", exc)
    return None

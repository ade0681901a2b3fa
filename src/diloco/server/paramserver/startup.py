"""Where a parameter server starts from: a checkpoint (the newest loadable one in ``save_dir``,
or the one named), else the initial parameters (given, or read from ``--init``, or from the
``--output-dir`` folder when it holds a model), else nothing: the first worker to register
uploads them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from diloco.persistence import (
    Checkpoint,
    NoLoadableCheckpoint,
    load_checkpoint,
    remove_stale_temporaries,
    resume_checkpoint,
)
from diloco.persistence.weights import weight_files
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
    if checkpoint is None and initial_params is None:
        source = config.initial_params or model_in_output_dir(config)
        if source:
            initial_params = load_initial_params(source)
            log.info("initial parameters from %s", source)
    store = (
        ParamStore.from_tensors(initial_params)
        if initial_params is not None and checkpoint is None
        else None
    )
    coordinator = Coordinator(config, store, outer_optimizer_factory)
    if checkpoint is not None:
        coordinator.restore(checkpoint)
    return coordinator


def model_in_output_dir(config: ServerConfig) -> str | None:
    """``output_dir`` when it holds a model's weights (it is then the initial model, unless
    ``initial_params`` names another), else None: the first worker's parameters."""
    if config.output_dir is None:
        return None
    folder = Path(config.output_dir)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--output-dir must be a folder: {folder} is a file (--init takes one)")
    if folder.is_dir() and weight_files(folder):
        return str(folder)
    log.info("no model in %s: the first worker to register provides the parameters", folder)
    return None


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

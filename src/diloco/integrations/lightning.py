"""DiLoCo for ``lightning.Trainer``: one callback makes the Trainer a DiLoCo worker.

>>> trainer = lightning.Trainer(max_steps=10_000,  # doctest: +SKIP
...     callbacks=[DiLoCoCallback(server_addr="10.0.0.5:8512", sync_every=500)])

The worker hooks the optimizer the module configured (``trainer.optimizers``, not Lightning's
``LightningOptimizer`` wrapper), so a step is a real optimizer step: gradient accumulation's
micro-batches and the steps a mixed-precision scaler skips do not count. The sync metrics go
through ``LightningModule.log_dict`` into every logger of the Trainer. Each batch reports its
samples, and its tokens when it is a mapping with an ``attention_mask`` (its nonzero entries) or
``input_ids`` (for a server run with ``--weighting tokens``). The worker's state and its
snapshot of the global parameters are the callback's state in Lightning checkpoints;
``trainer.fit(..., ckpt_path=...)`` rejoins as the same worker with the checkpoint's local
progress on top of the parameters the server serves now (``diloco.worker.resume``).

Under the DDP strategy (``strategy="ddp"``, one process per device, launched by Lightning or by
``torchrun``) the ranks are one worker (``diloco.worker.groups.group``): rank 0 alone talks to the
server, every rank syncs at the same optimizer step and ends it with rank 0's parameters, and
the group's weight is the samples (or tokens) of all ranks. A checkpoint holds rank 0's worker
state; resuming from it, rank 0's state decides for every rank.

Under ``ModelParallelStrategy`` (FSDP2 / DTensor parameters from ``configure_model``) the ranks
are a sharded group: no rank holds the whole model. A checkpoint keeps rank 0's callback state
only, so each rank writes its snapshot boxes beside it, into
``default_root_dir/diloco_snapshots/step=N`` (named in the state; not pruned with the
checkpoints), and resuming, each rank reads its boxes from there.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from diloco.integrations._core import WorkerCallback
from diloco.integrations._deps import missing
from diloco.worker import resume

try:
    import lightning
    from lightning.pytorch.callbacks import Callback
except ImportError as exc:
    raise missing("lightning", exc) from exc


SHARD_DIR = "diloco_snapshots"
"""Under the Trainer's ``default_root_dir``: a sharded group's snapshot boxes, per step."""


def _batch_size(batch: Any) -> int | None:
    """The leading size of the first tensor in a batch (a tensor, a sequence or a mapping)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else None
    items = batch.values() if isinstance(batch, dict) else batch
    if isinstance(items, (list, tuple)) or isinstance(batch, dict):
        for item in items:
            size = _batch_size(item)
            if size is not None:
                return size
    return None


def _batch_tokens(batch: Any) -> int | None:
    """The tokens of a language-model batch: a mapping's ``attention_mask`` (the tokens it
    keeps, padding left out), else its ``input_ids`` (every position); None for another batch."""
    if not isinstance(batch, Mapping):
        return None
    for key, count in (("attention_mask", torch.count_nonzero), ("input_ids", torch.numel)):
        value = batch.get(key)
        if isinstance(value, torch.Tensor):
            return int(count(value))
    return None


def _loss_of(outputs: Any) -> float | None:
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    return float(loss.detach()) if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


class DiLoCoCallback(WorkerCallback, Callback):
    """Join a DiLoCo run from a ``lightning.Trainer``.

    Arguments left as None come from ``DILOCO_*`` variables, then defaults, as for
    ``DiLoCoWorker``; ``worker_kwargs`` are passed on to it. ``final_sync``: at the end of
    training, sync the local steps not yet synced, so the module ends with the run's parameters.
    """

    # A checkpoint's worker state and residual, held from ``load_state_dict`` (which Lightning
    # calls before training starts) until ``on_train_start`` joins with them.
    _saved: tuple[resume.WorkerState, resume.Snapshot | None] | None = None
    _codec_state: dict[str, torch.Tensor] | None = None
    _shard_root = "."  # the Trainer's ``default_root_dir``, where a sharded group's boxes go
    _trainer: Any = None

    def on_train_start(
        self, trainer: lightning.Trainer, pl_module: lightning.LightningModule
    ) -> None:
        if not self._core.enabled:
            self._saved = self._codec_state = None  # a checkpoint's worker state stays unused
        if len(trainer.optimizers) != 1:
            raise ValueError(
                f"DiLoCoCallback needs exactly one optimizer, the module has "
                f"{len(trainer.optimizers)}"
            )
        self._shard_root = str(trainer.default_root_dir)
        self._trainer = trainer
        saved, self._saved = self._saved, None
        codec_state, self._codec_state = self._codec_state, None
        self._core.start(pl_module, trainer.optimizers[0], saved, codec_state)

    def on_train_batch_start(
        self,
        trainer: lightning.Trainer,
        pl_module: lightning.LightningModule,
        batch: Any,
        batch_idx: int,
    ) -> None:
        # Before the step, so the samples weigh in the upload that this very step may trigger.
        self._core.report(samples=_batch_size(batch), tokens=_batch_tokens(batch))

    def on_train_batch_end(
        self,
        trainer: lightning.Trainer,
        pl_module: lightning.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._core.report(loss=_loss_of(outputs))
        metrics = self._core.metrics()
        if metrics:
            pl_module.log_dict(metrics, on_step=True, on_epoch=False)

    def on_train_end(
        self, trainer: lightning.Trainer, pl_module: lightning.LightningModule
    ) -> None:
        self._core.finish()

    def on_exception(
        self, trainer: lightning.Trainer, pl_module: lightning.LightningModule, exc: BaseException
    ) -> None:
        # A crash may leave the local state garbage: leave, send nothing. Lightning's own
        # SIGTERM handling ends training at a batch's end: the last steps go first.
        self._core.end_on(exc)

    def state_dict(self) -> dict[str, Any]:
        # A sharded group's boxes cannot ride in the checkpoint (it keeps rank 0's callback
        # state only): every rank writes its own beside it, one folder per step.
        step = self._trainer.global_step if self.worker is not None else 0
        folder = os.path.join(self._shard_root, SHARD_DIR, f"step={step}")
        return self._core.state(folder)  # empty while DiLoCo is off

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            state = resume.WorkerState(**state_dict["state"])
            if "snapshot_dir" in state_dict:  # a sharded group: each rank reads its boxes
                self._saved = (state, resume.load_shard(state_dict["snapshot_dir"]))
                return
            self._saved = (state, dict(state_dict["snapshot"]))
            self._codec_state = dict(state_dict.get("codec_state") or {})

"""What the trainer callbacks share: a ``DiLoCoWorker`` built when training starts from the
trainer's model and optimizer, resumed from a checkpoint, its metrics named as trainers log them,
and a flush when training ends.

Under a multi-process launch every rank runs its own callback and the ranks are one worker (a worker
group, ``diloco.worker.groups.group``): starting, a checkpoint, the final sync and leaving are
collectives, so the trainers call these hooks on every rank at the same point; the worker's state in
a checkpoint is rank 0's, and resuming, rank 0's checkpoint decides for every rank.

With ``enabled=False`` (or ``DILOCO_ENABLED=0``) a callback is a no-op: its worker is off
(``DiLoCoWorker``'s one log line says so), it logs no metrics, writes and reads nothing in
checkpoints, and ``worker`` stays None."""

from __future__ import annotations

import logging
import os
from dataclasses import asdict
from typing import Any

import torch

from diloco.worker import resume
from diloco.worker.settings import off_reason
from diloco.worker.termination import Terminated
from diloco.worker.worker import DiLoCoWorker

log = logging.getLogger(__name__)

PREFIX = "diloco/"
#: The sync metrics a trainer logs (``DiLoCoWorker.sync_metrics`` has more).
LOGGED = (
    "round",
    "rounds",
    "local_step",
    "sync_every",
    "bytes_up",
    "bytes_down",
    "sync_time_s",
    "barrier_wait_s",
    "failed_syncs",
    "rebases",
    "dropped_steps",
    "last_bytes_up",
    "last_bytes_down",
    "residual_norm",
)


class TrainerWorker:
    """The worker behind a callback; ``worker_kwargs`` are ``DiLoCoWorker``'s (None: from the
    ``DILOCO_*`` variables, then the defaults)."""

    def __init__(self, worker_kwargs: dict[str, Any], final_sync: bool) -> None:
        self._kwargs = worker_kwargs
        self._final_sync = final_sync
        self.worker: DiLoCoWorker | None = None
        self.worker_id: str | None = None  # kept after the worker leaves

    @property
    def enabled(self) -> bool:
        """False: DiLoCo is off (``enabled=False`` or ``DILOCO_ENABLED=0``), the callback a
        no-op; read when training starts, before anything of a checkpoint is."""
        return off_reason(self._kwargs.get("enabled")) is None

    def start(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        saved: tuple[resume.WorkerState | None, resume.Snapshot | None] | None,
        codec_state: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Join the run; with ``saved`` (a checkpoint's worker state and snapshot), as the
        worker that wrote it, with its local progress on top of the current parameters and its
        error-feedback residual (``codec_state``) back. In a worker group rank 0's ``saved``
        decides (the other ranks' may be None; in a sharded group each rank's snapshot is its
        own, the state only rank 0's)."""
        if self.worker is not None:
            raise RuntimeError("the DiLoCo worker of this callback is already running")
        kwargs = dict(self._kwargs)
        state, snapshot = saved if saved is not None else (None, None)
        if state is not None:
            if kwargs.get("worker_id") not in (None, state.worker_id):
                log.warning(
                    "worker_id %s given; the checkpoint was written by worker %s",
                    kwargs["worker_id"],
                    state.worker_id,
                )
            kwargs["worker_id"] = kwargs.get("worker_id") or state.worker_id
        worker = DiLoCoWorker(model, optimizer, **kwargs)
        if not worker.enabled:
            return  # the worker said it is off; nothing joins, nothing is kept
        resume.start_resumed(worker, state, snapshot, codec_state)
        self.worker = worker
        self.worker_id = worker.worker_id

    def report(
        self,
        *,
        loss: float | None = None,
        samples: float | None = None,
        tokens: float | None = None,
    ) -> None:
        if self.worker is not None:
            self.worker.report(loss=loss, samples=samples, tokens=tokens)

    def metrics(self) -> dict[str, float]:
        """The sync metrics as a trainer logs them (``diloco/round``, ...); empty before start."""
        if self.worker is None:
            return {}
        m = self.worker.sync_metrics
        return {PREFIX + k: float(m[k]) for k in LOGGED if k in m}

    def save(self, folder: str) -> None:
        """Write the worker's state into a checkpoint ``folder`` where it exists and the state
        lives (every rank calls it: a group pools its samples first)."""
        worker = self.worker
        if worker is None or not resume.gather(worker):
            return
        if os.path.isdir(folder) or resume.sharded(worker):  # every shard is written
            resume.save(worker, folder)

    def state(self, shard_folder: str) -> dict[str, Any]:
        """The worker's state and snapshot, for a checkpoint that stores tensors itself (every
        rank calls it; empty except where the state lives). A sharded group's ranks write their
        snapshot boxes into ``shard_folder`` instead (a checkpoint keeps rank 0's values only),
        and the state names it: ``snapshot_dir``."""
        if self.worker is None or not resume.gather(self.worker):
            return {}
        state = {"state": asdict(resume.capture(self.worker))}
        if resume.sharded(self.worker):
            resume.save_shard(self.worker, shard_folder)
            return {**state, "snapshot_dir": shard_folder}
        return {
            **state,
            "snapshot": resume.snapshot(self.worker),
            "codec_state": resume.codec_state(self.worker),
        }

    def finish(self, *, submit: bool = True) -> None:
        """Hand in what is left and leave. With ``final_sync`` the last local steps are synced
        and the model ends with the run's global parameters (what the trainer saves next)."""
        worker, self.worker = self.worker, None
        if worker is None:
            return
        if submit and self._final_sync and worker.local_step > 0:
            worker.force_sync()
        worker.stop(submit=submit)

    def end_on(self, exc: BaseException) -> None:
        """Leave after ``exc`` ended training. A SIGTERM that a trainer turned into an exception
        at a step's end (Lightning), or the worker outside a sync (``Terminated.clean``), left
        the model holding parameters: the last local steps are handed in, without waiting for
        their round (the process is on its way out). Anything else may have left the local
        state garbage: nothing is sent."""
        worker, self.worker = self.worker, None
        if worker is not None:
            worker.stop(submit=_clean_exit(exc))


def _clean_exit(exc: BaseException) -> bool:
    """Whether ``exc`` is a SIGTERM raised between steps: the worker's own, outside a sync, or
    a trainer's (Lightning raises its ``SIGTERMException``, a ``SystemExit``, at a batch's end;
    named by its class so this module needs no trainer)."""
    if isinstance(exc, Terminated):
        return exc.clean
    return isinstance(exc, SystemExit) and type(exc).__name__ == "SIGTERMException"


class WorkerCallback:
    """What every trainer's callback takes and shows, whatever the trainer: ``DiLoCoWorker``'s
    arguments (None: from the ``DILOCO_*`` variables, then the defaults), ``final_sync``, the
    worker while training runs and its id afterwards. Mixed in before the trainer's own callback
    base class."""

    def __init__(
        self,
        server_addr: str | None = None,
        sync_every: int | None = None,
        bf16_comm: bool | None = None,
        worker_id: str | None = None,
        *,
        final_sync: bool = True,
        **worker_kwargs: Any,
    ) -> None:
        kwargs = dict(
            server_addr=server_addr, sync_every=sync_every, bf16_comm=bf16_comm, worker_id=worker_id
        )
        self._core = TrainerWorker({**kwargs, **worker_kwargs}, final_sync)

    @property
    def worker(self) -> DiLoCoWorker | None:
        """The worker, while training runs."""
        return self._core.worker

    @property
    def worker_id(self) -> str | None:
        """The id of this trainer's worker (kept after training ends)."""
        return self._core.worker_id

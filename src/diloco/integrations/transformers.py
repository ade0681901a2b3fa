"""DiLoCo for the Hugging Face ``Trainer``: one callback makes the Trainer a DiLoCo worker.

>>> trainer = Trainer(model, args, train_dataset=data,  # doctest: +SKIP
...                   callbacks=[DiLoCoCallback(server_addr="10.0.0.5:8512", sync_every=500)])

What counts as a step is a real optimizer step: the worker hooks the optimizer under
Accelerate's ``AcceleratedOptimizer``, whose ``step`` runs only at the end of a gradient
accumulation and which a mixed-precision scaler skips when the gradients are not finite. The
Trainer's ``on_step_end`` comes after skipped steps too, so it would count steps that changed
nothing. A sync runs inside that ``optimizer.step()``, before the learning-rate schedule steps.

Checkpoints: ``on_save`` writes the worker's state (id, round, counters) and its snapshot of the
global parameters into the checkpoint folder; ``trainer.train(resume_from_checkpoint=...)``
rejoins as the same worker, with the checkpoint's local progress on top of the parameters the
server serves now (``diloco.worker.resume``). The folder is found the way the Trainer names its
checkpoints (``output_dir/checkpoint-<step>``); pass ``resume_from`` for one kept elsewhere.

Under a multi-process launch (``torchrun``, or any launcher that sets its variables; on CPU
with ``ddp_backend="gloo"``) the ranks are one worker (``diloco.worker.groups.group``): rank 0 alone
talks to the server, every rank syncs at the same optimizer step and ends it with rank 0's
parameters, and the group's weight is the samples (or tokens) of all ranks. The tokens are
the Trainer's count (``TrainingArguments(include_num_input_tokens_seen=True)``), for a server
run with ``--weighting tokens``. Rank 0 writes the worker files
into a checkpoint; resuming, its checkpoint decides for every rank, so the other ranks need not
see those files.

A model whose parameters are DTensors (``fully_shard`` applied before the Trainer gets it) makes
the ranks a sharded group, and every rank writes its snapshot boxes into the checkpoint folder
and reads them back when resuming. Accelerate's own FSDP plugin (``fsdp_config={"fsdp_version":
2}``) does not shard on CPU: Accelerate 1.15 turns FSDP on for GPU-like devices only and the
Trainer trains with DDP instead (a replicated group).
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any

from diloco.integrations._core import WorkerCallback
from diloco.integrations._deps import missing
from diloco.worker import resume

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_callback import CallbackHandler
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as exc:
    raise missing("transformers", exc) from exc

log = logging.getLogger(__name__)


def _checkpoint_folder(args: TrainingArguments, state: TrainerState) -> str:
    """Where the Trainer puts the checkpoint of ``state.global_step``."""
    return os.path.join(str(args.output_dir), f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")


class DiLoCoCallback(WorkerCallback, TrainerCallback):
    """Join a DiLoCo run from a ``transformers.Trainer``.

    Arguments left as None come from ``DILOCO_*`` variables, then defaults, as for
    ``DiLoCoWorker``; ``worker_kwargs`` are passed on to it. ``final_sync``: at the end of
    training, sync the local steps not yet synced, so the model the Trainer saves is the run's.
    ``resume_from``: the checkpoint folder to take the worker's state from when resuming, if not
    ``output_dir/checkpoint-<step>``.
    """

    def __init__(
        self,
        server_addr: str | None = None,
        sync_every: int | None = None,
        bf16_comm: bool | None = None,
        worker_id: str | None = None,
        *,
        final_sync: bool = True,
        resume_from: str | None = None,
        **worker_kwargs: Any,
    ) -> None:
        super().__init__(
            server_addr, sync_every, bf16_comm, worker_id, final_sync=final_sync, **worker_kwargs
        )
        self.resume_from = resume_from
        self._samples_per_step = 0
        self._tokens_seen = 0  # the Trainer's count when it last reached the optimizer step

    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._log_before_reporters()

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: Any = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        self._log_before_reporters()
        folder = None
        if self._core.enabled:  # off: nothing of a checkpoint is read
            folder = self.resume_from
            if folder is None and state.global_step > 0:  # resumed from a checkpoint
                folder = _checkpoint_folder(args, state)
        saved: Any = resume.load(folder) if folder else None
        if folder and saved is None and (shard := resume.load_shard(folder)) is not None:
            saved = (None, shard)  # a sharded group's rank: its boxes; rank 0's state decides
        if folder and saved is None and state.is_world_process_zero:
            log.warning("checkpoint %s holds no DiLoCo worker state: joining afresh", folder)
        self._core.start(
            model, optimizer, saved, resume.load_codec_state(folder) if folder else None
        )
        self._samples_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
        self._tokens_seen = state.num_input_tokens_seen

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # Before the step, so the samples weigh in the upload that this very step may trigger.
        # The Trainer counts tokens only with ``include_num_input_tokens_seen``; its count then
        # holds every micro-batch of this step already.
        seen = state.num_input_tokens_seen
        tokens = seen - self._tokens_seen if args.include_num_input_tokens_seen else None
        self._tokens_seen = seen
        self._core.report(samples=self._samples_per_step, tokens=tokens)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if logs is None or self.worker is None:
            return
        if isinstance(logs.get("loss"), (int, float)):
            self._core.report(loss=float(logs["loss"]))
        metrics = self._core.metrics()
        logs.update(metrics)  # the reporting callbacks after this one log it
        last = state.log_history[-1] if state.log_history else None
        if last is not None and last.get("step") == state.global_step:
            last.update(metrics)  # the Trainer recorded this entry just before calling us

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # Every rank: a worker group pools its samples into rank 0's state before rank 0 writes.
        self._core.save(_checkpoint_folder(args, state))

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._core.finish()

    def _log_before_reporters(self) -> None:
        """The Trainer calls the reporting callbacks (TensorBoard, W&B, ...) before the ones it
        is given, each with the same logs: this callback moves itself first, so its metrics are
        in the logs they write. The handler is the caller's ``self`` (``call_event``); moving an
        entry from behind the loop's position to the front changes none of the loop's visits."""
        frame = inspect.currentframe()
        for _ in range(4):
            frame = frame.f_back if frame is not None else None
            handler = frame.f_locals.get("self") if frame is not None else None
            if isinstance(handler, CallbackHandler):
                callbacks = handler.callbacks
                if self in callbacks and callbacks[0] is not self:
                    callbacks.remove(self)
                    callbacks.insert(0, self)
                return

"""One rank of a Hugging Face Trainer on a model it shards itself (FSDP2), checkpointing and
resuming the DiLoCo worker; launched by ``torchrun --nproc-per-node 2``.

    python -m torch.distributed.run --nproc-per-node 2 -m tests.programs.hf_fsdp2_resume \\
        ADDRESS OUT_DIR

As examples/hf_fsdp2.py, the launch is hidden from Accelerate (which would wrap the sharded model
in DDP), so each rank's Trainer is a process of its own: each writes its checkpoints into its
own ``OUT_DIR/rank<r>`` (as on machines with their own disks), the DiLoCo callback rank 0's
worker state and every rank's snapshot shard. The Trainer's ``save_pretrained`` cannot write
DTensors (transformers 5.24), so ``DcpTrainer`` keeps the model in a folder the ranks share,
with ``torch.distributed.checkpoint``, and no optimizer state (AdamW starts afresh on resume).

``train``: TRAIN_STEPS steps syncing every SYNC_EVERY, a checkpoint every SAVE_STEPS. ``resume``:
a new Trainer and a model of other values, in the same processes, from the last checkpoint to
RESUME_STEPS. Each rank writes ``OUT_DIR/rank<r>.pt``: per phase the worker id and its local
step at the start, the shards at the start and the end (``shard_ranks._shards``) and, resuming,
the checkpoint's model as loaded."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from diloco.integrations.transformers import DiLoCoCallback
from tests.helpers.hf_setup import FAST, byte_blocks, tiny_gpt2
from tests.helpers.ranks import leave
from tests.programs.shard_ranks import _shards

SYNC_EVERY = 3
TRAIN_STEPS = 4
SAVE_STEPS = 4
RESUME_STEPS = 7
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


class DcpTrainer(transformers.Trainer):
    """A Trainer whose model checkpoint is ``torch.distributed.checkpoint`` in ``shared``."""

    shared: Path

    def _save(self, output_dir: str | None = None, state_dict: Any = None) -> None:
        folder = self.shared / f"model-{self.state.global_step}"
        dcp.save({"model": get_model_state_dict(self.model)}, checkpoint_id=str(folder))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        step = int(resume_from_checkpoint.rsplit("-", 1)[1])
        state = get_model_state_dict(self.model)
        dcp.load({"model": state}, checkpoint_id=str(self.shared / f"model-{step}"))
        set_model_state_dict(self.model, state)
        self.loaded = _shards(self.model)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        pass  # DTensor optimizer states: not what this test is about

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        pass


class Begin(transformers.TrainerCallback):
    """After the DiLoCo callback: the shards and the worker's local step it started with."""

    def __init__(self, diloco: DiLoCoCallback) -> None:
        self.diloco = diloco

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any, **kw: Any) -> None:
        self.shards = _shards(model)
        assert self.diloco.worker is not None
        self.local_step = self.diloco.worker.local_step


def sharded(seed: int) -> Any:
    model = tiny_gpt2(seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def run(address: str, out: Path, seed: int, steps: int, resume: str | None) -> dict[str, Any]:
    rank = dist.get_rank()
    diloco = DiLoCoCallback(address, sync_every=SYNC_EVERY, **FAST)
    begin = Begin(diloco)
    args = transformers.TrainingArguments(
        output_dir=str(out / f"rank{rank}"),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        seed=0,
    )
    data = byte_blocks(64)[rank::2]
    trainer = DcpTrainer(model=sharded(seed), args=args, train_dataset=data, callbacks=[diloco])
    trainer.shared = out / "shared"
    trainer.add_callback(begin)
    trainer.train(resume_from_checkpoint=resume)
    return {
        "worker_id": diloco.worker_id,
        "local_step": begin.local_step,
        "begin": begin.shards,
        "end": _shards(trainer.model),
        "loaded": getattr(trainer, "loaded", None),
    }


def main() -> None:
    address, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(minutes=2))
    rank = dist.get_rank()
    for name in LAUNCH_VARIABLES:  # the Trainer must not wrap the sharded model in DDP
        os.environ.pop(name, None)
    record = {"train": run(address, out, 0, TRAIN_STEPS, None)}
    own = out / f"rank{rank}" / f"checkpoint-{TRAIN_STEPS}"
    record["resume"] = run(address, out, 1, RESUME_STEPS, str(own))
    torch.save(record, out / f"rank{rank}.pt")
    leave()


if __name__ == "__main__":
    main()

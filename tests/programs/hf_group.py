"""One rank of a Hugging Face Trainer under a multi-process launch: started once per rank with
the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so the
Trainer (Accelerate) initialises the gloo group itself and the ranks are one DiLoCo worker.

    python -m tests.programs.hf_group ADDRESS OUT_DIR

``train``: TRAIN_STEPS real optimizer steps of ACCUMULATION micro-batches, syncing every
SYNC_EVERY, a checkpoint every SAVE_STEPS. ``resume``: a new Trainer, in the same processes,
resumes from the last checkpoint to RESUME_STEPS; rank 1's callback reads a folder that holds
no DiLoCo state (as if only rank 0's machine had the worker files), so rank 0's checkpoint must
decide for the group. Each rank writes OUT_DIR/rank<r>.pt: per phase the worker id, the log
history, the parameters at the end and, resuming, those the worker started with."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from diloco.integrations.transformers import DiLoCoCallback
from tests.helpers.hf_setup import FAST, Peek, hf_trainer, tiny_gpt2
from tests.helpers.ranks import leave

SYNC_EVERY = 3
TRAIN_STEPS = 4
SAVE_STEPS = 2
RESUME_STEPS = 7
ACCUMULATION = 2


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def main() -> None:
    address, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    record: dict[str, Any] = {}

    callback = DiLoCoCallback(address, sync_every=SYNC_EVERY, **FAST)
    trainer = hf_trainer(
        tiny_gpt2(),
        out / "run",
        callback,
        TRAIN_STEPS,
        gradient_accumulation_steps=ACCUMULATION,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        ddp_backend="gloo",
    )
    trainer.train()
    record["train"] = {
        "worker_id": callback.worker_id,
        "history": trainer.state.log_history,
        "params": params_of(trainer.model),
    }

    elsewhere = out / f"no-diloco-state-{rank}"
    elsewhere.mkdir()
    again = DiLoCoCallback(
        address, sync_every=SYNC_EVERY, resume_from=str(elsewhere) if rank else None, **FAST
    )
    peek = Peek()
    trainer = hf_trainer(
        tiny_gpt2(seed=1),
        out / "run",
        again,
        RESUME_STEPS,
        gradient_accumulation_steps=ACCUMULATION,
        ddp_backend="gloo",
    )
    trainer.add_callback(peek)
    trainer.train(resume_from_checkpoint=str(out / "run" / f"checkpoint-{TRAIN_STEPS}"))
    record["resume"] = {
        "worker_id": again.worker_id,
        "history": trainer.state.log_history,
        "begin": peek.params,
        "params": params_of(trainer.model),
    }
    torch.save(record, out / f"rank{rank}.pt")
    leave()


if __name__ == "__main__":
    main()

"""One rank of ``lightning.Trainer(accelerator="cpu", devices=2, strategy="ddp")``, started once
per rank with the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT): Lightning sees processes launched from outside and initialises the gloo group, and
the ranks are one DiLoCo worker. Also the small module the single-process tests train.

    python -m tests.programs.lightning_ddp ADDRESS OUT_DIR

``train``: TRAIN_STEPS optimizer steps syncing every SYNC_EVERY, one Lightning checkpoint at
step SAVE_AT. ``resume``: a new Trainer, in the same processes, ``fit(ckpt_path=...)`` from it
to RESUME_STEPS. Each rank writes OUT_DIR/rank<r>.pt: per phase the worker id, after every step
the round, the local step and the parameters, the parameters the worker started with, and the
checkpoint's path."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning
import torch

from diloco.integrations.lightning import DiLoCoCallback
from tests.helpers.lightning import Record, Regression, params_of
from tests.helpers.ranks import leave

SYNC_EVERY = 2
TRAIN_STEPS = 5
SAVE_AT = 3
RESUME_STEPS = 7








def fit(address: str, out: Path, max_steps: int, ckpt_path: str | None = None) -> dict[str, Any]:
    diloco = DiLoCoCallback(address, sync_every=SYNC_EVERY, heartbeat_interval=0, bf16_comm=False)
    record = Record(diloco)
    checkpoints = lightning.pytorch.callbacks.ModelCheckpoint(
        dirpath=str(out / "ckpt"), filename="{step}", every_n_train_steps=SAVE_AT, save_top_k=-1
    )
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=max_steps,
        callbacks=[diloco, record, checkpoints],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
    )
    module = Regression()
    trainer.fit(module, ckpt_path=ckpt_path)
    return {
        "worker_id": diloco.worker_id,
        "begin": record.begin,
        "steps": record.steps,
        "params": params_of(module),
        "checkpoint": checkpoints.best_model_path,
    }


def main() -> None:
    address, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    record = {"train": fit(address, out, TRAIN_STEPS)}
    ckpt = out / "ckpt" / f"step={SAVE_AT}.ckpt"
    record["resume"] = fit(address, out / "again", RESUME_STEPS, ckpt_path=str(ckpt))
    torch.save(record, out / f"rank{rank}.pt")
    leave()


if __name__ == "__main__":
    main()

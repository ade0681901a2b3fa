"""One rank of ``lightning.Trainer(accelerator="cpu", devices=2, strategy="ddp")``, started once
per rank with the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT): Lightning sees processes launched from outside and initialises the gloo group, and
the ranks are one DiLoCo worker. Also the small module the single-process tests train.

    python -m tests.lightning_ddp ADDRESS OUT_DIR

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
from tests.group_ranks import leave

SYNC_EVERY = 2
TRAIN_STEPS = 5
SAVE_AT = 3
RESUME_STEPS = 7
BATCH = 8


class Regression(lightning.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=g)
        data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
        return torch.utils.data.DataLoader(data, batch_size=BATCH)


def params_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


class Record(lightning.pytorch.callbacks.Callback):
    """After the DiLoCo callback: the parameters it started with, and after every step the
    worker's round and local step and the parameters."""

    def __init__(self, diloco: DiLoCoCallback) -> None:
        self.diloco = diloco
        self.steps: list[dict[str, Any]] = []

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.begin = params_of(pl_module)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        worker = self.diloco.worker
        assert worker is not None
        m = worker.sync_metrics
        self.steps.append(
            {
                "step": trainer.global_step,
                "round": m["round"],
                "local_step": m["local_step"],
                "params": params_of(pl_module),
            }
        )


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

"""The Lightning module and the recording callback the Lightning tests share (in-process and
under a two-rank launch)."""

from __future__ import annotations

from typing import Any

import lightning
import torch

from diloco.integrations.lightning import DiLoCoCallback

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

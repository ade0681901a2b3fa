"""A lightning.Trainer as a DiLoCo worker: a small regression module, on CPU.

    diloco server --num-workers 2 &                  # then, on each machine:
    python examples/lightning_train.py --server HOST:8512
    python examples/lightning_train.py --embedded   # or: a server in this process, one worker

The change to an existing Lightning script is three lines: the import, the callback, and the
address (here ``--server``; ``DILOCO_SERVER`` works too).
"""

from __future__ import annotations

import argparse

import lightning
import torch

from diloco import DiLoCoServer, ServerConfig
from diloco.integrations.lightning import DiLoCoCallback


class Regression(lightning.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
        )

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4096, 8, generator=g)
        y = torch.sin(x).sum(1, keepdim=True)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", default=None, help="host:port (default: DILOCO_SERVER)")
    parser.add_argument("--embedded", action="store_true", help="start a server in-process")
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--output-dir", default="lightning_out")
    args = parser.parse_args()

    server = DiLoCoServer(ServerConfig(port=0, num_workers=1)).start() if args.embedded else None
    try:
        torch.manual_seed(0)
        trainer = lightning.Trainer(
            max_steps=args.max_steps,
            accelerator="cpu",
            devices=1,
            default_root_dir=args.output_dir,
            log_every_n_steps=10,
            enable_progress_bar=False,
            callbacks=[
                DiLoCoCallback(
                    server.address if server else args.server, sync_every=args.sync_every
                )
            ],
        )
        trainer.fit(Regression())
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()

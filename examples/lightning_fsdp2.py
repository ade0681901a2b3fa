"""A Lightning module sharded with FSDP2 (``ModelParallelStrategy``) under ``torchrun`` as ONE
DiLoCo worker: no rank holds the whole model, rank 0 alone talks to the server (gloo on CPU).

    diloco server --num-workers 2 &                  # then, on each machine:
    torchrun --nproc-per-node 2 examples/lightning_fsdp2.py --server HOST:8512
    torchrun --nproc-per-node 2 examples/lightning_fsdp2.py --server HOST:8512 \\
        --resume lightning_fsdp2_out/ckpt/step=50.ckpt      # the same worker, where it was

The change to the Lightning script is the same three lines as examples/lightning_train.py,
marked ``# 1``, ``# 2`` and ``# 3``. Checkpoints are Lightning's distributed ones (a folder per
checkpoint); the DiLoCo callback's state is in it, and each rank's snapshot shard beside it in
``default_root_dir/diloco_snapshots``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pydoc_data.topics import topics
from typing import Any

import lightning
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

from diloco.integrations.lightning import DiLoCoCallback  # 1

CONTEXT = 8


class ByteLM(lightning.LightningModule):
    """Predicts the next byte from the previous ``CONTEXT`` bytes; sharded in ``configure_model``."""

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial model on every rank
        self.net = torch.nn.Sequential(
            torch.nn.Embedding(256, 32),
            torch.nn.Flatten(),
            torch.nn.Linear(CONTEXT * 32, 128),
            torch.nn.GELU(),
            torch.nn.Linear(128, 256),
        )
        self.batch_size = batch_size

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in (self.net[2], self.net[4]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> Any:
        data = torch.tensor(list("".join(topics.values()).encode()), dtype=torch.long)
        g = torch.Generator().manual_seed(self.global_rank)  # each rank its own windows
        start = torch.randint(len(data) - CONTEXT - 1, (4096, 1), generator=g)
        window = data[start + torch.arange(CONTEXT + 1)]
        pairs = torch.utils.data.TensorDataset(window[:, :-1], window[:, -1])
        return torch.utils.data.DataLoader(pairs, batch_size=self.batch_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", default=None, help="host:port (default: DILOCO_SERVER)")
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--save-every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--resume", default=None, help="a checkpoint to resume from")
    parser.add_argument("--output-dir", default="lightning_fsdp2_out")
    args = parser.parse_args()

    torch.set_num_threads(1)
    diloco = DiLoCoCallback(args.server, sync_every=args.sync_every)  # 2
    checkpoints = lightning.pytorch.callbacks.ModelCheckpoint(
        dirpath=os.path.join(args.output_dir, "ckpt"),
        filename="{step}",
        every_n_train_steps=args.save_every,
        save_top_k=-1,
    )
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        # FSDP2 over every rank (the data-parallel dim), no tensor parallelism.
        strategy=ModelParallelStrategy(
            data_parallel_size=int(os.environ.get("WORLD_SIZE", "1")), tensor_parallel_size=1
        ),
        max_steps=args.max_steps,
        callbacks=[diloco, checkpoints],  # 3
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.output_dir,
    )
    module = ByteLM(args.batch_size)
    trainer.fit(module, ckpt_path=args.resume)
    if trainer.global_rank == 0:
        kinds = sorted({type(p.data).__name__ for p in module.parameters()})
        print(f"done: worker {diloco.worker_id}, parameters {kinds}", flush=True)
    # torch 2.13's gloo threads sometimes abort the interpreter's teardown after all the work
    # is done; leave without it.
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

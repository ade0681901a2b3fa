"""A Hugging Face Trainer on an FSDP2-sharded model under ``torchrun`` as ONE DiLoCo worker: no
rank holds the whole model, rank 0 alone talks to the server (gloo on CPU).

    diloco server --num-workers 2 &                  # then, on each machine:
    torchrun --nproc-per-node 2 examples/hf_fsdp2.py --server HOST:8512

The change to the Trainer script is the same three lines as examples/hf_trainer.py, marked
``# 1``, ``# 2`` and ``# 3``. On CPU the script shards the model itself with ``fully_shard``:
Accelerate 1.15 turns its FSDP plugin (``fsdp_config={"fsdp_version": 2}``) on for GPU-like
devices only and would train a CPU launch with DDP, and it would wrap a sharded model in DDP,
which DTensors refuse (``c10d.broadcast_`` has no sharding strategy). So the script starts the
process group and then hides the launch from Accelerate: each rank's Trainer sees one process,
FSDP2 reduces the gradients over the ranks, and each rank reads its own part of the data.
The Trainer's checkpoints are off: its ``save_pretrained`` of DTensor parameters fails in
transformers 5.24 ("Attempted to access the data pointer on an invalid python storage").
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pydoc_data.topics import topics

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from diloco.integrations.transformers import DiLoCoCallback  # 1

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def byte_blocks(rank: int, ranks: int, length: int = 64) -> list[dict[str, torch.Tensor]]:
    """This rank's blocks of the bytes of local text (every ``ranks``-th one)."""
    data = torch.tensor(list("".join(topics.values()).encode()), dtype=torch.long)
    blocks = data[: len(data) // length * length].view(-1, length)[rank::ranks]
    return [{"input_ids": b, "labels": b} for b in blocks]


def sharded_gpt2(ranks: int) -> GPT2LMHeadModel:
    """A small GPT-2, each block and the root sharded over the ranks (FSDP2)."""
    torch.manual_seed(0)  # the same initial model on every rank
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2)
    )
    mesh = init_device_mesh("cpu", (ranks,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", default=None, help="host:port (default: DILOCO_SERVER)")
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--output-dir", default="hf_fsdp2_out")
    args = parser.parse_args()

    torch.set_num_threads(1)
    # A timeout longer than a sync can take: the other ranks wait for rank 0 in a collective.
    dist.init_process_group("gloo", timeout=timedelta(minutes=30))
    rank, ranks = dist.get_rank(), dist.get_world_size()
    for name in LAUNCH_VARIABLES:  # the Trainer must not wrap the sharded model in DDP
        os.environ.pop(name, None)
    model = sharded_gpt2(ranks)
    callback = DiLoCoCallback(args.server, sync_every=args.sync_every)  # 2
    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=args.output_dir,
            max_steps=args.max_steps,
            per_device_train_batch_size=args.batch_size,
            learning_rate=1e-3,
            logging_steps=10,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
            log_level="warning" if rank else "passive",
        ),
        train_dataset=byte_blocks(rank, ranks),
        callbacks=[callback],  # 3
    )
    trainer.train()
    if rank == 0:
        kinds = sorted({type(p.data).__name__ for p in model.parameters()})
        print(f"done: worker {callback.worker_id}, parameters {kinds}", flush=True)

    dist.destroy_process_group()
    # torch 2.13's gloo threads sometimes abort the interpreter's teardown after all the work
    # is done; leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

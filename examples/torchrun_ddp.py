"""A DistributedDataParallel script under ``torchrun`` as ONE DiLoCo worker: the ranks of the
launch train one replica together (gloo on CPU), and rank 0 alone talks to the server.

    diloco server --num-workers 2 &                  # then, on each machine:
    torchrun --nproc-per-node 2 examples/torchrun_ddp.py --server HOST:8512
    diloco worker --server HOST:8512 -- torchrun --nproc-per-node 2 examples/torchrun_ddp.py

The change to an existing DDP script is the same three lines as a plain loop, on every rank
(no ``if rank == 0``), marked ``# 1``, ``# 2`` and ``# 3``. The address comes from ``--server``
here; without it, ``DILOCO_SERVER`` (``diloco worker`` sets it for every rank).
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pydoc_data.topics import topics

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from diloco import DiLoCoWorker  # 1

CONTEXT = 8


def byte_lm() -> torch.nn.Sequential:
    """Predicts the next byte from the previous ``CONTEXT`` bytes."""
    return torch.nn.Sequential(
        torch.nn.Embedding(256, 32),
        torch.nn.Flatten(),
        torch.nn.Linear(CONTEXT * 32, 128),
        torch.nn.GELU(),
        torch.nn.Linear(128, 256),
    )


def batches(steps: int, size: int, seed: int):
    """``steps`` batches of random windows of the text: (bytes, next byte)."""
    data = torch.tensor(list("".join(topics.values()).encode()), dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(len(data) - CONTEXT - 1, (size, 1), generator=g)
        window = data[start + torch.arange(CONTEXT + 1)]
        yield window[:, :-1], window[:, -1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", default=None, help="host:port (default: DILOCO_SERVER)")
    parser.add_argument("--sync-every", type=int, default=50)
    parser.add_argument("--max-steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    args = parser.parse_args()

    torch.set_num_threads(1)
    # A timeout longer than a sync can take: the other ranks wait for rank 0 in a collective.
    dist.init_process_group("gloo", timeout=timedelta(minutes=30))
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial model on every rank
    model = DistributedDataParallel(byte_lm())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    with DiLoCoWorker(model, optimizer, args.server, sync_every=args.sync_every) as diloco:  # 2
        for step, (x, y) in enumerate(batches(args.max_steps, args.batch_size, seed=rank)):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()  # DDP averages the gradients over the ranks
            optimizer.step()  # every sync_every steps, rank 0 syncs and the ranks follow it
            optimizer.zero_grad()
            diloco.report(loss=loss.item(), samples=len(x))  # 3 (samples summed over ranks)
            if rank == 0 and (step + 1) % 50 == 0:
                print(f"step {step + 1}: loss {loss.item():.3f}", flush=True)
    if rank == 0:
        print(
            f"done: worker {diloco.worker_id}, {diloco.sync_metrics['rounds']} rounds", flush=True
        )

    dist.destroy_process_group()
    # torch 2.13's gloo threads sometimes abort the interpreter's teardown after all the work
    # is done; leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

"""A model split over two ranks (a two-stage pipeline, gloo on CPU) as ONE DiLoCo worker: rank 0
owns the first half of the layers, rank 1 the second; activations go forward and their gradients
back with ``send``/``recv``.

    diloco server --num-workers 2 &              # then, on each machine:
    torchrun --nproc-per-node 2 examples/pipeline_split.py --server HOST:8512

Each rank keeps the full model's parameter names (the layers it does not own become
``Identity``, as ``torch.distributed.pipelining`` keeps names), so the group is detected as
partitioned: rank 0 uploads the union of both halves and each rank gets its own half back. The
change is the same three lines as a plain loop, marked ``# 1``, ``# 2`` and ``# 3``.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pydoc_data.topics import topics

import torch
import torch.distributed as dist

from diloco import DiLoCoWorker  # 1

CONTEXT = 8
HIDDEN = 128
FIRST_STAGE = 4  # layers [0, 4) on rank 0, the rest on rank 1


def byte_lm() -> torch.nn.Sequential:
    """Predicts the next byte from the previous ``CONTEXT`` bytes."""
    return torch.nn.Sequential(
        torch.nn.Embedding(256, 32),
        torch.nn.Flatten(),
        torch.nn.Linear(CONTEXT * 32, HIDDEN),
        torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, 256),
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
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    torch.set_num_threads(1)
    # A timeout longer than a sync can take: rank 1 waits for rank 0 in a collective.
    dist.init_process_group("gloo", timeout=timedelta(minutes=30))
    rank = dist.get_rank()
    assert dist.get_world_size() == 2, "run with torchrun --nproc-per-node 2"
    torch.manual_seed(0)
    model = byte_lm()
    for i in range(len(model)):  # keep only this rank's stage; the names stay those of the whole
        if (i < FIRST_STAGE) != (rank == 0):
            model[i] = torch.nn.Identity()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    with DiLoCoWorker(model, optimizer, args.server, sync_every=args.sync_every) as diloco:  # 2
        # Both stages read the same batches: rank 0 the inputs, rank 1 the targets.
        for step, (x, y) in enumerate(batches(args.max_steps, args.batch_size, seed=0)):
            if rank == 0:
                h = model(x)
                dist.send(h.detach(), dst=1)
                grad = torch.empty_like(h)
                dist.recv(grad, src=1)
                h.backward(grad)
            else:
                h = torch.empty(len(x), HIDDEN)
                dist.recv(h, src=0)
                h.requires_grad_()
                loss = torch.nn.functional.cross_entropy(model(h), y)
                loss.backward()
                assert h.grad is not None
                dist.send(h.grad, dst=0)
            optimizer.step()  # every sync_every steps the group syncs, rank 0 with the server
            optimizer.zero_grad()
            diloco.report(samples=len(x) if rank == 1 else 0)  # 3 (count each sample once)
            if rank == 1 and (step + 1) % 50 == 0:
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

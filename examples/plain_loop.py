"""A plain PyTorch training loop as a DiLoCo worker: a small byte-level language model trained on
the bytes of local text (Python's own pydoc topics), so nothing is downloaded.

    diloco server --num-workers 2 &                  # then, on each machine:
    python examples/plain_loop.py --server HOST:8512
    python examples/plain_loop.py --embedded     # or: a server in this process, one worker

The change to an existing loop is three lines, marked ``# 1``, ``# 2`` and ``# 3`` below: the
import, the ``with DiLoCoWorker(...)`` around the loop, and ``report`` (optional: the loss the
server shows and the samples that weight this worker's upload). The address comes from
``--server`` here; without it, ``DILOCO_SERVER``.
"""

from __future__ import annotations

import argparse
from pydoc_data.topics import topics

import torch

from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig  # 1

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


def batches(steps: int, size: int, seed: int = 0):
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
    parser.add_argument("--embedded", action="store_true", help="start a server in-process")
    parser.add_argument("--sync-every", type=int, default=50)
    parser.add_argument("--max-steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="data order of this worker")
    args = parser.parse_args()

    server = DiLoCoServer(ServerConfig(port=0, num_workers=1)).start() if args.embedded else None
    try:
        torch.manual_seed(0)
        model = byte_lm()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        address = server.address if server else args.server
        with DiLoCoWorker(model, optimizer, address, sync_every=args.sync_every) as diloco:  # 2
            for step, (x, y) in enumerate(batches(args.max_steps, args.batch_size, args.seed)):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()  # every sync_every steps this also syncs with the server
                optimizer.zero_grad()
                diloco.report(loss=loss.item(), samples=len(x))  # 3
                if (step + 1) % 50 == 0:
                    print(f"step {step + 1}: loss {loss.item():.3f}", flush=True)
        print("done:", diloco.sync_metrics, flush=True)
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()

"""A Hugging Face Trainer as a DiLoCo worker: a small GPT-2 built from a config, trained on the
bytes of local text (Python's own pydoc topics), so nothing is downloaded.

    diloco server --num-workers 2 &                  # then, on each machine:
    python examples/hf_trainer.py --server HOST:8512
    python examples/hf_trainer.py --embedded     # or: a server in this process, one worker

The change to an existing Trainer script is three lines: the import, the callback, and the
address (here ``--server``; ``DILOCO_SERVER`` works too).
"""

from __future__ import annotations

import argparse
from pydoc_data.topics import topics

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from diloco import DiLoCoServer, ServerConfig
from diloco.integrations.transformers import DiLoCoCallback


def byte_blocks(length: int = 64) -> list[dict[str, torch.Tensor]]:
    data = torch.tensor(list("".join(topics.values()).encode()), dtype=torch.long)
    blocks = data[: len(data) // length * length].view(-1, length)
    return [{"input_ids": b, "labels": b} for b in blocks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", default=None, help="host:port (default: DILOCO_SERVER)")
    parser.add_argument("--embedded", action="store_true", help="start a server in-process")
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--output-dir", default="hf_trainer_out")
    args = parser.parse_args()

    server = DiLoCoServer(ServerConfig(port=0, num_workers=1)).start() if args.embedded else None
    try:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(
            GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2)
        )
        trainer = Trainer(
            model=model,
            args=TrainingArguments(
                output_dir=args.output_dir,
                max_steps=args.max_steps,
                per_device_train_batch_size=8,
                learning_rate=1e-3,
                logging_steps=10,
                save_steps=50,
                report_to=[],
                use_cpu=True,
            ),
            train_dataset=byte_blocks(),
            callbacks=[
                DiLoCoCallback(
                    server.address if server else args.server, sync_every=args.sync_every
                )
            ],
        )
        trainer.train()
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()

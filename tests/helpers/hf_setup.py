"""The Hugging Face Trainer the integration tests run: a tiny GPT-2 on the bytes of local text.
Its own module, so the rank processes of a launch import transformers and not lightning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from diloco.integrations.transformers import DiLoCoCallback

FAST = {"heartbeat_interval": 0, "bf16_comm": False}
BATCH = 4  # per device


def byte_blocks(n: int, length: int = 32) -> list[dict[str, torch.Tensor]]:
    """Byte-level tokens of local text (pydoc's topics): no tokenizer, no download."""
    from pydoc_data.topics import topics

    data = torch.tensor(list("".join(topics.values()).encode()[: n * length]), dtype=torch.long)
    return [{"input_ids": b, "labels": b} for b in data.view(n, length)]


def tiny_gpt2(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(config)


def hf_trainer(model: Any, out: Path, callback: DiLoCoCallback, max_steps: int, **args: Any) -> Any:
    targs = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=max_steps,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=1,
        save_strategy=args.pop("save_strategy", "no"),
        dataloader_num_workers=0,
        seed=0,
        **args,
    )
    return transformers.Trainer(
        model=model, args=targs, train_dataset=byte_blocks(64), callbacks=[callback]
    )


def logged(log_history: list[dict[str, Any]], key: str) -> dict[int, float]:
    """``key`` at each step of a Trainer's ``state.log_history``."""
    return {e["step"]: e[key] for e in log_history if key in e}


class Peek(transformers.TrainerCallback):
    """Keeps the model's parameters as the callbacks before it left them at ``on_train_begin``
    (added after ``DiLoCoCallback``: the parameters the worker resumed with)."""

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any, **kw: Any) -> None:
        self.params = {n: p.detach().clone() for n, p in model.named_parameters()}

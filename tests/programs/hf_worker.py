"""One Hugging Face Trainer as a DiLoCo worker, in a process of its own: Accelerate keeps its
state (the gradient-accumulation boundary among it) per process, so two Trainers in threads of
one process would step each other's optimizers.

    python -m tests.programs.hf_worker ADDRESS OUT_DIR SYNC_EVERY STEPS

Writes OUT_DIR/log_history.json and OUT_DIR/params.safetensors (the model after training)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors.torch import save_file

from diloco.integrations.transformers import DiLoCoCallback
from tests.helpers.hf_setup import FAST, hf_trainer, tiny_gpt2


def main() -> None:
    address, out, sync_every, steps = sys.argv[1], Path(sys.argv[2]), *map(int, sys.argv[3:5])
    callback = DiLoCoCallback(address, sync_every=sync_every, **FAST)
    trainer = hf_trainer(tiny_gpt2(), out, callback, steps, gradient_accumulation_steps=2)
    trainer.train()
    (out / "log_history.json").write_text(json.dumps(trainer.state.log_history))
    params = {n: p.detach().contiguous() for n, p in trainer.model.named_parameters()}
    save_file(params, str(out / "params.safetensors"))


if __name__ == "__main__":
    main()

"""The trainer callbacks against a real server, one process per worker: a tiny GPT-2 through the
Hugging Face Trainer with two workers, resuming from a Trainer checkpoint, and a small module
through lightning.Trainer, resuming from a Lightning checkpoint. Multi-process launches (a worker
group per trainer) are in test_integrations_groups.py."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("transformers")
lightning = pytest.importorskip("lightning")

from diloco.integrations.transformers import DiLoCoCallback  # noqa: E402
from diloco.worker import resume  # noqa: E402
from tests.helpers.hf_setup import FAST, Peek, hf_trainer, logged, tiny_gpt2  # noqa: E402
from tests.helpers.lightning import Record, Regression  # noqa: E402


@pytest.mark.timeout(90)
def test_resume_from_a_trainer_checkpoint_rejoins_as_the_same_worker(
    tmp_path: Path, server_of
) -> None:
    server = server_of(1)
    first = DiLoCoCallback(server.address, sync_every=3, **FAST)
    hf_trainer(tiny_gpt2(), tmp_path, first, 4, save_strategy="steps", save_steps=2).train()
    checkpoint = tmp_path / "checkpoint-4"
    state, snapshot = resume.load(str(checkpoint))  # type: ignore[misc]
    assert (state.worker_id, state.round, state.local_step) == (first.worker_id, 1, 1)
    # The run moved on since (the final sync): the checkpoint's progress goes on top.
    assert server.status()["round"] == 2
    saved_model = load_file(str(checkpoint / "model.safetensors"))
    now = server.global_params()
    expected = {n: now[n] + (saved_model[n] - snapshot[n]) for n in snapshot}

    again = DiLoCoCallback(server.address, sync_every=3, **FAST)
    peek = Peek()
    trainer = hf_trainer(tiny_gpt2(seed=1), tmp_path, again, 6)
    trainer.add_callback(peek)
    trainer.train(resume_from_checkpoint=str(checkpoint))
    assert again.worker_id == first.worker_id
    assert server.status()["registrations"] == 2  # the same id twice, no third worker
    for name, value in expected.items():
        torch.testing.assert_close(peek.params[name], value, rtol=1e-5, atol=1e-6)
    # The schedule goes on: one local step was in the checkpoint, so step 6 syncs.
    local_steps = logged(trainer.state.log_history, "diloco/local_step")
    assert (local_steps[5], local_steps[6]) == (2, 0)
    assert logged(trainer.state.log_history, "diloco/round")[6] == 3


@pytest.mark.timeout(60)
def test_lightning_syncs_every_real_step_and_logs_the_metrics(tmp_path: Path, server_of) -> None:
    from diloco.integrations.lightning import DiLoCoCallback as LightningCallback

    server = server_of(1)
    cb = LightningCallback(server.address, sync_every=2, **FAST)
    trainer = lightning.Trainer(
        max_steps=6,
        accumulate_grad_batches=2,
        accelerator="cpu",
        devices=1,
        callbacks=[cb],
        logger=lightning.pytorch.loggers.CSVLogger(str(tmp_path)),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(Regression())
    assert server.status()["round"] == 3
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("diloco/rounds")]
    assert rows and max(float(r["diloco/rounds"]) for r in rows) == 3
    assert cb.worker is None and cb.worker_id is not None


@pytest.mark.timeout(60)
def test_lightning_resume_from_a_checkpoint_rejoins_as_the_same_worker(
    tmp_path: Path, server_of
) -> None:
    from diloco.integrations.lightning import DiLoCoCallback as LightningCallback

    def fit(callbacks: list[Any], max_steps: int, ckpt_path: str | None = None) -> None:
        trainer = lightning.Trainer(
            max_steps=max_steps,
            accelerator="cpu",
            devices=1,
            callbacks=callbacks,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=str(tmp_path),
        )
        trainer.fit(Regression(), ckpt_path=ckpt_path)

    server = server_of(1)
    first = LightningCallback(server.address, sync_every=3, **FAST)
    saving = lightning.pytorch.callbacks.ModelCheckpoint(
        dirpath=str(tmp_path), filename="{step}", every_n_train_steps=4, save_top_k=-1
    )
    fit([first, saving], 4)
    path = tmp_path / "step=4.ckpt"
    checkpoint = torch.load(path, weights_only=False)
    saved = checkpoint["callbacks"]["DiLoCoCallback"]
    state = saved["state"]
    assert (state["worker_id"], state["round"], state["local_step"]) == (first.worker_id, 1, 1)
    # The run moved on since (the final sync): the checkpoint's progress goes on top.
    assert server.status()["round"] == 2
    now = server.global_params()
    expected = {n: now[n] + (checkpoint["state_dict"][n] - s) for n, s in saved["snapshot"].items()}

    again = LightningCallback(server.address, sync_every=3, **FAST)
    record = Record(again)
    fit([again, record], 6, ckpt_path=str(path))
    assert again.worker_id == first.worker_id
    assert server.status()["registrations"] == 2  # the same id twice, no third worker
    for name, value in expected.items():
        torch.testing.assert_close(record.begin[name], value, rtol=1e-5, atol=1e-6)
    # The schedule goes on: one local step was in the checkpoint, so step 6 syncs.
    assert [(s["step"], s["round"], s["local_step"]) for s in record.steps] == [
        (5, 2, 2),
        (6, 3, 0),
    ]
    assert server.status()["round"] == 3







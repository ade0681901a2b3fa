"""The trainer callbacks against a real server, one process per worker: a tiny GPT-2 through the
Hugging Face Trainer with two workers, resuming from a Trainer checkpoint, and a small module
through lightning.Trainer, resuming from a Lightning checkpoint. Multi-process launches (a worker
group per trainer) are in test_integrations_groups.py."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from diloco import DiLoCoServer, ServerConfig

pytest.importorskip("transformers")
lightning = pytest.importorskip("lightning")

from diloco.integrations.transformers import DiLoCoCallback  # noqa: E402
from diloco.worker import resume  # noqa: E402
from tests.hf_setup import FAST, Peek, hf_trainer, logged, tiny_gpt2  # noqa: E402
from tests.lightning_ddp import Record, Regression  # noqa: E402


@pytest.fixture
def server_of():
    started: list[DiLoCoServer] = []

    def make(num_workers: int) -> DiLoCoServer:
        srv = DiLoCoServer(ServerConfig(port=0, num_workers=num_workers, outer_momentum=0.0))
        started.append(srv.start())
        return srv

    yield make
    for srv in started:
        srv.stop()


@pytest.mark.timeout(90)
def test_two_hf_trainers_sync_every_real_step_under_accumulation(tmp_path: Path, server_of) -> None:
    server = server_of(2)
    sync_every, steps = 3, 6
    root = Path(__file__).parents[2]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.hf_worker", server.address, str(tmp_path / f"w{i}")]
            + [str(sync_every), str(steps)],
            cwd=root,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=80)
        assert p.returncode == 0, err[-3000:]
    for i in range(2):
        history = json.loads((tmp_path / f"w{i}" / "log_history.json").read_text())
        rounds = {e["step"]: e["diloco/rounds"] for e in history if "loss" in e}
        local_steps = {e["step"]: e["diloco/local_step"] for e in history if "loss" in e}
        # Twelve micro-batches, six real steps: a sync after the third and the sixth.
        assert rounds == {s: s // sync_every for s in range(1, steps + 1)}
        assert local_steps == {s: s % sync_every for s in range(1, steps + 1)}
    assert server.status()["round"] == steps // sync_every
    for i in range(2):
        params = load_file(str(tmp_path / f"w{i}" / "params.safetensors"))
        for name, value in server.global_params().items():
            torch.testing.assert_close(params[name], value)


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


def test_importing_diloco_imports_no_trainer_library() -> None:
    code = (
        "import sys, diloco, diloco.integrations, diloco.worker.resume; "
        "print(sorted(m for m in ('transformers', 'lightning', 'accelerate') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_missing_extra_names_what_to_install(tmp_path: Path) -> None:
    # A ``transformers`` that cannot be imported, ahead of the real one on the path.
    (tmp_path / "transformers.py").write_text("raise ImportError('absent', name='transformers')")
    code = "import diloco.integrations.transformers"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode != 0
    assert "pip install 'diloco[transformers]'" in out.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", ["hf_trainer.py", "lightning_train.py"])
def test_the_example_runs(tmp_path: Path, script: str) -> None:
    path = Path(__file__).parents[2] / "examples" / script
    cmd = [sys.executable, str(path), "--embedded", "--max-steps", "6", "--sync-every", "3"]
    cmd += ["--output-dir", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-3000:]

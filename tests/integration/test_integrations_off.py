"""The trainer callbacks with DiLoCo off (``enabled=False``, ``DILOCO_ENABLED=0``): the same
script trains alone, exactly as without the callback, with one log line and no connection to
the server it names (a port that records connection attempts). And how a callback leaves when a
SIGTERM ended training."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
lightning = pytest.importorskip("lightning")

import transformers  # noqa: E402

from diloco.integrations._core import TrainerWorker  # noqa: E402
from diloco.integrations.transformers import DiLoCoCallback  # noqa: E402
from diloco.worker.termination import Terminated  # noqa: E402
from diloco.worker.unwrap import real_optimizer  # noqa: E402
from tests.helpers.hf_setup import FAST, hf_trainer, tiny_gpt2  # noqa: E402
from tests.helpers.lightning import Regression, params_of  # noqa: E402
from tests.helpers.listener import Listener  # noqa: E402


def _off_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "DiLoCo is off" in r.getMessage()]


class Hooks(transformers.TrainerCallback):
    """The optimizer's post-step hooks at each step's end (the worker's would be there)."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any, **kw: Any) -> None:
        self.counts.append(len(real_optimizer(optimizer)._optimizer_step_post_hooks))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("switch", ["argument", "variable"])
def test_hf_callback_off_trains_as_without_it(
    switch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    alone = tiny_gpt2()
    hf_trainer(alone, tmp_path / "alone", transformers.TrainerCallback(), 4).train()
    with Listener() as server, caplog.at_level(logging.INFO, logger="diloco"):
        if switch == "variable":
            monkeypatch.setenv("DILOCO_ENABLED", "0")
            callback = DiLoCoCallback(server.address, sync_every=2, **FAST)
        else:
            callback = DiLoCoCallback(server.address, sync_every=2, enabled=False, **FAST)
        hooks = Hooks()
        trainer = hf_trainer(tiny_gpt2(), tmp_path / "off", callback, 4)
        trainer.add_callback(hooks)
        trainer.train()
        assert server.attempts() == 0
    assert hooks.counts == [0, 0, 0, 0]
    assert callback.worker is None and callback.worker_id is None
    assert not any(k.startswith("diloco/") for e in trainer.state.log_history for k in e)
    why = "enabled=False" if switch == "argument" else "DILOCO_ENABLED=0"
    assert [f"({why})" in line for line in _off_lines(caplog)] == [True]
    for name, value in alone.named_parameters():
        assert torch.equal(dict(trainer.model.named_parameters())[name], value), name


class LightningHooks(lightning.pytorch.callbacks.Callback):
    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self.counts.append(len(trainer.optimizers[0]._optimizer_step_post_hooks))


def _fit(callbacks: list[Any], root: Path) -> Regression:
    module = Regression()
    lightning.Trainer(
        max_steps=4,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        logger=lightning.pytorch.loggers.CSVLogger(str(root)),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    ).fit(module)
    return module


@pytest.mark.timeout(90)
def test_lightning_callback_off_trains_as_without_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from diloco.integrations.lightning import DiLoCoCallback as LightningCallback

    alone = _fit([], tmp_path / "alone")
    with Listener() as server, caplog.at_level(logging.INFO, logger="diloco"):
        callback = LightningCallback(server.address, sync_every=2, enabled=False, **FAST)
        hooks = LightningHooks()
        off = _fit([callback, hooks], tmp_path / "off")
        assert server.attempts() == 0
    assert hooks.counts == [0, 0, 0, 0]
    assert callback.worker is None and callback.state_dict() == {}
    metrics = (tmp_path / "off").rglob("metrics.csv")
    assert not any("diloco/" in m.read_text() for m in metrics)
    assert len(_off_lines(caplog)) == 1
    for name, value in params_of(alone).items():
        assert torch.equal(params_of(off)[name], value), name


class Stopped:
    """Stands for a running worker: records how it was stopped."""

    def stop(self, *, submit: bool = True) -> None:
        self.submit = submit


@pytest.mark.parametrize(
    ("exc", "submit"),
    [
        (lightning.pytorch.utilities.exceptions.SIGTERMException(), True),  # at a batch's end
        (Terminated(clean=True), True),
        (Terminated(clean=False), False),
        (KeyboardInterrupt(), False),
        (RuntimeError("crash"), False),
    ],
)
def test_a_trainer_ended_by_sigterm_hands_in_its_last_steps(
    exc: BaseException, submit: bool
) -> None:
    core = TrainerWorker({}, final_sync=True)
    worker = core.worker = Stopped()  # type: ignore[assignment]
    core.end_on(exc)
    assert worker.submit is submit and core.worker is None
